"""The router's own block index: what it costs and how fast it follows.

1. Memory: a router's index (no LRU order) and cachemeta's (with it) holding 1M and 10M blocks,
   each in a fresh process: resident memory added, per block (the 32-character hash strings
   included), and what the index estimates of itself (``kvmesh_kv_index_bytes``).
2. Catch-up: a real nats-server and cachemeta, 1M blocks through the KV event stream; a router's
   follower started (a) with no snapshot (the whole stream), (b) from cachemeta's snapshot of
   them with 100K more blocks on the stream after it.
3. Lookups at 1.1M indexed blocks, a 77K-token prompt (1,200 hashes): the router's local lookup
   against the round trip to cachemeta it replaces (same run, same index).
4. A stopped feed: a real stack (`kvmesh up`, the tiny model, fault hooks on); a worker's KV
   events cut while it computes a conversation's next turn; the time until the router's /health
   flags it, and until it is whole again once the cut ends (a resync), over several trials.

Prints a table; the last line is one JSON object: bytes_per_block_router, router_mb_1m,
router_mb_10m, cachemeta_mb_1m, catch_up_stream_1m_s, catch_up_snapshot_1m_s,
local_lookup_p99_ms, cachemeta_lookup_p99_ms, feed_flagged_s_max, feed_resynced_s_max.

    .venv/bin/python bench/kvindex.py [--skip-memory] [--skip-feed] [--trials N]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import AsyncExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Stack, emit, free_port, say  # noqa: E402
from kvmesh.natsserver import NatsServer  # noqa: E402
from shared.bus import Bus, subjects  # noqa: E402
from shared.kvindex.follow import IndexFollower, read_snapshot  # noqa: E402
from shared.kvindex.view import KvIndex  # noqa: E402
from shared.kvindex.watch import approx_bytes  # noqa: E402
from shared.messages.kvevents import (  # noqa: E402
    STORE,
    KvEvent,
    KvRecord,
    LookupReply,
    LookupRequest,
    pack_events,
)

REPO = Path(__file__).resolve().parent.parent
CHAIN = 1200  # blocks of one 77K-token prompt (64-token blocks)
EVENT_BLOCKS = 1000  # blocks per KV event
BLOCK_BYTES = 2_949_120  # the real model's 64-token block


def chains(n_blocks: int) -> list[list[str]]:
    """n_blocks as conversations of CHAIN blocks each."""
    return [[f"{c:08x}{i:024x}" for i in range(CHAIN)] for c in range(n_blocks // CHAIN)]


def events(n_blocks: int, workers: int = 8, source: str = "prefill-0") -> list[KvEvent]:
    """Every block stored in the storage tier; a quarter of them also in some worker's memory
    tier; as workers publish them (numbered)."""
    out, seq = [], 0
    for c, chain in enumerate(chains(n_blocks)):
        for start in range(0, CHAIN, EVENT_BLOCKS):
            part = chain[start : start + EVENT_BLOCKS]
            where = [STORE] + ([f"mem:prefill-{c % workers}"] if c % 4 == 0 else [])
            for location in where:
                seq += 1
                out.append(
                    KvEvent(
                        kind="stored",
                        location=location,
                        hashes=part,
                        sizes=[BLOCK_BYTES] * len(part),
                        at=time.time(),
                        source=source,
                        epoch=1.0,
                        seq=seq,
                    )
                )
    return out


# -- 1. memory ----------------------------------------------------------------------------


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def one_memory(n_blocks: int, lru: bool) -> dict:
    """(In a fresh process.) The index of n_blocks built from events: memory it added."""
    index = KvIndex({"chat": 1e9, "agent": 1e9}, lru=lru)
    before = rss()
    seq = 0
    for c, chain in enumerate(chains(n_blocks)):
        for location in [STORE] + ([f"mem:prefill-{c % 8}"] if c % 4 == 0 else []):
            seq += 1
            event = KvEvent(
                kind="stored",
                location=location,
                hashes=chain,
                sizes=[BLOCK_BYTES] * CHAIN,
                at=1.0,
                source="p",
                epoch=1.0,
                seq=seq,
            )
            index.apply(event, seq)
    added = rss() - before
    return {"blocks": len(index), "rss_bytes": added, "estimate_bytes": approx_bytes(index)}


def bench_memory(sizes: list[int]) -> list[dict]:
    rows = []
    for n in sizes:
        for lru in (False, True):
            if lru and n > 1_000_000:
                continue
            who = "cachemeta" if lru else "router"
            say(f"memory: a {who}'s index of {n:,} blocks (a fresh process)")
            out = subprocess.run(
                [sys.executable, __file__, "--one-memory", str(n), *(["--lru"] if lru else [])],
                capture_output=True,
                text=True,
                check=True,
                cwd=REPO,
            )
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"who": who, **row})
    return rows


# -- 2 and 3. catch-up and lookups ---------------------------------------------------------


async def follow(bus: Bus) -> tuple[IndexFollower, float]:
    follower = IndexFollower(bound_s=1.5, catch_up_s=600)
    async with AsyncExitStack() as stack:
        t = time.perf_counter()
        await follower.start(stack, bus)
        took = time.perf_counter() - t
    return follower, took


async def publish(bus: Bus, batch: list[KvEvent]) -> None:
    for i, event in enumerate(batch):
        data = pack_events([KvRecord.of(event)])
        await bus.publish_durable_bytes(subjects.kv_events("prefill"), data)
        if i % 500 == 0:
            say(f"  {i:,} of {len(batch):,} events published")


async def bench_follow(state: Path, n_blocks: int, rounds: int) -> dict:
    nats = NatsServer("127.0.0.1", free_port(), state / "js")
    nats.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(
        KVMESH_NATS_URL=nats.url,
        KVMESH_STATE_DIR=str(state),
        KVMESH_LOG_LEVEL="warning",
        KVMESH_CACHEMETA_SNAPSHOT_INTERVAL_S="3600",  # a snapshot when the bench says
        KVMESH_CACHEMETA_GC_INTERVAL_S="3600",
    )

    def cachemeta() -> subprocess.Popen:
        log = open(state / "cachemeta.log", "ab")  # noqa: SIM115
        return subprocess.Popen(
            [sys.executable, "-m", "services.cachemeta"],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )

    proc = cachemeta()
    bus = await Bus.connect(nats.url, "bench")
    out: dict = {}
    try:
        await bus.ensure_stream(subjects.KV_EVENTS_STREAM, [subjects.KV_EVENTS_ALL])
        first = events(n_blocks)
        say(f"catch-up: {n_blocks:,} blocks in {len(first):,} events through the stream")
        await publish(bus, first)
        follower, took = await follow(bus)
        assert len(follower.index) == n_blocks // CHAIN * CHAIN, len(follower.index)
        out["catch_up_stream_s"] = took
        say(f"  followed the whole stream in {took:.2f} s")
        # A snapshot of them (cachemeta saves one as it stops), then 100K blocks after it.
        proc.terminate()
        proc.wait(120)
        proc = cachemeta()
        while await read_snapshot(bus) is None:
            await asyncio.sleep(0.5)
        more = [  # new blocks (their hashes differ in the first character)
            e.model_copy(update={"hashes": [f"f{h[1:]}" for h in e.hashes]})
            for e in events(n_blocks // 10, source="prefill-9")
        ]
        await publish(bus, more)
        follower, took = await follow(bus)
        out.update(
            catch_up_snapshot_s=took,
            snapshot_blocks=follower.from_snapshot,
            after_snapshot_events=follower.index.seq - len(first),
            followed_blocks=len(follower.index),
        )
        say(f"  from the snapshot ({follower.from_snapshot:,} blocks) and the rest: {took:.2f} s")
        # Lookups: the router's own, and the round trip to cachemeta it replaces.
        probes = chains(n_blocks)
        while True:  # until cachemeta has consumed the last event
            reply = await bus.request(
                subjects.CACHEMETA_LOOKUP, LookupRequest.of(probes[-1]), LookupReply, 10
            )
            if reply.counts.get(STORE) == CHAIN:
                break
            await asyncio.sleep(0.5)
        local, remote = [], []
        for r in range(rounds):
            chain = probes[(r * 37) % len(probes)]
            t = time.perf_counter()
            counts = follower.index.blocks.lookup(chain, time.time(), touch=False)
            local.append((time.perf_counter() - t) * 1e3)
            assert counts.get(STORE) == CHAIN
            t = time.perf_counter()
            await bus.request(subjects.CACHEMETA_LOOKUP, LookupRequest.of(chain), LookupReply, 5)
            remote.append((time.perf_counter() - t) * 1e3)
        local.sort(), remote.sort()
        p99 = int(0.99 * rounds) - 1
        out.update(
            local_lookup_p50_ms=statistics.median(local),
            local_lookup_p99_ms=local[p99],
            cachemeta_lookup_p50_ms=statistics.median(remote),
            cachemeta_lookup_p99_ms=remote[p99],
        )
    finally:
        await bus.close()
        proc.terminate()
        proc.wait(60)
        nats.stop()
    return out


# -- 4. a stopped feed ---------------------------------------------------------------------


def http(url: str, method: str = "GET", body: dict | None = None) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as err:  # /health says 503 while a role is missing
        return json.loads(err.read() or b"{}")


def ask(url: str, ids: list[int]) -> str:
    """Send a prompt; the worker its prefill was routed to."""
    body = {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0}
    return http(f"{url}/v1/completions", "POST", body)["kvmesh"]["route"]["chosen"]


def wait_for(check, timeout_s: float, step_s: float = 0.05) -> float:  # noqa: ANN001
    t = time.monotonic()
    while not check():
        if time.monotonic() - t > timeout_s:
            raise SystemExit(f"not within {timeout_s} s")
        time.sleep(step_s)
    return time.monotonic() - t


def bench_feed(trials: int) -> dict:
    stack = Stack("tiny", threads=1, extra={"KVMESH_FAULT_HOOKS": "true"})
    flagged, resynced = [], []
    try:
        stack.wait_ready()
        health = http(f"{stack.url}/health")
        address = {w["id"]: w["address"] for w in health["roles"]["prefill"]}
        for trial in range(trials):
            ids = [(i * 7919 + trial * 104729) % 40000 + 100 for i in range(600)]
            home = ask(stack.url, ids)
            time.sleep(1.0)
            http(f"{address[home]}/faults/kv_events", "PUT")
            cut = time.monotonic()
            more = [(i * 31 + trial) % 40000 + 100 for i in range(256)]
            ask(stack.url, ids + more)  # its next turn: new blocks, their events lost

            def stale(want: bool, worker: str = home) -> bool:
                return (worker in http(f"{stack.url}/health")["kv_index"]["stale"]) == want

            wait_for(lambda: stale(True), 30)
            flagged.append(time.monotonic() - cut)
            http(f"{address[home]}/faults/kv_events", "DELETE")
            resynced.append(wait_for(lambda: stale(False), 60, 0.1))
            say(f"  trial {trial}: flagged in {flagged[-1]:.2f} s, whole in {resynced[-1]:.2f} s")
    finally:
        stack.stop()
    return {
        "heartbeat_s": 1.0,
        "flagged_s": flagged,
        "resynced_s": resynced,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--one-memory", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--lru", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--skip-feed", action="store_true")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks on the stream")
    ap.add_argument("--trials", type=int, default=5, help="stopped-feed trials")
    args = ap.parse_args()
    if args.one_memory:
        emit(one_memory(args.one_memory, args.lru))
        return
    memory = [] if args.skip_memory else bench_memory([1_000_000, 10_000_000])
    with tempfile.TemporaryDirectory(prefix="kvmesh-kvindex-") as d:
        follow_out = asyncio.run(bench_follow(Path(d), args.blocks, rounds=300))
    feed = {} if args.skip_feed else bench_feed(args.trials)

    print("\nmemory of an index (resident, added; 32-char hashes included)")
    print(f"{'holder':<10}{'blocks':>12}{'MiB':>10}{'B/block':>10}{'estimate MiB':>14}")
    for r in memory:
        mib = r["rss_bytes"] / 2**20
        print(
            f"{r['who']:<10}{r['blocks']:>12,}{mib:>10.0f}{r['rss_bytes'] / r['blocks']:>10.0f}"
            f"{r['estimate_bytes'] / 2**20:>14.0f}"
        )
    f = follow_out
    print(f"\na router's follower over {args.blocks:,} blocks on the stream")
    print(f"  whole stream, no snapshot:        {f['catch_up_stream_s']:.2f} s")
    print(
        f"  snapshot ({f['snapshot_blocks']:,} blocks) + {f['after_snapshot_events']} events: "
        f"{f['catch_up_snapshot_s']:.2f} s"
    )
    print(f"\nlookup of {CHAIN} hashes at {f['followed_blocks']:,} blocks   p50 ms   p99 ms")
    for name, key in (("router's own index", "local"), ("round trip to cachemeta", "cachemeta")):
        p50, p99 = f[f"{key}_lookup_p50_ms"], f[f"{key}_lookup_p99_ms"]
        print(f"  {name:<28}{p50:>8.3f} {p99:>8.3f}")
    if feed:
        print("\na worker's KV events cut while it computes (heartbeat 1 s)")
        print(f"  flagged after (s):  {', '.join(f'{x:.2f}' for x in feed['flagged_s'])}")
        print(f"  whole again after:  {', '.join(f'{x:.2f}' for x in feed['resynced_s'])}")

    def mb(who: str, n: int) -> float | None:
        found = [r for r in memory if r["who"] == who and r["blocks"] >= n * 0.99]
        return round(found[0]["rss_bytes"] / 2**20, 1) if found else None

    router_1m = [r for r in memory if r["who"] == "router" and r["blocks"] < 2_000_000]
    summary = {
        "bytes_per_block_router": round(router_1m[0]["rss_bytes"] / router_1m[0]["blocks"])
        if router_1m
        else None,
        "router_mb_1m": mb("router", 1_000_000),
        "router_mb_10m": mb("router", 10_000_000),
        "cachemeta_mb_1m": mb("cachemeta", 1_000_000),
        "catch_up_stream_1m_s": round(f["catch_up_stream_s"], 2),
        "catch_up_snapshot_1m_s": round(f["catch_up_snapshot_s"], 2),
        "local_lookup_p99_ms": round(f["local_lookup_p99_ms"], 3),
        "cachemeta_lookup_p99_ms": round(f["cachemeta_lookup_p99_ms"], 3),
        "feed_flagged_s_max": round(max(feed["flagged_s"]), 2) if feed else None,
        "feed_resynced_s_max": round(max(feed["resynced_s"]), 2) if feed else None,
    }
    emit(summary)


if __name__ == "__main__":
    main()

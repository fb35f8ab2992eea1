"""Storage-tier and cachemeta benchmark.

1. Storage tier: write and read throughput of engine-sized blocks (the real model's 64-token
   block, 2.9 MB) through FileStore, against a plain write/read of the same bytes to the same
   directory, same run (best of 3). Also: loading blocks into the engine (checksums + copy).
2. Cachemeta: a real cachemeta process fed 1M blocks through the KV event stream; lookup
   latency over NATS for a 77K-token request (1,200 hashes of 64 tokens), p50 and p99.
3. Prefill through the mesh (real model, 1 prefill + 1 decode + cachemeta, KV moves): an
   8K-token prompt cold, then one whose first 96% is in the storage tier.

Prints a table; the last line is one JSON object: store_write_ratio, store_read_ratio,
lookup_p99_ms, prefill_cold_ms, prefill_hit96_ms.

    .venv/bin/python bench/kvstore.py [--skip-mesh] [--dir PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import (  # noqa: E402
    Stack,
    free_port,
    say,  # noqa: E402
)
from kvmesh.natsserver import NatsServer  # noqa: E402
from shared.bus import Bus, subjects  # noqa: E402
from shared.engine.interface import EngineOptions  # noqa: E402
from shared.engine.torch.engine import TorchEngine  # noqa: E402
from shared.engine.torch.loader import load_model  # noqa: E402
from shared.kvstore.backend import FileStore  # noqa: E402
from shared.messages.kvevents import STORE, KvEvent, LookupReply, LookupRequest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


# -- 1. the storage tier ------------------------------------------------------------------


def real_blocks(state: Path, n: int) -> tuple[list[bytes], TorchEngine]:
    """n real 64-token blocks of the real model's KV (from a prefill)."""
    model = load_model("smollm2-135m-instruct", state)
    engine = TorchEngine(model, EngineOptions(block_size=64, kv_cache_tokens=64 * (n + 8)))
    ids = [(i * 7919) % 40000 + 100 for i in range(64 * n + 1)]
    from shared.messages.sampling import SamplingParams

    engine.prefill("b", ids, SamplingParams(max_tokens=1))
    blobs = engine.export_blocks("b", 0, n)
    engine.free("b")
    return blobs, engine


def bench_store(root: Path, blobs: list[bytes], engine: TorchEngine) -> dict:
    keys = [os.urandom(16).hex() for _ in blobs]
    total = sum(len(b) for b in blobs)
    best = {"store_w": 1e9, "plain_w": 1e9, "store_r": 1e9, "plain_r": 1e9, "load": 1e9}
    for rnd in range(3):
        for kind in ("plain", "store") if rnd % 2 else ("store", "plain"):
            d = root / f"{kind}{rnd}"
            store = FileStore(d)
            t = time.perf_counter()
            if kind == "store":
                for k, b in zip(keys, blobs, strict=True):
                    store.put(k, b)
            else:
                d.mkdir(parents=True, exist_ok=True)
                for k, b in zip(keys, blobs, strict=True):
                    with open(d / k, "wb") as f:
                        f.write(b)
            best[f"{kind}_w"] = min(best[f"{kind}_w"], time.perf_counter() - t)
            # Reads drop each block at once, both ways: keeping 64 fresh 3 MB buffers would
            # measure the allocator's page faults, not the store.
            t = time.perf_counter()
            if kind == "store":
                for k in keys:
                    assert store.get(k) is not None
            else:
                for k in keys:
                    with open(d / k, "rb") as f:
                        f.read()
            best[f"{kind}_r"] = min(best[f"{kind}_r"], time.perf_counter() - t)
            if kind == "store":
                got = [store.get(k) for k in keys]
                t = time.perf_counter()
                prefix = engine.import_blocks(got)  # every cell's CRC32, then into the cache
                best["load"] = min(best["load"], time.perf_counter() - t)
                engine.release(prefix)
            shutil.rmtree(d)
    mb = total / 1e6
    return {
        "block_mb": len(blobs[0]) / 1e6,
        "store_write_mb_s": mb / best["store_w"],
        "plain_write_mb_s": mb / best["plain_w"],
        "store_read_mb_s": mb / best["store_r"],
        "plain_read_mb_s": mb / best["plain_r"],
        "load_mb_s": mb / best["load"],
    }


# -- 2. cachemeta lookups -----------------------------------------------------------------


async def bench_lookup(state: Path, n_blocks: int, n_hashes: int, rounds: int) -> dict:
    nats = NatsServer("127.0.0.1", free_port(), state / "js")
    nats.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(KVMESH_NATS_URL=nats.url, KVMESH_STATE_DIR=str(state), KVMESH_LOG_LEVEL="warning")
    log = open(state / "cachemeta.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cachemeta"],
        env=env,
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    bus = await Bus.connect(nats.url, "bench")
    try:
        await bus.ensure_stream(subjects.KV_EVENTS_STREAM, [subjects.KV_EVENTS_ALL])
        # Requests are chains of blocks: n_blocks / n_hashes conversations of n_hashes each.
        chains = [
            [f"{c:08x}{i:024x}" for i in range(n_hashes)] for c in range(n_blocks // n_hashes)
        ]
        say(f"indexing {n_blocks:,} blocks through the KV event stream")
        t = time.perf_counter()
        for c, chain in enumerate(chains):
            for start in range(0, n_hashes, 400):
                part = chain[start : start + 400]
                event = KvEvent(
                    kind="stored",
                    location=STORE,
                    hashes=part,
                    sizes=[2_949_120] * len(part),
                    at=time.time(),
                )
                await bus.publish_durable(subjects.kv_events("prefill"), event)
            if c % 100 == 0:
                say(f"  {c * n_hashes:,} blocks published")
        probe = LookupRequest.of(chains[-1])
        while True:  # until cachemeta has consumed the last event
            try:
                reply = await bus.request(subjects.CACHEMETA_LOOKUP, probe, LookupReply, 5)
                if reply.counts.get(STORE) == n_hashes:
                    break
            except Exception:
                pass
            await asyncio.sleep(0.5)
        indexed_s = time.perf_counter() - t
        say(f"indexed in {indexed_s:.1f} s; {rounds} lookups of {n_hashes} hashes")
        floor = []
        for _ in range(rounds):  # the same round trip with one hash: NATS and the loop alone
            t = time.perf_counter()
            await bus.request(
                subjects.CACHEMETA_LOOKUP, LookupRequest.of(chains[0][:1]), LookupReply, 5
            )
            floor.append((time.perf_counter() - t) * 1e3)
        times = []
        for r in range(rounds):
            req = LookupRequest.of(chains[(r * 37) % len(chains)])
            t = time.perf_counter()
            reply = await bus.request(subjects.CACHEMETA_LOOKUP, req, LookupReply, 5)
            times.append((time.perf_counter() - t) * 1e3)
            assert reply.counts.get(STORE) == n_hashes
        times.sort()
        return {
            "indexed_blocks": n_blocks,
            "index_s": indexed_s,
            "lookup_p50_ms": statistics.median(times),
            "lookup_p99_ms": times[int(0.99 * len(times)) - 1],
            "one_hash_p50_ms": statistics.median(floor),
        }
    finally:
        await bus.close()
        proc.terminate()
        proc.wait(30)
        log.close()
        nats.stop()


# -- 3. prefill through the mesh ----------------------------------------------------------


def bench_mesh_prefill(n: int = 8000) -> dict:
    import openai

    os.environ["KVMESH_CACHEMETA_TTL_CHAT_S"] = "86400"
    stack = Stack(
        "smollm2-135m-instruct",
        threads=0,
        extra={
            "KVMESH_PREFILL_MEMORY_TIER_BYTES": "0",  # hits come from the storage tier's files
            "KVMESH_DECODE_MEMORY_TIER_BYTES": "0",
            "KVMESH_PREFILL_PREFILL_CHUNK": "1024",
        },
    )
    try:
        stack.wait_ready(180)
        client = openai.OpenAI(
            base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=600
        )
        base = [(i * 7919) % 40000 + 100 for i in range(n)]

        def run(ids: list[int]) -> tuple[float, dict, int]:
            t = time.perf_counter()
            r = client.completions.create(
                model="smollm2-135m-instruct", prompt=ids, max_tokens=1, temperature=0
            )
            took = (time.perf_counter() - t) * 1e3
            return took, r.model_extra["kvmesh"], r.usage.prompt_tokens_details.cached_tokens

        say(f"mesh: {n}-token prompt, cold")
        cold_ms, cold_t, _ = run(base)
        time.sleep(3)  # its blocks are written behind
        hit = base[: int(n * 0.96)] + [(i * 104729) % 40000 + 100 for i in range(n - int(n * 0.96))]
        say(f"mesh: {n}-token prompt, 96% from the storage tier")
        hit_ms, hit_t, cached = run(hit)
        return {
            "prefill_cold_ms": cold_ms,
            "prefill_cold_engine_ms": cold_t["prefill_ms"],
            "prefill_hit96_ms": hit_ms,
            "prefill_hit96_engine_ms": hit_t["prefill_ms"],
            "hit96_cached_tokens": cached,
        }
    finally:
        stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-mesh", action="store_true")
    ap.add_argument("--dir", type=Path, default=None, help="where files go (default: a temp dir)")
    ap.add_argument("--blocks", type=int, default=1_000_000, help="blocks indexed by cachemeta")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvmesh-kvstore-", dir=args.dir))
    try:
        say("storage tier: 64 real-model blocks")
        blobs, engine = real_blocks(work / "state", 64)
        store = bench_store(work / "files", blobs, engine)
        del blobs, engine
        lookup = asyncio.run(bench_lookup(work / "cm", args.blocks, 1200, 300))
        mesh = {} if args.skip_mesh else bench_mesh_prefill()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        ("block size (real model, 64 tokens)", f"{store['block_mb']:.2f} MB"),
        ("storage tier write", f"{store['store_write_mb_s']:.0f} MB/s"),
        ("plain write, same bytes, same dir", f"{store['plain_write_mb_s']:.0f} MB/s"),
        ("storage tier read", f"{store['store_read_mb_s']:.0f} MB/s"),
        ("plain read, same bytes, same dir", f"{store['plain_read_mb_s']:.0f} MB/s"),
        ("load into the engine (CRC32 per cell + copy)", f"{store['load_mb_s']:.0f} MB/s"),
        (
            "cachemeta: blocks indexed (via the stream)",
            f"{lookup['indexed_blocks']:,} in {lookup['index_s']:.0f} s",
        ),
        ("lookup of 1,200 hashes, p50", f"{lookup['lookup_p50_ms']:.2f} ms"),
        ("lookup of 1,200 hashes, p99", f"{lookup['lookup_p99_ms']:.2f} ms"),
        ("lookup of 1 hash (the round trip alone), p50", f"{lookup['one_hash_p50_ms']:.2f} ms"),
    ]
    if mesh:
        rows += [
            (
                "8K prompt through the mesh, cold",
                f"{mesh['prefill_cold_ms']:.0f} ms (engine {mesh['prefill_cold_engine_ms']:.0f})",
            ),
            (
                "same, 96% from the storage tier",
                "{:.0f} ms (engine {:.0f}, {} cached)".format(
                    mesh["prefill_hit96_ms"],
                    mesh["prefill_hit96_engine_ms"],
                    mesh["hit96_cached_tokens"],
                ),
            ),
        ]
    for name, value in rows:
        print(f"{name:<48}{value}")
    print(
        json.dumps(
            {
                "store_write_ratio": round(
                    store["store_write_mb_s"] / store["plain_write_mb_s"], 3
                ),
                "store_read_ratio": round(store["store_read_mb_s"] / store["plain_read_mb_s"], 3),
                "lookup_p99_ms": round(lookup["lookup_p99_ms"], 3),
                "prefill_cold_ms": round(mesh["prefill_cold_ms"], 1) if mesh else None,
                "prefill_hit96_ms": round(mesh["prefill_hit96_ms"], 1) if mesh else None,
            }
        )
    )


if __name__ == "__main__":
    main()

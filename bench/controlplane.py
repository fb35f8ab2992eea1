"""The control plane at DeepInfer's rate: each component's rates and sizes measured here, and
the cluster they size (docs/scale.md).

Measured in this process, on this machine's CPU:

1. The block index (shared/kvindex/index.py) as a router keeps it and as cachemeta keeps it:
   bytes per indexed block at 10^6 and 10^7 blocks (and --max-blocks for the router: 10^8 by
   default), built from packed KV event batches through ``KvIndex.apply_message``, the way
   both follow the stream: events applied per second (1,000-block events, and 16-block events
   batched 64 to a message); the message bytes per block on the stream.
2. A 77K-token prompt's lookup (1,200 blocks, all indexed: the longest walk) at each size,
   p50/p99 over --lookups.
3. Catch-up: cachemeta's snapshot of 10^6 and 10^7 blocks written, then read by a joining
   router (both timed; the trend taken to 10^8).
4. A router's CPU for a 77K-token turn whose history it has seen: the request's JSON parsed and
   checked (the Chat Completions model, as the router reads it into a conversation), the chat
   template rendered (from the conversation's messages, as the router renders them), the
   prompt tokenized by segment (the history's segments cached), its block hashes (the
   history's reused), looked up in the index and the workers ranked (64, the ttft policy),
   the task's bytes made; each turn answered before the next comes (the policy told it was
   prefilled). Beside it, ``reference_p50_ms``: ``sum(range(100_000))`` timed in the same
   turns, as this machine's speed at the time (it varies twofold from hour to hour here:
   compare figures by it).

Then the sizing (``sizing``): from DeepInfer's published rate (155 trillion tokens a day, 96%
cached, 77K tokens a request) and a model's KV bytes per token (DeepSeek-V3's MLA: 70,272
bytes in bf16), what each component must carry, and how many routers (in cells of the fleet)
and cachemeta partitions that takes at the measured rates.

Prints tables; the last line is one JSON object: router_bytes_per_block,
cachemeta_bytes_per_block, events_per_s, events_per_s_small, lookup_p99_ms,
lookup_blocks_indexed, catch_up_s_1e7, router_cpu_ms_per_request_77k, routers_for_deepinfer,
router_cells, cachemeta_for_deepinfer, and the sizing's rates.

    .venv/bin/python bench/controlplane.py [--max-blocks 100000000] [--lookups 2000]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from bench.harness import emit, say  # noqa: E402
from services.router.dispatch.job import Job  # noqa: E402
from services.router.dispatch.plan import PrefixHashes  # noqa: E402
from services.router.dispatch.send import generate_task  # noqa: E402
from services.router.formats.openai import conversation  # noqa: E402
from services.router.request.messages import chat_messages  # noqa: E402
from services.router.request.render import PromptTokenizer  # noqa: E402
from services.router.routing.policies import POLICIES  # noqa: E402
from services.router.routing.route import RouteRequest  # noqa: E402
from shared.kvindex.view import DEFAULT_TTL_S, KvIndex  # noqa: E402
from shared.messages.kvevents import STORE, KvRecord, memory_location, pack_events  # noqa: E402
from shared.messages.sampling import SamplingParams  # noqa: E402
from shared.model.text import load_text_model  # noqa: E402
from shared.search import percentile  # noqa: E402

CHAIN = 1200  # a 77K-token prompt's 64-token blocks
BLOCK_TOKENS = 64
WORKERS = 64
SIZE = (2_949_120).to_bytes(4, "little")  # a block's bytes (the real model's), as events say

# DeepInfer, as published: 155 trillion tokens a day, 96% of input tokens from the cache,
# ~77K tokens a request; DeepSeek-V3's KV (MLA, 61 layers × (512 + 64) × 2 bytes).
DAY_TOKENS = 155e12
CACHED = 0.96
REQUEST_TOKENS = 77_000
KV_BYTES_PER_TOKEN = 61 * (512 + 64) * 2
STORAGE_BYTES = 100 * 2**50  # its storage tier, ~100 PiB
HEADROOM = 2.0  # each process sized to half what it measured


def batches(n_blocks: int, per_event: int, per_message: int) -> tuple[list[bytes], int]:
    """Stream messages storing ``n_blocks`` random blocks: every event at the storage tier
    and, one in four, a worker's memory tier too; ``per_event`` blocks an event. Also the
    blocks they store, counted at each location."""
    out, seq, events, stored = [], 0, [], 0
    rng = np.random.default_rng(per_event)
    for start in range(0, n_blocks, per_event):
        raw = rng.bytes(16 * min(per_event, n_blocks - start))
        n = len(raw) // 16
        for location in [STORE] + ([memory_location(f"p{seq % WORKERS}")] if seq % 4 == 0 else []):
            seq += 1
            stored += n
            events.append(
                KvRecord(
                    "stored",
                    location,
                    raw,
                    16,
                    SIZE * n,
                    "chat",
                    0.0,
                    time.time(),
                    "bench",
                    1.0,
                    seq,
                )  # fmt: skip
            )
        if len(events) >= per_message:
            out.append(pack_events(events))
            events = []
    if events:
        out.append(pack_events(events))
    return out, stored


def index_part(max_blocks: int, lookups: int) -> dict:
    out: dict = {"sizes": {}}
    sizes = [n for n in (10**6, 10**7, 10**8) if n <= max_blocks]
    for lru, who in ((False, "router"), (True, "cachemeta")):
        for n in sizes:
            if lru and n > 10**7:
                continue  # (cachemeta is partitioned by hash past that: docs/scale.md)
            gc.collect()
            index = KvIndex(DEFAULT_TTL_S, lru=lru)
            say(f"{who}: {n:,} blocks, as packed events of 1,000 blocks ...")
            _applied, stream_bytes, seq, chains = 0.0, 0, 1, []
            rng = np.random.default_rng(n)
            rate_blocks, rate_s = 0, 0.0
            for start in range(0, n, 10**6):
                step = min(10**6, n - start)
                events, raw_all = [], []
                for _s in range(0, step, 1000):
                    raw = rng.bytes(16 * 1000)
                    raw_all.append(raw)
                    at = [STORE] + ([memory_location(f"p{seq % WORKERS}")] if seq % 4 == 0 else [])
                    for location in at:
                        events.append(pack_events([KvRecord(
                            "stored", location, raw, 16, SIZE * 1000, "chat", 0.0,
                            time.time(), "bench", 1.0, seq)]))  # fmt: skip
                        seq += 1
                        rate_blocks += 1000
                t = time.perf_counter()
                for data in events:
                    index.apply_message(data, index.seq + 1)
                rate_s += time.perf_counter() - t
                stream_bytes += sum(map(len, events))
                chains.append(raw_all[0] + raw_all[1][: 16 * 200])
                say(f"  {start + step:,} of {n:,}")
            blocks = index.blocks
            per_block = blocks.nbytes / len(blocks)
            row = {"bytes_per_block": round(per_block, 1), "events_per_s": rate_blocks / rate_s,
                   "stream_bytes_per_block": stream_bytes / rate_blocks}  # fmt: skip
            if not lru:
                hashes = [[c[i : i + 16].hex() for i in range(0, len(c), 16)] for c in chains]
                times = []
                for r in range(lookups):
                    chain = hashes[r % len(hashes)]
                    t = time.perf_counter()
                    counts = blocks.lookup(chain, time.time(), touch=False)
                    times.append((time.perf_counter() - t) * 1e3)
                assert counts.get(STORE) == CHAIN, counts
                row |= {"lookup_p50_ms": statistics.median(times),
                        "lookup_p99_ms": percentile(sorted(times), 99)}  # fmt: skip
            if n <= 10**7 and lru:
                t = time.perf_counter()
                data = index.snapshot()
                written = time.perf_counter() - t
                t = time.perf_counter()
                joined = KvIndex.from_snapshot(data, lru=False)
                read = time.perf_counter() - t
                assert len(joined) == len(index)
                row |= {"snapshot_bytes": len(data), "snapshot_write_s": written,
                        "router_catch_up_s": read}  # fmt: skip
                del joined, data
            out["sizes"][f"{who} {n:.0e}"] = row
            say(f"  {who} {n:,}: {json.dumps({k: round(v, 4) for k, v in row.items()})}")
            del index, blocks
    small = KvIndex(DEFAULT_TTL_S, lru=False)
    messages, stored = batches(10**6, 16, 64)
    t = time.perf_counter()
    for i, data in enumerate(messages, 1):
        small.apply_message(data, i)
    out["events_per_s_small"] = stored / (time.perf_counter() - t)
    return out


def router_cpu_part(rounds: int) -> dict:
    """A 77K-token turn whose history the router has seen: parse, render, tokenize, hash,
    look up, rank."""
    state = Path(os.environ.get("KVMESH_STATE_DIR", Path.home() / ".kvmesh"))
    model = load_text_model("smollm2-135m-instruct", state)
    tokenizer = PromptTokenizer(model.tokenizer, 8_000_000)
    hashes_cache = PrefixHashes()
    index = KvIndex(DEFAULT_TTL_S, lru=False)
    policy = POLICIES["ttft"]()
    workers = [f"p{i}" for i in range(WORKERS)]
    words = ["the", "harbour's", "ledger", "records", "each", "ship,", "its", "cargo", "and"]
    rng = np.random.default_rng(7)

    def message(k: int, n_words: int) -> str:
        return " ".join(words[i % len(words)] for i in rng.integers(0, 10**6, n_words)) + f" {k}"

    history = [{"role": "system", "content": message(0, 2000)}]
    while True:  # turns until ~77K tokens
        history += [{"role": "user", "content": message(len(history), 300)},
                    {"role": "assistant", "content": message(len(history) + 1, 900)}]  # fmt: skip
        if len(tokenizer.encode(model.chat_template.render(history))) > REQUEST_TOKENS:
            break
    steps = ("parse", "render", "tokenize", "hash", "lookup", "rank", "send", "total")
    times: dict[str, list[float]] = {k: [] for k in (*steps, "reference")}
    say(f"router CPU: a {len(history)}-message history, {rounds} turns ...")
    for r in range(rounds + 1):
        turn = [*history, {"role": "user", "content": message(10**6 + r, 60)}]
        body = json.dumps({"model": "m", "messages": turn, "max_tokens": 64}).encode()
        t0 = time.perf_counter()
        request = conversation(body, chat=True)  # (as the router reads a body)
        t1 = time.perf_counter()
        text = model.chat_template.render(chat_messages(request, "\x00kvmesh-image-"))
        t2 = time.perf_counter()
        ids, segments = tokenizer.encode_segments(text)
        t3 = time.perf_counter()
        hashes = hashes_cache.hashes(segments, BLOCK_TOKENS, "fingerprint", "")
        t4 = time.perf_counter()
        counts = index.blocks.lookup(hashes, time.time(), touch=False)
        t5 = time.perf_counter()
        route = RouteRequest(f"r{r}", len(ids), 64, hashes, counts, float(r))
        best = policy.rank(route, workers)[0].service_id
        t6 = time.perf_counter()
        job = Job(f"r{r}", "m", ids, SamplingParams(max_tokens=64), time.time() + 60,
                  block_size=BLOCK_TOKENS, block_hashes=hashes, cached_blocks=counts,
                  segments=segments)  # fmt: skip
        generate_task(job, "reply", "d0", "127.0.0.1:1", "token").to_bytes()
        t7 = time.perf_counter()
        policy.dispatched(best, route)
        policy.prefilled(best, route, route.at)  # (answered before its next turn comes)
        if r == 0:  # (the first: the history's segments and hashes made)
            index.apply_message(pack_events([KvRecord(
                "stored", STORE, bytes.fromhex("".join(hashes)), 16, b"", "chat", 0.0,
                time.time(), "bench", 1.0, 1)]), 1)  # fmt: skip
            continue
        t8 = time.perf_counter()
        sum(range(100_000))  # this machine's speed now (it varies 2× from hour to hour here)
        times["reference"].append((time.perf_counter() - t8) * 1e3)
        stamps = (t0, t1, t2, t3, t4, t5, t6, t7)
        for k, a, b in zip(steps[:-1], stamps[:-1], stamps[1:], strict=True):
            times[k].append((b - a) * 1e3)
        times["total"].append((t7 - t0) * 1e3)
    return {f"{k}_p50_ms": statistics.median(v) for k, v in times.items()} | {
        "total_p99_ms": percentile(sorted(times["total"]), 99), "prompt_tokens": len(ids),
        "blocks": len(hashes), "blocks_found": max(counts.values(), default=0)}  # fmt: skip


def storage_answer_part(workers: int, traces: tuple[str, ...], loads: tuple[float, ...]) -> dict:
    """What a router that does not follow the storage tier (only its workers' memory tiers;
    the prefill worker finds the rest itself) costs in TTFT, replayed in the profiled world
    (bench/routing.py's cells, the default policy)."""
    from bench.routing import Run, config, trace
    from simulator.replay import simulate

    cells = {}
    for name in traces:
        for load in loads:
            run = Run(name, workers, load, "", world="profiled")
            requests, bs = trace(name, workers)
            got = {}
            for answer in ("exact", "none"):
                cfg = replace(config(run), storage_answer=answer)
                got[answer] = simulate(requests, bs, cfg, "ttft").summary(workers)
            cell = {k: got["none"][k] / max(got["exact"][k], 1e-9) - 1
                    for k in ("ttft_mean_s", "ttft_p99_s")}  # fmt: skip
            cells[run.cell] = cell
            say(f"  {run.cell}: mean {cell['ttft_mean_s']:+.2%}, p99 {cell['ttft_p99_s']:+.2%}")
    return cells


def sizing(router_eps: float, router_ms: float, cachemeta_eps: float) -> dict:
    """DeepInfer's rates, and the processes that carry them (each at half what it measured).

    A router routes by the memory tiers of the workers it sends to (a cell of the fleet: it
    follows that cell's memory-tier events, stored and evicted) and asks the storage tier's
    holders (cachemeta, partitioned by hash) how long a prompt's prefix there is: every
    prefill worker reads the storage tier alike, so the tier decides the estimate, not the
    worker. Touches go to cachemeta alone (it decides what is deleted and says so in removal
    events), at most once per block per window (they are aggregated: a block's life is days).
    """
    tokens_s = DAY_TOKENS / 86400
    requests_s = tokens_s / REQUEST_TOKENS
    blocks_s = tokens_s / BLOCK_TOKENS  # looked up
    new_blocks_s = blocks_s * (1 - CACHED)  # computed: stored, and in steady state evicted
    memory_events_s = 2 * new_blocks_s  # stored into and evicted from workers' memory tiers
    store_events_s = 2 * new_blocks_s  # written to and deleted from the storage tier
    # Touches aggregated per block per window: each block is read 1 / (1 - cached) = 25
    # times in its life; at most once a window, they come to no more than its stores.
    touch_events_s = new_blocks_s
    routers_cpu = math.ceil(requests_s * router_ms / 1e3 * HEADROOM)
    # A router spends at most a quarter of its core on its cell's events.
    cells = math.ceil(memory_events_s / (router_eps / 4))
    cachemeta = math.ceil((store_events_s + touch_events_s) / (cachemeta_eps / HEADROOM))
    block_bytes = KV_BYTES_PER_TOKEN * BLOCK_TOKENS
    return {
        "input_tokens_s": tokens_s,
        "requests_s": requests_s,
        "lookup_blocks_s": blocks_s,
        "new_blocks_s": new_blocks_s,
        "memory_events_s": memory_events_s,
        "store_events_s": store_events_s,
        "touch_events_s": touch_events_s,
        "stream_mb_s": (memory_events_s + store_events_s + touch_events_s) * 20 / 1e6,
        "storage_blocks": STORAGE_BYTES / block_bytes,
        "storage_gb_read_s": blocks_s * CACHED * block_bytes / 1e9,
        "routers_by_cpu": routers_cpu,
        "router_cells": cells,
        "routers": max(routers_cpu, cells),
        "cachemeta_partitions": cachemeta,
        "cachemeta_lookups_s": requests_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-blocks", type=int, default=10**8)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--traces", default="mooncake,azure_conv,azure_code,agent")
    args = ap.parse_args()
    idx = index_part(args.max_blocks, args.lookups)
    cpu = router_cpu_part(args.turns)
    say("the storage-tier answer in the simulator (a router without it, against one with it):")
    store = storage_answer_part(8, tuple(args.traces.split(",")), (0.5, 0.8, 0.95, 1.3))
    sizes = idx["sizes"]
    largest = max((k for k in sizes if k.startswith("router")), key=lambda k: float(k.split()[1]))
    router = sizes[largest]
    cm = sizes["cachemeta 1e+07"] if "cachemeta 1e+07" in sizes else sizes["cachemeta 1e+06"]
    router_eps = min(v["events_per_s"] for k, v in sizes.items() if k.startswith("router"))
    size = sizing(router_eps, cpu["total_p50_ms"], cm["events_per_s"])
    print("index                 bytes/block  events/s (M)  lookup p50 ms  lookup p99 ms")
    for k, v in sizes.items():
        look = (f"{v['lookup_p50_ms']:>14.3f} {v['lookup_p99_ms']:>14.3f}"
                if "lookup_p50_ms" in v else f"{'-':>14} {'-':>14}")  # fmt: skip
        print(f"{k:<20} {v['bytes_per_block']:>12.1f} {v['events_per_s'] / 1e6:>13.2f} {look}")
    print(f"16-block events, 64 a message: {idx['events_per_s_small'] / 1e6:.2f} M blocks/s")
    for k, v in sizes.items():
        if "router_catch_up_s" in v:
            print(f"{k}: snapshot {v['snapshot_bytes'] / 1e6:.0f} MB written in "
                  f"{v['snapshot_write_s']:.2f} s, a joining router read it in "
                  f"{v['router_catch_up_s']:.2f} s")  # fmt: skip
    print("\nrouter CPU per 77K-token turn (history seen), p50 ms:")
    print("  " + "  ".join(f"{k.removesuffix('_p50_ms')} {v:.2f}" for k, v in cpu.items()
                          if k.endswith("_p50_ms")))  # fmt: skip
    print(
        f"  total p99 {cpu['total_p99_ms']:.2f} ms; {cpu['prompt_tokens']:,} tokens, "
        f"{cpu['blocks']} blocks"
    )
    print("\nrouter without the storage tier, TTFT against one with it (8 workers, profiled):")
    for cell, v in store.items():
        print(f"  {cell:<22} mean {v['ttft_mean_s']:+7.2%}   p99 {v['ttft_p99_s']:+7.2%}")
    print("\nDeepInfer's rate:")
    for k, v in size.items():
        print(f"  {k:<22} {v:,.3f}" if isinstance(v, float) and v < 100 else f"  {k:<22} {v:,.0f}")
    catch = [v["router_catch_up_s"] for k, v in sizes.items() if "router_catch_up_s" in v]
    figures = {
        "router_bytes_per_block": router["bytes_per_block"],
        "cachemeta_bytes_per_block": cm["bytes_per_block"],
        "events_per_s": round(router_eps),
        "events_per_s_small": round(idx["events_per_s_small"]),
        "lookup_p99_ms": round(router["lookup_p99_ms"], 4),
        "lookup_p50_ms": round(router["lookup_p50_ms"], 4),
        "lookup_blocks_indexed": int(float(largest.split()[1])),
        "catch_up_s_1e7": round(catch[-1], 2) if catch else None,
        "router_cpu_ms_per_request_77k": round(cpu["total_p50_ms"], 3),
        "router_cpu_p99_ms_77k": round(cpu["total_p99_ms"], 3),
        "routers_for_deepinfer": size["routers"],
        "router_cells": size["router_cells"],
        "cachemeta_for_deepinfer": size["cachemeta_partitions"],
        "sizing": {k: round(v, 3) for k, v in size.items()},
        "router_cpu": {k: round(v, 3) for k, v in cpu.items()},
        "storage_answer_ttft_cost_max": round(max(max(v.values()) for v in store.values()), 4)
        if store
        else None,  # fmt: skip
        "storage_answer_cells": store,
        "index": sizes,
    }
    emit(figures)


if __name__ == "__main__":
    main()

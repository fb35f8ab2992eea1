"""The simulator against the live mesh (simulator/validate.py): a small trace of sessions
replayed on `kvmesh up` (2 prefill workers, 1 decode worker, real processes, the tiny model) and
simulated in the world of those same workers, for two routing policies.

The world: the workers' engine profiled on this machine with their thread count
(simulator/measure.py), its KV bytes per token and import rates measured, no batching (kvmesh's
prefill worker batches prompts whose whole length fits its 512-token chunk: none of these do),
and the mesh's own time outside the engine's compute, per request and per prompt token (new
prompts of two lengths sent alone, live, less their profiled compute). Each request's TTFT is
compared, and the mean and the p99.

Prints a table; the last line is one JSON object: per policy the per-request error (mean of
|sim − live| ÷ live), the mean's and the p99's signed errors, and the live and simulated
figures; then the overhead and the profile's rate.

    .venv/bin/python bench/sim_vs_live.py [--model tiny] [--policies ttft,round_robin]
        [--sessions 6] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai  # noqa: E402

from bench.harness import Stack, emit, say  # noqa: E402
from simulator.measure import kv_rates, profile_engine  # noqa: E402
from simulator.profile import EngineProfile  # noqa: E402
from simulator.validate import (  # noqa: E402
    LiveRequest,
    compare,
    overhead,
    sessions,
    simulated,
    world_of,
)

SHORT = 64  # tokens of the short requests that measure the mesh's overhead (and the longest)


async def replay_live(
    url: str, model: str, requests: list[LiveRequest], api_key: str = "none"
) -> list[float]:
    """Each request sent at its time as a streamed completion of its token ids; its TTFT as
    the client saw it (sent → first token), in the requests' order."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0)
    start = time.perf_counter()

    async def one(r: LiveRequest) -> float:
        await asyncio.sleep(max(0.0, start + r.t - time.perf_counter()))
        sent = time.perf_counter()
        stream = await client.completions.create(
            model=model, prompt=r.ids, max_tokens=r.n_out, temperature=0, stream=True
        )
        first = None
        async for _ in stream:
            if first is None:
                first = time.perf_counter() - sent
        assert first is not None, "no token came"
        return first

    try:
        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        await client.close()


def measure_overhead(
    url: str, model: str, profile: EngineProfile, lengths: tuple[int, int], each: int = 5
) -> tuple[float, float]:
    """``overhead`` from new prompts of the two lengths sent alone, one after another, on
    the live mesh (the first of each length warms its path and is left out)."""
    rng = random.Random(99)
    alone: dict[int, list[float]] = {}
    for n in lengths:
        for _ in range(each + 1):
            r = LiveRequest(0.0, [rng.randrange(100, 40000) for _ in range(n)], 2)
            alone.setdefault(n, []).append(asyncio.run(replay_live(url, model, [r]))[0])
        alone[n] = alone[n][1:]
    return overhead(alone, profile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--policies", default="ttft,round_robin")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1536)
    ap.add_argument("--turn-tokens", type=int, default=384)
    ap.add_argument("--gap-s", type=float, default=0.4, help="between a session's turns")
    ap.add_argument("--stagger-s", type=float, default=0.15, help="between sessions' starts")
    args = ap.parse_args()
    requests = sessions(
        args.sessions,
        args.turns,
        args.system_tokens,
        args.turn_tokens,
        args.gap_s,
        args.stagger_s,
    )
    longest = max(len(r.ids) for r in requests)
    say(f"profiling {args.model} at 1 thread (the workers' count) up to {longest} tokens")
    profile = profile_engine(
        args.model,
        1,
        # (the grid's corner, context and prompt, within the model's context)
        cached=(0, longest // 4, longest // 2),
        uncached=(SHORT, args.turn_tokens, longest // 2),
        batch=(1, 2, 4),
        say=say,
    )
    kv = kv_rates(args.model, 1)
    say(
        f"KV: {kv.bytes_per_token} B/token, {kv.memory_gb_s:.2f} GB/s from memory, "
        f"{kv.storage_gb_s:.2f} GB/s from the storage tier's files"
    )
    tmp = Path(tempfile.mkdtemp(prefix="kvmesh-simlive-"))
    (tmp / "profile.json").write_text(profile.to_json())

    results = {}
    overheads = []
    for policy in args.policies.split(","):
        say(f"{policy}: starting the stack")
        stack = Stack(
            args.model,
            1,
            {
                "KVMESH_ROUTER_ROUTING_POLICY": policy,
                "KVMESH_PREFILL_KV_CACHE_TOKENS": str(4 * longest),
                "KVMESH_DECODE_KV_CACHE_TOKENS": str(4 * longest),
            },
            args=("--prefill", "2", "--encoder", "0"),
        )
        try:
            stack.wait_ready()
            overhead = measure_overhead(stack.url, args.model, profile, (SHORT, longest // 2))
            overheads.append(overhead)
            say(
                f"{policy}: overhead {overhead[0] * 1e3:.1f} ms + {overhead[1] * 1e6:.1f} µs a "
                f"token; replaying {len(requests)} requests"
            )
            live = asyncio.run(replay_live(stack.url, args.model, requests))
        finally:
            stack.stop()
        world = world_of(tmp / "profile.json", kv, batch_tokens=0, overhead=overhead)
        sim = simulated(requests, world, policy, workers=2)
        results[policy] = compare(live, sim)

    print(
        f"{len(requests)} requests, {args.sessions} sessions × {args.turns} turns, "
        f"prompts {min(len(r.ids) for r in requests)}–{longest} tokens"
    )
    print(
        "policy | TTFT mean live / sim (ms) | p99 live / sim (ms) | per-request error | "
        "mean error | p99 error"
    )
    for policy, c in results.items():
        print(
            f"{policy} | {c['live_mean_s'] * 1e3:.0f} / {c['sim_mean_s'] * 1e3:.0f} | "
            f"{c['live_p99_s'] * 1e3:.0f} / {c['sim_p99_s'] * 1e3:.0f} | "
            f"{c['per_request_error']:.1%} | {c['mean_error']:+.1%} | {c['p99_error']:+.1%}"
        )
    out = {
        p: {k: round(v, 4) if isinstance(v, float) else v for k, v in c.items()}
        for p, c in results.items()
    }
    out["overhead_ms"] = [round(o[0] * 1e3, 2) for o in overheads]
    out["overhead_us_per_token"] = [round(o[1] * 1e6, 2) for o in overheads]
    out["profile_tok_s"] = round(profile.tok_s(0, 1024))
    emit(out)


if __name__ == "__main__":
    main()

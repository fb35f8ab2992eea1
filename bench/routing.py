"""Routing benchmark: every policy over a grid of traces, loads and pool sizes through
`kvmesh sim`, in a simulated world that is not the policies' formula, and the router's decision
latency.

The world (``--world``, default ``profiled``: simulator/worlds/profiled.json): prefill times
from the torch engine's measured profile scaled to 60K tok/s (a token after a long context costs
more), each request's compute varying by 10%, short prompts sharing passes, the storage tier's
bandwidth shared by the loads running at once (3FS's published figures), memory hits costing a
copy, decode steps reading their sequences' KV (simulator/world.py). Each cell is replayed with
``--seeds`` of the world's variation, and with the storage bandwidth scaled by each of
``--store-scales``. ``--world policy`` replays in the policies' own estimate instead;
``--aggregated`` in a world of whole-request workers (each decodes what it prefilled).

The grid: Mooncake's synthetic trace and Azure's conversation and code traces (from
../shared/traces/), and an agent-like trace (bench/agent_trace.py: 300 sessions for 8 prefill
workers, 2,400 for 64); the prefill pool 50%, 80% and 95% busy over each trace's busy window
(the shortest stretch holding 90% of its reference work), and 130% (overload); 8 and 64 prefill
workers, each with a memory tier that holds its share of 30% of the trace's distinct blocks (the
pool cannot keep it all; the storage tier keeps everything). A cell is led by the policy with
the lowest mean and p99 TTFT; `ttft` leads it when both are within 2% of the best other policy,
in every seed and bandwidth.

Then the router's decision latency (hashing + index lookup + ranking) for a 77K-token request
with 64 workers and 1M indexed blocks.

Prints a table per world variant; the last line is one JSON object: ttft_leads_cells (led in
every variant), cells, runs_led / runs (cell × variant), hit_vs_infinite_min (ttft's hit ratio ÷
the infinite-cache bound, lowest over cells whose trace shares blocks), estimate_mape per trace
(ttft's fitted estimate against the replayed TTFTs, mean over cells and variants; and the plain
estimate's, Mooncake's, for comparison), replay_56k_64_s (the slowest policy's replay of the
56K-request agent trace at 64 workers), replay_s per policy (summed over cells) and
replay_ttft_vs_fastest (the default's against the cheapest policy's), decision_p99_ms, and per
variant and cell every policy's ttft_mean_s, ttft_p99_s, hit_ratio.

    .venv/bin/python bench/routing.py [--jobs 2] [--traces agent,mooncake] [--sizes 8]
        [--seeds 0,1,2] [--store-scales 0.5,1,2] [--world policy|FILE] [--aggregated]
"""

from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.agent_trace import SESSIONS_PER_WORKER, agent_trace  # noqa: E402
from bench.harness import emit, say  # noqa: E402
from services.router.dispatch.plan import PrefixHashes  # noqa: E402
from services.router.routing.policies import POLICIES  # noqa: E402
from services.router.routing.route import RouteRequest  # noqa: E402
from shared.kvindex.index import BlockIndex  # noqa: E402
from shared.kvstore.hashing import block_hashes, pack_tokens, packed_block_hashes  # noqa: E402
from shared.messages.kvevents import STORE, KvEvent, memory_location  # noqa: E402
from simulator.replay import (  # noqa: E402
    SimConfig,
    infinite_cache_hit_ratio,
    simulate,
    speed_for_utilization,
)
from simulator.traces import MOONCAKE_BLOCK, TraceRequest, read_trace  # noqa: E402
from simulator.world import WorldSettings  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TRACES_DIR = REPO.parent / "shared" / "traces"
TRACE_FILES = {
    "mooncake": "synthetic_trace.jsonl",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "azure_code": "AzureLLMInferenceTrace_code.csv",
}
TRACES = (*TRACE_FILES, "agent")
LOADS = (0.5, 0.8, 0.95, 1.3)
SIZES = (8, 64)
MEMORY_SHARE = 0.3  # of a trace's distinct blocks, held by the pool's memory tiers together
TIE = 0.02  # within 2% of the best other policy counts as leading


@functools.cache
def trace(name: str, workers: int, seed: int = 0) -> tuple[list[TraceRequest], int]:
    if name == "agent":
        return agent_trace(round(SESSIONS_PER_WORKER * workers), seed), MOONCAKE_BLOCK
    return read_trace(TRACES_DIR / TRACE_FILES[name])


@dataclass(frozen=True)
class Run:
    trace: str
    workers: int
    load: float
    policy: str
    seed: int = 0  # of the agent trace
    memory_share: float = MEMORY_SHARE
    world: str = ""  # a world file (simulator/world.py); "": the policies' own estimate
    world_seed: int = 0  # of its variation
    store_scale: float = 1.0  # its storage bandwidth, scaled
    aggregated: bool = False  # its prefill workers decode their own requests

    @property
    def cell(self) -> str:
        return f"{self.trace}@{self.workers}/{round(self.load * 100)}%"

    @property
    def variant(self) -> str:
        if not self.world:
            return "policy world"
        whole = ", aggregated" if self.aggregated else ""
        return f"seed {self.world_seed}, storage ×{self.store_scale:g}{whole}"


@functools.cache
def config(run: Run) -> SimConfig:
    requests, bs = trace(run.trace, run.workers, run.seed)
    unique = len({h for r in requests for h in r.hashes})
    cfg = SimConfig(
        prefill=run.workers,
        decode=run.workers,
        memory_blocks=max(50, int(unique * run.memory_share / run.workers)),
        world=world_settings(run),
    )
    return replace(cfg, speed=speed_for_utilization(requests, bs, cfg, run.load))


def world_settings(run: Run) -> WorldSettings | None:
    if not run.world:
        return None
    w = WorldSettings.named(run.world)
    return replace(
        w,
        seed=run.world_seed,
        store_gb_s_per_worker=w.store_gb_s_per_worker * run.store_scale,
        aggregated=run.aggregated or w.aggregated,
    )


def replay(run: Run) -> tuple[Run, dict]:
    requests, bs = trace(run.trace, run.workers, run.seed)
    cfg = config(replace(run, policy=""))
    started = time.perf_counter()
    s = simulate(requests, bs, cfg, run.policy).summary(run.workers)
    s["replay_s"] = time.perf_counter() - started
    s["requests"] = len(requests)
    return run, s


def leads(cell: dict[str, dict]) -> bool:
    """ttft has the lowest mean and p99 TTFT, within the tie margin of the best other."""
    ours = cell["ttft"]
    others = [s for name, s in cell.items() if name != "ttft"]
    return all(
        ours[k] <= (1 + TIE) * min(s[k] for s in others) for k in ("ttft_mean_s", "ttft_p99_s")
    )


def grid(runs: list[Run], jobs: int) -> dict[str, dict[str, dict[str, dict]]]:
    """variant → cell → policy → summary."""
    out: dict[str, dict[str, dict[str, dict]]] = {}
    with ProcessPoolExecutor(jobs) as pool:
        futures = [pool.submit(replay, r) for r in runs]
        for done, f in enumerate(as_completed(futures), 1):
            run, s = f.result()
            out.setdefault(run.variant, {}).setdefault(run.cell, {})[run.policy] = s
            say(
                f"[{done}/{len(runs)}] {run.variant}: {run.cell:<22} {run.policy:<13} "
                f"TTFT mean {s['ttft_mean_s']:.3f} s, p99 {s['ttft_p99_s']:.3f} s, "
                f"hit {s['hit_ratio']:.3f}, estimate off {s['estimate_mape']:.1%} "
                f"({s['replay_s']:.1f} s)"
            )
    return out


def decision_latency(n_workers: int = 64, n_blocks: int = 1_000_000, rounds: int = 300) -> dict:
    """Hashing a 77K-token prompt, looking it up in a 1M-block index, ranking 64 workers."""
    index = BlockIndex({"chat": 1e9, "agent": 1e9})
    per = 1200
    say(f"indexing {n_blocks:,} blocks for the decision-latency test")
    tokens = [[(c * 7919 + i) % 40000 for i in range(per * 64)] for c in range(n_blocks // per)]
    for c, toks in enumerate(tokens):
        hashes = block_hashes(toks, 64, "fingerprint")
        index.apply(KvEvent(kind="stored", location=STORE, hashes=hashes, sizes=[1] * per, at=0))
        index.apply(
            KvEvent(
                kind="stored",
                location=memory_location(f"p{c % n_workers}"),
                hashes=hashes[: per // 2],
                sizes=[1] * (per // 2),
                at=0,
            )
        )
    workers = [f"p{i}" for i in range(n_workers)]
    policy = POLICIES["ttft"]()
    # The index lives in cachemeta, not in the router: its million objects are left out of
    # this process's garbage collections, which would otherwise pause the timed decisions.
    gc.collect()
    gc.freeze()
    times, parts = [], {"hash": [], "lookup": [], "rank": []}
    # Tokenizing packs each segment's ids as hashing reads them (services/router/request/render.py).
    packed = [pack_tokens(toks) for toks in tokens]
    for r in range(rounds):
        toks = tokens[(r * 37) % len(tokens)]
        t0 = time.perf_counter()
        hashes = packed_block_hashes(packed[(r * 37) % len(tokens)], 64, "fingerprint")
        t1 = time.perf_counter()
        counts = index.lookup(hashes, 1.0, touch=False)
        t2 = time.perf_counter()
        route = RouteRequest(str(r), len(toks), 64, hashes, counts, float(r))
        best = policy.rank(route, workers)[0].service_id
        t3 = time.perf_counter()
        policy.dispatched(best, route)
        policy.prefilled(best, route, float(r))
        times.append((t3 - t0) * 1e3)
        for k, v in zip(("hash", "lookup", "rank"), (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[k].append(v * 1e3)
    times.sort()
    # The usual 77K-token request is the next turn of a conversation the router has seen:
    # its tokens were cached by segment, and its leading blocks' hashes are reused.
    cache = PrefixHashes()
    warm = []
    for r in range(rounds):
        c = (r * 37) % len(tokens)
        old = tokens[c][: per * 64 - 64]
        # As a chat's: special tokens and the opening messages first, then the long history.
        segments = (
            *((f"c{c} opening {j}", pack_tokens(old[j : j + 1])) for j in range(5)),
            (f"c{c} body", pack_tokens(old[5:])),
        )
        cache.hashes(segments, 64, "fingerprint", "")
        turn = [(r * 31 + i) % 40000 for i in range(64)]
        toks = old + turn
        t0 = time.perf_counter()
        hashes = cache.hashes((*segments, (f"turn {r}", pack_tokens(turn))), 64, "fingerprint", "")
        counts = index.lookup(hashes, 1.0, touch=False)
        route = RouteRequest(f"w{r}", len(toks), 64, hashes, counts, float(r))
        best = policy.rank(route, workers)[0].service_id
        warm.append((time.perf_counter() - t0) * 1e3)
        policy.dispatched(best, route)
        policy.prefilled(best, route, float(r))
    warm.sort()
    return {
        "decision_p50_ms": statistics.median(times),
        "decision_p99_ms": times[int(0.99 * len(times)) - 1],
        "warm_p50_ms": statistics.median(warm),
        "warm_p99_ms": warm[int(0.99 * len(warm)) - 1],
        **{f"{k}_p50_ms": statistics.median(v) for k, v in parts.items()},
    }


def print_grid(variant: str, cells: dict[str, dict[str, dict]], infinite: dict[str, float]) -> None:
    names = [n for n in POLICIES if any(n in c for c in cells.values())]
    print(f"\n{variant}: TTFT mean / p99 (s) per policy; * where ttft leads (within 2% on both)")
    print(f"{'cell':<22}{'hit/inf':>9}{'est. err':>9}" + "".join(f"{n:>17}" for n in names))
    for key, cell in cells.items():
        ours = cell.get("ttft")
        ratio = infinite[key]
        hit = f"{ours['hit_ratio'] / ratio:>9.3f}" if ours and ratio else f"{'-':>9}"
        err = f"{ours['estimate_mape']:>9.1%}" if ours else f"{'-':>9}"
        row = "".join(
            f"{cell[n]['ttft_mean_s']:>8.3f}/{cell[n]['ttft_p99_s']:<8.3f}"
            if n in cell
            else " " * 17
            for n in names
        )
        mark = " *" if ours and len(cell) > 1 and leads(cell) else ""
        print(f"{key:<22}{hit}{err}{row}{mark}")


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=",".join(TRACES), help="comma list of " + ", ".join(TRACES))
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)), help="prefill pool sizes")
    ap.add_argument("--loads", default=",".join(map(str, LOADS)), help="busy-window loads")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma list")
    ap.add_argument("--seed", type=int, default=0, help="of the agent trace")
    ap.add_argument(
        "--memory-share",
        type=float,
        default=MEMORY_SHARE,
        help="of a trace's distinct blocks the pool's memory tiers hold together",
    )
    ap.add_argument(
        "--world",
        default="profiled",
        help="a world by name (simulator/worlds/) or file (simulator/world.py), or 'policy': "
        "the policies' own estimate",
    )
    ap.add_argument("--seeds", default="0,1,2", help="of the world's variation")
    ap.add_argument(
        "--aggregated",
        action="store_true",
        help="the prefill workers decode their own requests (whole-request servers)",
    )
    ap.add_argument("--store-scales", default="1", help="the storage bandwidth, scaled by each")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="replays at once")
    ap.add_argument("--no-decision", action="store_true", help="skip the decision latency")
    args = ap.parse_args()
    traces = args.traces.split(",")
    policies = args.policies.split(",")
    unknown = [t for t in traces if t not in TRACES] + [p for p in policies if p not in POLICIES]
    if unknown:
        ap.error(f"unknown trace or policy: {', '.join(unknown)}")
    world = "" if args.world == "policy" else args.world
    variants = (
        [(int(seed), scale) for scale in floats(args.store_scales) for seed in floats(args.seeds)]
        if world
        else [(0, 1.0)]
    )
    runs = [
        Run(t, int(n), load, p, args.seed, args.memory_share, world, seed, scale, args.aggregated)
        for t in traces
        for n in floats(args.sizes)
        for load in floats(args.loads)
        for p in policies
        for seed, scale in variants
    ]
    # The longest replays first, so the pool's processes finish together.
    runs.sort(key=lambda r: (r.trace != "agent", -r.workers, r.trace))
    cells_n = len(runs) // len(policies) // len(variants)
    say(f"{len(runs)} replays: {cells_n} cells × {len(variants)} world variants")
    by_variant = grid(runs, args.jobs)
    order = {r.cell: i for i, r in enumerate(sorted(runs, key=lambda r: (r.trace, r.workers)))}
    for variant in by_variant:
        by_variant[variant] = dict(sorted(by_variant[variant].items(), key=lambda kv: order[kv[0]]))
    keys = sorted({key for cells in by_variant.values() for key in cells}, key=order.__getitem__)
    infinite = {}
    for key in keys:
        name, rest = key.split("@")
        requests, bs = trace(name, int(rest.split("/")[0]), args.seed)
        infinite[key] = infinite_cache_hit_ratio(requests, bs)
    decision = None if args.no_decision else decision_latency()

    for variant, cells in by_variant.items():
        print_grid(variant, cells, infinite)
    every = [(v, k, c) for v, cells in by_variant.items() for k, c in cells.items()]
    led_runs = [(v, k) for v, k, c in every if "ttft" in c and len(c) > 1 and leads(c)]
    led = [k for k in keys if all((v, k) in led_runs for v in by_variant)]
    lost = sorted({k for _, k, _ in every} - set(led), key=order.__getitem__)
    ratios = [c["ttft"]["hit_ratio"] / infinite[k] for _, k, c in every if infinite[k]]
    mape: dict[str, dict[str, float]] = {}
    for name in ("ttft", "mooncake"):
        for t in traces:
            errors = [c[name]["estimate_mape"] for _, k, c in every if k.startswith(t + "@")]
            if errors and name in policies:
                mape.setdefault(name, {})[t] = round(statistics.fmean(errors), 4)
    agent64 = [s for _, k, c in every if k.startswith("agent@64/") for s in c.values()]
    print(
        f"\nttft leads {len(led)} of {len(keys)} cells in every variant "
        f"({len(led_runs)} of {len(every)} cell-variants)"
        + (f"; not led: {', '.join(lost)}" if lost else "")
    )
    for name, per_trace in mape.items():
        print(
            f"{name}'s estimate off by (MAPE of TTFT): "
            + ", ".join(f"{t} {v:.1%}" for t, v in per_trace.items())
        )
    slowest = max((s["replay_s"] for s in agent64), default=None)
    if agent64:
        print(
            f"replay of the {agent64[0]['requests']:,}-request agent trace at 64 workers: "
            f"slowest policy {slowest:.1f} s"
        )
    # Each policy's replays summed over the cells and variants every policy ran: what the
    # default costs to decide against the cheapest (the replay is the same for all).
    replay_s: dict[str, float] = {}
    for _, _, c in every:
        if len(c) == len(policies):
            for name, s in c.items():
                replay_s[name] = replay_s.get(name, 0.0) + s["replay_s"]
    ratio = None
    if "ttft" in replay_s and len(replay_s) > 1:
        fastest = min(replay_s.values())
        ratio = replay_s["ttft"] / fastest
        print(
            "replay time per policy (s, all cells): "
            + ", ".join(f"{n} {v:.0f}" for n, v in sorted(replay_s.items(), key=lambda kv: kv[1]))
            + f"; ttft ÷ the fastest: {ratio:.2f}"
        )
    if decision:
        print(
            "decision (77K tokens, 64 workers, 1M indexed blocks): "
            f"p50 {decision['decision_p50_ms']:.2f} ms, p99 {decision['decision_p99_ms']:.2f} ms "
            f"(hash {decision['hash_p50_ms']:.2f}, lookup {decision['lookup_p50_ms']:.2f}, "
            f"rank {decision['rank_p50_ms']:.2f} ms at p50)"
        )
    out: dict = {
        "ttft_leads_cells": len(led),
        "cells": len(keys),
        "runs_led": len(led_runs),
        "runs": len(every),
        "hit_vs_infinite_min": round(min(ratios), 4) if ratios else None,
        "estimate_mape": mape,
        "replay_56k_64_s": round(slowest, 1) if agent64 else None,
        "replay_s": {n: round(v, 1) for n, v in replay_s.items()},
        "replay_ttft_vs_fastest": round(ratio, 3) if ratio else None,
    }
    if decision:
        out["decision_p99_ms"] = round(decision["decision_p99_ms"], 3)
        out["decision_next_turn_p99_ms"] = round(decision["warm_p99_ms"], 3)
    out["grid"] = {
        variant: {
            key: {
                name: {k: round(s[k], 6) for k in ("ttft_mean_s", "ttft_p99_s", "hit_ratio")}
                for name, s in cell.items()
            }
            for key, cell in cells.items()
        }
        for variant, cells in by_variant.items()
    }
    emit(out)


if __name__ == "__main__":
    main()

"""`kvmesh sim`: replay a trace through the routing policies against simulated workers.

    kvmesh sim --trace ../shared/traces/synthetic_trace.jsonl --prefill 64 --decode 64 \\
        --policy all --target-util 0.8 --png ttft.png

Prints a table per policy; the last line is one JSON object: per policy hit_ratio, ttft_mean_s,
ttft_p50_s, ttft_p99_s, tpot_mean_s, load_max_over_mean, utilization; and at the top level
infinite_cache_hit_ratio and the speed used.

--target-util U picks the speed at which the prefill pool would be U busy over the trace's busy
window: the shortest stretch of arrivals that holds 90% of the trace's reference work (prefill
with an infinite cache: every block computed once, reused blocks loaded at the load rate). That
work ÷ (prefill workers × the window ÷ speed) = U. A trace whose work is bunched (sessions
starting together) is loaded as its busy part is, not diluted by its quiet hours.
`--util-basis span` takes the whole span instead (the old basis). Real policies miss some of
the infinite cache's hits, so their measured load is a little above U.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from services.router.routing.policies import POLICIES
from simulator.replay import (
    UTIL_BASES,
    SimConfig,
    infinite_cache_hit_ratio,
    progress_bar,
    simulate,
    speed_for_utilization,
)
from simulator.traces import TraceError, read_trace
from simulator.world import ProfiledWorld, WorldSettings


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("sim", help="replay a trace through the routing policies")
    p.add_argument("--trace", type=Path, required=True, help="Mooncake .jsonl or Azure .csv")
    p.add_argument("--prefill", type=int, default=8, help="prefill workers")
    p.add_argument("--decode", type=int, default=8, help="decode workers")
    p.add_argument(
        "--policy", default="ttft", help=f"one of {', '.join(POLICIES)}, or all (comma list ok)"
    )
    load = p.add_mutually_exclusive_group()
    load.add_argument("--speed", type=float, help="divide arrival times by this")
    load.add_argument(
        "--target-util",
        type=float,
        help="pick the speed at which the prefill pool is this busy with the reference work "
        "(infinite cache) over the busy window: the shortest stretch holding 90%% of that work",
    )
    p.add_argument(
        "--util-basis",
        choices=UTIL_BASES,
        default="busy",
        help="what --target-util is measured over: the busy window, or the whole span",
    )
    d = SimConfig()
    p.add_argument("--prefill-tok-s", type=float, default=d.prefill_tok_s)
    p.add_argument("--load-tok-s", type=float, default=d.load_tok_s)
    p.add_argument("--decode-tok-s", type=float, default=d.decode_tok_s)
    p.add_argument(
        "--memory-blocks",
        type=int,
        default=d.memory_blocks,
        help="memory tier per prefill worker, in trace blocks",
    )
    p.add_argument(
        "--store-blocks",
        type=int,
        default=d.store_blocks,
        help="storage tier capacity, in trace blocks",
    )
    p.add_argument(
        "--retention-s",
        type=float,
        default=None,
        help="storage TTL after last use for every class (default 7 d chat, 3 d agent)",
    )
    p.add_argument(
        "--world",
        default="policy",
        help="how long the simulated workers take: 'policy' (the router's own estimate), "
        "'profiled' (the torch engine's measured profile at a card's rate, varying, sharing the "
        "storage tier, batching: simulator/worlds/profiled.json) or a world file (JSON: an "
        "engine profile from bench/profile.py and the tier's bandwidths; simulator/world.py)",
    )
    p.add_argument(
        "--aggregated",
        action="store_true",
        help="(with a profiled --world) each prefill worker decodes its own requests, in the "
        "same steps as its next prompts, as vLLM's and SGLang's whole-request servers do",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=d.max_loras,
        help="(a trace whose lines name an adapter) LoRA adapters each prefill worker holds",
    )
    p.add_argument(
        "--adapter-load-ms",
        type=float,
        default=d.adapter_load_s * 1e3,
        help="what loading an adapter a worker lacks takes, before the pass that needs it",
    )
    p.add_argument(
        "--adapter-blind",
        action="store_true",
        help="the router is not told requests' adapters (their blocks stay theirs)",
    )
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--png", type=Path, help="write the TTFT CDF of each policy here")
    p.set_defaults(run=run)


def fail(msg: str) -> int:
    print(f"kvmesh sim: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    names = list(POLICIES) if args.policy == "all" else args.policy.split(",")
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        return fail(f"--policy: unknown {', '.join(unknown)}; one of {', '.join(POLICIES)}, all")
    if args.adapter_load_ms < 0:
        return fail("--adapter-load-ms: 0 or more")
    for flag in ("prefill", "decode", "memory_blocks", "store_blocks", "max_loras"):
        if getattr(args, flag) < 1:
            return fail(f"--{flag.replace('_', '-')}: at least 1")
    if args.target_util is not None and not 0 < args.target_util < 1.5:
        return fail("--target-util: above 0 and below 1.5 (0.8: 80% busy; 1.3: overload)")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        return fail("--png needs matplotlib: pip install 'kvmesh[plot]'")
    try:
        requests, block_size = read_trace(args.trace)
    except TraceError as err:
        return fail(str(err))
    if args.limit:
        requests = requests[: args.limit]
    if not requests:
        return fail("--trace: no requests in it")
    world = None
    if args.world != "policy":
        try:
            world = WorldSettings.named(args.world)
            ProfiledWorld(world)  # its profile is read now: a bad one fails here, named
        except ValueError as err:
            return fail(f"--world: {err}")
        if args.aggregated:
            world = replace(world, aggregated=True)
    elif args.aggregated:
        return fail(
            "--aggregated: a profiled --world (the policies' own world has no decode "
            "steps to share)"
        )
    cfg = SimConfig(
        world=world,
        prefill=args.prefill,
        decode=args.decode,
        prefill_tok_s=args.prefill_tok_s,
        load_tok_s=args.load_tok_s,
        decode_tok_s=args.decode_tok_s,
        memory_blocks=args.memory_blocks,
        store_blocks=args.store_blocks,
        max_loras=args.max_loras,
        adapter_load_s=args.adapter_load_ms / 1e3,
        adapter_blind=args.adapter_blind,
    )
    if args.retention_s:
        cfg = replace(cfg, ttl_s=(("chat", args.retention_s), ("agent", args.retention_s)))
    speed = args.speed or 1.0
    if args.target_util:
        speed = speed_for_utilization(requests, block_size, cfg, args.target_util, args.util_basis)
    cfg = replace(cfg, speed=speed)
    refs = sum(len(r.hashes) for r in requests)
    print(
        f"{len(requests)} requests, {refs:,} block references ({block_size} tokens), "
        f"{args.prefill} prefill + {args.decode} decode workers, speed {speed:.2f}x, "
        f"world: {args.world}",
        file=sys.stderr,
    )
    results, summaries = {}, {}
    for name in names:
        started = time.monotonic()
        results[name] = simulate(requests, block_size, cfg, name, progress_bar(name))
        summaries[name] = results[name].summary(args.prefill)
        summaries[name]["replay_s"] = time.monotonic() - started
    print_table(summaries)
    if args.png:
        write_cdf(args.png, results)
        print(f"TTFT CDF written to {args.png}", file=sys.stderr)
    keys = (
        "hit_ratio",
        "ttft_mean_s",
        "ttft_p50_s",
        "ttft_p99_s",
        "tpot_mean_s",
        "load_max_over_mean",
        "utilization",
        "estimate_mape",
        "adapter_loads",
    )
    out: dict = {n: {k: round(s[k], 6) for k in keys} for n, s in summaries.items()}
    for n, s in summaries.items():
        out[n]["estimate_terms"] = s["estimate_terms"]
    out["infinite_cache_hit_ratio"] = round(infinite_cache_hit_ratio(requests, block_size), 6)
    out["speed"] = round(speed, 6)
    print(json.dumps(out))
    return 0


def print_table(summaries: dict[str, dict]) -> None:
    head = (
        "policy",
        "hit",
        "mem",
        "storage",
        "TTFT mean",
        "p50",
        "p99",
        "TPOT",
        "load max/mean",
        "util",
        "tok/s",
        "est. err",
        "replay",
    )
    print("{:<14}{:>7}{:>7}{:>9}{:>11}{:>8}{:>8}{:>8}{:>15}{:>7}{:>11}{:>10}{:>8}".format(*head))
    for name, s in summaries.items():
        print(
            f"{name:<14}{s['hit_ratio']:>7.3f}{s['memory_hit_ratio']:>7.3f}"
            f"{s['storage_hit_ratio']:>9.3f}{s['ttft_mean_s']:>10.3f}s{s['ttft_p50_s']:>7.3f}s"
            f"{s['ttft_p99_s']:>7.3f}s{s['tpot_mean_s'] * 1e3:>6.1f}ms"
            f"{s['load_max_over_mean']:>15.2f}"
            f"{s['utilization']:>7.2f}{s['throughput_tok_s']:>11.0f}"
            f"{s['estimate_mape']:>9.1%}{s['replay_s']:>7.1f}s"
        )


def write_cdf(path: Path, results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, res in results.items():
        xs = sorted(res.ttft_s)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.plot(xs, ys, label=name)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF by routing policy")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

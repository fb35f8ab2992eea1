"""`kvmesh plan`: the smallest prefill and decode pools that meet TTFT and TPOT targets for a
workload, found by replaying it in the simulator (simulator/plan.py).

    kvmesh plan --trace ../shared/traces/synthetic_trace.jsonl \\
        --ttft-p50 0.5 --ttft-p99 8 --tpot-p99 0.03
    kvmesh plan --rate 4 --input-mean 16000 --reuse 0.9 --output-mean 300 \\
        --ttft-p99 1 --tpot-p99 0.05 --retention chat=3d --png plan.png

The workload is a trace (Mooncake .jsonl, Azure .csv) or a description (``--rate`` and the
lengths: simulator/synthetic.py). The world is the profiled one by default (the torch
engine's measured profile at a card's rate, compute varying, the storage tier's bandwidth
shared; ``--world policy`` is the router's own estimate). What-ifs are flags: the cards'
rates, the storage tier's bandwidth, the memory tier's size, retention per class, the block
size (a description's: a trace's blocks are its own).

Prints the plan as a table (and every replay it took with --verbose); the last line is one
JSON object: prefill, decode, feasible, the figures at the plan (TTFT, TPOT, hit ratio by
tier, utilization), the margin left on each target, replays and planning_s. ``--png`` plots
TTFT against the prefill pool and TPOT against the decode pool, with the targets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

from services.router.routing.policies import POLICIES
from simulator.plan import (
    DECODE_TARGETS,
    PREFILL_TARGETS,
    Plan,
    Planner,
    Targets,
    show_replays,
)
from simulator.replay import SimConfig
from simulator.synthetic import Workload, generate
from simulator.traces import TraceError, read_trace
from simulator.world import ProfiledWorld, WorldSettings

UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("plan", help="size the prefill and decode pools for targets")
    work = p.add_argument_group("the workload: a trace, or a description")
    work.add_argument("--trace", type=Path, help="Mooncake .jsonl or Azure .csv")
    work.add_argument("--speed", type=float, default=1.0, help="(a trace) divide its times by this")
    w = Workload()
    work.add_argument("--rate", type=float, help="requests a second (a description)")
    work.add_argument(
        "--requests", type=int, help=f"how many to replay (a description's: {w.requests})"
    )
    work.add_argument("--input-mean", type=int, default=w.input_mean, help="tokens a prompt")
    work.add_argument("--output-mean", type=int, default=w.output_mean, help="tokens an answer")
    work.add_argument(
        "--reuse", type=float, default=w.reuse, help="share of a prompt an earlier turn sent"
    )
    work.add_argument("--think-s", type=float, default=w.think_s, help="median time between turns")
    work.add_argument(
        "--come-back",
        type=float,
        default=w.come_back,
        help="share of turns that come back 1-10 days later",
    )
    work.add_argument("--agent-share", type=float, default=w.agent_share)
    work.add_argument("--block-size", type=int, default=w.block_size, help="tokens a block")
    work.add_argument("--seed", type=int, default=0)
    goal = p.add_argument_group("targets (seconds; at least one)")
    goal.add_argument("--ttft-mean", type=float)
    goal.add_argument("--ttft-p50", type=float)
    goal.add_argument("--ttft-p99", type=float)
    goal.add_argument("--tpot-mean", type=float)
    goal.add_argument("--tpot-p99", type=float)
    what = p.add_argument_group("what-ifs")
    what.add_argument(
        "--world",
        default="profiled",
        help="'profiled' (default), 'policy' (the router's estimate) or a world file",
    )
    d = SimConfig()
    what.add_argument("--prefill-tok-s", type=float, help="a card's uncached prefill rate")
    what.add_argument("--load-tok-s", type=float, help="(policy world) cached tokens loaded/s")
    what.add_argument("--decode-tok-s", type=float, help="a decode card's output tokens/s")
    what.add_argument(
        "--store-gb-s", type=float, help="(profiled world) storage read GB/s per prefill worker"
    )
    what.add_argument(
        "--memory-blocks", type=int, default=d.memory_blocks, help="memory tier per worker"
    )
    what.add_argument(
        "--retention",
        default="",
        help="storage TTL after last use by class, e.g. chat=3d,agent=1d (default 7d, 3d)",
    )
    p.add_argument("--policy", default="ttft", help="the routing policy replayed")
    p.add_argument("--max-workers", type=int, default=512, help="the largest pool tried")
    p.add_argument("--png", type=Path, help="plot TTFT and TPOT against the pools here")
    p.add_argument("--verbose", action="store_true", help="a line per replay")
    p.set_defaults(run=run)


def fail(msg: str) -> int:
    print(f"kvmesh plan: {msg}", file=sys.stderr)
    return 2


def duration_s(text: str) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([smhd]?)", text.strip())
    if m is None:
        raise ValueError(f"{text!r} is not a duration (like 3d, 12h, 600)")
    return float(m.group(1)) * UNITS[m.group(2) or "s"]


def retention(text: str, default: tuple[tuple[str, float], ...]) -> tuple[tuple[str, float], ...]:
    ttl = dict(default)
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in ttl:
            raise ValueError(f"{name.strip()!r} is not a class (chat or agent)")
        ttl[name.strip()] = duration_s(value)
    return tuple(ttl.items())


def config(args: argparse.Namespace) -> SimConfig:
    """The world and the what-ifs (ValueError naming the flag)."""
    cfg = SimConfig(memory_blocks=args.memory_blocks)
    if args.memory_blocks < 1:
        raise ValueError("--memory-blocks: at least 1")
    try:
        cfg = replace(cfg, ttl_s=retention(args.retention, cfg.ttl_s))
    except ValueError as err:
        raise ValueError(f"--retention: {err}") from None
    for flag in ("prefill_tok_s", "load_tok_s", "decode_tok_s", "store_gb_s"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')}: above 0")
    if args.prefill_tok_s:
        cfg = replace(cfg, prefill_tok_s=args.prefill_tok_s)
    if args.load_tok_s:
        cfg = replace(cfg, load_tok_s=args.load_tok_s)
    if args.decode_tok_s:
        cfg = replace(cfg, decode_tok_s=args.decode_tok_s)
    if args.world == "policy":
        if args.store_gb_s:
            raise ValueError("--store-gb-s: a profiled world's (the policy world has --load-tok-s)")
        return cfg
    try:
        world = WorldSettings.named(args.world)
    except ValueError as err:
        raise ValueError(f"--world: {err}") from None
    changes = {"prefill_tok_s": args.prefill_tok_s, "decode_tok_s": args.decode_tok_s}
    changes["store_gb_s_per_worker"] = args.store_gb_s
    world = replace(world, **{k: v for k, v in changes.items() if v})
    ProfiledWorld(world)  # (its profile read now: a bad one fails here, named)
    return replace(cfg, world=world)


def workload(args: argparse.Namespace):  # noqa: ANN201
    """The requests, those before them (a description's), and their block size."""
    if (args.trace is None) == (args.rate is None):
        raise ValueError("the workload: --trace FILE, or --rate with the lengths (not both)")
    if args.trace is not None:
        if args.block_size != Workload.block_size:
            raise ValueError("--block-size: a trace's blocks are its own (its hashes' size)")
        try:
            requests, block_size = read_trace(args.trace)
        except TraceError as err:
            raise ValueError(str(err)) from None
        if args.speed <= 0:
            raise ValueError("--speed: above 0")
        requests = requests[: args.requests] if args.requests else requests
        if not requests:
            raise ValueError("--trace: no requests in it")
        scaled = [replace(r, t=r.t / args.speed) for r in requests]
        return scaled, [], block_size
    described = Workload(
        rate=args.rate,
        requests=args.requests or Workload.requests,
        input_mean=args.input_mean,
        output_mean=args.output_mean,
        reuse=args.reuse,
        think_s=args.think_s,
        come_back=args.come_back,
        agent_share=args.agent_share,
        block_size=args.block_size,
        seed=args.seed,
    )
    try:
        requests, earlier = generate(described)
    except ValueError as err:
        raise ValueError(f"--{str(err).replace('_', '-')}") from None
    return requests, earlier, args.block_size


def run(args: argparse.Namespace) -> int:
    targets = Targets(args.ttft_mean, args.ttft_p50, args.ttft_p99, args.tpot_mean, args.tpot_p99)
    given = targets.given(PREFILL_TARGETS + DECODE_TARGETS)
    if not given:
        return fail(
            "targets: at least one of --ttft-mean, --ttft-p50, --ttft-p99, --tpot-mean, --tpot-p99"
        )
    if any(v <= 0 for v in given.values()):
        return fail("targets: above 0 seconds")
    if args.max_workers < 1:
        return fail("--max-workers: at least 1")
    if args.policy not in POLICIES:
        return fail(f"--policy: unknown {args.policy!r}; one of {', '.join(POLICIES)}")
    if args.requests is not None and args.requests < 1:
        return fail("--requests: at least 1")
    if args.png and importlib.util.find_spec("matplotlib") is None:
        return fail("--png needs matplotlib: pip install 'kvmesh[plot]'")
    try:
        cfg = config(args)
        requests, earlier, block_size = workload(args)
    except ValueError as err:
        return fail(str(err))
    n_in = sum(r.n_in for r in requests)
    print(
        f"{len(requests)} requests ({n_in / len(requests):,.0f} input tokens on average), "
        f"world: {args.world}; searching pools up to {args.max_workers}",
        file=sys.stderr,
    )

    started = time.monotonic()
    planner = Planner(
        requests, block_size, cfg, targets, earlier, args.policy, args.max_workers, show_replays
    )
    result = planner.plan()
    planning_s = time.monotonic() - started
    print(file=sys.stderr)
    if args.verbose:
        print_trials(result)
    print_plan(result, targets)
    if args.png:
        if result.feasible:  # (the curves around the plan, not only the search's points)
            for n in range(1, min(2 * result.prefill, 16) + 1):
                planner.trial(n, 1)
            for n in range(1, min(2 * result.decode, 16) + 1):
                planner.trial(result.prefill, n)
        write_png(args.png, result, targets)
        print(f"plot written to {args.png}", file=sys.stderr)
    print(json.dumps(as_json(result, planning_s)))
    return 0 if result.feasible else 1


FIGURES = (
    ("ttft_mean_s", "TTFT mean", "s"),
    ("ttft_p50_s", "TTFT p50", "s"),
    ("ttft_p99_s", "TTFT p99", "s"),
    ("tpot_mean_s", "TPOT mean", "s"),
    ("tpot_p99_s", "TPOT p99", "s"),
    ("hit_ratio", "cache hit ratio", ""),
    ("memory_hit_ratio", "  from memory", ""),
    ("storage_hit_ratio", "  from storage", ""),
    ("utilization", "prefill busy", ""),
    ("decode_utilization", "decode busy", ""),
)


def print_plan(plan: Plan, targets: Targets) -> None:
    if plan.prefill is None or plan.decode is None:
        role, keys = (
            ("prefill", PREFILL_TARGETS) if plan.prefill is None else ("decode", DECODE_TARGETS)
        )
        best = ", ".join(
            f"{k.removesuffix('_s').replace('_', ' ')} {plan.summary[k]:.3f} s (target {v:g} s)"
            for k, v in targets.given(keys).items()
        )
        pool = max(p if role == "prefill" else d for p, d in plan.trials)
        print(f"no {role} pool meets the targets: at {pool} workers, more stop helping: {best}")
        return
    print(f"plan: {plan.prefill} prefill + {plan.decode} decode workers")
    print(f"{'':<18}{'at the plan':>12}{'target':>10}{'margin':>9}")
    for key, label, unit in FIGURES:
        value = plan.summary[key]
        target = getattr(targets, key, None)
        shown = f"{value:.3f}{unit}" if unit else f"{value:.3f}"
        goal = f"{target:g}{unit}" if target is not None else ""
        margin = f"{plan.margin[key]:.0%}" if key in plan.margin else ""
        print(f"{label:<18}{shown:>12}{goal:>10}{margin:>9}")


def print_trials(plan: Plan) -> None:
    print(f"{'prefill':>8}{'decode':>8}{'TTFT mean':>11}{'p99':>8}{'TPOT p99':>10}{'hit':>7}")
    for (p, d), s in sorted(plan.trials.items()):
        print(
            f"{p:>8}{d:>8}{s['ttft_mean_s']:>10.3f}s{s['ttft_p99_s']:>7.3f}s"
            f"{s['tpot_p99_s'] * 1e3:>8.1f}ms{s['hit_ratio']:>7.3f}"
        )


DECODE_FIGURES = frozenset(DECODE_TARGETS) | {"decode_utilization"}


def as_json(plan: Plan, planning_s: float) -> dict:
    """The plan, its figures and the pools they were replayed on (``at``). Where no prefill
    pool meets the targets no decode pool was sized, so no decode figure is given (the
    search's one decode worker under a prefill pool that large says nothing)."""
    keys = [k for k, _, _ in FIGURES]
    if plan.prefill is None:
        keys = [k for k in keys if k not in DECODE_FIGURES]
    prefill, decode = plan.at
    return {
        "prefill": plan.prefill,
        "decode": plan.decode,
        "feasible": plan.feasible,
        "at": {"prefill": prefill, "decode": decode if plan.prefill is not None else None},
        **{k: round(plan.summary[k], 6) for k in keys if k in plan.summary},
        "margin": plan.margin,
        "replays": len(plan.trials),
        "planning_s": round(planning_s, 3),
    }


def write_png(path: Path, plan: Plan, targets: Targets) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    prefill = sorted((p, s) for (p, d), s in plan.trials.items() if d == 1)
    for key, label in (("ttft_mean_s", "mean"), ("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")):
        left.plot([p for p, _ in prefill], [s[key] for _, s in prefill], "o-", label=label)
        if getattr(targets, key) is not None:
            left.axhline(getattr(targets, key), linestyle="--", alpha=0.5)
    left.set(xlabel="prefill workers", ylabel="TTFT (s)", yscale="log", title="TTFT")
    left.legend()
    decode = sorted((d, s) for (p, d), s in plan.trials.items() if p == plan.prefill)
    right.plot([d for d, _ in decode], [s["tpot_p99_s"] * 1e3 for _, s in decode], "o-")
    if targets.tpot_p99_s is not None:
        right.axhline(targets.tpot_p99_s * 1e3, linestyle="--", alpha=0.5)
    right.set(xlabel="decode workers", ylabel="TPOT p99 (ms)", title="TPOT")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

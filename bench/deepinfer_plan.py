"""DeepInfer's operating point, planned: `kvmesh plan`'s search (simulator/plan.py) on an
agent and chat workload like theirs, at their per-card rates, against their figures.

The workload (simulator/synthetic.py): 77K input tokens on average, 96% of them sent by an
earlier turn, half the conversations agents (3-day retention) and half chat (7 days); a share
COME_BACK of turns come back 1-10 days after the one before. Answers average OUTPUT tokens:
DeepInfer does not publish it. 155T tokens a day at 77K a request is 23K requests a second;
with P:D ≈ 1:1 and 14K output tok/s a decode card, their decode pool can produce at most
~1.4K tokens a request, so 1K is used (the pools' ratio moves with it).

The world (simulator/world.py, the torch engine's profile at a card's rate): their rates,
60K uncached prefill tok/s and 14K decode tok/s a card; a sequence at most 300 tok/s (their
code figure); DeepSeek-V3's 70 KB of KV a token, read by sparse attention 2048 tokens a step
(V3.2). Their 1.5M tok/s "with hits" sets the tiers' bandwidth: 1.5M × 70 KB = 105 GB/s a
card from storage and from memory (the profiled world's defaults, one 200 Gb/s NIC and PCIe
5.0, are a quarter and two thirds of that).

Targets: their 400 ms mean TTFT and 230 tok/s a request (a mean TPOT of 4.35 ms). The rate is
scaled down (RATE requests a second, not 23K): the pools come out per RATE, and their ratio
is what compares. Then the retention what-if: chat kept 3 days instead of 7 at the planned
pools, the hit ratio against their "0.5-1%".

Prints a table; the last line is one JSON object.

    .venv/bin/python bench/deepinfer_plan.py [--rate 40] [--requests 3000] [--come-back 0.02]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)

from simulator.plan import Planner, Targets, show_replays  # noqa: E402
from simulator.replay import SimConfig, simulate  # noqa: E402
from simulator.synthetic import Workload, generate  # noqa: E402
from simulator.world import WorldSettings  # noqa: E402

DAY = 86400.0
THEIRS = {"ttft_mean_s": 0.400, "tokens_per_s_per_request": 230, "hit_ratio": 0.96, "p_to_d": 1.0}
OUTPUT = 1000
HIT_GB_S = 1.5e6 * 70_272 / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=40.0, help="requests a second")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--come-back", type=float, default=0.02, help="share of turns")
    args = parser.parse_args()

    workload = Workload(
        rate=args.rate,
        requests=args.requests,
        input_mean=77_000,
        output_mean=OUTPUT,
        reuse=0.96,
        agent_share=0.5,
        come_back=args.come_back,
        think_s=60.0,
    )
    requests, earlier = generate(workload)
    world = replace(
        WorldSettings.named("profiled"),
        prefill_tok_s=60_000.0,
        decode_tok_s=14_000.0,
        min_tpot_s=1 / 300,
        attended_tokens=2048,
        # Their 1.5M tok/s with hits, as bandwidth: 1.5M × 70 KB = 105 GB/s a card, from the
        # storage tier and from memory (their nodes have several NICs; one is 25 GB/s).
        link_gb_s=HIT_GB_S,
        store_gb_s_per_worker=HIT_GB_S,
        memory_gb_s=HIT_GB_S,
    )
    cfg = SimConfig(world=world, ttl_s=(("chat", 7 * DAY), ("agent", 3 * DAY)))
    targets = Targets(ttft_mean_s=THEIRS["ttft_mean_s"], tpot_mean_s=1 / 230)
    n_in = sum(r.n_in for r in requests) / len(requests)
    print(
        f"{len(requests)} requests at {args.rate:g}/s, {n_in:,.0f} input tokens on average "
        f"({len(earlier)} turns before the trace warm the storage tier)",
        file=sys.stderr,
    )

    started = time.monotonic()
    planner = Planner(requests, workload.block_size, cfg, targets, earlier, progress=show_replays)
    plan = planner.plan()
    planning_s = time.monotonic() - started
    print(file=sys.stderr)
    if not plan.feasible:
        print(f"no plan: {plan.prefill} prefill, {plan.decode} decode; {plan.summary}")
        sys.exit(1)
    s = plan.summary

    # The retention what-if at the planned pools: chat kept 3 days.
    short = replace(cfg, prefill=plan.prefill, decode=plan.decode)
    short = replace(short, ttl_s=(("chat", 3 * DAY), ("agent", 3 * DAY)))
    three = simulate(requests, workload.block_size, short, "ttft", None, earlier)
    three_s = three.summary(plan.prefill)
    hit_drop = s["hit_ratio"] - three_s["hit_ratio"]
    cached_tok_s = (
        (s["memory_hit_ratio"] + s["storage_hit_ratio"]) * n_in / max(1e-9, s["ttft_mean_s"])
    )

    rows = (
        ("TTFT mean (s)", THEIRS["ttft_mean_s"], s["ttft_mean_s"]),
        ("tok/s a request", THEIRS["tokens_per_s_per_request"], 1 / s["tpot_mean_s"]),
        ("cache hit ratio", THEIRS["hit_ratio"], s["hit_ratio"]),
        ("P:D", THEIRS["p_to_d"], plan.prefill / plan.decode),
        ("hit ratio lost, chat 7→3 d", 0.0075, hit_drop),
    )
    print(f"{'':<28}{'DeepInfer':>11}{'kvmesh plan':>13}{'difference':>12}")
    for label, theirs, ours in rows:
        print(f"{label:<28}{theirs:>11.4g}{ours:>13.4g}{ours - theirs:>+12.4g}")
    print(
        f"\nplan: {plan.prefill} prefill + {plan.decode} decode workers for {args.rate:g} "
        f"requests/s; hits {s['memory_hit_ratio']:.3f} memory, {s['storage_hit_ratio']:.3f} "
        f"storage; prefill {s['utilization']:.0%} busy, decode {s['decode_utilization']:.0%}; "
        f"{len(plan.trials)} replays in {planning_s:.1f} s"
    )
    print(
        json.dumps(
            {
                "prefill": plan.prefill,
                "decode": plan.decode,
                "p_to_d": round(plan.prefill / plan.decode, 3),
                "ttft_mean_s": round(s["ttft_mean_s"], 4),
                "tpot_mean_s": round(s["tpot_mean_s"], 5),
                "hit_ratio": round(s["hit_ratio"], 4),
                "memory_hit_ratio": round(s["memory_hit_ratio"], 4),
                "storage_hit_ratio": round(s["storage_hit_ratio"], 4),
                "prefill_utilization": round(s["utilization"], 3),
                "decode_utilization": round(s["decode_utilization"], 3),
                "cached_tok_s_in_ttft": round(cached_tok_s),
                "hit_ratio_chat_3d": round(three_s["hit_ratio"], 4),
                "hit_ratio_lost_chat_7_to_3d": round(hit_drop, 5),
                "come_back": args.come_back,
                "replays": len(plan.trials),
                "planning_s": round(planning_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

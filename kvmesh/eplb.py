"""`kvmesh eplb plan`: plan expert replicas and their placement from a recorded load file.

    kvmesh eplb plan --load load.npz --experts 384 --cards 64 --slots 448

The load file holds per-step, per-layer, per-expert token counts (JSON ``{"counts": ...}`` or
NPZ with a ``counts`` array; a decode worker writes one with KVMESH_DECODE_EPLB_RECORD). The
steps are cut into windows of --window-steps, and the planner plans for the next
--replan-steps from them, starting from --current (a placement JSON written by --out) or from
the contiguous placement. Prints the placement (each card's experts, per layer) and its
predicted balance beside the contiguous placement's and EPLB's greedy plan's; --json prints
one JSON object instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from shared.eplb.placement import Placement, contiguous, moves
from shared.eplb.planner import Planner, forecast, greedy_plan, scenarios
from shared.eplb.stats import Window, read_load


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("eplb", help="MoE expert placement")
    sub = p.add_subparsers(dest="eplb_command", required=True)
    plan = sub.add_parser("plan", help="plan replicas and placement from a load file")
    plan.add_argument("--load", type=Path, required=True, help="load file (.json or .npz)")
    plan.add_argument("--experts", type=int, required=True, help="routed experts per layer")
    plan.add_argument("--cards", type=int, required=True, help="cards the experts are spread on")
    plan.add_argument("--slots", type=int, required=True, help="expert slots in all")
    plan.add_argument("--window-steps", type=int, default=1000)
    plan.add_argument("--replan-steps", type=int, default=10_000)
    plan.add_argument("--current", type=Path, help="the placement in use (JSON from --out)")
    plan.add_argument("--out", type=Path, help="write the new placement here (JSON)")
    plan.add_argument("--json", action="store_true", help="one JSON object, no table")
    plan.set_defaults(run=run_plan)


def _fail(message: str) -> int:
    print(f"kvmesh eplb plan: {message}", file=sys.stderr)
    return 2


def run_plan(args: argparse.Namespace) -> int:
    try:
        counts = read_load(args.load)
    except (OSError, ValueError, KeyError) as e:
        return _fail(f"--load: {e}")
    steps, layers, experts = counts.shape
    if args.experts != experts:
        return _fail(f"--experts {args.experts} does not match the load file's {experts} experts")
    if args.cards < 1:
        return _fail("--cards: at least 1")
    if args.slots < experts or args.slots % args.cards:
        return _fail(
            f"--slots: at least the {experts} experts and a multiple of --cards {args.cards} "
            f"(got {args.slots})"
        )
    if args.window_steps < 1 or args.replan_steps < args.window_steps:
        return _fail("--window-steps: at least 1, and --replan-steps at least --window-steps")
    current = contiguous(layers, experts, args.cards, args.slots)
    if args.current:
        try:
            current = Placement.from_json(json.loads(args.current.read_text()))
        except (OSError, ValueError, KeyError, AssertionError) as e:
            return _fail(f"--current: not a placement ({e})")
        if (current.layers, current.experts, current.slots, current.cards) != (
            layers,
            experts,
            args.slots,
            args.cards,
        ):
            return _fail("--current: its layers, experts, slots or cards differ from the plan's")
    size = min(args.window_steps, steps)
    windows = [Window.of(counts[i : i + size]) for i in range(0, steps - size + 1, size)]
    planner = Planner(
        args.cards, args.slots, replan_steps=args.replan_steps, window_steps=args.window_steps
    )
    plan = planner.plan(windows, current)
    f = forecast(windows, planner.horizon)
    x = scenarios(windows, f)
    greedy = greedy_plan(windows[-1].mean, args.cards, args.slots)
    figures = {
        "steps": steps,
        "windows": len(windows),
        "forecast": f.model,
        "predicted": plan.predicted,
        "current": plan.current,
        "greedy": planner.score(greedy, x),
        "contiguous": planner.score(contiguous(layers, experts, args.cards, args.slots), x),
        "moves": plan.moves,
        "greedy_moves": moves(current, greedy),
        "taken": plan.taken,
        "plan_ms": plan.seconds * 1e3,
    }
    placement = plan.placement if plan.taken else current
    if args.out:
        args.out.write_text(json.dumps(placement.to_json()))
    if args.json:
        print(json.dumps({**figures, "placement": plan.placement.to_json()}))
        return 0
    _print_placement(plan.placement, f.mean)
    print(
        f"\n{steps} steps in {len(windows)} windows of {size}; forecast: {f.model}\n"
        f"expected busiest ÷ mean card over the next {args.replan_steps} steps:\n"
        f"  this plan   {figures['predicted']:.3f}  ({plan.moves} experts moved, "
        f"{'taken' if plan.taken else 'not worth its moves'}, {figures['plan_ms']:.0f} ms)\n"
        f"  current     {figures['current']:.3f}\n"
        f"  EPLB greedy {figures['greedy']:.3f}  ({figures['greedy_moves']} experts moved)\n"
        f"  contiguous  {figures['contiguous']:.3f}"
    )
    if args.out:
        print(f"placement written to {args.out}")
    return 0


def _print_placement(placement: Placement, load: np.ndarray) -> None:
    """Each layer's cards: their experts (a replica marked ×n: its expert has n slots) and
    their expected share of the layer's tokens."""
    share = np.einsum("le,lec->lc", load, placement.card_share())
    share /= share.sum(-1, keepdims=True)
    replicas = placement.replicas()
    for layer in range(placement.layers):
        print(f"layer {layer}:")
        for card in range(placement.cards):
            held = placement.slot_expert[layer, card * placement.per_card :][: placement.per_card]
            names = " ".join(
                f"{e}×{replicas[layer, e]}" if replicas[layer, e] > 1 else str(e)
                for e in held.tolist()
            )
            print(f"  card {card:>3}  {100 * share[layer, card]:5.2f}%  {names}")

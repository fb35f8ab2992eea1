"""Expert placement on synthetic (or recorded) MoE load traces: how busy the busiest card is
against the mean card, planned on the past and scored on the future.

Synthetic traces: 384 experts, top-8 routing, 64 cards, 448 slots (7 per card), 8 layers,
16K tokens per step. Expert popularity is Zipf(α) in a random order per layer. It drifts
slowly: each expert's log-popularity moves with a velocity (σ ``--drift`` per window) that
itself changes slowly; the running requests' mix pulls each expert up or down (log σ ``--mix``,
lasting ~2,000 steps); now and then (``--jump`` per window and layer) one expert's load jumps
threefold; and each step multiplies every share by a lognormal of ``--spread`` (per-step noise).
No expert takes more than one of a token's k choices. Statistics every 1,000 steps; plans every
10,000 steps (and every 1,000 for comparison). Policies, every one scored on steps after the data
it planned on:

- contiguous: experts in order, 6 to a card, no replicas, never replanned;
- packed: balanced packing of the last window's load, no replicas;
- greedy: EPLB's replicate-then-pack on the last window (its published method, implemented here);
- kvmesh: shared.eplb.planner.Planner (forecast, risk-balanced packing, few moves);
- interval-oracle: greedy planned on the mean of the very interval it serves (the best a plan
  kept for the interval could do with a perfect forecast of the mean);
- oracle: greedy planned on the very window it is scored on (what no real plan can see).

Per α: busiest ÷ mean card per layer and step (mean, p99), experts moved per replan, the mean
with the moves' cost spread over the steps a plan serves (at the planner's default cost of a
move), planner time. ``--load FILE`` scores a recorded trace instead (JSON or NPZ per-step counts).

    .venv/bin/python bench/eplb.py [--alphas 0.8 1.0 1.2] [--steps 60000] [--layers 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import emit  # noqa: E402
from shared.eplb.placement import Placement, contiguous, gamma, moves  # noqa: E402
from shared.eplb.planner import Planner, greedy_plan, packed_plan  # noqa: E402
from shared.eplb.stats import Window, read_load  # noqa: E402

WINDOW = 1000
MOVE_COST = Planner(1, 1, replan_steps=1, window_steps=1).move_cost
JUMP = 3.0


@dataclass
class SyntheticLoad:
    """Per-step expert counts with drift, jumps and per-step noise (see the module docstring)."""

    experts: int = 384
    layers: int = 4
    top_k: int = 8
    tokens: int = 16384
    alpha: float = 1.0
    spread: float = 0.05
    drift: float = 0.02  # log-popularity velocity, per window (stationary std)
    jump: float = 0.01  # chance per window and layer that a cold expert turns hot
    mix: float = 0.05  # log σ of the request mix's pull on each expert, lasting ~mix_steps
    mix_steps: int = 2000
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.seed)
        ranks = np.stack([self.rng.permutation(self.experts) for _ in range(self.layers)])
        self.logp = -self.alpha * np.log1p(ranks).astype(np.float64)
        self.velocity = self.rng.normal(0, self.drift, self.logp.shape)
        self.pull = self.rng.normal(0, self.mix, self.logp.shape)

    def window(self, steps: int = WINDOW) -> np.ndarray:
        """The next ``steps`` steps' counts, [steps, layers, experts]."""
        t = (np.arange(steps) / steps)[:, None, None]
        logp = self.logp[None] + self.velocity[None] * t + self._pulls(steps)
        logp = logp + self.rng.normal(0, self.spread, logp.shape)
        share = np.exp(logp - logp.max(-1, keepdims=True))
        share = _cap(share / share.sum(-1, keepdims=True), 1.0 / self.top_k)
        self._advance()
        return (share * (self.tokens * self.top_k)).astype(np.float32)

    def _pulls(self, steps: int) -> np.ndarray:
        """The running requests' mix: an AR(1) per expert, σ ``mix``, ~``mix_steps`` long."""
        keep = np.exp(-1 / self.mix_steps)
        shocks = self.rng.normal(0, self.mix * np.sqrt(1 - keep**2), (steps, *self.pull.shape))
        out = np.empty_like(shocks)
        for i in range(steps):
            self.pull = keep * self.pull + shocks[i]
            out[i] = self.pull
        return out

    def _advance(self) -> None:
        self.logp += self.velocity
        keep = 0.9  # the velocity changes slowly, its spread stays ``drift``
        noise = self.rng.normal(0, self.drift * np.sqrt(1 - keep**2), self.velocity.shape)
        self.velocity = keep * self.velocity + noise
        # Popularity stays Zipf-like overall: the mean log-popularity does not wander off.
        self.logp -= self.logp.mean(-1, keepdims=True)
        for layer in range(self.layers):
            if self.rng.random() < self.jump:  # one expert's load jumps ×JUMP
                self.logp[layer, self.rng.integers(0, self.experts)] += np.log(JUMP)


def _cap(share: np.ndarray, cap: float) -> np.ndarray:
    """No share above ``cap`` (a token picks an expert once): the excess spread over the rest
    in proportion."""
    for _ in range(20):
        over = share > cap
        if not over.any():
            break
        excess = np.where(over, share - cap, 0).sum(-1, keepdims=True)
        share = np.where(over, cap, share)
        room = np.where(over, 0, share)
        share = share + excess * room / room.sum(-1, keepdims=True)
    return share


@dataclass
class Policy:
    name: str
    replan: int  # steps between plans; 0: never, or (oracle) every window on its own data
    placement: Placement | None = None
    gammas: list[np.ndarray] = field(default_factory=list)
    moved: list[int] = field(default_factory=list)
    plan_s: list[float] = field(default_factory=list)

    def summary(self) -> dict:
        g = np.concatenate([x.ravel() for x in self.gammas])
        moved = float(np.mean(self.moved)) if self.moved else 0.0
        return {
            "gamma_mean": float(g.mean()),
            "gamma_p99": float(np.quantile(g, 0.99)),
            "moves_per_replan": moved,
            # The moves' cost spread over the steps the plan serves (MOVE_COST mean-card steps
            # per expert moved): what the busiest card's time comes to with them.
            "gamma_with_moves": float(g.mean())
            + (moved * MOVE_COST / self.replan if self.replan > 0 else 0.0),
            "plan_ms": 1000 * float(np.median(self.plan_s)) if self.plan_s else 0.0,
        }


def run(windows, layers: int, experts: int, cards: int, slots: int, replans: list[int], label):
    """Score every policy over ``windows()`` (an iterator of per-step counts, one window each;
    called twice: a first pass learns each window's mean, for the interval oracle)."""
    means = [counts.astype(np.float64).mean(0) for counts in windows()]
    policies = [Policy("contiguous", 0), Policy("oracle", -1)]
    for replan in replans:
        policies += [Policy(f"{n}/{replan}", replan) for n in ("packed", "greedy", "kvmesh")]
        policies.append(Policy(f"interval-oracle/{replan}", replan))
    planners = {r: Planner(cards, slots, replan_steps=r, window_steps=WINDOW) for r in replans}
    start_placement = contiguous(layers, experts, cards, slots)
    first_scored = max(replans) // WINDOW
    seen: list[Window] = []
    t0 = time.perf_counter()
    for w, counts in enumerate(windows()):
        counts = counts.astype(np.float64)
        window = Window.of(counts)
        if w >= first_scored:
            for p in policies:
                placement = greedy_plan(window.mean, cards, slots) if p.replan < 0 else p.placement
                p.gammas.append(gamma(placement.card_loads(counts)))
        seen.append(window)
        seen = seen[-48:]  # what an engine's balancer keeps
        for p in policies:
            if p.replan < 0:
                continue
            if p.placement is None:
                p.placement = (
                    contiguous(layers, experts, cards)
                    if p.name == "contiguous" or p.name.startswith("packed")
                    else start_placement
                )
            if p.replan == 0 or (w + 1) * WINDOW % p.replan:
                continue
            t = time.perf_counter()
            if p.name.startswith("packed"):
                new = packed_plan(window.mean, cards)
            elif p.name.startswith("greedy"):
                new = greedy_plan(window.mean, cards, slots)
            elif p.name.startswith("interval-oracle"):  # the coming interval's own mean
                ahead = means[w + 1 : w + 1 + p.replan // WINDOW] or [window.mean]
                new = greedy_plan(np.mean(ahead, 0), cards, slots)
            else:
                new = planners[p.replan].plan(seen, p.placement).placement
            p.plan_s.append(time.perf_counter() - t)
            p.moved.append(moves(p.placement, new))
            p.placement = new
        print(f"{label}: window {w + 1} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    return {p.name: p.summary() for p in policies}


def table(label: str, results: dict) -> None:
    print(f"\n{label}")
    print(
        f"{'policy':<22} {'γ mean':>8} {'γ p99':>8} {'moves/replan':>13} "
        f"{'γ + moves':>10} {'plan ms':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<22} {r['gamma_mean']:8.4f} {r['gamma_p99']:8.4f} "
            f"{r['moves_per_replan']:13.1f} {r['gamma_with_moves']:10.4f} {r['plan_ms']:8.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.8, 1.0, 1.2])
    parser.add_argument("--steps", type=int, default=60_000)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=384)
    parser.add_argument("--cards", type=int, default=64)
    parser.add_argument("--slots", type=int, default=448)
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per decode step")
    parser.add_argument("--spread", type=float, default=0.05, help="per-step lognormal σ")
    parser.add_argument("--drift", type=float, default=0.02, help="log-popularity σ/window")
    parser.add_argument("--jump", type=float, default=0.01, help="jumps per window and layer")
    parser.add_argument("--mix", type=float, default=0.05, help="request-mix log σ")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--replans", type=int, nargs="+", default=[10_000, 1_000])
    parser.add_argument("--load", help="score a recorded load file instead (JSON or NPZ)")
    args = parser.parse_args()

    out: dict = {}
    if args.load:
        counts = read_load(args.load)
        layers, experts = counts.shape[1:]
        n = len(counts) // WINDOW
        replans = [r for r in args.replans if r < n * WINDOW] or [WINDOW]
        label = f"{args.load}: {len(counts)} steps, {layers} layers, {experts} experts"
        results = run(
            lambda: (counts[i * WINDOW : (i + 1) * WINDOW] for i in range(n)),
            layers,
            experts,
            args.cards,
            args.slots,
            replans,
            label,
        )
        table(label, results)
        out["load"] = results
    for alpha in args.alphas if not args.load else []:
        options = dict(
            experts=args.experts,
            layers=args.layers,
            tokens=args.tokens,
            alpha=alpha,
            spread=args.spread,
            drift=args.drift,
            jump=args.jump,
            mix=args.mix,
            seed=args.seed,
        )
        label = (
            f"α = {alpha}: {args.steps} steps, {args.layers} layers, {args.experts} experts, "
            f"{args.cards} cards, {args.slots} slots, {args.tokens} tokens/step, top-8, "
            f"noise σ {args.spread}, request mix σ {args.mix}, drift {args.drift}/window, "
            f"jumps {args.jump}/window"
        )

        def windows(options: dict = options) -> Iterator[np.ndarray]:
            trace = SyntheticLoad(**options)  # the same trace each time: the same seed
            return (trace.window() for _ in range(args.steps // WINDOW))

        results = run(
            windows, args.layers, args.experts, args.cards, args.slots, args.replans, label
        )
        table(label, results)
        out[f"alpha{alpha:g}"] = results
    main_replan = max(args.replans)
    a1 = out.get("alpha1") or next(iter(out.values()))
    figures = {
        "gamma_mean_alpha1": a1[f"kvmesh/{main_replan}"]["gamma_mean"],
        "gamma_p99_alpha1": a1[f"kvmesh/{main_replan}"]["gamma_p99"],
        "gamma_mean_greedy_alpha1": a1[f"greedy/{main_replan}"]["gamma_mean"],
        "gamma_oracle_alpha1": a1["oracle"]["gamma_mean"],
        "gamma_interval_oracle_alpha1": a1[f"interval-oracle/{main_replan}"]["gamma_mean"],
        "gamma_with_moves_alpha1": a1[f"kvmesh/{main_replan}"]["gamma_with_moves"],
        "gamma_with_moves_greedy_alpha1": a1[f"greedy/{main_replan}"]["gamma_with_moves"],
        "moves_per_replan": a1[f"kvmesh/{main_replan}"]["moves_per_replan"],
        "plan_ms": a1[f"kvmesh/{main_replan}"]["plan_ms"],
        "kvmesh_vs_greedy": {
            k: v[f"kvmesh/{main_replan}"]["gamma_mean"] / v[f"greedy/{main_replan}"]["gamma_mean"]
            for k, v in out.items()
        },
    }
    emit(figures)


if __name__ == "__main__":
    main()

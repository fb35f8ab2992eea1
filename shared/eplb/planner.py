"""Plans replicas and their placement on cards from expert load statistics. Pure functions
over numpy arrays; the engine and ``kvmesh eplb plan`` call them.

Two planners:

- ``greedy_plan``: EPLB's published method, implemented from its description: each spare slot
  goes to the expert with the most load per replica, then the replicas are packed onto cards
  heaviest first, each onto the lightest card with a free slot. It plans on one load vector,
  normally the last window's.
- ``Planner``: plans for the *next* interval. Each expert's load is forecast from the windows
  seen (the last window's level plus a damped trend), with its uncertainty (per-step noise and
  how far the forecast may miss); a card's risk is its expected load plus ``risk`` standard
  deviations. Replicas go where the risk per replica is highest, are packed the same way, and
  the packing is then improved by swaps off the riskiest card. The plan is renumbered to keep
  as many experts where they are as possible, and taken only when its predicted gain over the
  interval beats the cost of the experts it moves.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from shared.eplb.placement import Placement, moves, relabel_cards
from shared.eplb.stats import Window


def replicate(load: np.ndarray, slots: int) -> np.ndarray:
    """Replicas per expert ([experts] → [experts]): one each, then every spare slot to the
    expert with the highest load per replica."""
    counts = np.ones(len(load), dtype=np.int64)
    heap = [(-float(w), e) for e, w in enumerate(load)]
    heapq.heapify(heap)
    for _ in range(slots - len(load)):
        _, e = heapq.heappop(heap)
        counts[e] += 1
        heapq.heappush(heap, (-float(load[e]) / counts[e], e))
    return counts


def pack(weight: np.ndarray, cards: int) -> np.ndarray:
    """Card of each item ([items]): heaviest first, each onto the lightest card with room; every
    card gets ``items / cards`` items."""
    per_card = len(weight) // cards
    assert per_card * cards == len(weight), f"{len(weight)} items do not fill {cards} cards"
    loads = np.zeros(cards)
    room = np.full(cards, per_card)
    card = np.empty(len(weight), dtype=np.int64)
    for item in np.argsort(-weight, kind="stable"):
        c = int(np.where(room > 0, loads, np.inf).argmin())
        card[item] = c
        loads[c] += weight[item]
        room[c] -= 1
    return card


def _slots_from_cards(items: np.ndarray, card: np.ndarray, cards: int) -> np.ndarray:
    """Slot row (card-major) from each item's expert and card."""
    order = np.argsort(card, kind="stable")
    return items[order]


def _items(counts: np.ndarray) -> np.ndarray:
    """Expert of each replica: expert e repeated counts[e] times."""
    return np.repeat(np.arange(len(counts)), counts)


def greedy_plan(load: np.ndarray, cards: int, slots: int) -> Placement:
    """EPLB's replicate-then-pack on ``load`` ([layers, experts])."""
    rows = []
    for layer_load in load:
        counts = replicate(layer_load, slots)
        items = _items(counts)
        card = pack(layer_load[items] / counts[items], cards)
        rows.append(_slots_from_cards(items, card, cards))
    return Placement(np.stack(rows), load.shape[1], cards)


def packed_plan(load: np.ndarray, cards: int) -> Placement:
    """Balanced packing without replicas (as many slots as experts)."""
    items = np.arange(load.shape[1])
    rows = [_slots_from_cards(items, pack(layer_load, cards), cards) for layer_load in load]
    return Placement(np.stack(rows), load.shape[1], cards)


@dataclass(frozen=True)
class Forecast:
    """Per layer and expert, per step over the coming interval: expected tokens and the
    variance around that (per-step noise plus the forecast's own error)."""

    mean: np.ndarray  # [layers, experts]
    var: np.ndarray  # [layers, experts]
    model: str  # the forecasting rule the history chose


# Forecasting rules, each a (level weight, trend damping): the level is an exponentially weighted
# mean of the windows' means (weight 1: the last window alone); the trend, the mean log change
# per window over the last TREND_WINDOWS, carried on with the damping per window ahead (0: none).
RULES = [(1.0, 0.0), (0.5, 0.0), (0.25, 0.0), (0.1, 0.0), (1.0, 0.8), (0.5, 0.8), (1.0, 0.95)]
TREND_WINDOWS = 6


def _predict(means: np.ndarray, horizon: int, weight: float, damping: float) -> np.ndarray:
    """The mean load per step over the next ``horizon`` windows, from ``means`` ([W, ...],
    oldest first) by one rule."""
    ages = np.arange(len(means))[::-1]
    w = weight * (1 - weight) ** ages
    w[0] += (1 - weight) ** len(means)  # the oldest window stands for everything before it
    level = np.tensordot(w, means, axes=1)
    if damping == 0 or len(means) < 2:
        return level
    recent = means[-TREND_WINDOWS:]
    floor = 1e-3 * recent.mean() + 1e-12
    logs = np.log(np.maximum(recent, floor))
    slope = (logs[-1] - logs[0]) / (len(recent) - 1)
    # Σ_{h=1..H} Σ_{j=1..h} φ^j / H: how far the damped trend carries, averaged over the interval
    reach = np.mean([sum(damping**j for j in range(1, h + 1)) for h in range(1, horizon + 1)])
    return level * np.exp(slope * reach)


def forecast(windows: list[Window], horizon: float) -> Forecast:
    """The next ``horizon`` windows' load per step, from ``windows`` (oldest first).

    Each rule in RULES is tried on the history itself (forecast from the windows up to a
    point, scored on the ones after it, squared error summed over experts) and the rule that
    did best is used; with too little history to try them, the last window's level. The
    forecast is capped at the most tokens an expert was seen to take in a step, and its
    variance is the last window's per-step variance plus the chosen rule's squared error,
    relative to the load, pooled over experts."""
    assert windows, "a forecast needs at least one window"
    means = np.stack([w.mean for w in windows])  # [W, layers, experts]
    h = max(1, round(horizon))
    noise = windows[-1].var
    cap = np.stack([w.peak for w in windows]).max((0, 2), keepdims=False)[:, None]  # [layers, 1]
    origins = range(max(2, len(windows) - 4 * h), len(windows))
    best, best_error, best_rel = RULES[0], np.inf, 0.0
    if len(windows) >= 3:
        for rule in RULES:
            error = total = 0.0
            for t in origins:
                actual = means[t : t + h].mean(0)
                guess = np.minimum(_predict(means[:t], h, *rule), cap)
                error += float(((guess - actual) ** 2).sum())
                total += float((actual**2).sum())
            if error < best_error:
                best, best_error, best_rel = rule, error, error / total
    mean = np.minimum(_predict(means, h, *best), cap)
    return Forecast(mean, noise + best_rel * mean**2, f"level {best[0]:g}, trend {best[1]:g}")


@dataclass(frozen=True)
class Plan:
    placement: Placement
    predicted: float  # the placement's expected busiest ÷ mean card on the coming interval
    current: float  # the current placement's, the same way
    moves: int
    gain: float  # (current − predicted) × the interval's steps, in mean-card step times
    cost: float  # moves × the cost of one move, the same units
    taken: bool
    seconds: float


class Planner:
    """Replicas and placement for the interval ahead (see the module's docstring)."""

    def __init__(
        self,
        cards: int,
        slots: int,
        *,
        replan_steps: int,
        window_steps: int,
        risk: float = 1.5,
        move_cost: float = 0.05,
        max_swaps: int = 400,
    ) -> None:
        self.cards, self.slots = cards, slots
        self.horizon = replan_steps / window_steps  # windows the plan will serve
        self.replan_steps = replan_steps
        self.risk = risk
        self.move_cost = move_cost
        self.max_swaps = max_swaps

    def plan(self, windows: list[Window], current: Placement) -> Plan:
        start = time.perf_counter()
        f = forecast(windows, self.horizon)
        rows = [self._layer(f.mean[layer], f.var[layer]) for layer in range(current.layers)]
        fresh = relabel_cards(current, Placement(np.stack(rows), current.experts, self.cards))
        predicted = self.score(fresh, f)
        now = self.score(current, f)
        moved = moves(current, fresh)
        gain = (now - predicted) * self.replan_steps
        cost = moved * self.move_cost
        taken = gain > cost
        return Plan(
            placement=fresh if taken else current,
            predicted=predicted,
            current=now,
            moves=moved,
            gain=gain,
            cost=cost,
            taken=taken,
            seconds=time.perf_counter() - start,
        )

    def score(self, placement: Placement, f: Forecast) -> float:
        """Expected busiest ÷ mean card, averaged over layers: per card its expected load
        plus ``risk`` standard deviations."""
        share = placement.card_share()  # [layers, experts, cards]
        mean = np.einsum("le,lec->lc", f.mean, share)
        std = np.sqrt(np.einsum("le,lec->lc", f.var, share**2))
        worst = (mean + self.risk * std).max(-1)
        return float((worst / mean.mean(-1)).mean())

    def _layer(self, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
        std = np.sqrt(var)
        counts = replicate(mean + self.risk * std, self.slots)
        items = _items(counts)
        mu = mean[items] / counts[items]
        v = var[items] / counts[items] ** 2
        card = pack(mu + self.risk * np.sqrt(v), self.cards)
        card = self._improve(card, mu, v)
        return _slots_from_cards(items, card, self.cards)

    def _improve(self, card: np.ndarray, mu: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Swaps of one item on the riskiest card with one elsewhere, best first, while the
        pair's worse card gets better than the riskiest was."""
        card = card.copy()
        k = self.risk
        load = np.bincount(card, weights=mu, minlength=self.cards)
        var = np.bincount(card, weights=v, minlength=self.cards)
        for _ in range(self.max_swaps):
            risk = load + k * np.sqrt(var)
            top = int(risk.argmax())
            mine = np.flatnonzero(card == top)  # [m]
            others = np.flatnonzero(card != top)  # [o]
            d_mu = mu[others][None, :] - mu[mine][:, None]  # [m, o]: what top gains
            d_v = v[others][None, :] - v[mine][:, None]
            top_after = load[top] + d_mu + k * np.sqrt(np.maximum(var[top] + d_v, 0))
            dest = card[others][None, :]
            dest_after = load[dest] - d_mu + k * np.sqrt(np.maximum(var[dest] - d_v, 0))
            worse = np.maximum(top_after, dest_after)
            best = int(worse.argmin())
            if worse.flat[best] >= risk[top] - 1e-9 * risk[top]:
                break
            i, j = mine[best // len(others)], others[best % len(others)]
            other = card[j]
            card[i], card[j] = other, top
            load[top] += mu[j] - mu[i]
            load[other] += mu[i] - mu[j]
            var[top] += v[j] - v[i]
            var[other] += v[i] - v[j]
        return card

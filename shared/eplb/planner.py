"""Plans replicas and their placement on cards from expert load statistics. Pure functions
over numpy arrays; the engine and ``kvmesh eplb plan`` call them.

Two planners:

- ``greedy_plan``: EPLB's published method, implemented from its description: each spare slot
  goes to the expert with the most load per replica, then the replicas are packed onto cards
  heaviest first, each onto the lightest card with a free slot. It plans on one load vector,
  normally the last window's.
- ``Planner``: plans for the *next* interval. Each expert's load is forecast window by window
  ahead by the rule (a level over some windows, a damped trend or none) that forecast the
  history itself best; its uncertainty is the per-step noise plus that rule's error. Two
  candidates: a fresh plan (replicas where the risk per replica is highest, packed the same
  way, improved by swaps off the riskiest card, renumbered to keep what it can where it is),
  and a repair of the current placement (a few replicas handed to the experts that need them
  most, then the same swaps). The one with the most predicted gain net of its moves' cost is
  polished by swaps that lower the expected busiest card over scenarios (the forecast path
  times per-step swings seen lately), and taken when its gain over the interval beats the
  cost of the experts it moves.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from shared.eplb.placement import Placement, gamma, moves, relabel_cards
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


def pack(weight: np.ndarray, cards: int, experts: np.ndarray | None = None) -> np.ndarray:
    """Card of each item ([items]): heaviest first, each onto the lightest card with room; every
    card gets ``items / cards`` items. Given each item's expert, a card already holding it is
    passed over while another has room (two replicas on one card would waste a slot)."""
    per_card = len(weight) // cards
    assert per_card * cards == len(weight), f"{len(weight)} items do not fill {cards} cards"
    heap = [(0.0, c) for c in range(cards)]  # (load, card) of the cards with room
    room = [per_card] * cards
    held: list[set[int]] = [set() for _ in range(cards)]
    card = np.empty(len(weight), dtype=np.int64)
    for item in np.argsort(-weight, kind="stable").tolist():
        expert = int(experts[item]) if experts is not None else None
        passed = []
        load, c = heapq.heappop(heap)
        while expert in held[c] and heap:  # the lightest card without it, if any has room
            passed.append((load, c))
            load, c = heapq.heappop(heap)
        if expert in held[c]:  # every card with room holds it: the lightest of them
            passed.append((load, c))
            load, c = min(passed)
            passed.remove((load, c))
        for entry in passed:
            heapq.heappush(heap, entry)
        card[item] = c
        if expert is not None:
            held[c].add(expert)
        room[c] -= 1
        if room[c]:
            heapq.heappush(heap, (load + float(weight[item]), c))
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
    """Per layer and expert, per step: the expected load in each window ahead, and the
    variance around it (per-step noise plus the forecast's own error)."""

    path: np.ndarray  # [windows ahead, layers, experts]
    var: np.ndarray  # [layers, experts]
    model: str  # the forecasting rule the history chose

    @property
    def mean(self) -> np.ndarray:
        """Over the whole interval, [layers, experts]."""
        return self.path.mean(0)


# Forecasting rules, each (level span, trend span, damping): the load is the mean of the last
# ``level span`` windows; with a trend span, the trend (a least-squares line through that many
# windows' log loads) moves it to the last window and carries on ahead, ``damping`` of it per
# window further.
RULES = [
    (1, 0, 0.0),
    (3, 0, 0.0),
    (6, 0, 0.0),
    (12, 0, 0.0),
    (1, 6, 0.8),
    (1, 6, 0.95),
    (1, 12, 0.9),
    (3, 6, 0.8),
    (3, 12, 0.9),
]


def _path(means: np.ndarray, horizon: int, span: int, trend: int, damping: float) -> np.ndarray:
    """The load per step in each of the next ``horizon`` windows ([horizon, ...]), from
    ``means`` ([W, ...], oldest first) by one rule."""
    level = means[-span:].mean(0)
    recent = means[-trend:] if trend else means[:0]
    if len(recent) < 3:
        return np.broadcast_to(level, (horizon, *level.shape))
    t = np.arange(len(recent), dtype=np.float64)
    t -= t.mean()
    logs = np.log(np.maximum(recent, 1e-3 * recent.mean() + 1e-12))
    slope = np.tensordot(t, logs, axes=1) / (t**2).sum()
    # From the level's middle window to the last one, then Σ_{j=1..h} φ^j windows ahead.
    reach = (min(span, len(means)) - 1) / 2 + np.cumsum(damping ** np.arange(1, horizon + 1))
    return level[None] * np.exp(slope[None] * reach.reshape(-1, *([1] * slope.ndim)))


def forecast(windows: list[Window], horizon: float) -> Forecast:
    """The next ``horizon`` windows' load per step, from ``windows`` (oldest first).

    Each rule in RULES is tried on the history itself (forecast from the windows up to a
    point, scored on the ones after it, squared error summed over experts) and the rule that
    did best is used; with too little history to try them, the last window's. The
    forecast is capped at the most tokens an expert was seen to take in a step, and its
    variance is the last window's per-step variance plus the chosen rule's squared error,
    relative to the load, pooled over experts."""
    assert windows, "a forecast needs at least one window"
    means = np.stack([w.mean for w in windows])  # [W, layers, experts]
    h = max(1, round(horizon))
    noise = windows[-1].var
    cap = np.stack([w.peak for w in windows]).max((0, 2), keepdims=False)[:, None]  # [layers, 1]
    best, best_rel = RULES[0], 0.0
    if len(windows) >= 3:
        first = max(2, len(windows) - 4 * h)  # up to 12 points in the last 4 intervals
        points = min(12, len(windows) - first)
        origins = sorted(set(np.linspace(first, len(windows) - 1, points, dtype=int).tolist()))
        best_error = np.inf
        for rule in RULES:
            error = total = 0.0
            for t in origins:
                actual = means[t : t + h]
                guess = np.minimum(_path(means[:t], h, *rule)[: len(actual)], cap)
                error += float(((guess.mean(0) - actual.mean(0)) ** 2).sum())
                total += float((actual.mean(0) ** 2).sum())
            if error < best_error:
                best, best_error, best_rel = rule, error, error / total
    path = np.minimum(_path(means, h, *best), cap)
    mean = path.mean(0)
    return Forecast(path, noise + best_rel * mean**2, _describe(best))


def _describe(rule: tuple[int, int, float]) -> str:
    span, trend, damping = rule
    level = "the last window" if span == 1 else f"the last {span} windows"
    return f"{level}, trend over {trend} damped {damping:g}" if trend else level


def scenarios(windows: list[Window], f: Forecast, count: int = 24) -> np.ndarray:
    """Loads to plan against, [layers, count, experts]: the forecast's path, window by window,
    times the per-step swings of steps seen lately (each kept step over its window's mean),
    so the noise's shape and the experts' co-movement are the history's own."""
    swings = []
    for w in reversed(windows):
        swings.append(w.samples / np.maximum(w.mean, 1e-9)[None])
        if sum(len(s) for s in swings) >= count:
            break
    swing = np.concatenate(swings)[:count]  # [S, layers, experts]
    lead = np.arange(len(swing)) % len(f.path)
    return (f.path[lead] * swing).transpose(1, 0, 2)


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
    cards: np.ndarray  # the placement's expected share of the tokens per card, [cards]


class Planner:
    """Replicas and placement for the interval ahead (see the module's docstring)."""

    def __init__(
        self,
        cards: int,
        slots: int,
        *,
        replan_steps: int,
        window_steps: int,
        risk: float = 1.0,
        move_cost: float = 0.05,
        max_swaps: int = 100,
        max_polish: int = 40,
    ) -> None:
        self.cards, self.slots = cards, slots
        self.horizon = replan_steps / window_steps  # windows the plan will serve
        self.replan_steps = replan_steps
        self.risk = risk
        self.move_cost = move_cost
        self.max_swaps = max_swaps
        self.max_polish = max_polish

    def plan(self, windows: list[Window], current: Placement) -> Plan:
        """The better of two candidates for the coming interval, by gain less the cost of its
        moves: a fresh plan (renumbered to keep what it can where it is) and a repair of the
        current placement (a few replicas handed to the experts that need them most, then
        swaps). Taken when that is positive."""
        start = time.perf_counter()
        f = forecast(windows, self.horizon)
        x = scenarios(windows, f)
        layers = range(current.layers)
        fresh = Placement(
            np.stack([self._layer(f.mean[i], f.var[i]) for i in layers]),
            current.experts,
            self.cards,
        )
        repaired = Placement(
            np.stack([self._repair(current.slot_expert[i], f.mean[i], f.var[i]) for i in layers]),
            current.experts,
            self.cards,
        )
        now = self.score(current, x)
        best = None
        for candidate in (relabel_cards(current, fresh), repaired):
            moved = moves(current, candidate)
            value = (now - self.score(candidate, x)) * self.replan_steps - moved * self.move_cost
            if best is None or value > best[1]:
                best = (candidate, value)
        # The chosen one's packing polished against the scenarios (the costliest part: once).
        chosen = best[0]
        placement = Placement(
            np.stack([self._polished(chosen.slot_expert[i], f.mean[i], x[i]) for i in layers]),
            current.experts,
            self.cards,
        )
        predicted = self.score(placement, x)
        moved = moves(current, placement)
        gain, cost = (now - predicted) * self.replan_steps, moved * self.move_cost
        taken = gain > cost
        cards = np.einsum("le,lec->c", f.mean, (placement if taken else current).card_share())
        return Plan(
            placement=placement if taken else current,
            predicted=predicted,
            current=now,
            moves=moved,
            gain=gain,
            cost=cost,
            taken=taken,
            seconds=time.perf_counter() - start,
            cards=cards / cards.sum() if cards.sum() > 0 else cards,
        )

    def score(self, placement: Placement, x: np.ndarray) -> float:
        """Expected busiest ÷ mean card over the scenarios ``x`` [layers, S, experts],
        averaged over layers."""
        loads = np.einsum("lse,lec->lsc", x, placement.card_share())
        return float(gamma(loads).mean())

    def _layer(self, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
        """A fresh slot row for one layer: replicas, packing, swaps."""
        counts = replicate(mean + self.risk * np.sqrt(var), self.slots)
        items = _items(counts)
        card = pack(
            (mean[items] + self.risk * np.sqrt(var[items])) / counts[items], self.cards, items
        )
        return self._swaps(items, card, mean, var)

    def _repair(self, row: np.ndarray, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
        """One layer's current slot row, adjusted: while it lowers the highest risk per
        replica, a slot of the expert that needs its replicas least goes to the one that needs
        one most (on a card without it, where there is one); then swaps."""
        items = row.copy()
        card = self._slot_cards()
        counts = np.bincount(items, minlength=len(mean))
        need = mean + self.risk * np.sqrt(var)
        for _ in range(max(1, self.slots // 16)):
            taker = int((need / counts).argmax())
            after = np.where(counts > 1, need / np.maximum(counts - 1, 1), np.inf)
            after[taker] = np.inf
            giver = int(after.argmin())
            if after[giver] >= need[taker] / counts[taker]:
                break
            slots = np.flatnonzero(items == giver)
            free = [s for s in slots if not (items[card == card[s]] == taker).any()]
            slot = free[0] if free else slots[0]
            items[slot] = taker
            counts[giver] -= 1
            counts[taker] += 1
        return self._swaps(items, card, mean, var)

    def _swaps(
        self, items: np.ndarray, card: np.ndarray, mean: np.ndarray, var: np.ndarray
    ) -> np.ndarray:
        """Improve a packing (each item's expert and card) by swaps; the slot row."""
        counts = np.bincount(items, minlength=len(mean))
        held = self._held(items, card, len(mean))
        if self.cards > 1:
            mu, v = mean[items] / counts[items], var[items] / counts[items] ** 2
            card = self._improve(card, items, held, mu, v)
        return _slots_from_cards(items, card, self.cards)

    def _slot_cards(self) -> np.ndarray:
        """The card of each slot of a row."""
        return np.arange(self.slots) // (self.slots // self.cards)

    def _held(self, items: np.ndarray, card: np.ndarray, experts: int) -> np.ndarray:
        """[experts, cards]: copies of each expert on each card."""
        held = np.zeros((experts, self.cards), dtype=np.int64)
        np.add.at(held, (items, card), 1)
        return held

    def _polished(self, row: np.ndarray, mean: np.ndarray, x: np.ndarray) -> np.ndarray:
        if self.cards == 1:
            return row
        items = row.copy()
        card = self._slot_cards()
        counts = np.bincount(items, minlength=len(mean))
        held = self._held(items, card, len(mean))
        card = self._polish(card, items, held, x[:, items] / counts[items])
        return _slots_from_cards(items, card, self.cards)

    def _polish(
        self, card: np.ndarray, items: np.ndarray, held: np.ndarray, x: np.ndarray
    ) -> np.ndarray:
        """Swaps that lower the mean over scenarios of the busiest card's load: ``x``
        [S, items] is each item's load per scenario. Each round tries every item on the card
        busiest in the most scenarios against every item on the lightest cards and takes the
        best."""
        card = card.copy()
        loads = np.stack([np.bincount(card, weights=row, minlength=self.cards) for row in x])
        light = max(1, self.cards // 4)
        for _ in range(self.max_polish):
            top = np.argsort(-loads, axis=1)[:, :3]  # [S, ≤3]: the three busiest
            tops = np.take_along_axis(loads, top, 1)
            if top.shape[1] < 3:  # (fewer cards: no card stands in their place)
                pad = 3 - top.shape[1]
                top = np.pad(top, ((0, 0), (0, pad)), constant_values=-1)
                tops = np.pad(tops, ((0, 0), (0, pad)), constant_values=-np.inf)
            objective = tops[:, 0].mean()
            a = int(np.bincount(top[:, 0], minlength=self.cards).argmax())
            mine = np.flatnonzero(card == a)
            lightest = np.zeros(self.cards, dtype=bool)
            lightest[[c for c in np.argsort(loads.mean(0)).tolist() if c != a][:light]] = True
            others = np.flatnonzero(lightest[card])
            if not len(others):
                break
            b = card[others]  # [o]
            delta = x[:, others][:, None, :] - x[:, mine][:, :, None]  # [S, m, o]: a's change
            new_a = loads[:, a][:, None, None] + delta
            new_b = loads[:, b][:, None, :] - delta
            # The busiest of the cards other than a and b, per scenario and b.
            rest = np.where(
                (top[:, 0, None] != a) & (top[:, 0, None] != b[None]),
                tops[:, 0, None],
                np.where(
                    (top[:, 1, None] != a) & (top[:, 1, None] != b[None]),
                    tops[:, 1, None],
                    tops[:, 2, None],
                ),
            )  # [S, o]
            after = np.maximum(np.maximum(new_a, new_b), rest[:, None, :]).mean(0)  # [m, o]
            after[_doubles(items, held, card, mine, others)] = np.inf
            best = int(after.argmin())
            if after.flat[best] >= objective * (1 - 1e-6):
                break
            i, j = mine[best // len(others)], others[best % len(others)]
            other = card[j]
            _swap(card, items, held, i, j)
            loads[:, a] += x[:, j] - x[:, i]
            loads[:, other] += x[:, i] - x[:, j]
        return card

    def _improve(
        self, card: np.ndarray, items: np.ndarray, held: np.ndarray, mu: np.ndarray, v: np.ndarray
    ) -> np.ndarray:
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
            lightest = np.zeros(self.cards, dtype=bool)  # swaps with the least risky cards
            lightest[np.argsort(risk)[: max(1, self.cards // 4)]] = True
            lightest[top] = False
            others = np.flatnonzero(lightest[card])  # [o]
            if not len(others):
                break
            d_mu = mu[others][None, :] - mu[mine][:, None]  # [m, o]: what top gains
            d_v = v[others][None, :] - v[mine][:, None]
            top_after = load[top] + d_mu + k * np.sqrt(np.maximum(var[top] + d_v, 0))
            dest = card[others][None, :]
            dest_after = load[dest] - d_mu + k * np.sqrt(np.maximum(var[dest] - d_v, 0))
            worse = np.maximum(top_after, dest_after)
            worse[_doubles(items, held, card, mine, others)] = np.inf
            best = int(worse.argmin())
            if worse.flat[best] >= risk[top] - 1e-9 * risk[top]:
                break
            i, j = mine[best // len(others)], others[best % len(others)]
            other = card[j]
            _swap(card, items, held, i, j)
            load[top] += mu[j] - mu[i]
            load[other] += mu[i] - mu[j]
            var[top] += v[j] - v[i]
            var[other] += v[i] - v[j]
        return card


def _doubles(
    items: np.ndarray, held: np.ndarray, card: np.ndarray, mine: np.ndarray, others: np.ndarray
) -> np.ndarray:
    """[m, o]: swaps of ``mine`` (all on one card) with ``others`` that would put an expert on a
    card already holding it, or swap an expert with itself."""
    a = card[mine[0]]
    mine_e, other_e = items[mine][:, None], items[others][None, :]
    return (held[mine_e, card[others][None, :]] > 0) | (held[other_e, a] > 0) | (mine_e == other_e)


def _swap(card: np.ndarray, items: np.ndarray, held: np.ndarray, i: int, j: int) -> None:
    a, b = card[i], card[j]
    held[items[i], a] -= 1
    held[items[j], b] -= 1
    held[items[i], b] += 1
    held[items[j], a] += 1
    card[i], card[j] = b, a

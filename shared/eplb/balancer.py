"""An engine's expert balancer: counts each decode step's routed tokens, closes a window every
``window_steps``, replans every ``replan_steps``, and holds the placement the MoE layers follow.
Optionally records the per-step counts to a load file ``kvmesh eplb plan`` reads."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.eplb.placement import contiguous, gamma
from shared.eplb.planner import Plan, Planner
from shared.eplb.stats import LoadWindows, write_load

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BalancerOptions:
    cards: int
    slots: int  # in all (cards × slots per card); slots − experts are replicas
    window_steps: int = 1000
    replan_steps: int = 10_000
    move_cost: float = 0.05  # mean-card steps per expert moved (see Planner)
    record: str = ""  # a load file (.npz or .json) the per-step counts are written to
    record_steps: int = 100_000  # at most this many steps recorded (the first ones)


@dataclass(frozen=True)
class BalancerStats:
    """For /metrics and the decode span."""

    steps: int
    replans: int
    moves: int  # experts moved by taken plans, in all
    predicted: float  # the placement's expected busiest ÷ mean card (at its plan; 0: none yet)
    measured: float  # the last window's busiest ÷ mean card, per layer and step, mean
    predicted_cards: tuple[float, ...]  # per card, the plan's expected share of the tokens
    measured_cards: tuple[float, ...]  # per card, its share of the last window's tokens
    last_plan_s: float | None  # how long the last plan took to make (None: none yet)


class ExpertBalancer:
    def __init__(self, layers: int, experts: int, options: BalancerOptions) -> None:
        if options.slots < experts:
            raise ValueError(f"eplb_slots: at least the {experts} experts (got {options.slots})")
        if options.slots % options.cards:
            raise ValueError(
                f"eplb_slots: a multiple of eplb_cards ({options.cards}), got {options.slots}"
            )
        if options.replan_steps % options.window_steps:
            raise ValueError(
                f"eplb_replan_steps: a multiple of eplb_window_steps ({options.window_steps}), "
                f"got {options.replan_steps}"
            )
        self.options = options
        self.placement = contiguous(layers, experts, options.cards, options.slots)
        self.windows = LoadWindows(layers, experts, options.window_steps)
        self.planner = Planner(
            options.cards,
            options.slots,
            replan_steps=options.replan_steps,
            window_steps=options.window_steps,
            move_cost=options.move_cost,
        )
        self.replans = self.moves = 0
        self.predicted = 0.0
        self.predicted_cards = np.zeros(options.cards)
        self.measured = 0.0
        self.measured_cards = np.zeros(options.cards)
        self.last_plan: Plan | None = None
        self._window_gammas: list[np.ndarray] = []
        self._window_cards = np.zeros(options.cards)
        self._recorded: list[np.ndarray] = []
        self._saved = 0  # recorded steps already in the load file

    def observe(self, experts: np.ndarray, slots: np.ndarray) -> bool:
        """One step: tokens per layer and expert, and per layer and slot (what the layers
        dispatched). True when it replanned and the placement changed."""
        per_card = slots.reshape(slots.shape[0], self.options.cards, -1).sum(-1)  # [layers, cards]
        self._window_gammas.append(gamma(per_card))
        self._window_cards += per_card.sum(0)
        if self.options.record and len(self._recorded) < self.options.record_steps:
            self._recorded.append(experts.astype(np.int32))
        if not self.windows.add(experts):
            return False
        self._close_window()
        if self.windows.steps % self.options.replan_steps:
            return False
        try:
            return self.replan()
        except Exception:  # a planner bug must not stop decoding: the placement stays
            log.exception("expert placement: planning failed; the current placement stays")
            return False

    def replan(self) -> bool:
        """Plan from the windows seen; take the plan if it pays for its moves."""
        windows = list(self.windows.windows)
        if not windows:
            return False
        plan = self.planner.plan(windows, self.placement)
        self.replans += 1
        self.last_plan = plan
        log.info(
            "expert placement replanned: predicted %.3f (current %.3f), %d moves, %s in %.0f ms",
            plan.predicted,
            plan.current,
            plan.moves,
            "taken" if plan.taken else "kept the current one",
            plan.seconds * 1e3,
        )
        if not plan.taken:
            return False
        self.placement = plan.placement
        self.moves += plan.moves
        self.predicted = plan.predicted
        self.predicted_cards = plan.cards
        return True

    def _close_window(self) -> None:
        self.measured = float(np.mean(self._window_gammas))
        total = self._window_cards.sum()
        self.measured_cards = self._window_cards / total if total else self._window_cards
        self._window_gammas, self._window_cards = [], np.zeros(self.options.cards)
        if self.options.record and self.unsaved:
            self.save_record()

    @property
    def unsaved(self) -> int:
        """Recorded steps not yet in the load file."""
        return len(self._recorded) - self._saved

    def save_record(self) -> Path:
        path = Path(self.options.record)
        write_load(path, np.stack(self._recorded))
        self._saved = len(self._recorded)
        return path

    def stats(self) -> BalancerStats:
        return BalancerStats(
            steps=self.windows.steps,
            replans=self.replans,
            moves=self.moves,
            predicted=self.predicted,
            measured=self.measured,
            predicted_cards=tuple(float(x) for x in self.predicted_cards),
            measured_cards=tuple(float(x) for x in self.measured_cards),
            last_plan_s=None if self.last_plan is None else self.last_plan.seconds,
        )

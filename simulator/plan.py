"""Capacity planning: the smallest prefill and decode pools that meet a workload's targets,
found by replaying the workload in the simulator's world (simulator/replay.py).

In that world decode never holds prefill back (a decode worker takes each hand-over at once,
its sequences sharing its rate), so TTFT depends on the prefill pool alone and TPOT on the
decode pool: the prefill count is searched first (with one decode worker), then the decode
count beside it. Each search gallops (1, 2, 4, ...) to a pool that meets its targets, then
halves the gap to the smallest that does: about 2 log2(N) replays where a sweep needs N².
``sweep`` is that exhaustive grid, to check the search against.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from shared.search import smallest
from simulator.replay import SimConfig, simulate
from simulator.traces import TraceRequest

PREFILL_TARGETS = ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s")
DECODE_TARGETS = ("tpot_mean_s", "tpot_p99_s")


@dataclass(frozen=True)
class Targets:
    """What the plan must meet (seconds; None: no target)."""

    ttft_mean_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    tpot_mean_s: float | None = None
    tpot_p99_s: float | None = None

    def given(self, keys: tuple[str, ...]) -> dict[str, float]:
        return {k: v for k in keys if (v := getattr(self, k)) is not None}

    def met(self, summary: dict, keys: tuple[str, ...]) -> bool:
        return all(summary[k] <= v for k, v in self.given(keys).items())

    def margin(self, summary: dict, keys: tuple[str, ...]) -> dict[str, float]:
        """Per target, the share of it left unused (0.2: the figure is 80% of the target)."""
        return {k: round(1 - summary[k] / v, 4) for k, v in self.given(keys).items()}


@dataclass
class Plan:
    prefill: int | None  # None: no pool up to the bound meets the targets
    decode: int | None  # (None too when no prefill pool does: none was sized)
    summary: dict  # the replay at the plan (or, where none meets, where the search stopped)
    margin: dict[str, float]
    trials: dict[tuple[int, int], dict] = field(default_factory=dict)  # every replay made
    at: tuple[int, int] = (0, 0)  # the pools ``summary`` was replayed on (prefill, decode)

    @property
    def feasible(self) -> bool:
        return self.prefill is not None and self.decode is not None


class Planner:
    def __init__(
        self,
        requests: list[TraceRequest],
        block_size: int,
        cfg: SimConfig,
        targets: Targets,
        earlier: list[TraceRequest] = (),  # type: ignore[assignment]
        policy: str = "ttft",
        max_workers: int = 512,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if not targets.given(PREFILL_TARGETS + DECODE_TARGETS):
            raise ValueError("targets: at least one (a TTFT or the TPOT)")
        self.requests, self.block_size, self.cfg = requests, block_size, cfg
        self.targets, self.earlier, self.policy = targets, earlier, policy
        self.max_workers = max_workers
        self.progress = progress
        self.trials: dict[tuple[int, int], dict] = {}

    def trial(self, prefill: int, decode: int) -> dict:
        """The workload replayed on ``prefill`` + ``decode`` workers (once per pair)."""
        key = (prefill, decode)
        if key not in self.trials:
            cfg = replace(self.cfg, prefill=prefill, decode=decode)
            result = simulate(self.requests, self.block_size, cfg, self.policy, None, self.earlier)
            summary = result.summary(prefill)
            summary["decode_utilization"] = summary["output_tok_s"] / (decode * decode_rate(cfg))
            self.trials[key] = summary
            if self.progress:
                self.progress(len(self.trials), 0)
        return self.trials[key]

    def plan(self) -> Plan:
        t = self.targets
        ttft, tpot = t.given(PREFILL_TARGETS), t.given(DECODE_TARGETS)
        prefill = smallest(
            lambda p: t.met(self.trial(p, 1), PREFILL_TARGETS),
            lambda p: [self.trial(p, 1)[k] for k in ttft],
            self.max_workers,
        )
        if prefill is None:  # (the replay where the search stopped)
            stopped = max(p for p, d in self.trials if d == 1)
            return Plan(None, None, self.trial(stopped, 1), {}, self.trials, (stopped, 1))
        decode = smallest(
            lambda d: t.met(self.trial(prefill, d), DECODE_TARGETS),
            lambda d: [self.trial(prefill, d)[k] for k in tpot],
            self.max_workers,
        )
        if decode is None:
            stopped = max(d for p, d in self.trials if p == prefill)
            at = (prefill, stopped)
            return Plan(prefill, None, self.trial(*at), {}, self.trials, at)
        summary = self.trial(prefill, decode)
        margin = t.margin(summary, PREFILL_TARGETS + DECODE_TARGETS)
        return Plan(prefill, decode, summary, margin, self.trials, (prefill, decode))

    def sweep(self, prefill: range, decode: range) -> tuple[int, int] | None:
        """Every pair replayed: the cheapest that meets every target (fewest workers, then
        fewest prefill), or None."""
        keys = PREFILL_TARGETS + DECODE_TARGETS
        met = [
            (p + d, p, d)
            for p in prefill
            for d in decode
            if self.targets.met(self.trial(p, d), keys)
        ]
        if not met:
            return None
        _, p, d = min(met)
        return p, d


def show_replays(done: int, _total: int) -> None:
    """A planner's progress on stderr: the replays made so far."""
    print(f"\r  replays: {done}", end="", file=sys.stderr, flush=True)


def decode_rate(cfg: SimConfig) -> float:
    """A decode card's output tokens a second, in the config's world."""
    return cfg.world.decode_tok_s if cfg.world is not None else cfg.decode_tok_s

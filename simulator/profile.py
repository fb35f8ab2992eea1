"""A prefill profile of a real engine, for a simulated world that is not the router's formula:
the seconds an engine took to compute ``uncached`` prompt tokens after ``cached`` ones (whose
KV it already held), measured over a grid by ``bench/profile.py``, and the seconds of one pass
over several short prompts together. The simulator interpolates it; ``scaled`` moves it to a
card's rate while keeping its shape (what attention over a longer context costs per token, the
fixed cost of a pass).

Between grid points the time is interpolated linearly along each axis; past the grid it is
extrapolated along the last segment, so a context longer than any measured one keeps costing
what its growth measured. Stored as JSON (never pickle: a profile travels between machines).
"""

from __future__ import annotations

import json
from bisect import bisect_right
from dataclasses import asdict, dataclass, replace
from pathlib import Path


def _along(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended along the end segments."""
    if len(xs) == 1:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class EngineProfile:
    engine: str  # what was measured: the backend, the model, the machine and its threads
    model: str
    machine: str
    cached: tuple[int, ...]  # the grid's axes, ascending
    uncached: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]  # [cached][uncached], the median of the runs
    spread: float  # the runs' relative spread (median |run - median| / median), whole grid
    batch_tokens: int = 0  # the short prompts' length in the batch measurements
    batch: tuple[tuple[int, float], ...] = ()  # (prompts in one pass, seconds of the pass)

    def prefill_s(self, cached: int, uncached: int) -> float:
        """Seconds to compute ``uncached`` tokens after ``cached`` ones."""
        rows = [_along(self.uncached, list(row), uncached) for row in self.seconds]
        return max(0.0, _along(self.cached, rows, cached))

    def batch_s(self, prompts: int) -> float:
        """Seconds of one pass over ``prompts`` short prompts (``batch_tokens`` each)."""
        if not self.batch:
            return prompts * self.prefill_s(0, self.batch_tokens)
        sizes = tuple(n for n, _ in self.batch)
        return max(0.0, _along(sizes, [s for _, s in self.batch], prompts))

    def shared_pass_s(self) -> float:
        """The part of a pass that prompts computed together share (reading the weights, the
        launch): what each prompt past the first saves, from the batch measurements."""
        one = self.batch_s(1)
        saved = [(n * one - s) / (n - 1) for n, s in self.batch if n > 1]
        return max(0.0, sum(saved) / len(saved)) if saved else 0.0

    def tok_s(self, cached: int = 0, uncached: int = 1024) -> float:
        """The rate of computing ``uncached`` tokens after ``cached`` ones."""
        return uncached / self.prefill_s(cached, uncached)

    def scaled(self, tok_s: float, uncached: int = 1024) -> EngineProfile:
        """The same shape at a card's rate: ``tok_s`` for ``uncached`` tokens with nothing
        cached (DeepInfer's 60K tok/s, say)."""
        k = self.tok_s(0, uncached) / tok_s
        return replace(
            self,
            seconds=tuple(tuple(s * k for s in row) for row in self.seconds),
            batch=tuple((n, s * k) for n, s in self.batch),
        )

    def problem(self) -> str:
        """What makes this no profile ("" when nothing does)."""
        for name, axis in (("cached", self.cached), ("uncached", self.uncached)):
            if not axis or list(axis) != sorted(set(axis)):
                return f"the {name} axis is not ascending"
        if len(self.seconds) != len(self.cached):
            return "not a row of seconds per cached length"
        for row in self.seconds:
            if len(row) != len(self.uncached) or not all(s > 0 for s in row):
                return "a row of seconds not one positive figure per uncached length"
        return "" if self.spread >= 0 else "a negative spread"

    def check_integrity(self) -> None:
        assert not (problem := self.problem()), problem

    # -- a file ------------------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> EngineProfile:
        raw = json.loads(text)
        profile = cls(
            engine=str(raw["engine"]),
            model=str(raw["model"]),
            machine=str(raw["machine"]),
            cached=tuple(int(v) for v in raw["cached"]),
            uncached=tuple(int(v) for v in raw["uncached"]),
            seconds=tuple(tuple(float(s) for s in row) for row in raw["seconds"]),
            spread=float(raw["spread"]),
            batch_tokens=int(raw.get("batch_tokens", 0)),
            batch=tuple((int(n), float(s)) for n, s in raw.get("batch", ())),
        )
        if problem := profile.problem():
            raise ValueError(problem)
        return profile

    @classmethod
    def read(cls, path: Path) -> EngineProfile:
        """A profile file; ValueError naming the file when it is not one."""
        try:
            return cls.from_json(Path(path).read_text())
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"{path}: not an engine profile ({err or type(err).__name__})"
            ) from None

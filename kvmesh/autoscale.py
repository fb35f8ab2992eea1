"""`kvmesh up --autoscale MIN:MAX`: the prefill and decode pools follow the routers' plan
(``services/router/observe/capacity.py``, asked over NATS every few seconds): a worker is
started when the plan has asked for more for a while, and one is drained, then stopped,
when it has asked for fewer for longer. A drained worker finishes what it holds and takes
nothing new (the router stops sending at its first draining beat), so no request is lost.

Hysteresis, so a pool does not flap: growing waits for ``up_after`` checks in a row above the
pool and goes straight to the plan's count; shrinking waits for ``down_after`` checks in a
row below it and goes one worker at a time; after any change, ``cooldown_s`` with none.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

ROLES = ("prefill", "decode")


def bounds(text: str) -> tuple[int, int]:
    """``MIN:MAX`` (ValueError saying what is wrong)."""
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if m is None:
        raise ValueError(f"--autoscale {text!r}: give MIN:MAX, like 1:4")
    low, high = int(m.group(1)), int(m.group(2))
    if not 1 <= low <= high <= 64:
        raise ValueError(f"--autoscale {text!r}: 1 <= MIN <= MAX <= 64")
    return low, high


@dataclass
class Hysteresis:
    up_after: int = 2  # checks in a row asking for more before the pool grows
    down_after: int = 6  # checks in a row asking for fewer before it shrinks
    cooldown_s: float = 30.0  # after a change, no other for this long


@dataclass
class Decider:
    """Per role, the size to move its pool to."""

    low: int
    high: int
    hysteresis: Hysteresis = field(default_factory=Hysteresis)
    above: dict[str, int] = field(default_factory=dict)  # checks in a row asking for more
    below: dict[str, int] = field(default_factory=dict)
    changed_at: dict[str, float] = field(default_factory=dict)

    def decide(self, role: str, recommended: int, current: int, now: float) -> int:
        """The pool's size from now: ``current`` unless the plan's ``recommended`` (within the
        bounds) has held long enough, and no change came too lately."""
        h = self.hysteresis
        if current < self.low or current > self.high:  # (outside the bounds: at once)
            return self._changed(role, now, min(self.high, max(self.low, current)))
        want = min(self.high, max(self.low, recommended))
        self.above[role] = self.above.get(role, 0) + 1 if want > current else 0
        self.below[role] = self.below.get(role, 0) + 1 if want < current else 0
        if now - self.changed_at.get(role, float("-inf")) < h.cooldown_s:
            return current
        if self.above[role] >= h.up_after:
            return self._changed(role, now, want)
        if self.below[role] >= h.down_after:
            return self._changed(role, now, current - 1)
        return current

    def _changed(self, role: str, now: float, size: int) -> int:
        self.changed_at[role] = now
        self.above[role] = self.below[role] = 0
        return size

"""The smallest pool that meets a target, found in a few looks: ``kvmesh plan`` over the
simulator (simulator/plan.py) and the router's recommendation over its recent traffic
(services/router/observe/capacity.py) both search this way, and check their targets on the
same percentiles."""

from __future__ import annotations

from collections.abc import Callable


def smallest(
    meets: Callable[[int], bool], figures: Callable[[int], list[float]], most: int
) -> int | None:
    """The smallest pool in [1, most] that ``meets`` (which grows no worse with more
    workers): galloping, then bisecting. None when none does: at the bound, or once doubling
    the pool no longer improves its ``figures`` (the targets are below what any pool can do:
    a long prompt's own compute, say)."""
    low, high, before = 0, 1, None  # low fails (0 workers serve nothing); high is next
    while not meets(high):
        now = figures(high)
        plateau = before is not None and all(
            n >= 0.995 * b for n, b in zip(now, before, strict=True)
        )
        if high >= most or plateau:
            return None
        before, low, high = now, high, min(2 * high, most)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if meets(mid) else (mid, high)
    return high


def enough(meets: Callable[[int], bool], figure: Callable[[int], float], most: int) -> int:
    """The smallest pool in [1, most] that ``meets``; where none does, the smallest whose
    ``figure`` is within 5% of what ``most`` workers reach (where more stop helping)."""
    n = smallest(meets, lambda n: [figure(n)], most)
    if n is None:
        floor = figure(most)
        n = smallest(lambda n: figure(n) <= 1.05 * floor, lambda n: [figure(n)], most)
    return n or most


def percentile(ordered: list[float], p: float) -> float:
    """The ``p``-th percentile of values in ascending order (0 for none)."""
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]

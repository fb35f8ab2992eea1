"""Speculative decoding's parts that need no model: drafting by n-gram lookup, and choosing
how many drafted tokens each sequence verifies in a step.

Drafts: a sequence's last n tokens (longest n first, ``max_n`` down to 1) looked up in its own
prompt and output; the tokens that followed their most recent earlier occurrence are the
draft. Each sequence keeps an index of its n-grams, extended token by token, so drafting costs
a few dict lookups per step.

Lengths (``adaptive``): each candidate position j of a sequence's draft has an estimated
probability that it is accepted given the ones before it: the sequence's own running
acceptance at that position, starting from the engine's (every sequence's) acceptance at that
position for drafts of that match length; the probability that the draft is accepted up to j
is their product. Pairs (sequence, position) are admitted in order of that probability while
the expected tokens per second still rises, against the engine's cost curve: seconds per
forward pass by tokens in it, measured at start and updated online. Admitting nothing is a
valid choice: a step then costs what plain decode costs.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path

from shared.files import write_atomically

log = logging.getLogger(__name__)

MODES = ("off", "fixed", "adaptive")
PRIOR_ACCEPT = 0.5  # a position's acceptance before the engine has seen any
MATCH_BONUS = 0.08  # ... plus this per token of match length beyond 1
PRIOR_WEIGHT = 2.0  # the engine's table starts at that prior, worth this many observations
SEQ_WEIGHT = 6.0  # a sequence starts at the engine's figure, worth this many of its own
MEMORY = 0.999  # the engine's table forgets: each observation weighs this much less per new one


@dataclass
class Draft:
    tokens: list[int]
    match: int  # the n of the n-gram that matched (0: no draft)


@dataclass
class NgramIndex:
    """Where each n-gram (n ≤ max_n) of a sequence's tokens last ended."""

    max_n: int
    seen: int = 0  # tokens indexed
    last: dict[tuple[int, ...], int] = field(default_factory=dict)

    def extend(self, tokens: list[int]) -> None:
        """Index up to all but the last token's n-grams (those are the query)."""
        upto = len(tokens) - 1
        for end in range(max(self.seen, 1), upto + 1):
            for n in range(1, min(self.max_n, end) + 1):
                self.last[tuple(tokens[end - n : end])] = end
        self.seen = max(self.seen, upto + 1)

    def draft(self, tokens: list[int], length: int) -> Draft:
        """The tokens that followed the latest earlier occurrence of the longest suffix."""
        self.extend(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), 0, -1):
            end = self.last.get(tuple(tokens[-n:]))
            if end is not None and end < len(tokens):
                return Draft(tokens[end : end + length], n)
        return Draft([], 0)


class AcceptanceTable:
    """Every sequence's acceptance so far, by the draft's match length and the position in it:
    what a sequence expects before it has shown its own (a long-lived engine learns what its
    traffic copies)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[int, int], tuple[float, float]] = {}  # → (tried, accepted)

    def chance(self, position: int, match: int) -> float:
        tried, hits = self.counts.get((match, position), (0.0, 0.0))
        prior = min(0.95, PRIOR_ACCEPT + MATCH_BONUS * (match - 1))
        return (hits + prior * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def record(self, match: int, verified: int, accepted: int) -> None:
        """A draft of ``verified`` tokens, the first ``accepted`` taken: positions up to the
        first rejected one were tried (those after it were not: a chance given the ones
        before)."""
        for j in range(min(verified, accepted + 1)):
            tried, hits = self.counts.get((match, j), (0.0, 0.0))
            self.counts[(match, j)] = (tried * MEMORY + 1, hits * MEMORY + (j < accepted))


@dataclass
class Acceptance:
    """A sequence's acceptance so far, by draft position."""

    tried: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def record(self, verified: int, accepted: int) -> None:
        """As ``AcceptanceTable.record``: positions after the first rejected one untried."""
        while len(self.tried) < verified:
            self.tried.append(0.0)
            self.accepted.append(0.0)
        for j in range(min(verified, accepted + 1)):
            self.tried[j] += 1
            if j < accepted:
                self.accepted[j] += 1

    def chance(self, position: int, prior: float) -> float:
        """The chance that draft position ``position`` is accepted if all before it were;
        ``prior``: the engine's figure for it."""
        tried = self.tried[position] if position < len(self.tried) else 0.0
        hits = self.accepted[position] if position < len(self.accepted) else 0.0
        return (hits + prior * SEQ_WEIGHT) / (tried + SEQ_WEIGHT)


class CostCurve:
    """Seconds per forward pass by the tokens in it.

    At first: the points measured at start, joined by straight lines (the last segment's
    slope beyond them), times a scale that every pass seen since moves (a moving average of
    seen ÷ measured): a step without drafts corrects the cost of one with them too, so a
    curve that once looked too steep cannot stay wrong. Points, not a fitted line: on a CPU
    the cost is not a line in the tokens (a BLAS kernel's small-M path may make four rows
    cheaper than three, and compute takes over from memory reads at a few rows), and those
    steps are where the best lengths sit. Then, for each size seen a few times, its own
    moving average: a point measured badly at start (a busy machine for a moment) is
    corrected by the passes that use it."""

    SEEN_ALPHA = 0.1
    SEEN_AFTER = 3  # passes of a size before its own average replaces the curve there

    def __init__(self, points: dict[int, float], alpha: float = 0.05) -> None:
        self.alpha = alpha
        self.sizes = sorted(points)
        self.seconds = [points[n] for n in self.sizes]
        self.scale = 1.0
        self.seen: dict[int, tuple[float, int]] = {}  # tokens → (moving average, passes)

    def __call__(self, tokens: int) -> float:
        mean, passes = self.seen.get(tokens, (0.0, 0))
        return mean if passes >= self.SEEN_AFTER else self.scale * self.shape(tokens)

    def shape(self, tokens: int) -> float:
        sizes, seconds = self.sizes, self.seconds
        if tokens <= 0:
            return 0.0
        i = bisect.bisect_left(sizes, tokens)
        if i < len(sizes) and sizes[i] == tokens:
            return seconds[i]
        if i == 0:  # below the first point: in proportion
            return seconds[0] * tokens / sizes[0]
        if i == len(sizes):  # beyond the last: the last segment's slope goes on
            slope = (seconds[-1] - seconds[-2]) / (sizes[-1] - sizes[-2]) if i > 1 else 0.0
            return seconds[-1] + max(slope, 0.0) * (tokens - sizes[-1])
        x0, x1, y0, y1 = sizes[i - 1], sizes[i], seconds[i - 1], seconds[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def observe(self, tokens: int, seconds: float) -> None:
        """A pass of ``tokens`` took ``seconds``."""
        expected = self.shape(tokens)
        if expected <= 0:
            return
        self.scale += self.alpha * (seconds / expected - self.scale)
        mean, passes = self.seen.get(tokens, (seconds, 0))
        self.seen[tokens] = (mean + self.SEEN_ALPHA * (seconds - mean), passes + 1)


COSTS_KEPT_S = 30 * 86400.0  # a cost curve older than this is measured again


def cached_costs(cache_dir: Path, depends: list, measure: Callable[[], CostCurve]) -> CostCurve:
    """A cost curve measured once per machine and what ``depends`` names (the model, ...):
    cached under ``cache_dir`` with the machine (host, CPU, cores, torch build) in its key;
    measured again (``measure``) when the cache is missing, damaged or over a month old."""
    cpu = next((ln for ln in _cpuinfo().splitlines() if ln.startswith("model name")), "cpu")
    what = [*depends, version("torch"), platform.node(), cpu, os.cpu_count()]
    key = hashlib.sha256(json.dumps(what, default=str).encode()).hexdigest()[:16]
    path = cache_dir / f"costs-{key}.json"
    try:
        cached = json.loads(path.read_text())
        if time.time() - cached["measured_at"] < COSTS_KEPT_S:
            log.info("speculation's cost curve from %s (measured before)", path.name)
            return CostCurve({int(n): float(s) for n, s in cached["seconds"].items()})
    except (OSError, ValueError, KeyError):
        pass  # missing or damaged: measured now
    curve = measure()
    seconds = dict(zip(curve.sizes, curve.seconds, strict=True))
    write_atomically(path, json.dumps({"measured_at": time.time(), "seconds": seconds}))
    return curve


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def choose_lengths(candidates: list[tuple[list[float], int]], cost: CostCurve) -> list[int]:
    """How many drafted tokens each sequence verifies. ``candidates``: per sequence, the
    chances of its draft positions (each given the ones before) and ... its draft's length.
    Every sequence decodes at least one token; pairs are admitted in order of the chance
    that the draft is accepted up to them, and of those orders' prefixes the one with the
    most expected tokens per second is taken."""
    pairs = []
    for seq, (chances, _) in enumerate(candidates):
        prefix = 1.0
        for j, c in enumerate(chances):
            prefix *= c
            pairs.append((prefix, seq, j))
    pairs.sort(key=lambda p: -p[0])
    lengths = [0] * len(candidates)
    tokens = len(candidates)
    expected = float(len(candidates))
    best_rate, best = expected / cost(tokens), list(lengths)
    for prefix, seq, j in pairs:
        if j != lengths[seq]:  # (ties may list a later position first: it waits its turn)
            continue
        lengths[seq] += 1
        tokens += 1
        expected += prefix
        rate = expected / cost(tokens)
        if rate > best_rate:
            best_rate, best = rate, list(lengths)
    return best

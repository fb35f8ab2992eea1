"""The pools this router's recent traffic needs: the prefill and decode counts that would
meet the targets (``KVMESH_ROUTER_PLAN_*``), from the requests answered in the last window
and the workers' fitted rates. Served at ``/v1/plan`` and as ``kvmesh_recommended_workers``,
for an autoscaler (``kvmesh up --autoscale``, or KEDA on Kubernetes) to act on.

Prefill: each request's time on a worker is the routing policy's fitted estimate for its
shape (its uncached, loaded and memory tokens: the pool's learned rates); the window's
arrivals are replayed on c workers, each request to the one free first, and a request's TTFT
on c workers is the TTFT it had, less its replayed wait on today's pool, plus its wait on c
(what the model leaves out stays as measured). The smallest c whose TTFTs meet the targets,
searched as ``kvmesh plan`` searches (``simulator/plan.py``).

Decode: a request's time per output token grows with the sequences its worker decodes at
once: TPOT = a + b × (sequences a worker holds), fitted by least squares over the window
(each request's sequences: the pool's decoding while it decoded, over today's decode pool).
The smallest pool whose predicted mean TPOT meets the target.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import REGISTRY
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from services.router.routing.estimate import Rates, Shape
from services.router.settings import PlanSettings
from shared.bus import Bus, subjects
from shared.messages.heartbeat import PlanQuery, PlanReply
from shared.search import enough, percentile

MAX_ANSWERED = 5000  # requests a plan is made from, at most (the latest)
REUSE_S = 2.0  # a plan this recent is served again


@dataclass(frozen=True, slots=True)
class Answered:
    """A request this router answered, as the plan needs it."""

    arrived: float  # time.perf_counter()
    ttft_s: float
    generation_s: float  # first token to last
    uncached: int
    loaded: int  # from the storage tier
    memory: int  # from a worker's memory tier
    output: int

    @classmethod
    def of(cls, arrived: float, ttft_s: float, generation_s: float, usage, memory: int) -> Answered:  # noqa: ANN001
        """From a request's usage (its prompt, cached and completion tokens) and the cached
        tokens that came from a memory tier (the rest came from the storage tier)."""
        cached = usage.cached_tokens
        return cls(
            arrived,
            ttft_s,
            generation_s,
            uncached=max(0, usage.prompt_tokens - cached),
            loaded=cached - memory,
            memory=memory,
            output=usage.completion_tokens,
        )

    @property
    def decode_interval(self) -> tuple[float, float]:
        start = self.arrived + self.ttft_s
        return start, start + self.generation_s


@dataclass(frozen=True)
class PlanTargets:
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_mean_s: float


class Capacity:
    def __init__(
        self,
        window_s: float,
        targets: PlanTargets,
        bounds: tuple[int, int],
        estimate: Callable[[], Rates],
        ready: Callable[[str], int],
    ) -> None:
        """``estimate``: the prefill pool's fitted rates now; ``ready(role)``: its ready
        workers now; ``bounds``: the fewest and most workers of a role recommended."""
        self.window_s = window_s
        self.targets = targets
        self.bounds = bounds
        self.estimate = estimate
        self.ready = ready
        # The window's requests (the latest MAX_ANSWERED of a busier one: a plan stays a few
        # milliseconds), and the last plan with when it was made (``plan`` reuses it briefly:
        # every scrape and every open operator's page asks).
        self.answered: deque[Answered] = deque(maxlen=MAX_ANSWERED)
        self._last: tuple[float, dict] | None = None

    @classmethod
    def configured(
        cls, s: PlanSettings, estimate: Callable[[], Rates], ready: Callable[[str], int]
    ) -> Capacity:
        targets = PlanTargets(s.plan_ttft_p50_s, s.plan_ttft_p99_s, s.plan_tpot_mean_s)
        bounds = (s.plan_min_workers, s.plan_max_workers)
        return cls(s.plan_window_s, targets, bounds, estimate, ready)

    async def serve(self, bus: Bus, router_id: str) -> None:
        """The plan over NATS too (``kvmesh up --autoscale`` asks there)."""

        async def answer(_query: PlanQuery) -> PlanReply:
            plan = self.plan()
            return PlanReply(
                router_id=router_id,
                requests=plan["requests"],
                window_s=plan["window_s"],
                recommended=plan["recommended"],
                current=plan["current"],
            )

        await bus.serve(subjects.ROUTER_PLAN, PlanQuery, answer, subjects.ROUTER_QUEUE)

    def record(self, answered: Answered) -> None:
        self.answered.append(answered)
        self._forget(time.perf_counter())

    def _forget(self, now: float) -> None:
        while self.answered and self.answered[0].arrived < now - self.window_s:
            self.answered.popleft()

    def plan(self, now: float | None = None) -> dict:
        """The recommendation, with what it rests on (the one made less than REUSE_S ago,
        unless ``now`` is given)."""
        if now is None and self._last is not None:
            made_at, plan = self._last
            if time.perf_counter() - made_at < REUSE_S:
                return plan
        plan = self._plan(time.perf_counter() if now is None else now)
        self._last = (time.perf_counter(), plan)
        return plan

    def _plan(self, now: float) -> dict:
        self._forget(now)
        window = list(self.answered)
        prefill_now, decode_now = self.ready("prefill"), self.ready("decode")
        low, high = self.bounds
        out: dict = {
            "window_s": self.window_s,
            "requests": len(window),
            "targets": self.targets.__dict__,
            "current": {"prefill": prefill_now, "decode": decode_now},
        }
        if not window:
            out["recommended"] = {"prefill": low, "decode": low}
            out["why"] = "no requests in the window: the fewest workers"
            return out
        prefill, ttft = self._prefill(window, max(1, prefill_now))
        decode, tpot, fit = self._decode(window, max(1, decode_now))
        out["recommended"] = {"prefill": prefill, "decode": decode}
        out["predicted"] = {**ttft, **tpot}
        out["fitted"] = {**self.estimate().terms(), **fit}
        return out

    # -- prefill -----------------------------------------------------------------------------

    def _prefill(self, window: list[Answered], now_pool: int) -> tuple[int, dict]:
        rates = self.estimate()
        arrivals = [a.arrived for a in window]
        service = [rates.service_s(Shape(a.uncached, a.loaded, a.memory)) for a in window]
        waits_now = replay(arrivals, service, now_pool)
        low, high = self.bounds

        @functools.cache  # (each pool's replay once: the search asks twice)
        def ttfts(c: int) -> list[float]:
            waits = replay(arrivals, service, c)
            return sorted(
                max(0.0, a.ttft_s - now + then)
                for a, now, then in zip(window, waits_now, waits, strict=True)
            )

        def meets(c: int) -> bool:
            t = ttfts(c)
            return (
                percentile(t, 50) <= self.targets.ttft_p50_s
                and percentile(t, 99) <= self.targets.ttft_p99_s
            )

        c = max(low, enough(meets, lambda c: percentile(ttfts(c), 99), high))
        t = ttfts(c)
        return c, {"ttft_p50_s": percentile(t, 50), "ttft_p99_s": percentile(t, 99)}

    # -- decode ------------------------------------------------------------------------------

    def _decode(self, window: list[Answered], now_pool: int) -> tuple[int, dict, dict]:
        low, high = self.bounds
        sequences = concurrency(window)  # per request: the pool's decoding meanwhile
        points = [
            (n / now_pool, a.generation_s / (a.output - 1))
            for a, n in zip(window, sequences, strict=True)
            if a.output > 1 and a.generation_s > 0
        ]
        if not points:
            return low, {}, {}
        a, b = fit_line(points)

        def tpot(d: int) -> float:
            return statistics.fmean(a + b * x * now_pool / d for x, _ in points)

        d = max(low, enough(lambda d: tpot(d) <= self.targets.tpot_mean_s, tpot, high))
        fit = {"tpot_base_s": round(a, 6), "tpot_per_sequence_s": round(b, 6)}
        return d, {"tpot_mean_s": tpot(d)}, fit


def replay(arrivals: list[float], service: list[float], workers: int) -> list[float]:
    """Each request's wait with ``workers`` taking arrivals in order, each to the worker
    free first."""
    free = [arrivals[0] if arrivals else 0.0] * workers
    heapq.heapify(free)
    waits = []
    for at, s in zip(arrivals, service, strict=True):
        start = max(at, heapq.heappop(free))
        waits.append(start - at)
        heapq.heappush(free, start + s)
    return waits


def concurrency(window: list[Answered]) -> list[float]:
    """Per request, the mean number of requests decoding while it decoded (itself among
    them), from the window's decode intervals."""
    starts = sorted(a.decode_interval[0] for a in window)
    ends = sorted(a.decode_interval[1] for a in window)

    def decoding(t: float) -> int:
        return bisect.bisect_right(starts, t) - bisect.bisect_left(ends, t)

    out = []
    for a in window:
        begin, end = a.decode_interval
        probes = [begin + (end - begin) * k / 4 for k in range(5)]
        out.append(max(1.0, statistics.fmean(decoding(t) for t in probes)))
    return out


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b x, with b ≥ 0 (more sequences never speed a worker up)."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in points) / var if var > 0 else 0.0
    b = max(0.0, b)
    return my - b * mx, b


class RecommendationCollector(Collector):
    """``kvmesh_recommended_workers{role}`` at scrape time: the plan's counts, what an
    autoscaler (KEDA, an HPA on external metrics) scales each pool to. One a process (the
    registry is the process's): the router sets its capacity."""

    def __init__(self) -> None:
        self.capacity: Capacity | None = None

    def collect(self):  # noqa: ANN201
        if self.capacity is None:
            return
        plan = self.capacity.plan()
        g = GaugeMetricFamily(
            "kvmesh_recommended_workers",
            "workers of a role the recent traffic needs for the plan's targets (/v1/plan)",
            labels=["role"],
        )
        for role, n in plan["recommended"].items():
            g.add_metric([role], n)
        yield g


RECOMMENDATION = RecommendationCollector()
REGISTRY.register(RECOMMENDATION)

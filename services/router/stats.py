"""The operator's figures, as DeepInfer publishes them: over a rolling 24 hours, tokens per
day, input tokens per request, mean TTFT, generation speed per request, input cache hit ratio,
and requests and tokens per worker-hour; overall and per traffic class. Pure: requests and
worker counts in, figures out.

Kept in one-minute buckets (1,440 for a day), so memory is fixed and old minutes drop off.
While the router has run less than a day, per-day figures are extrapolated from what it has
seen (tokens ÷ seconds observed × 86,400).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DAY_S = 86_400.0
BUCKET_S = 60.0


@dataclass
class Totals:
    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # summed
    speed_requests: int = 0  # requests with a generation speed (two tokens or more)
    speed_tok_s: float = 0.0  # summed

    def add(self, other: Totals) -> None:
        for name in self.__dataclass_fields__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def figures(self, window_s: float, worker_hours: float) -> dict:
        tokens = self.input_tokens + self.output_tokens
        n = self.requests
        return {
            "requests": n,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "tokens_per_day": round(tokens / window_s * DAY_S) if window_s > 0 else 0,
            "input_tokens_per_request": round(self.input_tokens / n, 2) if n else None,
            "ttft_mean_s": round(self.ttft_s / n, 6) if n else None,
            "generation_tok_s_per_request": (
                round(self.speed_tok_s / self.speed_requests, 3) if self.speed_requests else None
            ),
            "input_cache_hit_ratio": (
                round(self.cached_tokens / self.input_tokens, 6) if self.input_tokens else None
            ),
            "requests_per_worker_hour": round(n / worker_hours, 3) if worker_hours else None,
            "tokens_per_worker_hour": round(tokens / worker_hours, 1) if worker_hours else None,
        }


@dataclass
class _Bucket:
    minute: int
    by_class: dict[str, Totals] = field(default_factory=dict)
    worker_s: float = 0.0


class RollingStats:
    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self._buckets: deque[_Bucket] = deque()
        self._last_tick: float | None = None

    def _bucket(self, now: float) -> _Bucket:
        minute = int(now // BUCKET_S)
        if not self._buckets or self._buckets[-1].minute != minute:
            self._buckets.append(_Bucket(minute))
        oldest = minute - int(DAY_S // BUCKET_S) + 1
        while self._buckets[0].minute < oldest:
            self._buckets.popleft()
        return self._buckets[-1]

    def record(
        self,
        now: float,
        traffic_class: str,
        input_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        ttft_s: float,
        generation_s: float,
    ) -> None:
        """A request that was answered: its tokens, its TTFT, and the time from its first
        token to its last (its generation speed is output_tokens - 1 over that)."""
        t = self._bucket(now).by_class.setdefault(traffic_class, Totals())
        t.requests += 1
        t.input_tokens += input_tokens
        t.cached_tokens += cached_tokens
        t.output_tokens += output_tokens
        t.ttft_s += ttft_s
        if output_tokens > 1 and generation_s > 0:
            t.speed_requests += 1
            t.speed_tok_s += (output_tokens - 1) / generation_s

    def tick(self, now: float, workers: int) -> None:
        """``workers`` (prefill and decode) were live since the last tick."""
        if self._last_tick is not None and now > self._last_tick:
            self._bucket(now).worker_s += workers * (now - self._last_tick)
        self._last_tick = now

    def report(self, now: float) -> dict:
        self._bucket(now)  # drop what is older than a day
        window_s = min(DAY_S, max(now - self.started_at, 1e-9))
        worker_hours = sum(b.worker_s for b in self._buckets) / 3600
        overall, by_class = Totals(), {}
        for b in self._buckets:
            for name, t in b.by_class.items():
                overall.add(t)
                by_class.setdefault(name, Totals()).add(t)
        return {
            "window_s": round(window_s, 3),
            "extrapolated": window_s < DAY_S,
            "worker_hours": round(worker_hours, 6),
            "overall": overall.figures(window_s, worker_hours),
            "by_class": {
                name: t.figures(window_s, worker_hours) for name, t in sorted(by_class.items())
            },
        }

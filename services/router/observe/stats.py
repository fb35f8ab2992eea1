"""The operator's figures, as DeepInfer publishes them: over a rolling 24 hours, tokens per
day, input tokens per request, mean TTFT, generation speed per request, input cache hit ratio,
and requests and tokens per worker-hour; overall and per traffic class; and each tenant's
requests, input tokens and cache hit ratio (the TENANTS_PER_MINUTE busiest in a router's
minute by name, the rest together as OTHER_TENANTS, so memory stays fixed). Pure: requests, worker
counts and other routers' minutes in, figures out.

Kept in one-minute buckets (1,440 a day per router), so memory is fixed and old minutes drop
off. Each router counts what it answered; the routers share their minutes on a JetStream stream
(``StatsMinute``, one message per router and minute, the last one kept), so any router reports
the whole mesh, and a router that restarts finds its own earlier minutes there. Workers are
counted by every router alike, so a minute's worker-seconds are the most any router saw, not
their sum. While the mesh has been observed for less than a day, per-day figures are
extrapolated from what was seen (tokens ÷ seconds observed × 86,400).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from shared.messages import Message
from shared.messages.generate import RANKS

DAY_S = 86_400.0
BUCKET_S = 60.0
DAY_MINUTES = int(DAY_S // BUCKET_S)


class Totals(BaseModel):
    """One traffic class's sums over some minutes."""

    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # summed
    speed_requests: int = 0  # requests with a generation speed (two tokens or more)
    speed_tok_s: float = 0.0  # summed
    memory_tokens: int = 0  # of the cached: from a worker's memory tier (the rest: storage)
    ttft_counts: list[int] = Field(default_factory=list)  # by TTFT_EDGES_MS (percentiles)

    def add(self, other: Totals) -> None:
        for name in Totals.model_fields:
            if name == "ttft_counts":
                self.ttft_counts = merged_counts(self.ttft_counts, other.ttft_counts)
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def count_ttft(self, ttft_s: float) -> None:
        i = bisect.bisect_left(TTFT_EDGES_MS, ttft_s * 1e3)
        if len(self.ttft_counts) <= i:
            self.ttft_counts += [0] * (i + 1 - len(self.ttft_counts))
        self.ttft_counts[i] += 1

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


# TTFT buckets (their upper edges, ms): 30% apart from 1 ms to ~4 minutes, so a percentile
# read from them is within 30%; minutes from every router add up bucket by bucket.
TTFT_EDGES_MS = [1.3**i for i in range(48)]


def merged_counts(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)]


def percentile_ms(counts: list[int], p: float) -> float | None:
    """The p-th percentile of counted TTFTs (a bucket's upper edge), None when none."""
    total = sum(counts)
    if not total:
        return None
    rank, seen = p / 100 * total, 0
    for i, n in enumerate(counts):
        seen += n
        if seen >= rank:
            return round(TTFT_EDGES_MS[min(i, len(TTFT_EDGES_MS) - 1)], 3)
    return round(TTFT_EDGES_MS[-1], 3)


class TenantTotals(BaseModel):
    """One tenant's (or one class's: shared/messages/generate.py) sums over some minutes:
    requests answered, their tokens and TTFTs, and requests refused for load (429)."""

    requests: int = 0
    input_tokens: int = 0
    cached_tokens: int = 0
    refused: int = 0
    ttft_counts: list[int] = Field(default_factory=list)  # by TTFT_EDGES_MS (percentiles)

    def add(self, other: TenantTotals) -> None:
        self.requests += other.requests
        self.input_tokens += other.input_tokens
        self.cached_tokens += other.cached_tokens
        self.refused += other.refused
        self.ttft_counts = merged_counts(self.ttft_counts, other.ttft_counts)

    def figures(self) -> dict:
        n = self.input_tokens
        return {
            "requests": self.requests,
            "input_tokens": n,
            "cached_tokens": self.cached_tokens,
            "input_cache_hit_ratio": round(self.cached_tokens / n, 6) if n else None,
            "ttft_p50_ms": percentile_ms(self.ttft_counts, 50),
            "ttft_p99_ms": percentile_ms(self.ttft_counts, 99),
            "refused": self.refused,
        }


TENANTS_PER_MINUTE = 64
TENANTS_REPORTED = 100
OTHER_TENANTS = "(other)"  # tenants past a minute's first TENANTS_PER_MINUTE, together
NO_TENANT = "(none)"  # requests with no tenant (auth off and no tenant header)
UNKNOWN = "(unknown)"  # the class of a request refused before its body was read


def _one(ttft_s: float) -> list[int]:
    """One TTFT as bucket counts."""
    i = bisect.bisect_left(TTFT_EDGES_MS, ttft_s * 1e3)
    return [0] * i + [1]


class StatsMinute(Message):
    """One router's minute, as it shares it (subject: subjects.stats(router_id, minute))."""

    router_id: str
    started_at: float  # when that router process started
    minute: int  # unix time // 60
    worker_s: float = 0.0  # prefill and decode workers live × seconds, as that router saw
    by_class: dict[str, Totals] = Field(default_factory=dict)
    by_tenant: dict[str, TenantTotals] = Field(default_factory=dict)
    by_status: dict[str, int] = Field(default_factory=dict)  # every request's HTTP status
    by_priority: dict[str, TenantTotals] = Field(default_factory=dict)


@dataclass
class _Minute:
    started_at: float
    worker_s: float = 0.0
    by_class: dict[str, Totals] = field(default_factory=dict)
    by_tenant: dict[str, TenantTotals] = field(default_factory=dict)
    by_status: dict[str, int] = field(default_factory=dict)
    by_priority: dict[str, TenantTotals] = field(default_factory=dict)

    def tenant(self, name: str) -> TenantTotals:
        name = name or NO_TENANT
        if name not in self.by_tenant and len(self.by_tenant) >= TENANTS_PER_MINUTE:
            name = OTHER_TENANTS
        return self.by_tenant.setdefault(name, TenantTotals())


class RollingStats:
    def __init__(self, router_id: str, started_at: float) -> None:
        self.router_id = router_id
        self.started_at = started_at
        self._minutes: dict[tuple[str, int], _Minute] = {}  # every router's, this one's too
        self._changed: set[int] = set()  # this router's minutes not yet shared
        self._last_tick: float | None = None

    def _mine(self, now: float) -> _Minute:
        minute = int(now // BUCKET_S)
        m = self._minutes.get((self.router_id, minute))
        if m is None:
            m = self._minutes[(self.router_id, minute)] = _Minute(self.started_at)
            self._drop_before(minute - DAY_MINUTES + 1)
        self._changed.add(minute)
        return m

    def _drop_before(self, oldest: int) -> None:
        for key in [k for k in self._minutes if k[1] < oldest]:
            del self._minutes[key]

    # -- this router's requests and workers ------------------------------------------------

    def record(
        self,
        now: float,
        traffic_class: str,
        input_tokens: int,
        cached_tokens: int,
        output_tokens: int,
        ttft_s: float,
        generation_s: float,
        tenant: str = "",
        memory_tokens: int = 0,
        priority: str = "default",
    ) -> None:
        """A request that was answered: its tokens, its TTFT, and the time from its first
        token to its last (its generation speed is output_tokens - 1 over that)."""
        minute = self._mine(now)
        for mine in (
            minute.tenant(tenant),
            minute.by_priority.setdefault(priority, TenantTotals()),
        ):
            mine.requests += 1
            mine.input_tokens += input_tokens
            mine.cached_tokens += cached_tokens
            mine.ttft_counts = merged_counts(mine.ttft_counts, _one(ttft_s))
        t = minute.by_class.setdefault(traffic_class, Totals())
        t.requests += 1
        t.input_tokens += input_tokens
        t.cached_tokens += cached_tokens
        t.output_tokens += output_tokens
        t.ttft_s += ttft_s
        t.memory_tokens += memory_tokens
        t.count_ttft(ttft_s)
        if output_tokens > 1 and generation_s > 0:
            t.speed_requests += 1
            t.speed_tok_s += (output_tokens - 1) / generation_s

    def status(self, now: float, status: int, priority: str = "", tenant: str = "") -> None:
        """Any request that ended (answered or not), by its HTTP status; one refused for load
        (429) counted against its class and tenant (a class not known yet: refused before its
        body was read, as ``(unknown)``)."""
        minute = self._mine(now)
        counts = minute.by_status
        counts[str(status)] = counts.get(str(status), 0) + 1
        if status == 429:
            minute.by_priority.setdefault(priority or UNKNOWN, TenantTotals()).refused += 1
            minute.tenant(tenant).refused += 1

    def tick(self, now: float, workers: int) -> None:
        """``workers`` (prefill and decode) were live since the last tick."""
        if self._last_tick is not None and now > self._last_tick:
            self._mine(now).worker_s += workers * (now - self._last_tick)
        self._last_tick = now

    # -- sharing -------------------------------------------------------------------------

    def to_share(self) -> list[StatsMinute]:
        """This router's minutes that changed since the last call."""
        out = []
        for minute in sorted(self._changed):
            m = self._minutes.get((self.router_id, minute))
            if m is not None:
                out.append(
                    StatsMinute(
                        router_id=self.router_id,
                        started_at=m.started_at,
                        minute=minute,
                        worker_s=m.worker_s,
                        by_class={k: t.model_copy() for k, t in m.by_class.items()},
                        by_tenant={k: t.model_copy() for k, t in m.by_tenant.items()},
                        by_status=dict(m.by_status),
                        by_priority={k: t.model_copy() for k, t in m.by_priority.items()},
                    )
                )
        self._changed.clear()
        return out

    def unshared(self, minute: int) -> None:
        """Sharing ``minute`` failed: offer it again next time."""
        self._changed.add(minute)

    def merge(self, shared: StatsMinute, replaying: bool) -> None:
        """A minute from the stream: another router's (replacing what it said before), or
        this router's own from before a restart (only while ``replaying`` the stream at
        start: afterwards they are the echoes of what it shares)."""
        key = (shared.router_id, shared.minute)
        if shared.router_id != self.router_id:
            self._minutes[key] = _Minute(
                shared.started_at,
                shared.worker_s,
                shared.by_class,
                shared.by_tenant,
                dict(shared.by_status),
                shared.by_priority,
            )
            return
        if not replaying:
            return
        m = self._minutes.setdefault(key, _Minute(self.started_at))
        m.started_at = min(m.started_at, shared.started_at)
        m.worker_s = max(m.worker_s, shared.worker_s)  # this minute before and after: both
        for name, t in shared.by_class.items():
            m.by_class.setdefault(name, Totals()).add(t)
        for name, tt in shared.by_tenant.items():
            m.tenant(name).add(tt)
        for code, n in shared.by_status.items():
            m.by_status[code] = m.by_status.get(code, 0) + n
        for name, pt in shared.by_priority.items():
            m.by_priority.setdefault(name, TenantTotals()).add(pt)
        self._changed.add(shared.minute)

    # -- the report ----------------------------------------------------------------------

    def series(self, now: float, minutes: int) -> list[dict]:
        """The mesh's last ``minutes`` minute by minute (every router's summed): TTFT p50 and
        p99, hit ratio by tier, tokens/s in and out, requests answered and failed."""
        last = int(now // BUCKET_S)
        first = last - minutes + 1
        totals: dict[int, Totals] = {}
        statuses: dict[int, dict[str, int]] = {}
        for (_, minute), m in self._minutes.items():
            if minute < first:
                continue
            t = totals.setdefault(minute, Totals())
            for one in m.by_class.values():
                t.add(one)
            for code, n in m.by_status.items():
                statuses.setdefault(minute, {})[code] = statuses.get(minute, {}).get(code, 0) + n
        out = []
        for minute in range(first, last + 1):
            t = totals.get(minute, Totals())
            by_status = statuses.get(minute, {})
            n_in = t.input_tokens
            out.append(
                {
                    "minute": minute * int(BUCKET_S),
                    "requests": t.requests,
                    "ttft_p50_ms": percentile_ms(t.ttft_counts, 50),
                    "ttft_p99_ms": percentile_ms(t.ttft_counts, 99),
                    "hit_ratio_memory": round(t.memory_tokens / n_in, 6) if n_in else None,
                    "hit_ratio_storage": (
                        round((t.cached_tokens - t.memory_tokens) / n_in, 6) if n_in else None
                    ),
                    "input_tok_s": round(n_in / BUCKET_S, 3),
                    "output_tok_s": round(t.output_tokens / BUCKET_S, 3),
                    "by_status": by_status,
                    "ok": sum(n for code, n in by_status.items() if code.startswith("2")),
                    "errors": sum(n for code, n in by_status.items() if not code.startswith("2")),
                }
            )
        return out

    def report(self, now: float) -> dict:
        self._drop_before(int(now // BUCKET_S) - DAY_MINUTES + 1)
        started = min([self.started_at, *(m.started_at for m in self._minutes.values())])
        window_s = min(DAY_S, max(now - started, 1e-9))
        worker_s: dict[int, float] = {}
        overall, by_class, by_tenant, by_priority = Totals(), {}, {}, {}
        for (_, minute), m in self._minutes.items():
            worker_s[minute] = max(worker_s.get(minute, 0.0), m.worker_s)
            for name, t in m.by_class.items():
                overall.add(t)
                by_class.setdefault(name, Totals()).add(t)
            for name, tt in m.by_tenant.items():
                by_tenant.setdefault(name, TenantTotals()).add(tt)
            for name, pt in m.by_priority.items():
                by_priority.setdefault(name, TenantTotals()).add(pt)
        busiest = sorted(by_tenant.items(), key=lambda kv: (-kv[1].input_tokens, kv[0]))
        worker_hours = sum(worker_s.values()) / 3600
        return {
            "window_s": round(window_s, 3),
            "extrapolated": window_s < DAY_S,
            "routers": len({r for r, _ in self._minutes} | {self.router_id}),
            "worker_hours": round(worker_hours, 6),
            "overall": overall.figures(window_s, worker_hours),
            "by_class": {
                name: t.figures(window_s, worker_hours) for name, t in sorted(by_class.items())
            },
            # The busiest tenants by input tokens, most first.
            "by_tenant": {name: t.figures() for name, t in busiest[:TENANTS_REPORTED]},
            # Each service class (priority, default, flex, batch), highest first.
            "by_priority": {
                name: by_priority[name].figures()
                for name in sorted(by_priority, key=lambda n: RANKS.get(n, len(RANKS)))
            },
        }

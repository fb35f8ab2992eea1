"""Each request's record: its span (the trace's root, under the client's traceparent if it
sent one), its id on every log line, a log line when it ends, its metrics, its statistics, and
its place in the operator page's list of recent requests. The HTTP middleware and the gRPC
interceptor wrap each generation request in ``RequestRecorder.handling``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind
from prometheus_client import Gauge

from services.router.observe.capacity import Answered, Capacity
from services.router.observe.sharing import StatsSharing
from services.router.observe.stats import RollingStats
from services.router.request.prepare import Prepared
from services.router.routing.estimate import Rates
from services.router.settings import ObserveSettings, PlanSettings
from shared.bus import Bus
from shared.logs import request_scope
from shared.telemetry.metrics import (
    CLASS_TTFT,
    INPUT_TOKENS,
    OUTPUT_TOKENS,
    REQUESTS,
    TPOT,
    TTFT,
)
from shared.telemetry.tracing import REQUEST_ID, current_ids, extract, tracer

log = logging.getLogger(__name__)

RECENT_REQUESTS_BYTES = Gauge(
    "kvmesh_router_recent_requests_bytes",
    "what the operator page's recent requests take (at most KVMESH_ROUTER_RECENT_REQUESTS_BYTES)",
)


@dataclass
class Outcome:
    """What became of a request, filled in by the API layer as it goes."""

    prepared: Prepared | None = None
    status: int = 200


def request_ids(rid: str) -> dict[str, str]:
    """What names a request and its trace in its response (HTTP headers, gRPC metadata);
    called while the request is handled, so its span is the current one."""
    trace_id, _ = current_ids()
    return {"x-request-id": rid, **({"x-kvmesh-trace-id": trace_id} if trace_id else {})}


class RecentRequests:
    """The last requests this router answered, newest first (the operator page's list): at
    most ``size``, within ``max_bytes`` (each by its JSON's length: a routing decision's terms
    over many workers are most of it), the oldest dropped first."""

    def __init__(self, size: int = 200, max_bytes: int = 16 << 20) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._items: deque[tuple[dict, int]] = deque()
        self._by_id: dict[str, dict] = {}
        self.bytes = 0

    def add(self, item: dict) -> None:
        cost = len(json.dumps(item, separators=(",", ":"), default=str))
        self._items.append((item, cost))
        self._by_id[item["id"]] = item
        self.bytes += cost
        while self._items and (len(self._items) > self.size or self.bytes > self.max_bytes):
            oldest, gone = self._items.popleft()
            self.bytes -= gone
            if self._by_id.get(oldest["id"]) is oldest:  # (a client may reuse an id)
                del self._by_id[oldest["id"]]

    def latest(self, n: int) -> list[dict]:
        return [item for item, _ in list(self._items)[-n:][::-1]]

    def get(self, rid: str) -> dict | None:
        return self._by_id.get(rid)


class RequestRecorder:
    def __init__(
        self,
        router_id: str,
        started_at: float,
        plan: PlanSettings,
        estimate: Callable[[], Rates],
        ready: Callable[[str], int],
        recent_bytes: int = 16 << 20,
    ) -> None:
        self.router_id = router_id
        self.stats = RollingStats(router_id, started_at)  # the mesh's figures (stats.py)
        self.recent = RecentRequests(max_bytes=recent_bytes)  # the operator page's list
        RECENT_REQUESTS_BYTES.set_function(lambda: self.recent.bytes)
        # The pools the recent traffic needs (capacity.py): from the prefill pool's fitted
        # rates (``estimate``) and the ready workers of a role (``ready``).
        self.capacity = Capacity.configured(plan, estimate, ready)

    async def start(self, stack: AsyncExitStack, bus: Bus, settings: ObserveSettings) -> None:
        """Share this router's figures with the other routers (sharing.py), and answer the
        plan's queries (capacity.py)."""
        await StatsSharing(bus, self.router_id, self.stats, settings).start(stack)
        await self.capacity.serve(bus, self.router_id)

    @contextlib.contextmanager
    def handling(self, rid: str, endpoint: str, headers: Mapping[str, str]) -> Iterator[Outcome]:
        """One request's span (its parent: the client's traceparent, if any), its request id
        on every log line, and, when it is over, its metrics and statistics."""
        outcome = Outcome()
        with (
            tracer.start_as_current_span(
                endpoint,
                context=extract(headers),
                kind=SpanKind.SERVER,
                attributes={REQUEST_ID: rid, "http.route": endpoint},
            ) as span,
            request_scope(rid),
        ):
            try:
                yield outcome
            except (asyncio.CancelledError, ConnectionResetError):
                # The client went away: before its answer was out (499), or just after the
                # last event, before the stream's end was written (it has the answer).
                p = outcome.prepared
                outcome.status = 200 if p is not None and p.delivered else 499
                raise
            except Exception:
                if outcome.status == 200:  # else the API layer has said (gRPC's abort raises)
                    outcome.status = 500
                raise
            finally:
                self._finished(outcome, endpoint, span, rid)

    def _finished(self, outcome: Outcome, endpoint: str, span: trace.Span, rid: str) -> None:
        REQUESTS.labels(endpoint, str(outcome.status)).inc()
        span.set_attribute("http.response.status_code", outcome.status)
        p = outcome.prepared
        priority = p.job.priority if p is not None else ""
        self.stats.status(time.time(), outcome.status, priority, p.tenant if p else "")
        self._remember(outcome, endpoint, span, rid)
        if p is None:
            log.info("%s %d", endpoint, outcome.status)
            return
        t, u = p.timing, p.answer_usage()  # (every choice's: n, best_of, several prompts)
        log.info(
            "%s %d: %d prompt tokens (%d cached), %d generated, %.1f ms",
            endpoint,
            outcome.status,
            u.prompt_tokens,
            u.cached_tokens,
            u.completion_tokens,
            (time.perf_counter() - p.received_at) * 1e3,
        )
        cached = u.cached_tokens
        span.set_attributes(
            {
                "model": p.job.model,
                "traffic_class": p.job.retention,
                "prompt_tokens": u.prompt_tokens,
                "cached_tokens": cached,
                "completion_tokens": u.completion_tokens,
            }
        )
        if outcome.status != 200 or not t.first_token_at:
            return
        ttft = t.first_token_at - p.received_at
        generation_s = t.last_token_at - t.first_token_at
        span.set_attribute("ttft_ms", round(ttft * 1e3, 3))
        TTFT.observe(ttft)
        if p.usage.completion_tokens > 1:  # (the first choice's pace)
            TPOT.observe(generation_s / (p.usage.completion_tokens - 1))
        memory = min(cached, t.cached_tokens_by_tier.get("memory", 0))  # (the rest: storage)
        INPUT_TOKENS.labels("computed").inc(max(0, u.prompt_tokens - cached))
        INPUT_TOKENS.labels("memory").inc(memory)
        INPUT_TOKENS.labels("storage").inc(cached - memory)
        OUTPUT_TOKENS.inc(u.completion_tokens)
        self.stats.record(
            time.time(),
            p.job.retention,
            u.prompt_tokens,
            cached,
            u.completion_tokens,
            ttft,
            generation_s,
            p.tenant,
            memory,
            p.job.priority,
        )
        CLASS_TTFT.labels(p.job.priority, p.tenant if p.tenant_is_key else "").observe(ttft)
        self.capacity.record(Answered.of(p.received_at, ttft, generation_s, u, memory))

    def _remember(self, outcome: Outcome, endpoint: str, span: trace.Span, rid: str) -> None:
        """The request in the operator page's recent list."""
        ctx = span.get_span_context()
        p = outcome.prepared
        t = p.timing if p is not None else None
        usage = p.answer_usage() if p is not None else None
        ttft = (t.first_token_at - p.received_at) if p is not None and t.first_token_at else None
        self.recent.add(
            {
                "id": rid,
                "trace_id": f"{ctx.trace_id:032x}" if ctx.is_valid else "",
                "time": time.time(),
                "endpoint": endpoint,
                "status": outcome.status,
                "tenant": p.tenant if p is not None else "",
                "model": p.job.model if p is not None else "",
                "prompt_tokens": usage.prompt_tokens if usage is not None else None,
                "cached_tokens": usage.cached_tokens if usage is not None else None,
                "completion_tokens": usage.completion_tokens if usage is not None else None,
                "ttft_ms": round(ttft * 1e3, 3) if ttft is not None else None,
                "route": t.decision(every=True) if t is not None else {},
                "workers": t.workers if t is not None else [],
            }
        )

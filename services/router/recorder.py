"""Each request's record: its span (the trace's root, under the client's traceparent if it
sent one), its id on every log line, a log line when it ends, its metrics and its statistics.
The HTTP and gRPC APIs wrap each request in ``RequestRecorder.handling``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from services.router.generation import Prepared
from services.router.stats import RollingStats
from shared.logs import request_scope
from shared.telemetry.metrics import INPUT_TOKENS, OUTPUT_TOKENS, REQUESTS, TPOT, TTFT
from shared.telemetry.tracing import REQUEST_ID, current_ids, extract, tracer

log = logging.getLogger(__name__)


@dataclass
class Handled:
    """What became of a request, filled in by the API layer as it goes."""

    prepared: Prepared | None = None
    status: int = 200


def request_ids(rid: str) -> dict[str, str]:
    """What names a request and its trace in its response (HTTP headers, gRPC metadata);
    called while the request is handled, so its span is the current one."""
    trace_id, _ = current_ids()
    return {"x-request-id": rid, **({"x-kvmesh-trace-id": trace_id} if trace_id else {})}


class RequestRecorder:
    def __init__(self, stats: RollingStats) -> None:
        self.stats = stats

    @contextlib.contextmanager
    def handling(self, rid: str, endpoint: str, headers: Mapping[str, str]) -> Iterator[Handled]:
        """One request's span (its parent: the client's traceparent, if any), its request id
        on every log line, and, when it is over, its metrics and statistics."""
        handled = Handled()
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
                yield handled
            except asyncio.CancelledError:
                handled.status = 499  # the client went away
                raise
            except Exception:
                if handled.status == 200:  # else the API layer has said (gRPC's abort raises)
                    handled.status = 500
                raise
            finally:
                self._finished(handled, endpoint, span)

    def _finished(self, handled: Handled, endpoint: str, span: trace.Span) -> None:
        REQUESTS.labels(endpoint, str(handled.status)).inc()
        span.set_attribute("http.response.status_code", handled.status)
        p = handled.prepared
        if p is None:
            log.info("%s %d", endpoint, handled.status)
            return
        log.info(
            "%s %d: %d prompt tokens (%d cached), %d generated, %.1f ms",
            endpoint,
            handled.status,
            p.usage.prompt_tokens,
            p.usage.cached_tokens,
            p.usage.completion_tokens,
            (time.perf_counter() - p.received_at) * 1e3,
        )
        t, u = p.timing, p.usage
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
        if handled.status != 200 or not t.first_token_at:
            return
        ttft = t.first_token_at - p.received_at
        generation_s = t.last_token_at - t.first_token_at
        span.set_attribute("ttft_ms", round(ttft * 1e3, 3))
        TTFT.observe(ttft)
        if u.completion_tokens > 1:
            TPOT.observe(generation_s / (u.completion_tokens - 1))
        memory = min(cached, t.cached_tokens_by_tier.get("memory", 0))
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
        )

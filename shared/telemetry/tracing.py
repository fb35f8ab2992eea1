"""One trace per request, across every service it touches.

Each process sets up a TracerProvider at start (``setup_tracing``) with the exporter the
``KVMESH_TRACE_EXPORTER`` setting names: ``file`` (JSON lines under the state dir, one file per
service: what `kvmesh trace` reads; the default), ``otlp-grpc`` / ``otlp-http`` (Jaeger, Tempo;
endpoint from ``KVMESH_TRACE_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``), ``console`` or
``none``. Spans are exported in batches on the SDK's own thread, off the request path.

Context crosses processes as W3C trace context: in NATS message headers (``Bus`` injects it
into every request and extracts it around every handler) and in gRPC metadata (the KV handoff).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from prometheus_client import Gauge

log = logging.getLogger(__name__)

EXPORTERS = ("file", "otlp-grpc", "otlp-http", "console", "none")
REQUEST_ID = "kvmesh.request_id"  # the attribute `kvmesh trace` finds a request by

tracer = trace.get_tracer("kvmesh")


def trace_files(state_dir: Path) -> Path:
    return Path(state_dir) / "traces"


class JsonLinesExporter(SpanExporter):
    """Each finished span as one JSON line in ``path``; past ``max_bytes`` the file moves to
    ``<path>.1`` (the one before is dropped), so a long-running service keeps two files."""

    def __init__(self, path: Path, max_bytes: int = 100 << 20) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = "".join(json.dumps(span_record(s), separators=(",", ":")) + "\n" for s in spans)
        with self._lock:
            try:
                if self.path.exists() and self.path.stat().st_size > self.max_bytes:
                    os.replace(self.path, self.path.with_name(self.path.name + ".1"))
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(lines)
            except OSError as err:
                log.warning("cannot write spans to %s: %s", self.path, err)
                return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    parent = span.parent
    resource = span.resource.attributes if span.resource else {}
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name,
        "kind": span.kind.name.lower(),
        "service": resource.get("service.name", ""),
        "service_id": resource.get("service.instance.id", ""),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "error": span.status.description or "",  # why, for a span that failed
        "attributes": dict(span.attributes or {}),
        **({"events": [[e.name, e.timestamp] for e in span.events]} if span.events else {}),
    }


def mark_span(name: str, span: trace.Span | None = None, at_ns: int | None = None) -> None:
    """A point on a request's path (``span``: its span here; else the current one), as an
    event of that span (``at_ns``: when it happened, if not now): bench/e2e.py's hop table
    reads where each request's time went from them. Nothing is kept for a span not recorded
    (sampled out)."""
    (span or trace.get_current_span()).add_event(name, timestamp=at_ns)


def _exporter(kind: str, endpoint: str, path: Path) -> SpanExporter | None:
    if kind == "file":
        return JsonLinesExporter(path)
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "otlp-grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint or None, insecure=True)
    if kind == "otlp-http":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        url = f"{endpoint.rstrip('/')}/v1/traces" if endpoint else None
        return HttpExporter(endpoint=url)
    return None


# -- each service's recent spans, in memory (the operator page asks for them over NATS) --

MAX_TRACES = 4096  # the most recent traces kept (a request's spans are a few dozen at most)
MAX_TRACES_BYTES = 64 << 20
MAX_SPANS_PER_TRACE = 256
SPAN_BYTES = 400  # a span's own objects (context, times, name, status), about


def span_bytes(span: ReadableSpan) -> int:
    """What a kept span takes, about: its own objects, its attributes' keys and values (a
    string by its length, a sequence by its items'), its events with theirs."""

    def of(value: object) -> int:
        if isinstance(value, str | bytes):
            return 49 + len(value)
        if isinstance(value, list | tuple):
            return 56 + sum(of(v) for v in value)
        return 32

    def attrs(attributes: object) -> int:
        items = attributes.items() if attributes else ()  # type: ignore[union-attr]
        return sum(of(k) + of(v) for k, v in items)

    events = sum(SPAN_BYTES // 4 + attrs(e.attributes) for e in span.events)
    return SPAN_BYTES + attrs(span.attributes) + events


class RecentSpans(SpanProcessor):
    """Each trace's spans here, the most recent ``max_traces`` traces within ``max_bytes``
    (by ``span_bytes``): the oldest trace goes first."""

    def __init__(self, max_traces: int = MAX_TRACES, max_bytes: int = MAX_TRACES_BYTES) -> None:
        self.max_traces = max_traces
        self.max_bytes = max_bytes
        # The spans themselves: their records are made only when a trace is asked for
        # (rarely), not on the path of every span's end.
        self._traces: OrderedDict[int, tuple[list[ReadableSpan], list[int]]] = OrderedDict()
        self.bytes = 0
        self._lock = threading.Lock()  # (spans end on the engine thread too)

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        trace_id = span.get_span_context().trace_id
        size = span_bytes(span)
        with self._lock:
            spans, held = self._traces.setdefault(trace_id, ([], [0]))
            self._traces.move_to_end(trace_id)
            if len(spans) < MAX_SPANS_PER_TRACE:
                spans.append(span)
                held[0] += size
                self.bytes += size
            while self._traces and (
                len(self._traces) > self.max_traces or self.bytes > self.max_bytes
            ):
                _, (_, gone) = self._traces.popitem(last=False)
                self.bytes -= gone[0]

    def __len__(self) -> int:
        return len(self._traces)

    def of(self, trace_id: str) -> list[dict]:
        with self._lock:
            spans = list(self._traces.get(int(trace_id, 16), ((), []))[0])
        return [span_record(s) for s in spans]

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


RECENT = RecentSpans()  # the process's (setup_tracing adds it to the provider)
RECENT_TRACES = Gauge(
    "kvmesh_recent_traces",
    "traces this process keeps for the operator page (at most KVMESH_RECENT_TRACES)",
)
RECENT_TRACES.set_function(lambda: len(RECENT))
RECENT_TRACES_BYTES = Gauge(
    "kvmesh_recent_traces_bytes",
    "what those traces take, by their spans' own count (at most KVMESH_RECENT_TRACES_BYTES)",
)
RECENT_TRACES_BYTES.set_function(lambda: RECENT.bytes)


EXPORT_DELAY_MS = 500


def setup_tracing(
    role: str,
    service_id: str,
    exporter: str,
    endpoint: str,
    sample_ratio: float,
    state_dir: Path,
    recent_traces: int = MAX_TRACES,
    recent_traces_bytes: int = MAX_TRACES_BYTES,
) -> TracerProvider:
    """The process's tracer provider, exporting as ``exporter`` says (see the module doc).
    With ``none``, spans are not even recorded (the API's no-op tracer; context still flows
    through, so the services downstream see the caller's trace). ``recent_traces`` and
    ``recent_traces_bytes``: how many the operator's page can show, in how much (``RECENT``)."""
    if exporter == "none":
        return TracerProvider()  # never installed: only its shutdown is called
    RECENT.max_traces, RECENT.max_bytes = recent_traces, recent_traces_bytes
    resource = Resource.create(
        {"service.name": f"kvmesh-{role}", "service.instance.id": service_id}
    )
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
    )
    provider.add_span_processor(RECENT)  # the operator page's view of recent requests
    out = _exporter(exporter, endpoint, trace_files(state_dir) / f"{service_id}.jsonl")
    if out is not None:
        # Exported within half a second of its end: `kvmesh trace` and the operator's page
        # show a request right after it (the processor's default waits 5 s).
        provider.add_span_processor(BatchSpanProcessor(out, schedule_delay_millis=EXPORT_DELAY_MS))
    trace.set_tracer_provider(provider)
    return provider


# -- context across processes ------------------------------------------------------------------


def inject(
    headers: dict[str, str] | None = None, context: otel_context.Context | None = None
) -> dict[str, str]:
    """``headers`` with the trace context (the current one by default) added: traceparent,
    tracestate."""
    headers = dict(headers or {})
    propagate.inject(headers, context=context)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))


@contextmanager
def attached(ctx: otel_context.Context) -> Iterator[None]:
    """Run the block with ``ctx`` as the current trace context."""
    token = otel_context.attach(ctx)
    try:
        yield
    finally:
        otel_context.detach(token)


def current_ids() -> tuple[str, str]:
    """(trace id, span id) of the current span, hex; empty when there is none."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return "", ""
    return f"{ctx.trace_id:032x}", f"{ctx.span_id:016x}"

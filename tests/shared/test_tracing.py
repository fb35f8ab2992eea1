"""Span exporters: OTLP over gRPC and over HTTP reach a collector (a real OTLP receiver
served here), the file exporter writes what `kvmesh trace` reads, and trace context survives
a trip through message headers."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from tests.procs import REPO, free_port

# A process that sets up tracing as a service does, makes one span with a child, and exits.
EMIT = """
import sys
from pathlib import Path
from shared.telemetry.tracing import setup_tracing, tracer
provider = setup_tracing("router", "router-t", sys.argv[1], sys.argv[2], 1.0, Path(sys.argv[3]))
with tracer.start_as_current_span("outer", attributes={"kvmesh.request_id": "r-1"}):
    with tracer.start_as_current_span("inner"):
        pass
provider.shutdown()
"""


def emit(exporter: str, endpoint: str, state_dir: Path) -> None:
    subprocess.run(
        [sys.executable, "-c", EMIT, exporter, endpoint, str(state_dir)],
        cwd=REPO,
        check=True,
        timeout=60,
    )


def span_names(request: trace_service_pb2.ExportTraceServiceRequest) -> list[tuple[str, str]]:
    return [
        (
            span.name,
            next(a.value.string_value for a in rs.resource.attributes if a.key == "service.name"),
        )
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]


def test_otlp_grpc_reaches_a_collector(tmp_path: Path) -> None:
    got: list[trace_service_pb2.ExportTraceServiceRequest] = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: ANN001, ANN201, N802
            got.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        emit("otlp-grpc", f"http://127.0.0.1:{port}", tmp_path)
    finally:
        server.stop(0)
    names = [n for r in got for n in span_names(r)]
    assert sorted(names) == [("inner", "kvmesh-router"), ("outer", "kvmesh-router")]


def test_otlp_http_reaches_a_collector(tmp_path: Path) -> None:
    got: list[tuple[str, trace_service_pb2.ExportTraceServiceRequest]] = []

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append((self.path, trace_service_pb2.ExportTraceServiceRequest.FromString(body)))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", free_port()), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        emit("otlp-http", f"http://127.0.0.1:{server.server_port}", tmp_path)
    finally:
        server.shutdown()
    assert {path for path, _ in got} == {"/v1/traces"}
    names = sorted(n for _, r in got for n in span_names(r))
    assert names == [("inner", "kvmesh-router"), ("outer", "kvmesh-router")]


@pytest.mark.parametrize("exporter", ["file", "none"])
def test_the_file_exporter_writes_spans_and_none_writes_nothing(
    tmp_path: Path, exporter: str
) -> None:
    emit(exporter, "", tmp_path)
    path = tmp_path / "traces" / "router-t.jsonl"
    if exporter == "none":
        assert not path.exists()
        return
    spans = {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}
    assert spans["inner"]["parent_id"] == spans["outer"]["span_id"]
    assert spans["outer"]["attributes"]["kvmesh.request_id"] == "r-1"
    assert spans["outer"]["service"] == "kvmesh-router"


def test_recent_spans_keep_the_last_so_many_traces() -> None:
    """KVMESH_RECENT_TRACES: the operator page's traces are the most recent ones only."""
    from opentelemetry.sdk.trace import TracerProvider

    from shared.telemetry.tracing import RecentSpans

    recent = RecentSpans(max_traces=3)
    provider = TracerProvider()
    provider.add_span_processor(recent)
    ids = []
    for _ in range(5):
        with provider.get_tracer("t").start_as_current_span("request") as span:
            ids.append(format(span.get_span_context().trace_id, "032x"))
    assert len(recent) == 3
    assert recent.of(ids[0]) == [] and len(recent.of(ids[-1])) == 1


def test_recent_spans_stay_within_their_bytes_and_free_what_they_drop() -> None:
    """KVMESH_RECENT_TRACES_BYTES: traces with large attributes (a routing decision's terms
    on many workers) are dropped, oldest first, to stay within the bytes, whatever the count."""
    from opentelemetry.sdk.trace import TracerProvider

    from shared.telemetry.tracing import RecentSpans

    recent = RecentSpans(max_traces=1000, max_bytes=20_000)
    provider = TracerProvider()
    provider.add_span_processor(recent)
    ids = []
    for i in range(50):
        with provider.get_tracer("t").start_as_current_span("request") as span:
            span.set_attribute("route.terms", [f"worker-{w}: 0.123 s" for w in range(64)])
            span.add_event("routed", {"chosen": f"worker-{i}"})
            ids.append(format(span.get_span_context().trace_id, "032x"))
    assert 0 < recent.bytes <= 20_000
    assert 1 < len(recent) < 50  # (each trace a few KB: some kept, the oldest dropped)
    assert recent.of(ids[0]) == [] and len(recent.of(ids[-1])) == 1
    kept = len(recent)
    for _ in range(50):  # small traces from now on: the count grows back, the bytes stay
        with provider.get_tracer("t").start_as_current_span("small"):
            pass
    assert len(recent) > kept and recent.bytes <= 20_000

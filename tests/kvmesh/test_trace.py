"""`kvmesh trace`: spans from several files become one tree in time order."""

from __future__ import annotations

import json
from pathlib import Path

from kvmesh.trace import read_spans, request_trace, waterfall


def span(name: str, sid: str, parent: str | None, start_ms: float, ms: float, **attrs) -> dict:
    return {
        "trace_id": "t" * 32,
        "span_id": sid,
        "parent_id": parent,
        "name": name,
        "service": "kvmesh-" + attrs.pop("service", "router"),
        "start_ns": int(start_ms * 1e6),
        "end_ns": int((start_ms + ms) * 1e6),
        "status": attrs.pop("status", "unset"),
        "attributes": attrs,
    }


def test_spans_from_every_file_make_one_waterfall(tmp_path: Path) -> None:
    spans = {
        "router-0.jsonl": [
            span("/v1/chat/completions", "a", "client", 0, 100, **{"kvmesh.request_id": "r1"}),
            span("route", "b", "a", 2, 1, chosen="prefill-0"),
        ],
        "prefill-0.jsonl": [
            span("prefill", "c", "b", 5, 40, service="prefill"),
            span("prefill.compute", "d", "c", 10, 30, service="prefill", tokens_computed=300),
        ],
        "other.jsonl": [{**span("unrelated", "z", None, 0, 1), "trace_id": "u" * 32}],
    }
    for name, rows in spans.items():
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"torn')
    found = request_trace(read_spans(tmp_path), "r1")
    assert sorted(s["name"] for s in found) == sorted(
        ["/v1/chat/completions", "route", "prefill", "prefill.compute"]
    )
    lines = waterfall(found).splitlines()
    assert lines[0].startswith(f"trace {'t' * 32}: 4 spans, 100.0 ms")
    body = lines[2:]
    order = [
        next(w for w in ("/v1/chat", "route", "prefill.compute", "prefill") if w in line)
        for line in body
    ]
    assert order == ["/v1/chat", "route", "prefill", "prefill.compute"]  # children under parents
    assert "  prefill.compute" in body[3] and "tokens_computed=300" in body[3]
    assert body[3].split()[0] == "10.0" and body[3].split()[1] == "30.0"

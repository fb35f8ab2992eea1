"""`kvmesh trace REQUEST_ID`: one request's spans from every service, as a waterfall.

Reads the JSON-lines span files the services write under ``<state_dir>/traces`` (the default
exporter), finds the spans of the request's trace, and prints them as a tree in time order:
start offset, duration, a bar on the request's time line, service, span and its key figures.
Request debugging without Jaeger.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from shared.settings import CommonSettings, SettingsError, load_settings
from shared.telemetry.tracing import EXPORT_DELAY_MS, REQUEST_ID, trace_files

BAR = 32
SKIPPED = {REQUEST_ID, "http.route", "worker"}


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("trace", help="print one request's spans as a waterfall")
    p.add_argument("request_id", help="the request's id (its x-request-id)")
    p.add_argument("--dir", type=Path, help="span files (default: <KVMESH_STATE_DIR>/traces)")
    p.add_argument(
        "--wait",
        type=float,
        default=5.0,
        help="seconds to wait for its spans to be written (each service writes them within "
        "half a second of their end)",
    )
    p.set_defaults(run=run)


def read_spans(directory: Path) -> list[dict]:
    spans = []
    for path in sorted(directory.glob("*.jsonl*")):
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    spans.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line being written
    return spans


def request_trace(spans: list[dict], request_id: str) -> list[dict]:
    """Every span of the traces whose spans name ``request_id``."""
    traces = {s["trace_id"] for s in spans if s["attributes"].get(REQUEST_ID) == request_id}
    return [s for s in spans if s["trace_id"] in traces]


def _attrs(span: dict, width: int = 90) -> str:
    parts = []
    for key, value in span["attributes"].items():
        if key in SKIPPED or value in ("", None):
            continue
        if isinstance(value, float):
            value = f"{value:g}"
        elif isinstance(value, str) and len(value) > 40:
            value = value[:37] + "..."
        parts.append(f"{key}={value}")
    if span.get("status") == "error":
        why = span.get("error", "")
        parts.insert(0, f"ERROR({why[:60]})" if why else "ERROR")
    text = " ".join(parts)
    return text if len(text) <= width else text[: width - 3] + "..."


def waterfall(spans: list[dict]) -> str:
    """The spans as a tree (children under their parent, in start order) with timings."""
    if not spans:
        return ""
    ids = {s["span_id"] for s in spans}
    children: dict[str | None, list[dict]] = defaultdict(list)
    for s in spans:  # a parent outside these spans (the client's) makes a root
        children[s["parent_id"] if s["parent_id"] in ids else None].append(s)
    for group in children.values():
        group.sort(key=lambda s: s["start_ns"])
    t0 = min(s["start_ns"] for s in spans)
    total = max(s["end_ns"] for s in spans) - t0 or 1
    lines = [
        f"trace {spans[0]['trace_id']}: {len(spans)} spans, {total / 1e6:.1f} ms",
        f"{'start ms':>9} {'took ms':>8}  {'':{BAR}}  {'service':<10} span",
    ]

    def walk(span: dict, depth: int) -> None:
        start, took = span["start_ns"] - t0, span["end_ns"] - span["start_ns"]
        a = int(start / total * BAR)
        b = max(a + 1, int((start + took) / total * BAR))
        bar = " " * a + "█" * (b - a) + " " * (BAR - b)
        service = span["service"].removeprefix("kvmesh-")
        name = "  " * depth + span["name"]
        lines.append(
            f"{start / 1e6:9.1f} {took / 1e6:8.1f}  {bar}  {service:<10} {name:<24} {_attrs(span)}"
        )
        for child in children.get(span["span_id"], []):
            walk(child, depth + 1)

    for root in children[None]:
        walk(root, 0)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.dir is None:
        try:
            args.dir = trace_files(load_settings(CommonSettings).state_dir)
        except SettingsError as err:
            print(f"kvmesh trace: {err}", file=sys.stderr)
            return 2
    deadline = time.monotonic() + args.wait
    spans: list = []
    while True:
        found = request_trace(read_spans(args.dir), args.request_id) if args.dir.is_dir() else []
        # Once some are in, the other services' land within their export delay: until no
        # more come for that long.
        if found and len(found) == len(spans):
            break
        spans = found
        if time.monotonic() >= deadline:
            break
        time.sleep(EXPORT_DELAY_MS / 1e3 + 0.1 if spans else 0.25)
    if not spans:
        print(
            f"kvmesh trace: no spans of request {args.request_id} in {args.dir} within "
            f"{args.wait:g} s (--wait waits longer; is tracing on, KVMESH_TRACE_EXPORTER?)",
            file=sys.stderr,
        )
        return 1
    print(waterfall(spans))
    return 0

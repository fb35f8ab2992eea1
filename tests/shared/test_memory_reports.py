"""A memory report names the source line that holds what grew since the last report, and the
holder of the objects that grew; what a request leaves behind in pydantic's caches."""

from __future__ import annotations

import gc
import json
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

from services.router.formats.openai import ChatRequest
from services.router.formats.wire import parse_body
from shared.messages.generate import Cancel
from shared.telemetry.memory import MemoryReports


def test_a_report_names_the_line_that_grew(tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        reports = MemoryReports(tmp_path / "memory" / "router-0.txt")
        reports.write()
        line = sys._getframe().f_lineno + 1
        held = [bytes(1000) + bytes([i % 256]) for i in range(20_000)]  # ~20 MB, this line
        reports.write()
    finally:
        tracemalloc.stop()
    assert len(held) == 20_000
    second = (tmp_path / "memory" / "router-0.txt").read_text().split("\n# ")[-1]
    top = second.splitlines()[1]  # (after the heading)
    kib, growth, where = top.split()[0], top.split()[2], top.split()[-1]
    assert where.endswith(f"test_memory_reports.py:{line}"), second
    assert float(growth) > 18_000 and float(kib) > 18_000, top
    # The heading says what glibc's heap holds in use: those objects (over 512 bytes each,
    # Python asks malloc for them) among it.
    heading = second.splitlines()[0]
    assert "C heap" in heading, heading
    in_use = float(heading.split("C heap: ")[1].split(" MiB in use")[0])
    assert in_use > 18, heading


def test_a_report_names_what_cycles_hold_until_the_collector_runs(tmp_path: Path) -> None:
    class Turn:  # a request's state that refers to itself (a callback, a traceback)
        def __getattr__(self, name: str) -> str:  # any name answered, as pyparsing's results do
            return ""

    for _ in range(3):
        turn = Turn()
        turn.me, turn.kv = turn, bytes(4 << 20)  # type: ignore[attr-defined]
    del turn
    tracemalloc.start()
    try:
        MemoryReports(tmp_path / "memory" / "decode-0.txt").write()
    finally:
        tracemalloc.stop()
    report = (tmp_path / "memory" / "decode-0.txt").read_text()
    heading = next(line for line in report.splitlines() if line.startswith("## garbage"))
    assert float(heading.split(", ")[-1].removesuffix(" MiB")) >= 12, heading
    by_type = report.split(heading)[1].splitlines()[1:4]
    assert by_type[0].split()[-1] == "bytes" and int(by_type[0].split()[2]) >= 3, by_type
    assert any(line.split()[-1].endswith("Turn") for line in by_type), by_type


class Request:  # what a service would keep by mistake, one per request
    pass


KEPT: dict[str, list[Request]] = {"answered": []}


def test_a_report_names_the_type_that_grew_in_number_and_what_holds_it(tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        reports = MemoryReports(tmp_path / "memory" / "router-0.txt")
        reports.write()
        reports.write()  # (what the first report's own work made, counted before this one)
        KEPT["answered"].extend(Request() for _ in range(5_000))
        reports.write()
    finally:
        tracemalloc.stop()
        KEPT["answered"].clear()
    second = (tmp_path / "memory" / "router-0.txt").read_text().split("\n# ")[-1]
    heading = "## live objects that grew in number since the last report, by type"
    grown = second.split(heading)[1].strip().splitlines()
    line = next(line for line in grown if line.split()[2] == "Request")
    assert int(line.split()[0]) == 5_000, line
    assert line.split("held by ")[1] == "list of 5000 <- dict['answered'] <- dict['KEPT']", line


def held_after(parse: Callable[[int], object], n: int = 20_000) -> int:
    """Bytes still allocated after ``parse(i)`` for i < n, each result dropped."""
    for i in range(100):
        parse(-i)  # (warm: what the first calls make once)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(n):
            parse(i)
        gc.collect()
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename"))


def test_request_bodies_and_wire_messages_parsed_leave_no_strings_behind() -> None:
    """pydantic caches the strings it parses from JSON, process-wide: each request's texts,
    ids and hashes would fill that cache (a soak's steady growth, its holder in no object)."""

    def body(i: int) -> object:
        sent = {"model": "tiny", "messages": [{"role": "user", "content": f"question {i}"}]}
        return parse_body(json.dumps(sent).encode(), ChatRequest)

    def message(i: int) -> object:
        return Cancel.from_bytes(f'{{"request_id": "{i:032x}"}}'.encode())

    assert held_after(body) < 64 << 10
    assert held_after(message) < 64 << 10

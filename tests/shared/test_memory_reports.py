"""A memory report names the source line that holds what grew since the last report."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from shared.telemetry.memory import MemoryReports


def test_a_report_names_the_line_that_grew(tmp_path: Path) -> None:
    tracemalloc.start()
    try:
        reports = MemoryReports(tmp_path / "memory" / "router-0.txt")
        reports.write()
        held = [bytes(1000) + bytes([i % 256]) for i in range(20_000)]  # ~20 MB, this line
        reports.write()
    finally:
        tracemalloc.stop()
    assert len(held) == 20_000
    second = (tmp_path / "memory" / "router-0.txt").read_text().split("\n# ")[-1]
    top = second.splitlines()[1]  # (after the heading)
    kib, growth, where = top.split()[0], top.split()[2], top.split()[-1]
    assert where.endswith("test_memory_reports.py:16"), second
    assert float(growth) > 18_000 and float(kib) > 18_000, top
    # The heading says what glibc's heap holds in use: those objects (over 512 bytes each,
    # Python asks malloc for them) among it.
    heading = second.splitlines()[0]
    assert "C heap" in heading, heading
    in_use = float(heading.split("C heap: ")[1].split(" MiB in use")[0])
    assert in_use > 18, heading

"""Where a process's memory goes. A service started with ``PYTHONTRACEMALLOC=<frames>`` in its
environment writes, on SIGUSR2, the source lines holding the most live memory and how much each
grew since its previous report, to ``<state dir>/memory/<service id>.txt`` (each report
appended, headed by the time, the total traced and the C heap's figures: what native code
holds beyond Python's objects, and what the heap holds free: ``shared/telemetry/heap.py``).
Tracing slows the process: for a diagnosis (a soak's growth: ``bench/soak.py
--trace-memory``), not for serving. Off, nothing is installed."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import tracemalloc
from pathlib import Path

from shared.telemetry.heap import figures

log = logging.getLogger(__name__)

TOP = 25  # lines in a report
IGNORED = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<unknown>"))


class MemoryReports:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._last: tracemalloc.Snapshot | None = None

    def write(self) -> None:
        snapshot = tracemalloc.take_snapshot().filter_traces(IGNORED)
        if self._last is None:
            stats = snapshot.statistics("lineno")
            total = sum(s.size for s in stats)
            lines = [f"{s.size / 1024:10.0f} KiB  {_where(s.traceback)}" for s in stats[:TOP]]
        else:
            diffs = snapshot.compare_to(self._last, "lineno")
            total = sum(d.size for d in diffs)
            diffs.sort(key=lambda d: d.size_diff, reverse=True)
            lines = [
                f"{d.size / 1024:10.0f} KiB {d.size_diff / 1024:+10.0f} KiB  {_where(d.traceback)}"
                for d in diffs[:TOP]
            ]
        self._last = snapshot
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a") as out:
            out.write(
                f"# {time.strftime('%Y-%m-%dT%H:%M:%S')} traced {total / 2**20:.1f} MiB"
                f"{'' if (heap := figures()) is None else f'; {heap}'}\n"
            )
            out.write("\n".join(lines) + "\n\n")
        log.info("memory report written to %s", self.path)


def _where(traceback: tracemalloc.Traceback) -> str:
    frame = traceback[0]
    return f"{frame.filename}:{frame.lineno}"


def report_memory_on_signal(loop: asyncio.AbstractEventLoop, state_dir: Path, sid: str) -> None:
    """SIGUSR2 writes a report, where tracemalloc traces this process."""
    if not tracemalloc.is_tracing():
        return
    reports = MemoryReports(state_dir / "memory" / f"{sid}.txt")
    loop.add_signal_handler(signal.SIGUSR2, reports.write)

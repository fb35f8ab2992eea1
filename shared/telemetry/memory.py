"""Where a process's memory goes. A service started with ``PYTHONTRACEMALLOC=<frames>`` in its
environment writes, on SIGUSR2, the source lines holding the most live memory and how much each
grew since its previous report, to ``<state dir>/memory/<service id>.txt`` (each report
appended, headed by the time, the total traced and the C heap's figures: what native code
holds beyond Python's objects, and what the heap holds free: ``shared/telemetry/heap.py``).
Tracing slows the process: for a diagnosis (a soak's growth: ``bench/soak.py
--trace-memory``), not for serving. Off, nothing is installed."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import sys
import time
import tracemalloc
import types
from collections import Counter, deque
from pathlib import Path

from shared.telemetry.heap import figures

log = logging.getLogger(__name__)

TOP = 25  # lines in a report
GROWN = 8  # types whose live objects grew, each with what holds its newest
HOLDER_DEPTH = 10
IGNORED = (tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<unknown>"))


class MemoryReports:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._last: tracemalloc.Snapshot | None = None
        self._counts: Counter[type] | None = None

    def write(self) -> None:
        garbage = garbage_lines()
        grown = self._grown_lines()
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
            out.write("\n".join(lines) + "\n")
            out.write("\n".join(garbage + grown) + "\n\n")
        log.info("memory report written to %s", self.path)

    def _grown_lines(self) -> list[str]:
        """The types whose live objects grew most in number since the last report, each with
        what holds its newest one (tracemalloc names where an object was made, not what keeps
        it)."""
        objects = gc.get_objects()
        counts: Counter[type] = Counter(map(type, objects))
        last, self._counts = self._counts, counts
        if last is None:
            return []
        grown = (counts - last).most_common(GROWN)
        newest: dict[type, object] = {kind: None for kind, _ in grown}
        for obj in reversed(objects):  # (the youngest generation last)
            if newest.get(type(obj), 0) is None:
                newest[type(obj)] = obj
        targets = list(newest.values())
        newest.clear()  # (else it would be their holder)
        chains = _holders(targets, objects)
        return [
            "## live objects that grew in number since the last report, by type",
            *(
                f"{n:+10d} {counts[kind]:8d}  {_type_name(obj)}  held by {chain}"
                for (kind, n), obj, chain in zip(grown, targets, chains, strict=True)
            ),
        ]


def _holders(targets: list[object], objects: list) -> list[str]:
    """For each of ``targets``, the chain of objects that keeps it alive, nearest first, up to
    a module's names, a class or HOLDER_DEPTH steps (frames and this report's own lists
    skipped): one scan of the heap a step, for every chain at once."""
    chains: list[list[str]] = [[] for _ in targets]
    current: list[object | None] = list(targets)  # None: the chain has ended
    seen = {id(objects), id(targets), id(current)}
    for _ in range(HOLDER_DEPTH):
        live = [obj for obj in current if obj is not None]
        if not live:
            break
        seen.update(id(obj) for obj in live)
        referrers = gc.get_referrers(*live)
        seen.update((id(live), id(referrers)))
        for i, obj in enumerate(current):
            step = None if obj is None else _holder(obj, referrers, seen)
            if step is not None:
                holder, name = step
                chains[i].append(name)
                # A class, or a module's names, ends the chain.
                ends = isinstance(holder, type) or (
                    isinstance(holder, dict) and "__name__" in holder
                )
                current[i] = None if ends else holder
            else:
                current[i] = None
            step = holder = None  # (a holder kept here would be the next step's referrer)
        del live, referrers
    return [" <- ".join(chain) or "nothing found" for chain in chains]


def _holder(obj: object, referrers: list, seen: set[int]) -> tuple[object, str] | None:
    """What among ``referrers`` holds ``obj``, and its name on a chain. (Loops, not
    comprehensions: on Python 3.11 a comprehension's cell would hold obj.)"""
    for holder in referrers:
        if id(holder) in seen or isinstance(holder, types.FrameType):
            continue
        for ref in gc.get_referents(holder):
            if ref is obj:
                break
        else:
            continue
        break
    else:
        return None
    if isinstance(holder, dict):
        for k, v in holder.items():
            if v is obj:
                return holder, f"dict[{repr(k)[:40]}]"
        return holder, f"dict of {len(holder)}"
    if isinstance(holder, list | tuple | set | deque):
        return holder, f"{_type_name(holder)} of {len(holder)}"
    return holder, _type_name(holder)


def garbage_lines() -> list[str]:
    """What a full collection finds unreachable but for cycles, by type: count and bytes (a
    tensor's and a buffer's own, past their object), and the buffers and strings they refer
    to. Then freed. Such garbage waits for the collector: its young pass runs every 50,000
    allocations in a service (minutes, in a quiet one), its older ones rarer still. An async
    generator left suspended in a cycle is not listed: the collector hands it to the event
    loop to be closed, and what it holds goes once that ran."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = list(gc.garbage)
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
    # With the buffers and strings they refer to: those are not the collector's (they refer
    # to nothing), so not among the cycles' objects themselves.
    held = {id(obj): obj for obj in found}
    for obj in found:
        for ref in gc.get_referents(obj):
            if not gc.is_tracked(ref):
                held.setdefault(id(ref), ref)
    by_type: dict[str, list[int]] = {}
    for obj in held.values():
        entry = by_type.setdefault(_type_name(obj), [0, 0])
        entry[0] += 1
        entry[1] += _bytes_of(obj)
    del found, held
    gc.collect()
    total = sum(b for _, b in by_type.values())
    top = sorted(by_type.items(), key=lambda kv: -kv[1][1])[:TOP]
    return [
        f"## garbage in cycles, and what it holds: {sum(n for n, _ in by_type.values())} objects, "
        f"{total / 2**20:.1f} MiB",
        *(f"{b / 1024:10.0f} KiB {n:8d}  {name}" for name, (n, b) in top),
    ]


def _type_name(obj: object) -> str:
    name = type(obj).__qualname__
    # A coroutine's or a frame's code says which. Asked by type: some objects answer any
    # attribute (pyparsing's results give "" for a name they do not hold).
    code = (
        obj.cr_code
        if isinstance(obj, types.CoroutineType)
        else obj.f_code
        if isinstance(obj, types.FrameType)
        else None
    )
    if code is not None:
        name += f" {code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}"
    return name


def _bytes_of(obj: object) -> int:
    size = sys.getsizeof(obj, 0)
    if hasattr(type(obj), "untyped_storage"):  # a tensor: its storage, allocated apart
        with contextlib.suppress(Exception):
            size += obj.untyped_storage().nbytes()  # type: ignore[attr-defined]
    return size


def _where(traceback: tracemalloc.Traceback) -> str:
    frame = traceback[0]
    return f"{frame.filename}:{frame.lineno}"


def report_memory_on_signal(loop: asyncio.AbstractEventLoop, state_dir: Path, sid: str) -> None:
    """SIGUSR2 writes a report, where tracemalloc traces this process."""
    if not tracemalloc.is_tracing():
        return
    reports = MemoryReports(state_dir / "memory" / f"{sid}.txt")
    loop.add_signal_handler(signal.SIGUSR2, reports.write)

"""glibc's heap: what it holds, and what it holds free. A long-running service frees as much
as it allocates, yet its resident memory climbs: glibc gives freed memory back to the system
only from the top of each arena, and the buffers a request passes through (KV blocks, gRPC
frames, JSON bodies, each of its own size, on several threads' arenas) leave free holes
below live objects that it keeps. In a soak's first minutes the free space inside the
router's heap grew from 41 to 107 MiB, and a decode worker's from 70 to 117 MiB, while what
they had in use held steady; one ``malloc_trim`` gave 97 MB of the router's back at once.
``keep_trimmed`` asks glibc every few seconds to give those free pages back (``malloc_trim``:
whole free pages inside every arena, not only the top); ``HeapCollector`` puts the figures
on /metrics. Where the C library is not glibc, both do nothing."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import os
import time
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")


MALLINFO2 = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2.split()]  # noqa: RUF012 (glibc's order)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


@dataclass(frozen=True)
class HeapFigures:
    """Bytes, over all of glibc's arenas."""

    in_use: int  # allocated and not freed (Python's objects among them)
    free: int  # free inside the arenas: held from the system, resident where touched
    arenas: int  # the arenas' size (in use + free)
    mapped: int  # large blocks mapped on their own (given back as soon as freed)

    def __str__(self) -> str:
        return (
            f"C heap: {self.in_use / MIB:.1f} MiB in use, {self.free / MIB:.1f} MiB free in it"
            f" ({self.arenas / MIB:.1f} MiB of arenas), {self.mapped / MIB:.1f} MiB mapped apart"
        )


def figures() -> HeapFigures | None:
    """The heap now (None: not glibc). It walks the arenas' free lists: milliseconds, under
    each arena's lock."""
    if _LIBC is None:
        return None
    m = _LIBC.mallinfo2()
    return HeapFigures(m.uordblks, m.fordblks, m.arena, m.hblkhd)


@dataclass
class Trims:
    count: int = 0
    seconds: float = 0.0
    released: int = 0  # resident bytes given back, by the process's RSS before and after


TRIMS = Trims()


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def trim() -> None:
    """Give the heap's free pages back to the system, now (blocking: a thread's work)."""
    if _LIBC is None:
        return
    before, started = resident_bytes(), time.perf_counter()
    _LIBC.malloc_trim(0)
    TRIMS.count += 1
    TRIMS.seconds += time.perf_counter() - started
    TRIMS.released += max(0, before - resident_bytes())


async def keep_trimmed(interval_s: float) -> None:
    """Every ``interval_s``, the heap trimmed on a thread (ctypes lets go of the GIL: the loop
    goes on; only a malloc on the arena being walked waits for it)."""
    if _LIBC is None or interval_s <= 0:
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim)


class HeapCollector(Collector):
    """The heap's figures at scrape time, and the trims so far."""

    def collect(self):  # noqa: ANN201
        heap = figures()
        if heap is None:
            return
        g = GaugeMetricFamily(
            "kvmesh_heap_bytes",
            "glibc's heap: bytes in use, free inside it (held from the system), mapped apart",
            labels=["of"],
        )
        for of, value in (("in_use", heap.in_use), ("free", heap.free), ("mapped", heap.mapped)):
            g.add_metric([of], value)
        yield g
        yield CounterMetricFamily(
            "kvmesh_heap_trims", "times the heap's free pages were given back", value=TRIMS.count
        )
        yield CounterMetricFamily(
            "kvmesh_heap_trim_seconds", "time spent giving them back", value=TRIMS.seconds
        )
        yield CounterMetricFamily(
            "kvmesh_heap_released_bytes",
            "resident bytes the trims gave back",
            value=TRIMS.released,
        )

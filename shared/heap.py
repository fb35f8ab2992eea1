"""The C heap of a kvmesh process kept from growing by its fragments.

glibc's malloc maps a buffer of 128 KiB or more on its own and returns it whole when freed,
but each time such a buffer is freed it raises that threshold (up to 32 MiB), so that later
ones are carved from the heap instead. A worker moves buffers of every size (gRPC's messages
with KV blocks, tensors, bytes read from the storage tier): carved from the heap, their free
gaps are pinned by what is allocated after them, and the heap grows. In a soak, a decode
worker's heap grew by hundreds of MB an hour this way while its Python objects stayed at
~100 MB. Fixing the threshold (which turns glibc's raising off) keeps large buffers mapped:
freed, they go back to the system. Elsewhere than glibc, nothing is done."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # (glibc's malloc.h)
MAP_FROM_BYTES = 128 << 10  # glibc's own starting threshold, kept


def steady_malloc() -> bool:
    """Large buffers mapped on their own for the rest of the process; whether it was set."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MAP_FROM_BYTES))

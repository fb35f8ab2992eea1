"""shared/heap.py on this machine's glibc: buffers of a MiB, freed between small allocations
that stay, are given back to the system with the fixed threshold, and are kept (the heap
grown by them) without it once a larger buffer has been freed."""

from __future__ import annotations

import subprocess
import sys

from tests.procs import REPO

SCENE = """
import ctypes, sys
from shared.heap import steady_malloc
if sys.argv[1] == "steady":
    assert steady_malloc()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
libc.free(libc.malloc(16 << 20))  # a large buffer freed: glibc raises its threshold
before = rss()
big, small = [], []
for _ in range(200):  # a MiB each, touched, with a small allocation after each that stays
    p = libc.malloc(1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    big.append(p)
    small.append(libc.malloc(64))
for p in big:
    libc.free(p)
print(rss() - before)
"""


def kept_after_freeing(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", SCENE, mode], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return int(done.stdout)


def test_freed_large_buffers_go_back_to_the_system() -> None:
    assert kept_after_freeing("default") > 150 << 20  # glibc alone: the heap holds them
    assert kept_after_freeing("steady") < 20 << 20

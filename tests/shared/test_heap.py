"""The C heap gives back what a process freed in holes between live objects."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.procs import REPO

# Buffers of 100 KB (under glibc's threshold for mapping one apart: from the heap), each
# followed by a small object that stays: freeing the buffers leaves holes below live objects,
# which glibc keeps resident (it gives back only from the top). In a process of its own: a
# heap already full of holes would take the buffers into them.
HOLES = """
import json
from shared.telemetry import heap

buffers, pins = [], []
for i in range(1000):
    buffers.append(bytes(100_000) + bytes([i % 256]))
    pins.append(bytes(600) + bytes([i % 256]))
held = heap.figures()
del buffers
kept = heap.figures()
resident = heap.resident_bytes()
heap.trim()
print(json.dumps({
    "freed_kept": kept.free - held.free,
    "given_back": resident - heap.resident_bytes(),
    "trims": heap.TRIMS.count,
    "released": heap.TRIMS.released,
    "pins": len(pins),
}))
"""


def test_a_trim_gives_back_the_free_holes_the_heap_keeps() -> None:
    out = subprocess.run(
        [sys.executable, "-c", HOLES], cwd=REPO, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    assert got["freed_kept"] > 50 << 20, got  # (of 100 MB freed, held by the heap)
    assert got["trims"] == 1
    assert got["given_back"] > 50 << 20, got
    assert got["released"] >= got["given_back"], got
    assert got["pins"] == 1000  # (still held: the holes were below them)

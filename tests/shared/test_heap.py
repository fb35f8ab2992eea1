"""The C heap gives back what a process freed in holes between live objects."""

from __future__ import annotations

from shared.telemetry import heap


def test_a_trim_gives_back_the_free_holes_the_heap_keeps() -> None:
    # Buffers of 100 KB (under glibc's threshold for mapping one apart: from the heap), each
    # followed by a small object that stays: freeing the buffers leaves holes below live
    # objects, which glibc keeps resident (it gives back only from the top).
    buffers, pins = [], []
    for i in range(1000):
        buffers.append(bytes(100_000) + bytes([i % 256]))
        pins.append(bytes(600) + bytes([i % 256]))
    held = heap.figures()
    del buffers
    kept = heap.figures()
    resident = heap.resident_bytes()
    assert held is not None and kept is not None
    assert kept.free - held.free > 50 << 20, (held, kept)  # (of 100 MB freed)

    trims = heap.TRIMS.count
    heap.trim()

    assert heap.TRIMS.count == trims + 1
    given_back = resident - heap.resident_bytes()
    assert given_back > 50 << 20, given_back
    assert heap.TRIMS.released >= given_back
    assert len(pins) == 1000  # (still held: the holes were below them)

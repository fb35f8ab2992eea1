"""Block hashing and the storage backends."""

from __future__ import annotations

import os
import time
from pathlib import Path

from shared.kvstore.backend import FileStore, MemoryStore
from shared.kvstore.hashing import block_hashes


def test_hashes_chain_over_full_blocks_and_depend_on_model_and_salt() -> None:
    ids = list(range(200))
    h = block_hashes(ids, 64, "model-a")
    assert len(h) == 3 and len(set(h)) == 3
    assert block_hashes(ids[:130], 64, "model-a") == h[:2]  # same prefix, same hashes
    assert block_hashes([999] + ids[1:], 64, "model-a")[2] != h[2]  # chained: block 0 matters
    assert block_hashes(ids, 64, "model-b")[0] != h[0]
    assert block_hashes(ids, 64, "model-a", salt="tenant-1")[0] != h[0]
    # Stable across processes and restarts: a fixed value, not Python's hash().
    assert block_hashes([1] * 4, 4, "m") == ["8b079e81b8cc67516135f1626655c64d"]
    assert len(h[0]) == 32 and int(h[0], 16) >= 0


def test_file_store_round_trip_atomic_and_truncation_is_a_miss(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    key, blob = "ab" * 16, os.urandom(10_000)
    store.put(key, blob)
    assert key in store and store.get(key) == blob
    assert not list(tmp_path.rglob("*.tmp"))  # the temp file was renamed into place
    path = store.path(key)
    path.write_bytes(path.read_bytes()[:-10])  # torn write
    assert store.get(key) is None
    assert not path.exists() and store.damaged == 1
    assert store.get("cd" * 16) is None


def test_memory_store_is_lru_within_capacity() -> None:
    mem = MemoryStore(capacity_bytes=30)
    assert mem.put("a", b"x" * 10) == [] and mem.put("b", b"x" * 10) == []
    mem.get("a")  # a is now more recent than b
    assert mem.put("c", b"x" * 15) == ["b"]
    assert mem.leading(["a", "c", "b"]) == 2
    assert mem.put("huge", b"x" * 31) == [] and "huge" not in mem
    mem.check_integrity()


def test_an_image_is_hashed_by_its_content_not_its_placeholders() -> None:
    from shared.messages.generate import ImageRef

    ids = [7] * 10 + [0] * 16 + [9] * 6  # an image's 16 placeholders at 10..25, 8-token blocks
    a = [ImageRef(image_hash="aa" * 16, start=10, tokens=16)]
    b = [ImageRef(image_hash="bb" * 16, start=10, tokens=16)]
    plain, with_a = block_hashes(ids, 8, "m"), block_hashes(ids, 8, "m", images=a)
    with_b = block_hashes(ids, 8, "m", images=b)
    assert with_a[0] == plain[0] == with_b[0]  # the block before the image
    assert len({with_a[1], with_b[1], plain[1]}) == 3  # from the image on, all differ
    assert with_a[3] != with_b[3]
    assert block_hashes(ids, 8, "m", images=a) == with_a  # the same image, the same blocks
    # An answer continuing the prompt (decode stores it) keeps the prompt's hashes.
    assert block_hashes([*ids, 1, 2, 3, 4, 5, 6, 7, 8], 8, "m", images=a)[:4] == with_a


def test_memory_store_keeps_pinned_blocks_until_their_pin_ends() -> None:
    now = time.time()
    mem = MemoryStore(capacity_bytes=30)
    mem.put("pinned", b"x" * 10, pinned_until=now + 60)
    mem.put("a", b"x" * 10)
    assert mem.put("b", b"x" * 15) == ["a"]  # the oldest unpinned, not the oldest
    assert "pinned" in mem
    assert mem.put("c", b"x" * 25) == [] and "c" not in mem  # no room beside the pin
    assert "b" in mem and mem.used_bytes == 25
    mem.put("late", b"x" * 5, pinned_until=now - 1)  # a pin already over: plain LRU
    mem.pin(["b"], now + 60)
    assert mem.put("d", b"x" * 5) == ["late"]
    mem.pin(["pinned", "b"], now - 1)  # (an earlier end leaves the later one)
    assert mem.put("e", b"x" * 20) == [] and "e" not in mem
    mem.check_integrity()

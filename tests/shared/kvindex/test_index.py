"""The block index: lookups per location, TTLs, LRU eviction, persistence. Events are built
unchecked (``model_construct``): short names stand for block hashes here."""

from __future__ import annotations

import json

import pytest

from shared.kvindex.index import BlockIndex
from shared.messages.kvevents import STORE, KvEvent, LookupRequest

TTL = {"chat": 100.0, "agent": 10.0}


def stored(location: str, hashes: list[str], at: float = 0.0, retention: str = "chat", size=10):
    return KvEvent.model_construct(
        kind="stored",
        location=location,
        hashes=hashes,
        sizes=[size] * len(hashes),
        retention=retention,
        at=at,
    )


def test_lookup_counts_leading_blocks_per_location() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, ["a", "b", "c"]))
    index.apply(stored("mem:p0", ["a", "b"]))
    index.apply(stored("mem:p1", ["b", "c"]))  # not from the first block: holds no prefix
    assert index.lookup(["a", "b", "c", "d"], now=1) == {STORE: 3, "mem:p0": 2}
    assert index.lookup(["x", "a"], now=1) == {}
    index.check_integrity()


def test_removal_and_a_gone_worker() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, ["a", "b"]))
    index.apply(stored("mem:p0", ["a", "b"]))
    index.apply(KvEvent.model_construct(kind="removed", location=STORE, hashes=["b"], at=1))
    assert index.lookup(["a", "b"], now=2) == {STORE: 1, "mem:p0": 2}
    assert index.drop_location("mem:p0") == 2
    assert index.lookup(["a", "b"], now=2) == {STORE: 1}
    assert index.store_bytes == 10
    index.check_integrity()


def test_ttl_by_retention_class_counts_from_last_use() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, ["a"], at=0, retention="agent"))
    index.apply(stored(STORE, ["b"], at=0, retention="chat"))
    assert index.lookup(["a"], now=9) == {STORE: 1}  # used at 9: lives until 19
    assert [h for h, _ in index.expired(now=15)] == []
    assert [h for h, _ in index.expired(now=20)] == ["a"]
    index.forget(["a"])
    assert index.lookup(["a"], now=20) == {}
    assert index.lookup(["b"], now=99) == {STORE: 1}
    assert index.lookup(["b"], now=250) == {}  # past its TTL: not offered even before GC


def test_eviction_takes_least_recently_used_down_to_low_watermark() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, ["a", "b", "c", "d", "e"], size=20))  # 100 bytes
    index.lookup(["a"], now=1)  # a is now the most recently used
    assert index.eviction_victims(capacity=200, high=0.9, low=0.5) == []
    assert index.eviction_victims(capacity=100, high=0.9, low=0.5) == ["b", "c", "d"]


def test_a_used_chain_is_evicted_from_its_tail() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, ["a", "b", "c"], size=10))
    index.apply(stored(STORE, ["x"], size=10))
    index.lookup(["a", "b", "c"], now=1)
    assert index.eviction_victims(capacity=40, high=0.5, low=0.5) == ["x", "c"]


def h(name: str) -> str:
    """A hash of a block's full width (snapshots pack them)."""
    return name.encode().hex().ljust(32, "0")


def test_columns_round_trip_keeps_order_and_locations() -> None:
    a, b, c = h("a"), h("b"), h("c")
    index = BlockIndex(TTL)
    index.apply(stored(STORE, [a, b], at=5))
    index.apply(stored("mem:p0", [c], at=6, retention="agent"))
    index.lookup([a], now=7)
    again = BlockIndex.from_columns(index.columns(), TTL)
    assert list(again.store_lru) == [b, a]
    assert again.entries[a].last_access == 7 and again.store_bytes == 20
    assert again.lookup([a], now=8) == {STORE: 1}
    assert again.entries[c].retention == "agent" and again.entries[c].locations == {"mem:p0"}
    again.check_integrity()
    # A router's copy keeps no LRU order, and answers alike.
    router = BlockIndex.from_columns(index.columns(), TTL, lru=False)
    assert not router.store_lru and router.lookup([a], now=8) == {STORE: 1}
    router.check_integrity()


def test_touches_and_clears_are_events() -> None:
    index = BlockIndex(TTL, lru=False)
    index.apply(stored(STORE, ["a", "b"], at=0, retention="agent"))
    index.apply(stored("mem:p0", ["a", "b"], at=0, retention="agent"))
    used = KvEvent.model_construct(kind="touched", hashes=["a"], at=8)  # a router used it at 8
    index.apply(used)
    assert [k for k, _ in index.expired(now=15)] == ["b"]  # a lives until 18
    index.apply(KvEvent.model_construct(kind="cleared", location="mem:p0", at=9))
    assert index.lookup(["a", "b"], now=9) == {STORE: 2}
    index.check_integrity()


def test_sglangs_64_digit_hashes_are_blocks_beside_kvmeshs() -> None:
    """An SGLang model's blocks are named by SGLang's page hashes (SHA-256: 64 hex digits):
    events, lookups and snapshots take them beside kvmesh's 32-digit ones."""
    ours, theirs = h("a"), "5e" * 32
    event = KvEvent(kind="stored", location=STORE, hashes=[theirs], sizes=[10], at=1.0)
    with pytest.raises(ValueError, match="hashes"):
        KvEvent(kind="stored", location=STORE, hashes=[ours, theirs], sizes=[1, 1], at=1.0)
    asked = LookupRequest.of([theirs, "6f" * 32])
    assert LookupRequest.model_validate_json(asked.model_dump_json()).hashes == [theirs, "6f" * 32]
    with pytest.raises(ValueError, match="packed"):
        LookupRequest(packed=theirs[:40], width=64)
    index = BlockIndex(TTL)
    index.apply(event)
    index.apply(stored("mem:p0", [ours], at=2))
    again = BlockIndex.from_columns(json.loads(json.dumps(index.columns())), TTL)
    assert again.lookup([theirs], now=3) == {STORE: 1}
    assert again.lookup([ours], now=3) == {"mem:p0": 1}
    again.check_integrity()


def test_a_pinned_block_is_neither_expired_nor_evicted_until_its_pin_ends() -> None:
    """Stored pinned until 50 (its class lives 10): kept past its TTL and passed over by
    eviction until then; a router's touch pins a read block again, later; then it goes."""
    index = BlockIndex(TTL)
    index.apply(stored(STORE, ["a"], at=0, retention="agent", size=20))
    pin = KvEvent.model_construct(
        kind="stored", location=STORE, hashes=["p"], sizes=[20], retention="agent", at=0,
        pinned_until=50,
    )  # fmt: skip
    index.apply(pin)
    index.apply(stored(STORE, ["b"], at=1, retention="agent", size=20))
    assert [k for k, _ in index.expired(now=20)] == ["a", "b"]  # p: pinned, not expired
    assert index.lookup(["p"], now=20, touch=False) == {STORE: 1}
    # Down to 10 bytes of 60: every block but the pinned one.
    assert index.eviction_victims(capacity=40, high=0.5, low=0.25, now=20) == ["a", "b"]
    touch = KvEvent.model_construct(kind="touched", hashes=["p"], at=30, pinned_until=90)
    index.apply(touch)
    assert index.eviction_victims(capacity=40, high=0.5, low=0.25, now=60) == ["a", "b"]
    assert [k for k, _ in index.expired(now=95)] == ["a", "p", "b"]
    assert index.eviction_victims(capacity=40, high=0.5, low=0.25, now=95) == ["a", "b", "p"]
    again = BlockIndex.from_columns(index.columns(), TTL)  # (a snapshot keeps the pin)
    assert [k for k, _ in again.expired(now=60)] == ["a", "b"]
    index.check_integrity()

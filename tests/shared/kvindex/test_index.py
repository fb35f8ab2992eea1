"""The block index: lookups per location, TTLs, LRU eviction, persistence; and the same
answers as the dict-of-entries index it replaced (tests/shared/kvindex/reference.py) on random
event streams. Events are built unchecked (``model_construct``); ``h`` makes a block hash of
a short name."""

from __future__ import annotations

import random

import pytest

from shared.kvindex.index import BlockIndex
from shared.kvindex.view import KvIndex
from shared.messages.kvevents import STORE, KvEvent, KvRecord, LookupRequest, pack_events
from tests.shared.kvindex.reference import BlockIndex as DictIndex

TTL = {"chat": 100.0, "agent": 10.0}


def h(name: str) -> str:
    """A block hash of a short name (32 hex digits)."""
    return name.encode().hex().ljust(32, "0")


def hs(names: str) -> list[str]:
    return [h(n) for n in names]


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
    index.apply(stored(STORE, hs("abc")))
    index.apply(stored("mem:p0", hs("ab")))
    index.apply(stored("mem:p1", hs("bc")))  # not from the first block: holds no prefix
    assert index.lookup(hs("abcd"), now=1) == {STORE: 3, "mem:p0": 2}
    assert index.lookup(hs("xa"), now=1) == {}
    index.check_integrity()


def test_removal_and_a_gone_worker() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, hs("ab")))
    index.apply(stored("mem:p0", hs("ab")))
    index.apply(KvEvent.model_construct(kind="removed", location=STORE, hashes=hs("b"), at=1))
    assert index.lookup(hs("ab"), now=2) == {STORE: 1, "mem:p0": 2}
    assert index.drop_location("mem:p0") == 2
    assert index.lookup(hs("ab"), now=2) == {STORE: 1}
    assert index.store_bytes == 10 and len(index) == 1
    index.check_integrity()


def test_ttl_by_retention_class_counts_from_last_use() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, hs("a"), at=0, retention="agent"))
    index.apply(stored(STORE, hs("b"), at=0, retention="chat"))
    assert index.lookup(hs("a"), now=9) == {STORE: 1}  # used at 9: lives until 19
    assert index.expired(now=15) == []
    assert index.expired(now=20) == hs("a")
    index.forget(hs("a"))
    assert index.lookup(hs("a"), now=20) == {}
    assert index.lookup(hs("b"), now=99) == {STORE: 1}
    assert index.lookup(hs("b"), now=250) == {}  # past its TTL: not offered even before GC


def test_eviction_takes_least_recently_used_down_to_low_watermark() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, hs("abcde"), size=20))  # 100 bytes
    index.lookup(hs("a"), now=1)  # a is now the most recently used
    assert index.eviction_victims(capacity=200, high=0.9, low=0.5) == []
    assert index.eviction_victims(capacity=100, high=0.9, low=0.5) == hs("bcd")


def test_a_used_chain_is_evicted_from_its_tail() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, hs("abc"), size=10))
    index.apply(stored(STORE, hs("x"), size=10))
    index.lookup(hs("abc"), now=1)
    assert index.eviction_victims(capacity=40, high=0.5, low=0.5) == hs("xc")


def snapshot_of(index: BlockIndex, lru: bool = True) -> BlockIndex:
    """The index through a snapshot's bytes, as cachemeta (or, not lru, a router) reads it."""
    view = KvIndex(TTL, index.lru)
    view.blocks = index
    return KvIndex.from_snapshot(view.snapshot(), lru=lru).blocks


def test_columns_round_trip_keeps_order_and_locations() -> None:
    a, b, c = hs("abc")
    index = BlockIndex(TTL)
    index.apply(stored(STORE, [a, b], at=5))
    index.apply(stored("mem:p0", [c], at=6, retention="agent"))
    index.lookup([a], now=7)
    again = snapshot_of(index)
    assert again.store_order() == [b, a]
    assert again.info(a)["expires"] == 107 and again.store_bytes == 20
    assert again.lookup([a], now=8) == {STORE: 1}
    assert again.info(c)["retention"] == "agent" and again.info(c)["locations"] == {"mem:p0"}
    again.check_integrity()
    # A router's copy keeps no hash whole nor LRU order, and answers alike.
    router = snapshot_of(index, lru=False)
    assert router.lookup([a], now=8) == {STORE: 1} and router.lookup([c], now=8) == {"mem:p0": 1}
    assert router.nbytes < again.nbytes / 3
    router.check_integrity()


def test_touches_and_clears_are_events() -> None:
    index = BlockIndex(TTL)
    index.apply(stored(STORE, hs("ab"), at=0, retention="agent"))
    index.apply(stored("mem:p0", hs("ab"), at=0, retention="agent"))
    used = KvEvent.model_construct(kind="touched", hashes=hs("a"), at=8)  # a router used it at 8
    index.apply(used)
    assert index.expired(now=15) == hs("b")  # a lives until 18
    index.apply(KvEvent.model_construct(kind="cleared", location="mem:p0", at=9))
    assert index.lookup(hs("ab"), now=9) == {STORE: 2}
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
    again = snapshot_of(index)
    assert again.lookup([theirs], now=3) == {STORE: 1}
    assert again.lookup([ours], now=3) == {"mem:p0": 1}
    assert again.store_order() == [theirs]  # (its name whole: the file cachemeta deletes)
    again.check_integrity()


def test_a_pinned_block_is_neither_expired_nor_evicted_until_its_pin_ends() -> None:
    """Stored pinned until 50 (its class lives 10): kept past its TTL and passed over by
    eviction until then; a router's touch pins a read block again, later; then it goes."""
    a, p, b = hs("apb")
    index = BlockIndex(TTL)
    index.apply(stored(STORE, [a], at=0, retention="agent", size=20))
    pin = KvEvent.model_construct(
        kind="stored", location=STORE, hashes=[p], sizes=[20], retention="agent", at=0,
        pinned_until=50,
    )  # fmt: skip
    index.apply(pin)
    index.apply(stored(STORE, [b], at=1, retention="agent", size=20))
    assert sorted(index.expired(now=20)) == sorted([a, b])  # p: pinned, not expired
    assert index.lookup([p], now=20, touch=False) == {STORE: 1}
    # Down to 10 bytes of 60: every block but the pinned one.
    assert index.eviction_victims(capacity=40, high=0.5, low=0.25, now=20) == [a, b]
    touch = KvEvent.model_construct(kind="touched", hashes=[p], at=30, pinned_until=90)
    index.apply(touch)
    assert index.eviction_victims(capacity=40, high=0.5, low=0.25, now=60) == [a, b]
    assert sorted(index.expired(now=95)) == sorted([a, p, b])
    assert index.eviction_victims(capacity=40, high=0.5, low=0.25, now=95) == [a, b, p]
    again = snapshot_of(index)  # (a snapshot keeps the pin)
    assert sorted(again.expired(now=60)) == sorted([a, b])
    index.check_integrity()


LOCATIONS = [STORE, "mem:p0", "mem:p1", "mem:p2"]


def random_stream(rng: random.Random, n: int) -> list[KvEvent]:
    """Conversations growing turn by turn (chains sharing prefixes), stored at random
    locations, used, removed, pinned and cleared, at whole seconds moving on."""
    chains: list[list[str]] = []
    out, now = [], 0
    for _ in range(n):
        now += rng.choice((0, 0, 1, 3, 40))
        kind = rng.choices(["stored", "removed", "touched", "cleared"], [6, 2, 3, 0.3])[0]
        if kind == "stored" or not chains:
            if chains and rng.random() < 0.6:
                base = rng.choice(chains)
                chain = base[: rng.randint(1, len(base))]
            else:
                chain = []
            chain = chain + [h(f"{rng.getrandbits(40):x}") for _ in range(rng.randint(1, 12))]
            chains.append(chain)
            part = chain[rng.randint(0, len(chain) // 2) :]
            out.append(
                KvEvent.model_construct(
                    kind="stored",
                    location=rng.choice(LOCATIONS),
                    hashes=part,
                    sizes=[10 + int(x[:2], 16) for x in part],  # (a block's own)
                    retention=rng.choice(("chat", "agent")),
                    at=now,
                    pinned_until=rng.choice((0, 0, 0, now + 150)),
                )
            )
        else:
            chain = rng.choice(chains)
            cut = chain[rng.randint(0, len(chain) - 1) :]
            location = rng.choice(LOCATIONS)
            pin = rng.choice((0, 0, now + 60))
            out.append(
                KvEvent.model_construct(
                    kind=kind, location=location, hashes=cut, at=now, pinned_until=pin
                )
            )
    return out


@pytest.mark.parametrize("seed", range(4))
def test_the_table_answers_as_the_dict_index_did_on_random_streams(seed: int) -> None:
    """Every lookup, expiry, eviction and size the same as the dict-of-entries index, at
    every step of a random stream (whole-second times: the table keeps seconds)."""
    rng = random.Random(seed)
    table, plain, router = BlockIndex(TTL), DictIndex(TTL), BlockIndex(TTL, lru=False)
    events = random_stream(rng, 1500)
    known = [e.hashes for e in events if e.kind == "stored"]
    for step, event in enumerate(events):
        for index in (table, plain, router):
            index.apply(event)
        now = event.at + rng.choice((0, 5, 60, 200))
        prompt = rng.choice(known)
        expect = plain.lookup(prompt, now, touch=False)
        assert table.lookup(prompt, now, touch=False) == expect, step
        assert router.lookup(prompt, now, touch=False) == expect, step
        if step % 50 == 0:
            assert sorted(table.expired(now)) == sorted(h for h, _ in plain.expired(now))
            assert table.store_order() == list(plain.store_lru)
            assert table.store_bytes == plain.store_bytes and len(table) == len(plain)
            for cap in (200, 2000):
                want = plain.eviction_victims(cap, 0.5, 0.25, now)
                assert table.eviction_victims(cap, 0.5, 0.25, now) == want
            table.check_integrity()
            router.check_integrity()
        if step % 300 == 299:  # now and then through a snapshot, as a restart reads it
            table, router = snapshot_of(table), snapshot_of(table, lru=False)
    assert len(table) > 200  # (the stream kept a fair number of blocks)


def test_a_snapshot_read_with_a_shorter_ttl_shortens_its_blocks_lives() -> None:
    """Cachemeta restarted with another TTL: each block lives its last use plus the new one
    (a pinned block until its pin)."""
    a, p = hs("ap")
    index = BlockIndex(TTL)
    index.apply(stored(STORE, [a], at=5))
    index.apply(stored(STORE, [p], at=5, size=10))
    index.touch([p], now=6, pinned_until=70)
    view = KvIndex(TTL)
    view.blocks = index
    shorter = KvIndex.from_snapshot(view.snapshot(), {"chat": 6.0, "agent": 10.0}).blocks
    assert shorter.info(a)["expires"] == 11 and shorter.info(p)["expires"] == 70
    assert sorted(shorter.expired(now=12)) == [a]


def test_packed_batches_apply_as_the_events_one_by_one() -> None:
    """The stream's batches (MessagePack, hashes packed) and the same events applied one at a
    time as models give the same index; a router that joins late (cachemeta's snapshot of
    the first half, then the stream after it) answers as one that followed it all."""
    rng = random.Random(7)
    events = [
        e.model_copy(update={"source": "p", "epoch": 1.0, "seq": i})
        for i, e in enumerate(random_stream(rng, 1200), 1)
    ]
    for e in events:  # (as a worker's events are: hex hashes of one width)
        assert all(len(x) == 32 for x in e.hashes)
    one, batched = KvIndex(TTL), KvIndex(TTL)
    for seq, e in enumerate(events, 1):
        one.apply(e, seq)
    messages = [events[i : i + 37] for i in range(0, len(events), 37)]
    for seq, part in enumerate(messages, 1):
        batched.apply_message(pack_events([KvRecord.of(e) for e in part]), seq)
        if seq == len(messages) // 2:
            snapshot = batched.snapshot()
    late = KvIndex.from_snapshot(snapshot, lru=False)
    for seq, part in enumerate(messages, 1):
        if seq > len(messages) // 2:
            late.apply_message(pack_events([KvRecord.of(e) for e in part]), seq)
    now = events[-1].at
    for prompt in {tuple(e.hashes) for e in events if e.kind == "stored"}:
        expect = one.blocks.lookup(list(prompt), now, touch=False)
        assert batched.blocks.lookup(list(prompt), now, touch=False) == expect
        assert late.blocks.lookup(list(prompt), now, touch=False) == expect
    assert len(batched) == len(one) == len(late) and batched.seq == late.seq
    assert batched.blocks.store_order() == one.blocks.store_order()

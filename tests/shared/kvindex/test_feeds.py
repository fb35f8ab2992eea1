"""The workers' KV event feeds: events counted against what heartbeats say was made; a feed
that lags or stops is stale until it is whole again; a resync's clear accounts for what was
lost; a new process's memory tier starts empty; the same events give the same index."""

from __future__ import annotations

import random

from shared.kvindex.feeds import Feeds
from shared.kvindex.view import KvIndex
from shared.messages.kvevents import STORE, KvEvent

TTL = {"chat": 1e6, "agent": 1e6}
EPOCH = 1000.0


def h(i: int) -> str:
    return f"{i:032x}"


class Worker:
    """Events as a worker publishes them: numbered in its process."""

    def __init__(self, name: str, epoch: float = EPOCH) -> None:
        self.name, self.epoch, self.made = name, epoch, 0

    def event(self, kind: str, hashes: list[str], location: str = "") -> KvEvent:
        self.made += 1
        return KvEvent(
            kind=kind,  # type: ignore[arg-type]
            location=location or f"mem:{self.name}",
            hashes=hashes,
            sizes=[10] * len(hashes) if kind == "stored" else [],
            at=1.0,
            source=self.name,
            epoch=self.epoch,
            seq=self.made,
        )


class Stream:
    def __init__(self, *holders: KvIndex) -> None:
        self.holders, self.seq = holders, 0

    def put(self, event: KvEvent) -> None:
        self.seq += 1
        for holder in self.holders:
            holder.apply(event, self.seq)


def test_a_whole_feed_is_trusted_and_a_lost_event_makes_it_stale() -> None:
    index = KvIndex(TTL, lru=False, bound_s=2.0)
    stream, p0 = Stream(index), Worker("p0")
    stream.put(p0.event("stored", [h(1), h(2)]))
    feeds = index.feeds
    feeds.heard("p0", EPOCH, p0.made, unannounced_s=0.0, now=0.0)
    assert feeds.check(now=0.5) == [] and feeds.trusted("p0", EPOCH)
    p0.event("stored", [h(3)])  # made, never published
    feeds.heard("p0", EPOCH, p0.made, unannounced_s=0.0, now=1.0)
    assert feeds.check(now=2.9) == []  # within the bound: it may be on its way
    assert feeds.check(now=3.1) == [("p0", "1 KV events made have not come")]
    assert not feeds.trusted("p0", EPOCH) and feeds.by_source["p0"].lag() == 1
    # A resync: its location cleared (accounting for everything before), blocks again.
    stream.put(p0.event("cleared", []))
    stream.put(p0.event("stored", [h(1), h(2), h(3)]))
    feeds.heard("p0", EPOCH, p0.made, unannounced_s=0.0, now=4.0)
    assert feeds.check(now=4.1) == [("p0", "")] and feeds.trusted("p0", EPOCH)
    assert index.blocks.lookup([h(1), h(2), h(3)], now=5, touch=False) == {"mem:p0": 3}


def test_a_feed_that_stops_while_its_worker_computes_is_stale() -> None:
    feeds, v0 = Feeds(bound_s=2.0), Worker("v0")
    for _ in range(5):
        feeds.admit(v0.event("stored", [h(1)]))
    feeds.heard("v0", EPOCH, made=5, unannounced_s=0.0, now=0.0)
    feeds.heard("v0", EPOCH, made=5, unannounced_s=0.0, now=5.0)
    assert feeds.check(now=5.0) == []  # quiet and idle: nothing expected
    feeds.heard("v0", EPOCH, made=5, unannounced_s=1.5, now=6.0)  # computed, within the bound
    assert feeds.check(now=6.0) == []
    feeds.heard("v0", EPOCH, made=5, unannounced_s=2.5, now=7.0)  # still no events
    changed = feeds.check(now=7.0)
    assert changed and changed[0][0] == "v0" and "no KV events for 2.5 s" in changed[0][1]


def test_a_new_process_starts_with_an_empty_memory_tier() -> None:
    index = KvIndex(TTL, lru=False)
    stream, old = Stream(index), Worker("p0", epoch=EPOCH)
    stream.put(old.event("stored", [h(1)]))
    stream.put(old.event("stored", [h(1)], location=STORE))
    assert not index.feeds.trusted("p0", EPOCH + 60)  # its next process, heard of before events
    new = Worker("p0", epoch=EPOCH + 60)
    stream.put(new.event("stored", [h(2)]))
    assert index.blocks.lookup([h(1)], now=2, touch=False) == {STORE: 1}
    assert index.blocks.lookup([h(2)], now=2, touch=False) == {"mem:p0": 1}
    stream.put(old.event("stored", [h(3)]))  # the old process's, late: its memory is gone
    assert index.blocks.lookup([h(3)], now=2, touch=False) == {}
    assert index.feeds.trusted("p0", EPOCH + 60)


def test_holders_of_the_same_events_answer_alike_and_a_snapshot_resumes_them() -> None:
    rng = random.Random(7)
    a, b = KvIndex(TTL, lru=False), KvIndex(TTL, lru=True)
    stream = Stream(a, b)
    workers = [Worker(f"p{i}") for i in range(3)]
    for _ in range(400):
        w = rng.choice(workers)
        chain = [h(i) for i in range(rng.randrange(1, 40))]
        kind = rng.choice(["stored", "stored", "removed", "touched"])
        location = rng.choice([STORE, f"mem:{w.name}"])
        stream.put(w.event(kind, chain[rng.randrange(len(chain)) :], location))
        if rng.random() < 0.02:
            stream.put(w.event("cleared", []))
    c = KvIndex.from_snapshot(b.snapshot(), lru=False)  # a third, started from a snapshot
    assert c.seq == b.seq and c.feeds.states() == b.feeds.states()
    for _ in range(100):
        w = rng.choice(workers)
        stream.holders = (a, b, c)
        stream.put(w.event("stored", [h(rng.randrange(60)) for _ in range(5)]))
    for n in range(1, 60):
        prompt = [h(i) for i in range(n)]
        answers = [x.blocks.lookup(prompt, now=2, touch=False) for x in (a, b, c)]
        assert answers[0] == answers[1] == answers[2]
    b.blocks.check_integrity()
    c.blocks.check_integrity()


def test_a_quiet_feed_is_whole_only_when_its_events_flow_again() -> None:
    """Republishing what a worker said before (a resync) does not mend a quiet engine feed:
    only lag asks for one; the stopped feed is whole once its event count moves."""
    feeds, v0 = Feeds(bound_s=1.0), Worker("v0")
    feeds.admit(v0.event("stored", [h(1)]))
    feeds.heard("v0", EPOCH, made=1, unannounced_s=0.0, now=0.0)
    feeds.heard("v0", EPOCH, made=1, unannounced_s=3.0, now=3.0)
    feeds.check(now=3.0)
    feed = feeds.by_source["v0"]
    assert feed.stale and not feed.lagging
    feeds.admit(v0.event("stored", [h(2)]))  # its engine speaks again
    feeds.heard("v0", EPOCH, made=2, unannounced_s=0.0, now=4.0)
    assert feeds.check(now=4.0) == [("v0", "")]

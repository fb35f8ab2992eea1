"""The block index: which locations hold each KV block, its size, last access and retention.

Pure and synchronous: KV events in, lookups and garbage-collection decisions out. Cachemeta
keeps one (and decides what is deleted), and so does every router (it routes by its own).
Cachemeta's also keeps the storage tier's blocks in least-recently-used order, for eviction
past a capacity; a router's does without (``lru=False``: it evicts nothing).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from shared.messages.kvevents import HASH_CHARS, STORE, KvEvent


@dataclass(slots=True)
class Entry:
    size: int
    retention: str
    last_access: float
    expires_at: float  # last_access + the retention class's TTL, or the pin's end if later
    locations: frozenset[str] = frozenset()  # interned: equal sets are the same object
    pinned_until: float = 0.0  # neither expired nor evicted before this (unix time)


class BlockIndex:
    def __init__(self, ttl_s: dict[str, float], lru: bool = True) -> None:
        self.ttl_s = ttl_s  # retention class → seconds a block lives after its last use
        self.entries: dict[str, Entry] = {}
        self.lru = lru
        self.store_lru: OrderedDict[str, None] = OrderedDict()  # oldest use first (if lru)
        self.store_bytes = 0
        self._sets: dict[frozenset[str], frozenset[str]] = {}
        self._moves: dict[tuple[frozenset[str], str, bool], frozenset[str]] = {}

    def _interned(self, locations: frozenset[str]) -> frozenset[str]:
        return self._sets.setdefault(locations, locations)

    def _with(self, locations: frozenset[str], location: str) -> frozenset[str]:
        """``locations`` plus ``location``, interned (the transitions are few: cached)."""
        key = (locations, location, True)
        out = self._moves.get(key)
        if out is None:
            out = self._moves[key] = self._interned(locations | {location})
        return out

    def _without(self, locations: frozenset[str], location: str) -> frozenset[str]:
        key = (locations, location, False)
        out = self._moves.get(key)
        if out is None:
            out = self._moves[key] = self._interned(locations - {location})
        return out

    def __len__(self) -> int:
        return len(self.entries)

    # -- changes ---------------------------------------------------------------------------

    def apply(self, event: KvEvent) -> None:
        if event.kind == "stored":
            sizes = event.sizes or [0] * len(event.hashes)
            for h, size in zip(event.hashes, sizes, strict=True):
                self._add(h, event.location, size, event.retention, event.at, event.pinned_until)
        elif event.kind == "removed":
            for h in event.hashes:
                self._remove(h, event.location)
        elif event.kind == "touched":
            self.touch(event.hashes, event.at, event.pinned_until)
        else:  # cleared
            self.drop_location(event.location)

    def _add(
        self, h: str, location: str, size: int, retention: str, at: float, pinned: float = 0.0
    ) -> None:
        entry = self.entries.get(h)
        if entry is None:
            ends = max(at + self.ttl_s[retention], pinned)
            entry = self.entries[h] = Entry(size, retention, at, ends, pinned_until=pinned)
        else:
            if at > entry.last_access:
                entry.last_access = at
            # The longer-lived class wins: an agent's block is not cut short by a chat's.
            if retention != entry.retention and self.ttl_s[retention] > self.ttl_s[entry.retention]:
                entry.retention = retention
            entry.pinned_until = max(entry.pinned_until, pinned)
            entry.expires_at = max(
                entry.last_access + self.ttl_s[entry.retention], entry.pinned_until
            )
            entry.size = size or entry.size
        held = entry.locations
        if location == STORE:
            if STORE not in held:
                self.store_bytes += entry.size
            if self.lru:
                self.store_lru[h] = None
                self.store_lru.move_to_end(h)
        if location not in held:
            entry.locations = self._with(held, location)

    def _remove(self, h: str, location: str) -> None:
        entry = self.entries.get(h)
        if entry is None or location not in entry.locations:
            return
        entry.locations = self._without(entry.locations, location)
        if location == STORE:
            self.store_bytes -= entry.size
            if self.lru:
                del self.store_lru[h]
        if not entry.locations:
            del self.entries[h]

    def drop_location(self, location: str) -> int:
        """A worker is gone: its memory tier with it. Returns the blocks it held."""
        held = [h for h, e in self.entries.items() if location in e.locations]
        for h in held:
            self._remove(h, location)
        return len(held)

    # -- questions -------------------------------------------------------------------------

    def _alive(self, entry: Entry, now: float) -> bool:
        return now <= entry.expires_at

    def lookup(self, hashes: list[str], now: float, touch: bool = True) -> dict[str, int]:
        """Per location, how many of ``hashes`` from the first it holds. Blocks counted are
        marked used now (they are about to be read), unless the caller does that later with
        ``touch`` (off the lookup's latency)."""
        counts: dict[str, int] = {}
        alive: frozenset[str] | None = None  # locations holding every block so far
        n = 0
        for entry in map(self.entries.get, hashes):
            if entry is None or now > entry.expires_at:
                break
            held = entry.locations
            if held is not alive:  # interned: the same set is the same object
                if alive is None:
                    alive = held
                elif not held >= alive:
                    for gone in alive - held:  # a location's run ends here
                        counts[gone] = n
                    alive = alive & held
                    if not alive:
                        break
            n += 1
        for location in alive or ():
            counts[location] = n
        if touch:
            self.touch(hashes[:n], now)
        return counts

    def touch(self, hashes: list[str], now: float, pinned_until: float = 0.0) -> None:
        """Mark blocks used (and pinned until ``pinned_until``, when later than they are).
        Later blocks first, so a chain's head ends up the most recent: eviction then trims
        chains from the tail, never cutting a prefix's head."""
        for h in reversed(hashes):
            entry = self.entries.get(h)
            if entry is None:
                continue
            if pinned_until > entry.pinned_until:
                entry.pinned_until = pinned_until
                entry.expires_at = max(entry.expires_at, pinned_until)
            if now > entry.last_access:
                entry.last_access = now
                entry.expires_at = max(now + self.ttl_s[entry.retention], entry.pinned_until)
            if self.lru and STORE in entry.locations:
                self.store_lru.move_to_end(h)

    def expired(self, now: float) -> list[tuple[str, Entry]]:
        return [(h, e) for h, e in self.entries.items() if not self._alive(e, now)]

    def forget(self, hashes: Iterable[str]) -> None:
        """Drop blocks from every location (expired ones)."""
        for h in hashes:
            entry = self.entries.get(h)
            if entry is not None:
                for location in list(entry.locations):
                    self._remove(h, location)

    def eviction_victims(
        self, capacity: int, high: float, low: float, now: float | None = None
    ) -> list[str]:
        """Past the high watermark, the least recently used storage-tier blocks whose removal
        brings it down to the low watermark; a block pinned past ``now`` is passed over."""
        if self.store_bytes <= capacity * high:
            return []
        now = time.time() if now is None else now
        victims, freed = [], 0
        for h in self.store_lru:
            if self.store_bytes - freed <= capacity * low:
                break
            entry = self.entries[h]
            if entry.pinned_until > now:
                continue
            victims.append(h)
            freed += entry.size
        return victims

    # -- persistence -----------------------------------------------------------------------

    def columns(self) -> dict:
        """The index as columns of plain values (a snapshot's body): one packed string of
        hashes (a list where SGLang's are among them), storage-tier blocks first in LRU order,
        then one list per field; each block's locations as an index into the distinct sets of
        them (they are few)."""
        order = list(self.store_lru) if self.lru else []
        order += [h for h, e in self.entries.items() if not (self.lru and STORE in e.locations)]
        entries = [self.entries[h] for h in order]
        sets: dict[frozenset[str], int] = {}
        uniform = all(len(h) == HASH_CHARS for h in order)
        return {  # (SGLang's hashes among kvmesh's: a list, not one string of fixed width)
            "hashes": "".join(order) if uniform else order,
            "sizes": [e.size for e in entries],
            "agent": [int(e.retention == "agent") for e in entries],
            "last_access": [e.last_access for e in entries],
            "pinned_until": [e.pinned_until for e in entries],
            "where": [sets.setdefault(e.locations, len(sets)) for e in entries],
            "sets": [sorted(s) for s in sets],
        }

    @classmethod
    def from_columns(cls, cols: dict, ttl_s: dict[str, float], lru: bool = True) -> BlockIndex:
        index = cls(ttl_s, lru)
        packed, width = cols["hashes"], HASH_CHARS
        if isinstance(packed, list):
            hashes = packed
        else:
            hashes = [packed[i : i + width] for i in range(0, len(packed), width)]
        sets = [index._interned(frozenset(s)) for s in cols["sets"]]
        pins = cols.get("pinned_until") or [0.0] * len(cols["sizes"])  # (older snapshots)
        rows = zip(
            cols["sizes"], cols["agent"], cols["last_access"], cols["where"], pins, strict=True
        )
        for h, (size, agent, last_access, where, pin) in zip(hashes, rows, strict=True):
            retention = "agent" if agent else "chat"
            locations = sets[where]
            if not locations:
                continue
            ends = max(last_access + ttl_s[retention], pin)
            index.entries[h] = Entry(size, retention, last_access, ends, locations, pin)
            if STORE in locations:
                index.store_bytes += size
                if lru:
                    index.store_lru[h] = None
        return index

    def check_integrity(self) -> None:
        in_store = {h for h, e in self.entries.items() if STORE in e.locations}
        if self.lru:
            assert in_store == set(self.store_lru), "LRU order and store locations differ"
        assert self.store_bytes == sum(self.entries[h].size for h in in_store)
        assert all(e.locations for e in self.entries.values()), "an entry with no location"

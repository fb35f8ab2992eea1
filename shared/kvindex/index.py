"""The block index: which locations hold each KV block, until when it lives, and (for the holder
that evicts) its size, pin and place in the least-recently-used order.

Pure and synchronous: KV events in, lookups and garbage-collection decisions out. Cachemeta
keeps one (and decides what is deleted), and so does every router (it routes by its own).

The blocks are rows of flat arrays (``shared/kvindex/table.py``): a router's row is its key,
its locations (an id of the distinct sets of them: they are few), when it expires and its
retention class, 17 bytes; cachemeta's (``lru=True``) also holds each hash whole (it deletes
files by it), the block's bytes, its pin and its last use in LRU order. Times are whole
seconds, rounded up: a block lives until the end of the second its TTL or pin ends in.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import numpy as np

from shared.kvindex import table
from shared.messages.kvevents import RETENTIONS, STORE, KvEvent, KvRecord

NAME_BYTES = 32  # a hash whole: kvmesh's 16 bytes, or SGLang's 32
WIDE = 2  # the retention byte's flag for a 64-digit (SGLang) hash; bit 0 is the class
SECONDS_MAX = 2**32 - 1


def _second(t: float) -> int:
    """A time as the table keeps it: whole seconds, rounded up."""
    return min(SECONDS_MAX, max(0, math.ceil(t)))


class BlockIndex:
    def __init__(self, ttl_s: dict[str, float], lru: bool = True, capacity: int = 1024) -> None:
        self.ttl_s = ttl_s  # retention class → seconds a block lives after its last use
        self.lru = lru
        self.ttl = np.array([ttl_s[r] for r in RETENTIONS])  # by the class's code
        self.live = 0  # rows holding a block
        self.gone = 0  # rows whose block was removed (a probe passes them)
        self.store_bytes = 0  # (lru) the storage tier's blocks, summed
        self.uses = 0  # (lru) the LRU clock: each use of a storage-tier block counts one
        self.loc_ids: dict[str, int] = {}
        self.loc_names: list[str] = []
        self.sets: list[frozenset[int]] = [frozenset()]  # id 0: no location (a free row)
        self.set_ids: dict[frozenset[int], int] = {frozenset(): 0}
        self.members = np.zeros((8, 8), dtype=np.bool_)  # set id × location id
        self._moves: dict[tuple[int, int, bool], int] = {}
        self._add_moves: dict[int, np.ndarray] = {}  # (stored events: table.settle's)
        self.store = self._location(STORE)
        self._allocate(capacity)

    # -- rows -------------------------------------------------------------------------------

    def _allocate(self, capacity: int) -> None:
        self.keys = np.zeros(capacity, np.uint64)
        self.where = np.zeros(capacity, np.uint32)
        self.expires = np.zeros(capacity, np.uint32)
        self.retention = np.zeros(capacity, np.uint8)
        if self.lru:
            self.names = np.zeros((capacity, NAME_BYTES), np.uint8)
            self.sizes = np.zeros(capacity, np.uint32)
            self.pins = np.zeros(capacity, np.uint32)
            self.used = np.zeros(capacity, np.uint64)

    def _columns(self) -> tuple[str, ...]:
        """The arrays besides ``keys`` that hold a row's fields."""
        own = ("where", "expires", "retention")
        return own + (("names", "sizes", "pins", "used") if self.lru else ())

    def _room(self, more: int) -> None:
        """Room for ``more`` new rows: past the table's load it is rebuilt, larger when its
        live rows need it (the removed ones' slots free again)."""
        if self.live + self.gone + more <= table.MAX_LOAD * self.keys.size:
            return
        need = int((self.live + more) / table.MAX_LOAD * table.GROWTH) + 1
        rows = np.flatnonzero(self.keys > table.GONE)
        old = {name: getattr(self, name) for name in ("keys", *self._columns())}
        self._allocate(max(need, self.keys.size if self.gone > self.live else 0, 1024))
        slots = table.place(self.keys, old["keys"][rows])
        for name in self._columns():
            getattr(self, name)[slots] = old[name][rows]
        self.gone = 0

    @property
    def nbytes(self) -> int:
        """What the rows take in memory (every slot, used or not)."""
        return sum(getattr(self, name).nbytes for name in ("keys", *self._columns()))

    def __len__(self) -> int:
        return self.live

    # -- locations and their sets ------------------------------------------------------------

    def _location(self, name: str) -> int:
        loc = self.loc_ids.get(name)
        if loc is None:
            loc = self.loc_ids[name] = len(self.loc_names)
            self.loc_names.append(name)
            if loc >= self.members.shape[1]:
                grown = np.zeros((self.members.shape[0], 2 * loc), np.bool_)
                grown[:, : self.members.shape[1]] = self.members
                self.members = grown
        return loc

    def _set(self, locations: frozenset[int]) -> int:
        sid = self.set_ids.get(locations)
        if sid is None:
            sid = self.set_ids[locations] = len(self.sets)
            self.sets.append(locations)
            if sid >= self.members.shape[0]:
                grown = np.zeros((2 * sid, self.members.shape[1]), np.bool_)
                grown[: self.members.shape[0]] = self.members
                self.members = grown
            self.members[sid, list(locations)] = True
        return sid

    def _moved(self, sids: np.ndarray, loc: int, add: bool) -> np.ndarray:
        """Each set id in ``sids`` with ``loc`` added or taken out (the moves are few:
        cached; the distinct ids of a batch are mapped, then gathered)."""
        distinct = np.unique(sids)
        to = np.arange(len(self.sets), dtype=np.uint32)
        for sid in distinct.tolist():
            key = (sid, loc, add)
            out = self._moves.get(key)
            if out is None:
                held = self.sets[sid]
                out = self._moves[key] = self._set(held | {loc} if add else held - {loc})
            to[sid] = out
        return to[sids]

    def locations_of(self, sid: int) -> frozenset[str]:
        return frozenset(self.loc_names[loc] for loc in self.sets[sid])

    # -- changes ---------------------------------------------------------------------------

    def apply(self, event: KvEvent | KvRecord) -> None:
        """An event as a model (hex hashes) or as the stream carries it (packed)."""
        if isinstance(event, KvRecord):
            raw, width = event.hashes, event.width
            q = table.keys_of_packed(raw, width)
            sizes = np.frombuffer(event.sizes, "<u4") if event.sizes else None
        else:
            raw, width = None, len(event.hashes[0]) // 2 if event.hashes else 16
            q = table.keys_of(event.hashes)
            sizes = np.asarray(event.sizes, np.uint32) if event.sizes else None
        if event.kind == "stored":
            if self.lru and raw is None:
                raw = bytes.fromhex("".join(event.hashes))
            self._stored(
                q, raw, width, event.location, sizes, event.retention, event.at,
                event.pinned_until,
            )  # fmt: skip
        elif event.kind == "removed":
            self._removed(q, event.location)
        elif event.kind == "touched":
            self._touch(q, event.at, event.pinned_until)
        else:  # cleared
            self.drop_location(event.location)

    def _stored(
        self,
        q: np.ndarray,
        raw: bytes | None,
        width: int,
        location: str,
        sizes: np.ndarray | None,
        retention: str,
        at: float,
        pinned_until: float,
    ) -> None:
        """Blocks (their keys ``q``; hashes packed in ``raw``, where kept) stored at
        ``location``."""
        if not q.size:
            return
        self._room(q.size)
        slots = np.empty(q.size, np.int64)
        new = np.empty(q.size, np.bool_)
        took = table.claim(self.keys, q, slots, new)
        fresh = slots[new]
        self.live += fresh.size
        self.gone -= fresh.size - took
        loc = self._location(location)
        if self.lru:
            assert raw is not None, "the holder that evicts keeps each hash whole"
            names = np.frombuffer(raw, np.uint8).reshape(q.size, width)
            self._stored_lru(names, slots, new, fresh, loc, sizes, pinned_until)
        code, flags = RETENTIONS.index(retention), WIDE if width > 16 else 0
        pinned, j = _second(pinned_until), 0
        while True:  # (stopping at each set whose move with this location is new)
            moves = self._adds(loc)
            j = table.settle(
                self.where, self.expires, self.retention, slots, new, j, code, flags,
                self.ttl, at, pinned, moves,
            )  # fmt: skip
            if j == slots.size:
                return
            sid = int(self.where[slots[j]])
            moves[sid] = self._set(self.sets[sid] | {loc})

    def _adds(self, loc: int) -> np.ndarray:
        """Set id → the set with ``loc`` added (-1: not known yet), as long as the sets."""
        moves = self._add_moves.get(loc)
        if moves is None or moves.size < len(self.sets):
            grown = np.full(2 * len(self.sets) + 8, -1, np.int32)
            if moves is not None:
                grown[: moves.size] = moves
            moves = self._add_moves[loc] = grown
        return moves

    def _stored_lru(
        self,
        names: np.ndarray,
        slots: np.ndarray,
        new: np.ndarray,
        fresh: np.ndarray,
        loc: int,
        sizes: np.ndarray | None,
        pinned_until: float,
    ) -> None:
        """The holder that evicts: each new block's hash whole, sizes (a size changed while
        in the storage tier: its sum follows), pins, and the storage tier's LRU order."""
        self.where[fresh] = 0
        self.names[fresh, : names.shape[1]] = names[new]
        self.pins[fresh] = 0
        self.sizes[fresh] = 0
        if sizes is not None:
            changed = slots[sizes > 0]
            before = self.sizes[changed].astype(np.int64)
            self.sizes[changed] = sizes[sizes > 0]
            there = self.members[self.where[changed], self.store]
            self.store_bytes += int((self.sizes[changed] - before)[there].sum())
        self.pins[slots] = np.maximum(self.pins[slots], _second(pinned_until))
        if loc == self.store:
            distinct = np.unique(slots)
            joining = distinct[~self.members[self.where[distinct], loc]]
            self.store_bytes += int(self.sizes[joining].sum())
            self.used[slots] = self.uses + np.arange(1, slots.size + 1, dtype=np.uint64)
            self.uses += slots.size

    def _removed(self, q: np.ndarray, location: str) -> None:
        loc = self.loc_ids.get(location)
        if loc is None or not q.size:
            return
        slots = table.locate(self.keys, q)
        self._take(np.unique(slots[slots >= 0]), loc)

    def _take(self, slots: np.ndarray, loc: int) -> None:
        """``loc`` out of these rows' locations; a row left with none is freed."""
        slots = slots[self.members[self.where[slots], loc]]
        if not slots.size:
            return
        if self.lru and loc == self.store:
            self.store_bytes -= int(self.sizes[slots].sum())
        self.where[slots] = self._moved(self.where[slots], loc, add=False)
        empty = slots[self.where[slots] == 0]
        self.keys[empty] = table.GONE
        self.live -= empty.size
        self.gone += empty.size

    def drop_location(self, location: str) -> int:
        """A worker is gone: its memory tier with it. Returns the blocks it held."""
        loc = self.loc_ids.get(location)
        if loc is None:
            return 0
        sids = np.flatnonzero(self.members[: len(self.sets), loc])
        rows = np.flatnonzero(np.isin(self.where, sids) & (self.keys > table.GONE))
        self._take(rows, loc)
        return int(rows.size)

    def forget(self, hashes: Iterable[str]) -> None:
        """Drop blocks from every location (expired ones)."""
        hashes = list(hashes)
        if not hashes:
            return
        slots = table.locate(self.keys, table.keys_of(hashes))
        slots = np.unique(slots[slots >= 0])
        for loc in range(len(self.loc_names)):
            self._take(slots, loc)

    # -- questions -------------------------------------------------------------------------

    def lookup(self, hashes: list[str], now: float, touch: bool = True) -> dict[str, int]:
        """Per location, how many of ``hashes`` from the first it holds. Blocks counted are
        marked used now (they are about to be read), unless the caller does that later with
        ``touch`` (off the lookup's latency)."""
        if not hashes:
            return {}
        q = table.keys_of(hashes)
        n, ends = table.chain(self.keys, self.where, self.expires, self.members, q, now)
        counts = {self.loc_names[loc]: int(e) for loc, e in enumerate(ends.tolist()) if e > 0}
        if touch and n:
            self._touch(q[:n], now)
        return counts

    def touch(self, hashes: list[str], now: float, pinned_until: float = 0.0) -> None:
        """Mark blocks used (and pinned until ``pinned_until``, when later than they are).
        Later blocks first, so a chain's head ends up the most recent: eviction then trims
        chains from the tail, never cutting a prefix's head."""
        if hashes:
            self._touch(table.keys_of(hashes), now, pinned_until)

    def _touch(self, q: np.ndarray, now: float, pinned_until: float = 0.0) -> None:
        slots = table.locate(self.keys, q)
        slots = slots[slots >= 0]
        if not slots.size:
            return
        self._live_until(slots, now, pinned_until)
        if self.lru:
            self.pins[slots] = np.maximum(self.pins[slots], _second(pinned_until))
            stored = slots[self.members[self.where[slots], self.store]][::-1]
            self.used[stored] = self.uses + np.arange(1, stored.size + 1, dtype=np.uint64)
            self.uses += stored.size

    def _live_until(self, slots: np.ndarray, at: float, pinned_until: float) -> None:
        """Used at ``at``: each row lives its class's TTL from then, or to its pin if later
        (never less than it did)."""
        ends = np.ceil(at + self.ttl[self.retention[slots] & 1])
        ends = np.clip(np.maximum(ends, _second(pinned_until)), 0, SECONDS_MAX)
        self.expires[slots] = np.maximum(self.expires[slots], ends.astype(np.uint32))

    def _rows(self, location: str | None = None) -> np.ndarray:
        rows = self.keys > table.GONE
        if location is not None:
            loc = self.loc_ids.get(location)
            if loc is None:
                return np.zeros(0, np.int64)
            rows &= self.members[self.where, loc]
        return np.flatnonzero(rows)

    def names_of(self, slots: np.ndarray) -> list[str]:
        """(lru) The hashes of these rows, whole."""
        assert self.lru, "only the holder that evicts keeps hashes whole"
        wide = (self.retention[slots] & WIDE) != 0
        return [
            self.names[s].tobytes().hex() if w else self.names[s, :16].tobytes().hex()
            for s, w in zip(slots.tolist(), wide.tolist(), strict=True)
        ]

    def expired(self, now: float, location: str | None = None) -> list[str]:
        """(lru) The blocks whose life ended before ``now`` (held at ``location``, if given)."""
        rows = self._rows(location)
        return self.names_of(rows[self.expires[rows] < now])

    def eviction_victims(
        self, capacity: int, high: float, low: float, now: float | None = None
    ) -> list[str]:
        """(lru) Past the high watermark, the least recently used storage-tier blocks whose
        removal brings it down to the low watermark; a block pinned past ``now`` is passed
        over."""
        if self.store_bytes <= capacity * high:
            return []
        now = time.time() if now is None else now
        rows = self._rows(STORE)
        rows = rows[np.argsort(self.used[rows], kind="stable")]
        rows = rows[self.pins[rows] <= now]
        need = self.store_bytes - capacity * low
        freed = np.cumsum(self.sizes[rows], dtype=np.int64)
        return self.names_of(rows[: int(np.searchsorted(freed, need)) + 1])

    def info(self, h: str) -> dict | None:
        """One block's row, as values (tests, tools)."""
        (slot,) = table.locate(self.keys, table.keys_of([h])).tolist()
        if slot < 0:
            return None
        out = {
            "locations": self.locations_of(int(self.where[slot])),
            "retention": RETENTIONS[self.retention[slot] & 1],
            "expires": int(self.expires[slot]),
        }
        if self.lru:
            out |= {"size": int(self.sizes[slot]), "pinned_until": int(self.pins[slot])}
        return out

    def store_order(self) -> list[str]:
        """(lru) The storage tier's blocks, least recently used first."""
        rows = self._rows(STORE)
        return self.names_of(rows[np.argsort(self.used[rows], kind="stable")])

    # -- persistence -----------------------------------------------------------------------

    def columns(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The index as plain values and arrays of its live rows (a snapshot's body): the
        location sets by name, and per field one array, storage-tier blocks in LRU order."""
        rows = self._rows()
        if self.lru:
            rows = rows[np.argsort(self.used[rows], kind="stable")]
        sids, where = np.unique(self.where[rows], return_inverse=True)
        arrays = {"keys": self.keys[rows], "where": where.astype(np.uint32)}
        arrays |= {name: getattr(self, name)[rows] for name in self._columns()[1:]}
        if self.lru:
            arrays["used"] = np.arange(rows.size, dtype=np.uint64)  # (the order is the rows')
        plain = {"sets": [sorted(self.locations_of(int(s))) for s in sids.tolist()]}
        return plain, arrays

    @classmethod
    def from_columns(
        cls,
        plain: dict,
        arrays: dict[str, np.ndarray],
        ttl_s: dict[str, float],
        lru: bool = True,
        kept_with: dict[str, float] | None = None,
    ) -> BlockIndex:
        """The index of ``columns``; kept with other TTLs than it was (``kept_with``), each
        block's life is its last use plus its class's new TTL (or its pin, where later)."""
        if lru and "names" not in arrays:
            raise ValueError("names: a holder that evicts needs each hash whole")
        rows = arrays["keys"].size
        index = cls(ttl_s, lru, capacity=int(rows / table.MAX_LOAD * table.GROWTH) + 1024)
        sets = np.array(
            [index._set(frozenset(index._location(n) for n in s)) for s in plain["sets"]] or [0],
            np.uint32,
        )
        slots = table.place(index.keys, np.ascontiguousarray(arrays["keys"], np.uint64))
        index.where[slots] = sets[arrays["where"]]
        for name in index._columns()[1:]:
            getattr(index, name)[slots] = arrays[name]
        index.live = rows
        if kept_with and kept_with != ttl_s:
            code = index.retention[slots] & 1
            was = np.array([kept_with[r] for r in RETENTIONS])[code]
            ends = index.expires[slots] - was + index.ttl[code]
            if lru:
                ends = np.maximum(ends, index.pins[slots])
            index.expires[slots] = np.clip(np.ceil(ends), 0, SECONDS_MAX)
        if lru:
            index.uses = rows
            index.store_bytes = int(index.sizes[index._rows(STORE)].sum())
        return index

    def copy(self) -> BlockIndex:
        """A copy whose arrays are its own (a snapshot written on a thread)."""
        other = object.__new__(BlockIndex)
        other.__dict__ = dict(self.__dict__)
        for name in ("keys", *self._columns()):
            setattr(other, name, getattr(self, name).copy())
        other.sets, other.set_ids = list(self.sets), dict(self.set_ids)
        other.loc_ids, other.loc_names = dict(self.loc_ids), list(self.loc_names)
        other.members, other._moves = self.members.copy(), dict(self._moves)
        other._add_moves = {loc: m.copy() for loc, m in self._add_moves.items()}
        return other

    def check_integrity(self) -> None:
        rows = self._rows()
        assert rows.size == self.live, "live rows miscounted"
        assert int((self.keys == table.GONE).sum()) == self.gone, "removed rows miscounted"
        assert (self.where[rows] != 0).all(), "a block with no location"
        found = table.locate(self.keys, self.keys[rows])
        assert (found == rows).all(), "a block its probe does not reach"
        if self.lru:
            assert self.store_bytes == int(self.sizes[self._rows(STORE)].sum())

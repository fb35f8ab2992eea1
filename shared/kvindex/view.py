"""The block index and the workers' feeds, as the KV event stream made them up to a stream
position; saved and shared as a snapshot from which the stream is followed on.

A snapshot is one JSON object: the stream position it reflects, the TTLs it was kept with,
each source's feed (``Feed.state``) and the blocks as columns (``BlockIndex.columns``).
Cachemeta writes one every so often (to its state dir, and to the bus where routers find it).
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict

from shared.kvindex.feeds import Feeds
from shared.kvindex.index import BlockIndex
from shared.messages.kvevents import KvEvent
from shared.telemetry.metrics import KV_EVENTS_MALFORMED

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
# A block's life after its last use, by retention class, until a snapshot says what
# cachemeta keeps (KVMESH_CACHEMETA_TTL_*_S: these are its defaults).
DEFAULT_TTL_S = {"chat": 7 * 86400.0, "agent": 3 * 86400.0}


class SnapshotError(ValueError):
    """A snapshot that cannot be read (another version, damaged)."""


class KvIndex:
    def __init__(self, ttl_s: dict[str, float], lru: bool = True, bound_s: float = 2.0) -> None:
        self.blocks = BlockIndex(ttl_s, lru)
        self.feeds = Feeds(bound_s)
        self.seq = 0  # the last stream message applied

    def __len__(self) -> int:
        return len(self.blocks)

    def apply(self, event: KvEvent, seq: int) -> bool:
        """Apply the stream's message ``seq``; False when it was applied already."""
        if seq <= self.seq:
            return False
        self.seq = seq
        self.admit(event)
        return True

    def admit(self, event: KvEvent) -> None:
        """Apply an event counted against its source's feed (the stream's, or one its holder
        follows itself: a server a router routes to that publishes on no stream)."""
        admitted, forget = self.feeds.admit(event)
        if forget:
            self.blocks.drop_location(forget)
        if admitted:
            self.blocks.apply(event)

    def apply_message(self, data: bytes, seq: int) -> bool:
        """Apply the stream's message ``seq`` as it came; a malformed one is logged and
        skipped (its position counts as applied). False for a malformed one."""
        try:
            event = KvEvent.from_bytes(data)
        except ValueError as err:
            log.warning("dropped a malformed KV event (stream seq %d): %s", seq, err)
            KV_EVENTS_MALFORMED.inc()
            self.seq = max(self.seq, seq)
            return False
        self.apply(event, seq)
        return True

    # -- snapshots --------------------------------------------------------------------------

    def frozen(self) -> KvIndex:
        """A shallow copy (fast: no entry is copied) whose snapshot can be written on a
        thread. Entries changed meanwhile change after ``seq``: replayed from the stream
        (applying an event twice changes nothing)."""
        copy = KvIndex(self.blocks.ttl_s, self.blocks.lru, self.feeds.bound_s)
        copy.blocks.entries = dict(self.blocks.entries)
        copy.blocks.store_lru = OrderedDict(self.blocks.store_lru)
        copy.feeds.restore(self.feeds.states())
        copy.seq = self.seq
        return copy

    def snapshot(self) -> bytes:
        body = {
            "version": SNAPSHOT_VERSION,
            "seq": self.seq,
            "ttl_s": self.blocks.ttl_s,
            "feeds": self.feeds.states(),
            **self.blocks.columns(),
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_snapshot(
        cls,
        data: bytes,
        ttl_s: dict[str, float] | None = None,
        lru: bool = True,
        bound_s: float = 2.0,
    ) -> KvIndex:
        """The index a snapshot holds, kept with ``ttl_s`` (the snapshot's own by default)."""
        try:
            body = json.loads(data)
            if body.get("version") != SNAPSHOT_VERSION:
                raise SnapshotError(f"version {body.get('version')!r}, not {SNAPSHOT_VERSION}")
            ttl = ttl_s or {k: float(v) for k, v in body["ttl_s"].items()}
            index = cls(ttl, lru, bound_s)
            index.blocks = BlockIndex.from_columns(body, ttl, lru)
            index.feeds.restore(body["feeds"])
            index.seq = int(body["seq"])
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise SnapshotError(f"unreadable: {err!r}") from None
        return index

"""The block index and the workers' feeds, as the KV event stream made them up to a stream
position; saved and shared as a snapshot from which the stream is followed on.

A snapshot is one line of JSON (the stream position it reflects, the TTLs it was kept with,
each source's feed (``Feed.state``), the blocks' location sets and the arrays that follow),
then the blocks' arrays as raw bytes, one after another (``BlockIndex.columns``): read back
without a parse per block. Cachemeta writes one every so often (to its state dir, and to the
bus where routers find it).
"""

from __future__ import annotations

import json
import logging
import math

import numpy as np

from shared.kvindex.feeds import Feeds
from shared.kvindex.index import BlockIndex
from shared.messages.kvevents import KvEvent, KvRecord, unpack_events
from shared.telemetry.metrics import KV_EVENTS_MALFORMED

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 2
DTYPES = {"<u8", "<u4", "|u1", "<f8"}  # what a snapshot's arrays may be
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

    def admit(self, event: KvEvent | KvRecord) -> None:
        """Apply an event counted against its source's feed (the stream's, or one its holder
        follows itself: a server a router routes to that publishes on no stream)."""
        admitted, forget = self.feeds.admit(event)
        if forget:
            self.blocks.drop_location(forget)
        if admitted:
            self.blocks.apply(event)

    def apply_message(self, data: bytes, seq: int) -> bool:
        """Apply the stream's message ``seq`` (a batch of events) as it came; a malformed one
        is logged and skipped (its position counts as applied). False for a malformed one."""
        if seq <= self.seq:
            return True
        try:
            events = unpack_events(data)
        except ValueError as err:
            log.warning("dropped a malformed KV event (stream seq %d): %s", seq, err)
            KV_EVENTS_MALFORMED.inc()
            self.seq = max(self.seq, seq)
            return False
        self.seq = seq
        for event in events:
            self.admit(event)
        return True

    # -- snapshots --------------------------------------------------------------------------

    def frozen(self) -> KvIndex:
        """A copy (its arrays copied whole: fast) whose snapshot can be written on a
        thread. Entries changed meanwhile change after ``seq``: replayed from the stream
        (applying an event twice changes nothing)."""
        copy = KvIndex(self.blocks.ttl_s, self.blocks.lru, self.feeds.bound_s)
        copy.blocks = self.blocks.copy()
        copy.feeds.restore(self.feeds.states())
        copy.seq = self.seq
        return copy

    def snapshot(self) -> bytes:
        plain, arrays = self.blocks.columns()
        head = {
            "version": SNAPSHOT_VERSION,
            "seq": self.seq,
            "ttl_s": self.blocks.ttl_s,
            "feeds": self.feeds.states(),
            **plain,
            "arrays": [[name, a.dtype.str, list(a.shape)] for name, a in arrays.items()],
        }
        body = b"".join(np.ascontiguousarray(a).tobytes() for a in arrays.values())
        return json.dumps(head, separators=(",", ":")).encode() + b"\n" + body

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
            end = data.index(b"\n")
            head = json.loads(data[:end])
            if head.get("version") != SNAPSHOT_VERSION:
                raise SnapshotError(f"version {head.get('version')!r}, not {SNAPSHOT_VERSION}")
            arrays, offset = {}, end + 1
            for name, dtype, shape in head["arrays"]:
                if dtype not in DTYPES:
                    raise SnapshotError(f"array {name!r}: dtype {dtype!r}")
                count = math.prod(shape)
                a = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
                arrays[name] = a.reshape(shape)
                offset += a.nbytes
            if offset != len(data):
                raise SnapshotError(f"{len(data) - offset} bytes past the arrays")
            kept_with = {k: float(v) for k, v in head["ttl_s"].items()}
            ttl = ttl_s or kept_with
            index = cls(ttl, lru, bound_s)
            index.blocks = BlockIndex.from_columns(head, arrays, ttl, lru, kept_with)
            index.feeds.restore(head["feeds"])
            index.seq = int(head["seq"])
        except SnapshotError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as err:
            raise SnapshotError(f"unreadable: {err!r}") from None
        return index

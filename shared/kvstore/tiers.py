"""A worker's KV tiers: its host-memory tier, the shared storage tier, the write-behind queue,
and the KV events that tell cachemeta about every change.

Reads are on the request's path: the longest prefix of a prompt's blocks, from memory first,
then from the storage tier (blocks any worker wrote). Writes never are: new blocks go on a
bounded queue written by a background task; when the queue is full the blocks are skipped (and
counted), so a slow disk never stalls prefill. A storage tier that cannot be written (full,
read-only, I/O errors) is left alone for ``retry_s`` after each failure: its blocks stay in
the memory tier only, counted, and the worker's heartbeat says why (``store_error``) until a
write works again. A block that cannot be read is a miss.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass

from opentelemetry import context as otel_context

from shared.bus import Bus, subjects
from shared.kvindex.publisher import KvEventPublisher
from shared.kvstore.backend import FileStore, MemoryStore, why_not_written
from shared.messages.kvevents import MEMORY, STORAGE, STORE, memory_location
from shared.telemetry.metrics import BYTES, STORE_FAILURES
from shared.telemetry.tracing import tracer

log = logging.getLogger(__name__)


@dataclass
class CachedPrefix:
    """Blobs of a prompt's leading blocks, each with the tier it came from."""

    hashes: list[str]
    blobs: list[bytes]
    tiers: list[str]

    def truncate(self, n: int) -> None:
        del self.hashes[n:], self.blobs[n:], self.tiers[n:]

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        return {t: self.tiers.count(t) * block_size for t in (MEMORY, STORAGE)}


@dataclass
class _Write:
    hashes: list[str]
    blobs: list[bytes]
    retention: str
    context: otel_context.Context  # the request's: its "kv.store" span goes there
    queued_ns: int  # the span starts when the blocks were queued
    pinned_until: float = 0.0  # (unix time) kept in both tiers until then


class KvTiers:
    def __init__(
        self,
        bus: Bus,
        events: KvEventPublisher,
        memory_bytes: int,
        store: FileStore | None,
        queue_bytes: int,
        retry_s: float = 30.0,
    ) -> None:
        self.bus = bus
        self.events = events
        self.location = memory_location(events.source)
        self.memory = MemoryStore(memory_bytes)
        self.store = store
        self._queue: asyncio.Queue[_Write] = asyncio.Queue()
        self.queue_bytes = queue_bytes  # (bytes, not blocks: one long prompt is never cut
        self.queued_bytes = 0  # short by a count sized for short ones)
        self.queued_blocks = 0
        self.skipped_blocks = 0  # not stored: the write-behind queue was full
        self.written_blocks = 0
        self.store_error = ""  # why the storage tier is not written now (empty: it is)
        self.unstored_blocks = 0  # not in the storage tier: it could not be written
        self.retry_s = retry_s
        self._retry_at = 0.0

    @property
    def keep(self) -> bool:
        """Whether a block written here is kept anywhere (memory tier or storage)."""
        return self.memory.capacity_bytes > 0 or self.store is not None

    async def start(self, stack: AsyncExitStack) -> None:
        # Cachemeta owns the stream's configuration; a worker that starts first creates it.
        await self.bus.ensure_stream(
            subjects.KV_EVENTS_STREAM, [subjects.KV_EVENTS_ALL], create_only=True
        )
        writer = asyncio.create_task(self._writer())
        stack.callback(writer.cancel)

    # -- reads (on the request's path) -----------------------------------------------------

    async def read_prefix(self, hashes: list[str]) -> CachedPrefix:
        """The longest run of ``hashes`` from the first that some tier holds."""
        found = CachedPrefix([], [], [])
        for h in hashes:
            blob = self.memory.get(h)
            if blob is None:
                break
            found.hashes.append(h)
            found.blobs.append(blob)
            found.tiers.append(MEMORY)
        rest = hashes[len(found.hashes) :]
        # A cold prompt's first block is not there: one stat, no trip to a thread.
        if rest and self.store is not None and rest[0] in self.store:
            blobs = await asyncio.to_thread(self._read_files, rest)
            BYTES.labels("store", "read").inc(sum(len(b) for b in blobs))
            found.hashes += rest[: len(blobs)]
            found.blobs += blobs
            found.tiers += [STORAGE] * len(blobs)
        return found

    def _read_files(self, hashes: list[str]) -> list[bytes]:
        """The blocks from the first up to the first missing (or unreadable: a miss)."""
        assert self.store is not None
        errors = self.store.read_errors
        blobs = []
        for h in hashes:
            blob = self.store.get(h)
            if blob is None:
                break
            blobs.append(blob)
        STORE_FAILURES.labels("read", "io").inc(self.store.read_errors - errors)
        return blobs

    async def discard(self, h: str, tier: str, reason: str) -> None:
        """A block that failed its checksums on load: gone from its tier, and reported."""
        if tier == MEMORY:
            self.memory.delete(h)
            await self.events.publish("removed", self.location, [h])
        elif self.store is not None:
            self.store.discard(h, reason)
            await self.events.publish("removed", STORE, [h])

    async def remember(
        self, prefix: CachedPrefix, retention: str, pinned_until: float = 0.0
    ) -> None:
        """Blocks just read from the storage tier are kept in memory for next time (those
        read from memory pinned there too, for a conversation that said it will continue)."""
        blocks = list(zip(prefix.hashes, prefix.blobs, prefix.tiers, strict=True))
        pairs = [(h, b) for h, b, t in blocks if t == STORAGE]
        if pairs:
            hashes, blobs = [h for h, _ in pairs], [b for _, b in pairs]
            await self._to_memory(hashes, blobs, retention, pinned_until)
        if pinned_until:
            self.memory.pin([h for h, _, t in blocks if t == MEMORY], pinned_until)

    # -- writes (behind the request's path) ------------------------------------------------

    def write_behind(
        self,
        hashes: list[str],
        blobs: list[bytes],
        retention: str,
        context: otel_context.Context | None = None,
        pinned_until: float = 0.0,
    ) -> int:
        """Queue blocks for both tiers (kept there until ``pinned_until`` whatever eviction
        would do); returns how many were skipped (queue full). Their "kv.store" span goes to
        ``context`` (the current one by default)."""
        room = max(0, self.queue_bytes - self.queued_bytes)
        take = size = 0
        for blob in blobs:
            if size + len(blob) > room:
                break
            take, size = take + 1, size + len(blob)
        if take:
            ctx = context or otel_context.get_current()
            write = _Write(
                hashes[:take], blobs[:take], retention, ctx, time.time_ns(), pinned_until
            )
            self._queue.put_nowait(write)
            self.queued_blocks += take
            self.queued_bytes += size
            if self.keep:  # (announced where it is kept: its memory tier first)
                where = self.location if self.memory.capacity_bytes > 0 else STORE
                self.events.computed(take, where)
        skipped = len(hashes) - take
        if skipped:
            self.skipped_blocks += skipped
            log.warning("write-behind queue full: %d blocks not stored", skipped)
        return skipped

    async def _writer(self) -> None:
        """Everything queued at once: one pass over the files, one event per location and
        retention class (the events are what costs, not the bytes)."""
        while True:
            items = [await self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            for retention, pin in {(i.retention, i.pinned_until) for i in items}:
                batch = [i for i in items if (i.retention, i.pinned_until) == (retention, pin)]
                hashes = [h for i in batch for h in i.hashes]
                blobs = [b for i in batch for b in i.blobs]
                try:
                    await self._to_memory(hashes, blobs, retention, pin)
                    if self.store is not None:
                        n = await self._to_store(hashes, blobs)
                        sizes = [len(b) for b in blobs[:n]]
                        BYTES.labels("store", "write").inc(sum(sizes))
                        if n:
                            await self.events.publish(
                                "stored", STORE, hashes[:n], sizes, retention, pin
                            )
                    self.written_blocks += len(hashes)
                except Exception:
                    log.exception("storing %d KV blocks failed", len(hashes))
                finally:
                    self.queued_blocks -= len(hashes)
                    self.queued_bytes -= sum(len(b) for b in blobs)
                for item in batch:  # one span per request: queued → stored
                    span = tracer.start_span(
                        "kv.store",
                        context=item.context,
                        start_time=item.queued_ns,
                        attributes={
                            "blocks": len(item.hashes),
                            "bytes": sum(len(b) for b in item.blobs),
                            "storage_tier": self.store is not None,
                            "written_with_blocks": len(hashes),
                        },
                    )
                    span.end()

    @property
    def store_retry_in_s(self) -> float:
        """While the storage tier fails: how long until a write is tried on it again (0 when
        the next write is tried)."""
        return max(0.0, self._retry_at - time.monotonic()) if self.store_error else 0.0

    async def _to_store(self, hashes: list[str], blobs: list[bytes]) -> int:
        """The blocks written to the storage tier, from the first: how many. While it fails
        (full, read-only, I/O) one write is tried per ``retry_s``; the rest are not stored."""
        if self.store_error and time.monotonic() < self._retry_at:
            self._unstored(len(hashes), self.store_error)
            return 0
        n, err = await asyncio.to_thread(self._write_files, hashes, blobs)
        if err is None:
            if self.store_error:
                log.warning("storage tier %s is written again", self.store.root)
                self.store_error = ""
            return n
        why = why_not_written(err)
        if why != self.store_error:
            log.error(
                "storage tier %s cannot be written (%s: %s): blocks stay in the memory tier "
                "only; one write is tried again every %g s",
                self.store.root,
                why,
                err,
                self.retry_s,
            )
        self.store_error = why
        self._retry_at = time.monotonic() + self.retry_s
        self._unstored(len(hashes) - n, why)
        return n

    def _unstored(self, n: int, why: str) -> None:
        self.unstored_blocks += n
        STORE_FAILURES.labels("write", why).inc(n)

    def _write_files(self, hashes: list[str], blobs: list[bytes]) -> tuple[int, OSError | None]:
        """Blocks written from the first, until one cannot be: how many, and why not."""
        assert self.store is not None
        for i, (h, blob) in enumerate(zip(hashes, blobs, strict=True)):
            try:
                if h not in self.store:  # the same block from another worker: already there
                    self.store.put(h, blob)
            except OSError as err:
                return i, err
        return len(hashes), None

    async def _to_memory(
        self, hashes: list[str], blobs: list[bytes], retention: str, pinned_until: float = 0.0
    ) -> None:
        evicted: list[str] = []
        for h, blob in zip(hashes, blobs, strict=True):
            evicted += self.memory.put(h, blob, pinned_until)
        kept = [(h, len(b)) for h, b in zip(hashes, blobs, strict=True) if h in self.memory]
        await self.events.publish(
            "stored",
            self.location,
            [h for h, _ in kept],
            [size for _, size in kept],
            retention,
            pinned_until,
        )
        if evicted:
            await self.events.publish("removed", self.location, evicted)

    def held(self) -> list[tuple[str, int]]:
        """What the memory tier holds: each block's hash and bytes (for a resync)."""
        return self.memory.sizes()

"""A process's KV events, numbered, on its role's subject of the KV event stream.

Each event carries its publisher's id, its process's start (``epoch``) and its number in that
process (``seq``, from 1); ``made`` goes in the heartbeat, so that whoever applies the stream
can tell a feed that lags (``shared/kvindex/feeds.py``). A worker also tells the blocks of new
KV it computed (``computed``): each is to be announced by a "stored" event at the location it
was kept, and how long the oldest of them has waited (``unannounced_s``, in the heartbeat)
tells a feed that went quiet while its worker computes (a bridge whose engine stopped
talking). Blocks are matched to announcements by count, oldest first, so an earlier
computation's late event does not hide a later one's silence; those still waiting when an
event is made more than ``bound_s`` after them are dropped (the feed flows: the engine chose
not to keep them). An engine's event may also come before its worker tells what it computed
(vLLM's feed and its answers are two streams): blocks announced that nothing waited for are
kept for ``bound_s``, and the blocks computed next take them first.

Events go out in order, in batches: one message carries what was published while the one
before it was being stored (``pack_events``), up to ``BATCH_BYTES``; a quiet worker's event
goes alone, at once.

A publish that fails is logged and counted, not raised: the event is lost. The holders of the
index see the gap and ask for a resync (``resync``); a worker also resyncs by itself at its
first event published after a loss (``held``: what its memory tier holds, given at start).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from shared import faults
from shared.bus import Bus, subjects
from shared.messages.kvevents import KvEvent, KvRecord, memory_location, pack_events

log = logging.getLogger(__name__)

# How long a KV event is retried when no store answers (a NATS node lost, a stream electing
# its leader): the holders of the index must learn of every block, or they resync.
EVENT_RETRY_S = 30.0
RESYNC_CHUNK = 1000  # blocks per event of a resync
RESYNC_BLOCKS_PER_S = 50_000  # a resync's rate at most (its events share the stream)
BATCH_BYTES = 1 << 20  # a message's events at most (nats.conf's max_payload is 8 MB)


class KvEventPublisher:
    def __init__(
        self,
        bus: Bus,
        role: str,
        service_id: str,
        epoch: float,
        held: Callable[[], list[tuple[str, int]]] | None = None,
        bound_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bus = bus
        self.held = held  # a worker's memory tier: each block's hash and bytes
        self.subject = subjects.kv_events(role)
        self.source = service_id
        self.epoch = epoch
        self.made = 0  # events made in this process (the last one's seq)
        self.lost = 0  # of those, not published
        self.bound_s = bound_s
        self.clock = clock  # when blocks were computed and announced (tests give their own)
        # Blocks of new KV computed, each to be announced: location → [computed at, blocks];
        # and blocks announced before they were told computed: location → [announced at, blocks].
        self.waiting: dict[str, deque[list]] = {}
        self.ahead: dict[str, deque[list]] = {}
        self._resync: asyncio.Task | None = None
        self._lost_since_resync = False
        self.resyncs = 0
        self._pending: list[tuple[KvRecord, asyncio.Future]] = []  # (the next batch)
        self._sender: asyncio.Task | None = None
        self.messages = 0  # batches stored

    async def publish(
        self,
        kind: str,
        location: str,
        hashes: list[str],
        sizes: list[int] | None = None,
        retention: str = "chat",
        pinned_until: float = 0.0,
    ) -> None:
        if not hashes and kind != "cleared":
            return
        self.made += 1
        self._announced(location if kind == "stored" else "", len(hashes), self.clock())
        event = KvEvent(
            kind=kind,  # type: ignore[arg-type]
            location=location,
            hashes=hashes,
            sizes=sizes or [],
            retention=retention,  # type: ignore[arg-type]
            pinned_until=pinned_until,
            at=time.time(),
            source=self.source,
            epoch=self.epoch,
            seq=self.made,
        )
        failed = await self._send(KvRecord.of(event))
        if failed is not None:
            self.lost += 1
            self._lost_since_resync = True
            log.warning("KV event %d not published: %s", event.seq, failed)
            return
        if self._lost_since_resync and self.held is not None:
            self.resync(self.held(), "events were lost before this one")

    async def _send(self, record: KvRecord) -> Exception | None:
        """``record`` in the next batch; None once it is stored, else why not."""
        sent = asyncio.get_running_loop().create_future()
        self._pending.append((record, sent))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.create_task(self._send_batches())
        return await asyncio.shield(sent)

    async def _send_batches(self) -> None:
        """Batches in order, one stored before the next is sent."""
        while self._pending:
            await asyncio.sleep(0)  # (what the loop's other tasks publish now joins this one)
            size, n = 0, 0
            while n < len(self._pending) and (not n or size < BATCH_BYTES):
                size += len(self._pending[n][0].hashes) + len(self._pending[n][0].sizes) + 64
                n += 1
            batch, self._pending = self._pending[:n], self._pending[n:]
            outcome: Exception | None = None
            try:
                if faults.on("kv_events"):
                    raise RuntimeError("fault hook kv_events: not published")
                data = pack_events([record for record, _ in batch])
                await self.bus.publish_durable_bytes(self.subject, data, retry_s=EVENT_RETRY_S)
                self.messages += 1
            except Exception as err:  # (each event's publisher counts it lost)
                outcome = err
            for _, sent in batch:
                if not sent.done():
                    sent.set_result(outcome)

    def computed(self, blocks: int, location: str) -> None:
        """``blocks`` of new KV were computed, to be announced as stored at ``location``."""
        now = self.clock()
        self._expire(self.ahead, now)
        blocks = self._take(self.ahead.get(location), blocks)
        if blocks > 0:
            self.waiting.setdefault(location, deque()).append([now, blocks])

    def unannounced_s(self) -> float:
        """How long the oldest block computed and not yet announced has waited (0: none)."""
        fronts = [queue[0][0] for queue in self.waiting.values() if queue]
        return max(0.0, self.clock() - min(fronts)) if fronts else 0.0

    def _announced(self, location: str, blocks: int, now: float) -> None:
        """An event made: ``blocks`` stored at ``location`` announce the oldest computed
        there (those left over are kept a while, for blocks told computed after), and blocks
        left waiting more than ``bound_s`` before it are not to be."""
        blocks = self._take(self.waiting.get(location), blocks)
        if location and blocks > 0:
            self.ahead.setdefault(location, deque()).append([now, blocks])
        self._expire(self.waiting, now)  # (the feed flows: the engine chose not to keep them)
        self._expire(self.ahead, now)

    @staticmethod
    def _take(queue: deque[list] | None, blocks: int) -> int:
        """``blocks`` matched against ``queue``'s oldest first; returns those left over."""
        while queue and blocks > 0:
            take = min(blocks, queue[0][1])
            queue[0][1] -= take
            blocks -= take
            if not queue[0][1]:
                queue.popleft()
        return blocks

    def _expire(self, queues: dict[str, deque[list]], now: float) -> None:
        """Entries older than ``bound_s`` dropped from ``queues``."""
        for queue in queues.values():
            while queue and now - queue[0][0] > self.bound_s:
                queue.popleft()

    def resync(self, held: list[tuple[str, int]], why: str) -> bool:
        """Republish what this worker's memory tier holds (``held``: hash and bytes of each
        block): its location cleared, then its blocks at a bounded rate. False while one is
        under way already."""
        if self._resync is not None and not self._resync.done():
            return False
        log.info("KV events resync (%s): republishing %d blocks", why, len(held))
        self.resyncs += 1
        self._lost_since_resync = False
        self._resync = asyncio.create_task(self._republish(held))
        return True

    async def _republish(self, held: list[tuple[str, int]]) -> None:
        location = memory_location(self.source)
        await self.publish("cleared", location, [])
        for start in range(0, len(held), RESYNC_CHUNK):
            chunk = held[start : start + RESYNC_CHUNK]
            await self.publish("stored", location, [h for h, _ in chunk], [n for _, n in chunk])
            await asyncio.sleep(len(chunk) / RESYNC_BLOCKS_PER_S)

    async def stop(self) -> None:
        for task in (self._resync, self._sender):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for _, sent in self._pending:  # (not sent: their publishers count them lost)
            if not sent.done():
                sent.set_result(RuntimeError("the publisher stopped"))
        self._pending = []

"""The cachemeta process: where every KV block lives.

It consumes the KV event stream with a durable consumer into the block index, answers lookups
over NATS request/reply, deletes expired and evicted block files from the storage tier (and
says so on the stream), and forgets a worker's memory tier when the worker goes away. The index
is saved every ``snapshot_interval_s`` with the stream position it reflects; on a restart the
consumer is placed just after that position, so the stream replays what the snapshot lacks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import AsyncExitStack, suppress
from pathlib import Path

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry.trace import SpanKind

from services.cachemeta.index import BlockIndex
from services.cachemeta.settings import CachemetaSettings
from shared.bus import Bus, subjects
from shared.files import write_atomically
from shared.kvstore.backend import FileStore
from shared.messages.heartbeat import Heartbeat, Load
from shared.messages.kvevents import STORE, KvEvent, LookupReply, LookupRequest, memory_location
from shared.service import Service
from shared.settings import CommonSettings
from shared.telemetry.tracing import tracer

log = logging.getLogger(__name__)

CONSUMER = "cachemeta"
TOUCH_SLICE = 200  # blocks marked used per turn of the event loop


class CachemetaService(Service):
    role = "cachemeta"

    def __init__(self, common: CommonSettings, settings: CachemetaSettings) -> None:
        super().__init__(common, settings)
        self.settings: CachemetaSettings = settings
        self.index = BlockIndex(settings.ttls())
        self.applied_seq = 0  # the last stream message applied to the index
        self.saved_seq = -1  # the position of the last snapshot written
        self.snapshot_path = Path(common.state_dir) / "cachemeta" / "index.json"
        self.store = FileStore(common.resolved_kv_store_dir)
        self.bus: Bus | None = None
        self.workers_seen: dict[str, float] = {}  # memory location → last heartbeat (monotonic)
        self.touches: asyncio.Queue[tuple[list[str], float]] = asyncio.Queue()

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        self.bus = bus
        await bus.ensure_stream(
            subjects.KV_EVENTS_STREAM,
            [subjects.KV_EVENTS_ALL],
            max_age_s=max(self.settings.ttls().values()) + 86400,
        )
        self._load_snapshot()
        await self._consume(stack)
        await bus.serve(
            subjects.CACHEMETA_LOOKUP, LookupRequest, self.on_lookup, subjects.CACHEMETA_QUEUE
        )
        await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        for loop in (self._gc_loop(), self._snapshot_loop(), self._touch_loop()):
            task = asyncio.create_task(loop)
            stack.callback(task.cancel)
        stack.push_async_callback(self.save_snapshot)

    def load(self) -> Load:
        return Load(inflight=len(self.index))

    # -- the index, from a snapshot and the stream ----------------------------------------

    def _load_snapshot(self) -> None:
        if not self.snapshot_path.is_file():
            return
        try:
            saved = json.loads(self.snapshot_path.read_text())
            self.index = BlockIndex.from_rows(saved["rows"], self.settings.ttls())
            self.applied_seq = int(saved["seq"])
        except (ValueError, KeyError, TypeError) as err:
            log.warning("index snapshot unreadable (%s): rebuilding from the stream", err)
            self.index, self.applied_seq = BlockIndex(self.settings.ttls()), 0
            return
        log.info("index snapshot: %d blocks, stream position %d", len(self.index), self.applied_seq)

    async def _consume(self, stack: AsyncExitStack) -> None:
        """A durable consumer placed just after the snapshot's position."""
        assert self.bus is not None
        js = self.bus.js
        with suppress(NotFoundError):
            await js.delete_consumer(subjects.KV_EVENTS_STREAM, CONSUMER)
        start = self.applied_seq + 1
        config = ConsumerConfig(
            durable_name=CONSUMER,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start > 1 else DeliverPolicy.ALL,
            opt_start_seq=start if start > 1 else None,
            max_ack_pending=100_000,
        )
        sub = await js.subscribe(
            subjects.KV_EVENTS_ALL,
            durable=CONSUMER,
            stream=subjects.KV_EVENTS_STREAM,
            cb=self._on_event_msg,
            manual_ack=True,
            config=config,
        )
        stack.push_async_callback(sub.unsubscribe)

    async def _on_event_msg(self, raw: Msg) -> None:
        seq = raw.metadata.sequence.stream
        if seq > self.applied_seq:
            try:
                self.index.apply(KvEvent.from_bytes(raw.data))
            except ValueError as err:
                log.warning("dropped a malformed KV event (stream seq %d): %s", seq, err)
            self.applied_seq = seq
        await raw.ack()

    async def save_snapshot(self) -> None:
        """The index and the stream position it reflects, written atomically off the loop.
        Entries may change while they are written: those changes come after ``seq`` and
        are replayed on a restart (applying an event twice changes nothing)."""
        if self.applied_seq == self.saved_seq:
            return
        seq = self.applied_seq
        index = self.index.copy_for_snapshot()

        def write() -> None:
            write_atomically(self.snapshot_path, json.dumps({"seq": seq, "rows": index.to_rows()}))

        await asyncio.to_thread(write)
        self.saved_seq = seq

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.snapshot_interval_s)
            try:
                await self.save_snapshot()
            except OSError as err:
                log.warning("index snapshot not saved: %s", err)

    # -- questions and housekeeping --------------------------------------------------------

    async def on_lookup(self, req: LookupRequest) -> LookupReply:
        with tracer.start_as_current_span("cachemeta.lookup", kind=SpanKind.SERVER) as span:
            reply = self._lookup(req)
            span.set_attributes(
                {
                    "blocks": len(req.hashes),
                    "indexed_blocks": len(self.index),
                    "held": json.dumps(reply.counts, sort_keys=True),
                }
            )
        return reply

    def _lookup(self, req: LookupRequest) -> LookupReply:
        now = time.time()
        hashes = req.hashes
        counts = self.index.lookup(hashes, now, touch=False)
        # The blocks about to be read are marked used, a slice at a time off the lookup's
        # path (a touch comes a few ms late; TTLs are days).
        longest = max(counts.values(), default=0)
        if longest:
            self.touches.put_nowait((hashes[:longest], now))
        gone = [loc for loc in counts if loc != STORE and not self._worker_alive(loc)]
        for loc in gone:
            del counts[loc]
        return LookupReply(counts=counts)

    def _worker_alive(self, location: str) -> bool:
        seen = self.workers_seen.get(location)
        limit = 3 * self.common.heartbeat_interval_s
        return seen is not None and time.monotonic() - seen <= limit

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        if hb.role not in ("prefill", "decode"):
            return
        location = memory_location(hb.service_id)
        if hb.status == "stopped":
            self.workers_seen.pop(location, None)
            dropped = self.index.drop_location(location)
            log.info("%s stopped: forgot %d blocks of its memory tier", hb.service_id, dropped)
        else:
            self.workers_seen[location] = time.monotonic()

    async def _touch_loop(self) -> None:
        while True:
            hashes, now = await self.touches.get()
            for start in range(len(hashes) - TOUCH_SLICE, -TOUCH_SLICE, -TOUCH_SLICE):
                self.index.touch(hashes[max(0, start) : start + TOUCH_SLICE], now)
                await asyncio.sleep(0)  # let lookups in between

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gc_interval_s)
            try:
                await self.collect()
            except Exception:
                log.exception("garbage collection failed")

    async def collect(self) -> None:
        """Expired blocks, then the least recently used past the high watermark: files
        deleted, removals published (and applied here at once)."""
        s = self.settings
        expired = self.index.expired(time.time())
        stored = [h for h, e in expired if STORE in e.locations]
        self.index.forget(h for h, _ in expired)
        victims = self.index.eviction_victims(
            s.store_capacity_bytes, s.high_watermark, s.low_watermark
        )
        for h in victims:
            self.index.apply(KvEvent(kind="removed", location=STORE, hashes=[h], at=time.time()))
        doomed = stored + victims
        if not doomed:
            return
        await asyncio.to_thread(lambda: [self.store.delete(h) for h in doomed])
        assert self.bus is not None
        removal = KvEvent(kind="removed", location=STORE, hashes=doomed, at=time.time())
        await self.bus.publish_durable(subjects.kv_events("cachemeta"), removal, retry_s=30)
        log.info(
            "storage tier: %d expired and %d evicted blocks deleted (%d bytes indexed)",
            len(stored),
            len(victims),
            self.index.store_bytes,
        )

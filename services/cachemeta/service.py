"""The cachemeta process: the authority on what is deleted from the KV cache.

It consumes the KV event stream with a durable consumer into the block index (the same one
every router keeps), deletes expired and evicted block files from the storage tier, and says
so on the stream: every router applies its removals, as it applies the blocks routers used
(touches, which restart TTL and LRU clocks everywhere). A worker that stops has its memory tier
cleared, on the stream too. It watches each worker's KV event feed as routers do
(``shared/kvindex/watch.py``) and answers lookups for tools and tests (routers look up in their
own index).

The index is saved every ``snapshot_interval_s`` with the stream position it reflects, to its
state dir and to the bus (where a router starting finds it); on a restart the consumer is
placed just after that position, so the stream replays what the snapshot lacks.

A malformed event is dropped and counted (the stream goes on); a snapshot or a GC pass that
fails is counted, logged, shown on /health ("degraded", naming it) and tried again next time;
a block file that cannot be deleted stays indexed until a pass deletes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from contextlib import AsyncExitStack, suppress
from pathlib import Path

from aiohttp import web
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from opentelemetry.trace import SpanKind

from services.cachemeta.settings import CachemetaSettings
from shared.bus import Bus, subjects
from shared.files import write_atomically
from shared.kvindex import table
from shared.kvindex.follow import publish_snapshot
from shared.kvindex.publisher import KvEventPublisher
from shared.kvindex.view import KvIndex, SnapshotError
from shared.kvindex.watch import FeedWatch, IndexCollector
from shared.kvstore.backend import FileStore
from shared.messages.heartbeat import Heartbeat, Load
from shared.messages.kvevents import STORE, KvEvent, LookupReply, LookupRequest, memory_location
from shared.service import Service
from shared.settings import CommonSettings
from shared.telemetry.metrics import CACHEMETA_FAILURES, STREAM_BYTES, register_load
from shared.telemetry.tracing import tracer

log = logging.getLogger(__name__)

CONSUMER = "cachemeta"


class CachemetaService(Service):
    role = "cachemeta"

    def __init__(self, common: CommonSettings, settings: CachemetaSettings) -> None:
        super().__init__(common, settings)
        self.settings: CachemetaSettings = settings
        self.index = self.fresh_index()
        self.saved_seq = -1  # the position of the last snapshot written
        self.snapshot_path = Path(common.state_dir) / "cachemeta" / "index.snapshot"
        self.store = FileStore(common.resolved_kv_store_dir)
        self.bus: Bus | None = None
        self.events: KvEventPublisher | None = None
        self.watch: FeedWatch | None = None
        self.workers_seen: dict[str, float] = {}  # memory location → last heartbeat (monotonic)
        self.catch_up_to = 0  # the stream's last message at start
        self.failing: dict[str, str] = {}  # housekeeping failing now (snapshot, gc) → why
        self.clearing: set[asyncio.Task] = set()  # stopped workers' tiers being cleared

    def fresh_index(self) -> KvIndex:
        return KvIndex(self.settings.ttls(), lru=True, bound_s=self.common.kv_feed_bound_s)

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        self.bus = bus
        await asyncio.to_thread(table.warm)  # (the index's loops compiled before serving)
        self.events = KvEventPublisher(bus, self.role, self.service_id, self.started_at)
        await bus.ensure_stream(
            subjects.KV_EVENTS_STREAM,
            [subjects.KV_EVENTS_ALL],
            max_age_s=max(self.settings.ttls().values()) + 86400,
            max_bytes=self.settings.events_stream_bytes,
        )
        await bus.ensure_stream(
            subjects.KV_INDEX_STREAM, [subjects.KV_INDEX_ALL], last_per_subject=True
        )
        self._load_snapshot()
        # Nothing is expired before the stream is caught up with: a block a router used
        # while this process was away is kept alive by a touch still to be applied.
        info = await bus.js.stream_info(subjects.KV_EVENTS_STREAM)
        self.catch_up_to = info.state.last_seq
        self.watch = FeedWatch(self.index, bus, self.service_id)
        register_load(IndexCollector(self.watch))
        await self._consume(stack)
        await bus.serve(
            subjects.CACHEMETA_LOOKUP, LookupRequest, self.on_lookup, subjects.CACHEMETA_QUEUE
        )
        await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        for loop in (self._gc_loop(), self._snapshot_loop(), self._watch_loop()):
            task = asyncio.create_task(loop)
            stack.callback(task.cancel)
        stack.push_async_callback(self.save_snapshot)

    def load(self) -> Load:
        return Load(inflight=len(self.index))

    async def health(self, request: web.Request) -> web.Response:
        """The heartbeat's figures, the workers whose KV events are stale (degraded), and the
        storage tier's indexed size against its capacity."""
        body = self.heartbeat().model_dump(mode="json")
        stale = self.watch.stale() if self.watch else {}
        body["kv_events"] = {"stale": stale, "applied_seq": self.index.seq}
        body["storage_tier"] = {
            "bytes": self.index.blocks.store_bytes,
            "capacity": self.settings.store_capacity_bytes,
        }
        body["failing"] = self.failing
        body["health"] = "degraded" if stale or self.failing else "ok"
        return web.json_response(body, status=200 if self.status == "ready" else 503)

    # -- the index, from a snapshot and the stream ----------------------------------------

    def _load_snapshot(self) -> None:
        if not self.snapshot_path.is_file():
            return
        try:
            self.index = KvIndex.from_snapshot(
                self.snapshot_path.read_bytes(),
                self.settings.ttls(),
                lru=True,
                bound_s=self.common.kv_feed_bound_s,
            )
        except (OSError, SnapshotError) as err:
            log.warning("index snapshot unreadable (%s): rebuilding from the stream", err)
            self.index = self.fresh_index()
            return
        log.info("index snapshot: %d blocks, stream position %d", len(self.index), self.index.seq)

    async def _consume(self, stack: AsyncExitStack) -> None:
        """A durable consumer placed just after the snapshot's position."""
        assert self.bus is not None
        js = self.bus.js
        with suppress(NotFoundError):
            await js.delete_consumer(subjects.KV_EVENTS_STREAM, CONSUMER)
        start = self.index.seq + 1
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
        try:
            self.index.apply_message(raw.data, raw.metadata.sequence.stream)
        except Exception:  # never a message that blocks the stream: counted, and passed
            CACHEMETA_FAILURES.labels("event").inc()
            seq = raw.metadata.sequence.stream
            log.exception("a KV event failed to apply (stream seq %d)", seq)
        await raw.ack()

    async def save_snapshot(self) -> None:
        """The index and the stream position it reflects, written atomically off the loop,
        to the state dir and to the bus (for routers starting)."""
        if self.index.seq == self.saved_seq:
            return
        frozen = self.index.frozen()
        data = await asyncio.to_thread(frozen.snapshot)
        await asyncio.to_thread(write_atomically, self.snapshot_path, data)
        self.saved_seq = frozen.seq
        assert self.bus is not None
        await publish_snapshot(self.bus, data, frozen.seq)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.snapshot_interval_s)
            try:
                await self.save_snapshot()
            except Exception as err:  # a full disk, NATS away: the next interval tries again
                self._failed("snapshot", f"index snapshot not saved: {err}")
            else:
                self._recovered("snapshot")
            with contextlib.suppress(Exception):  # (a figure: the next interval reads it again)
                info = await self.bus.js.stream_info(subjects.KV_EVENTS_STREAM)
                STREAM_BYTES.labels(subjects.KV_EVENTS_STREAM, "held").set(info.state.bytes)
                STREAM_BYTES.labels(subjects.KV_EVENTS_STREAM, "limit").set(info.config.max_bytes)

    def _failed(self, what: str, why: str) -> None:
        """Housekeeping that failed: counted; logged when it starts failing or fails anew."""
        CACHEMETA_FAILURES.labels(what).inc()
        if self.failing.get(what) != why:
            log.error("%s", why)
        self.failing[what] = why

    def _recovered(self, what: str) -> None:
        if self.failing.pop(what, None) is not None:
            log.warning("%s works again", what)

    def _delete_files(self, hashes: list[str]) -> list[tuple[str, OSError]]:
        """The block files deleted; those that could not be, each with why."""
        kept = []
        for h in hashes:
            try:
                self.store.delete(h)
            except OSError as err:
                kept.append((h, err))
        return kept

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
        """A question only: the blocks are not marked used (routers say what they use)."""
        counts = self.index.blocks.lookup(req.hashes, time.time(), touch=False)
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
        assert self.watch is not None and self.events is not None
        self.watch.heard(hb, time.monotonic())
        location = memory_location(hb.service_id)
        if hb.status == "stopped":
            self.workers_seen.pop(location, None)
            # Not awaited here: a heartbeat handler that waits on the stream's ack would hold
            # up closing (the bus drains this subscription before the ack's).
            task = asyncio.create_task(self.events.publish("cleared", location, []))
            self.clearing.add(task)
            task.add_done_callback(self.clearing.discard)
            log.info("%s stopped: its memory tier cleared from the index", hb.service_id)
        else:
            self.workers_seen[location] = time.monotonic()

    async def _watch_loop(self) -> None:
        assert self.watch is not None
        while True:
            await asyncio.sleep(min(0.25, self.common.heartbeat_interval_s / 4))
            await self.watch.check(time.monotonic())

    async def _gc_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.gc_interval_s)
            try:
                await self.collect()
            except Exception as err:
                log.exception("garbage collection failed")
                self._failed("gc", f"garbage collection failed: {err}")

    async def collect(self) -> None:
        """Expired blocks, then the least recently used past the high watermark: files
        deleted, removals published (and applied here as they come back)."""
        if self.index.seq < self.catch_up_to:
            log.info("garbage collection waits: the KV event stream not caught up with yet")
            return
        s, blocks = self.settings, self.index.blocks
        expired = blocks.expired(time.time(), STORE)
        victims = blocks.eviction_victims(s.store_capacity_bytes, s.high_watermark, s.low_watermark)
        doomed = list(dict.fromkeys(expired + victims))
        if not doomed:
            self._recovered("gc")
            return
        kept = await asyncio.to_thread(self._delete_files, doomed)
        if kept:  # they stay indexed: the next pass picks them again
            why = f"{len(kept)} of {len(doomed)} block files could not be deleted ({kept[0][1]})"
            self._failed("gc", f"garbage collection: {why}")
        else:
            self._recovered("gc")
        failed = {h for h, _ in kept}
        doomed = [h for h in doomed if h not in failed]
        expired = [h for h in expired if h not in failed]
        if not doomed:
            return
        # Applied here at once too: the next pass must not pick them again.
        removal = KvEvent(kind="removed", location=STORE, hashes=doomed, at=time.time())
        blocks.apply(removal)
        assert self.events is not None
        await self.events.publish("removed", STORE, doomed)
        log.info(
            "storage tier: %d expired and %d evicted blocks deleted (%d bytes indexed)",
            len(expired),
            len(doomed) - len(expired),
            blocks.store_bytes,
        )

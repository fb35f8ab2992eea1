"""This router's own KV block index: built from cachemeta's snapshot and kept current from the
KV event stream (``shared/kvindex/follow.py``), so a request's lookup is local, and routing goes
on while cachemeta is away.

What a lookup counts of a worker's memory tier is trusted only while that worker is alive (in
the registry) and its KV event feed is whole: events from its current process, none missing,
none stopped while it computes (``shared/kvindex/feeds.py``). Otherwise its memory tier is
unknown: the worker is routed by load and by what the storage tier holds. A stale feed is
logged once, asked to resync, and shown on /health, /metrics and `kvmesh status`.

The blocks a lookup found are about to be used: they go out as one touch event every
``touch_interval_s`` (deduplicated), so their TTL restarts at cachemeta and at every router.
The index changes only by the stream (this router's own touches too, as they come back): two
routers that applied the same events answer a lookup alike.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack

from services.router.dispatch.workers import WorkerRegistry
from services.router.settings import WorkerSettings
from shared.bus import Bus
from shared.kvindex.follow import IndexFollower
from shared.kvindex.publisher import KvEventPublisher
from shared.kvindex.view import KvIndex
from shared.kvindex.watch import FeedWatch, IndexCollector, approx_bytes
from shared.messages.heartbeat import Heartbeat
from shared.messages.kvevents import STORE, KvEvent, memory_owner
from shared.telemetry.metrics import register_load

log = logging.getLogger(__name__)

TOUCH_MAX_BLOCKS = 20_000  # per touch event (NATS carries a megabyte)


class RouterIndex:
    def __init__(
        self,
        router_id: str,
        started_at: float,
        registry: WorkerRegistry,
        settings: WorkerSettings,
        bound_s: float,
    ) -> None:
        self.router_id = router_id
        self.started_at = started_at
        self.registry = registry
        self.settings = settings
        self.follower = IndexFollower(bound_s, settings.index_catch_up_s)
        self.watch: FeedWatch | None = None
        self.touched: dict[str, float] = {}  # blocks used since the last touch event: their pin
        self.touches_sent = 0

    @property
    def index(self) -> KvIndex:
        return self.follower.index

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        await self.follower.start(stack, bus)
        self.watch = FeedWatch(self.index, bus, self.router_id)
        register_load(IndexCollector(self.watch))
        events = KvEventPublisher(bus, "router", self.router_id, self.started_at)
        toucher = asyncio.create_task(self._send_touches(events))
        stack.callback(toucher.cancel)

    # -- lookups ----------------------------------------------------------------------------

    def lookup(self, hashes: list[str], pinned_until: float = 0.0) -> dict[str, int]:
        """Per location, how many of ``hashes`` from the first it holds: the storage tier, and
        each live worker whose memory tier is known (its feed whole). Those held are touched
        (their clocks restart: sent in batches), pinned until ``pinned_until`` if later."""
        counts = self.index.blocks.lookup(hashes, time.time(), touch=False)
        for location in [loc for loc in counts if loc != STORE]:
            if not self.known(memory_owner(location)):
                del counts[location]
        longest = max(counts.values(), default=0)
        touched = self.touched
        for h in hashes[:longest]:
            if touched.get(h, 0.0) < pinned_until or h not in touched:
                touched[h] = pinned_until
        return counts

    def apply_local(self, event: KvEvent) -> None:
        """An event that came by no stream: of a server this router follows itself
        (``services/router/upstream/``), applied to its index only."""
        self.index.admit(event)

    def known(self, worker: str) -> bool:
        """Whether what the index says of the worker's memory tier can be routed by."""
        record = self.registry.get(worker)
        if record is None:
            return False
        return self.index.feeds.trusted(worker, record.heartbeat.started_at)

    async def _send_touches(self, events: KvEventPublisher) -> None:
        while True:
            await asyncio.sleep(self.settings.touch_interval_s)
            while self.touched:
                pins: dict[float, list[str]] = {}  # one event per pin (most: none)
                for h in list(self.touched)[:TOUCH_MAX_BLOCKS]:
                    pins.setdefault(self.touched.pop(h), []).append(h)
                for pin, hashes in pins.items():
                    await events.publish("touched", "", hashes, pinned_until=pin)
                    self.touches_sent += 1

    # -- the workers' feeds -----------------------------------------------------------------

    def heard(self, hb: Heartbeat, now: float) -> None:
        if self.watch is not None:
            self.watch.heard(hb, now)

    async def check(self, now: float) -> None:
        if self.watch is not None:
            await self.watch.check(now)

    def stale(self) -> dict[str, str]:
        """Workers whose KV events are stale, and why."""
        return self.watch.stale() if self.watch is not None else {}

    def report(self) -> dict:
        """The index as /health shows it."""
        f = self.follower
        return {
            "blocks": len(self.index),
            "bytes": approx_bytes(self.index),
            "applied_seq": self.index.seq,
            "caught_up": f.caught_up.is_set(),
            "start_s": round(f.took_s, 3),
            "from_snapshot": f.from_snapshot,
            "stale": self.stale(),
        }

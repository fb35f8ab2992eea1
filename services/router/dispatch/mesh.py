"""The mesh as this router follows it: every service from its heartbeats (the registry), where
every KV block is (its own index, from the KV event stream: ``kvindex.py``), the workers'
circuit breakers, how far this router's loop runs behind, and the services stopped or lost
lately. Answers other routers' and `kvmesh status`'s registry queries.

A service whose NATS connection closes (it died, or was cut off) is dropped the moment
nats-server says so (its disconnect advisory; kvmesh/natsconf.py); one that only misses its
heartbeats (frozen, or a NATS server of your own without the advisory) is dropped, with a log
line, by whichever notices first: the sweep (a few times per beat interval), ``/health`` or a
registry query. The sweep also
measures the loop's lag (its own wake-ups against when they were due): a router that far
behind gives its workers' beats that much grace (they wait in its queue too).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from contextlib import AsyncExitStack

from nats.aio.msg import Msg

from services.router.dispatch.kvindex import RouterIndex
from services.router.dispatch.workers import Breakers, LoopLag, WorkerRecord, WorkerRegistry
from services.router.settings import WorkerSettings
from shared.bus import Bus, subjects
from shared.messages.heartbeat import Heartbeat, RegistryQuery, RegistrySnapshot
from shared.security import tls
from shared.settings import CommonSettings

log = logging.getLogger(__name__)

GONE_KEPT_S = 600.0  # a service gone is listed as gone this long


class Mesh:
    def __init__(
        self, router_id: str, started_at: float, settings: WorkerSettings, common: CommonSettings
    ) -> None:
        self.router_id = router_id
        self.registry = WorkerRegistry(missed_beats=settings.missed_heartbeats)
        self.kv = RouterIndex(
            router_id, started_at, self.registry, settings, common.kv_feed_bound_s
        )
        self.breakers = Breakers(settings.breaker_faults, settings.breaker_cooldown_s)
        self.lag = LoopLag()
        self.beat_interval_s = common.heartbeat_interval_s
        self.links_tls = tls.mesh_server_context(common)  # (the workers' token links)
        self.gone: dict[str, tuple[str, float]] = {}  # services stopped or lost: role, when
        # Called after each sweep with (unix time, ready prefill and decode workers).
        self.on_sweep: list[Callable[[float, int], None]] = []

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await bus.nc.subscribe(subjects.SYS_DISCONNECT, cb=self.on_disconnect)
        await self.kv.start(stack, bus)  # (caught up with the stream before it serves)
        await bus.serve(
            subjects.ROUTER_REGISTRY, RegistryQuery, self.on_registry_query, subjects.ROUTER_QUEUE
        )
        sweeper = asyncio.create_task(self._sweep())
        stack.callback(sweeper.cancel)

    async def known(self) -> None:
        """Until a ready prefill and decode worker are known, at most a beat and a half: a
        router joining a running mesh learns its workers from their next heartbeats (a mesh
        without them answers 503 as before)."""
        deadline = time.monotonic() + 1.5 * self.beat_interval_s
        while time.monotonic() < deadline and not all(
            self.registry.ready(role) for role in ("prefill", "decode")
        ):
            await asyncio.sleep(0.05)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        self.kv.heard(hb, time.monotonic())
        if self.registry.observe(hb, time.monotonic()):
            log.info("registered %s %s", hb.role, hb.service_id)
            if hb.role in ("prefill", "decode"):  # a new process: its breaker starts closed
                self.breakers.success(hb.service_id)
            self.gone.pop(hb.service_id, None)
        elif hb.status == "stopped":
            log.info("%s %s stopped", hb.role, hb.service_id)
            self.gone[hb.service_id] = (hb.role, time.time())

    async def on_disconnect(self, raw: Msg) -> None:
        """nats-server's advisory that a connection closed: the service whose heartbeats
        came over it is gone (a later connection of the same process registers it again)."""
        try:
            advisory = json.loads(raw.data)
            connection = f"{advisory['server']['id']}:{advisory['client']['id']}"
            reason = str(advisory.get("reason", ""))
        except (ValueError, KeyError, TypeError):
            return
        for record in self.registry.workers():
            if record.heartbeat.connection == connection:
                self.drop(record.service_id, f"its NATS connection closed ({reason})")

    def drop(self, service_id: str, why: str) -> None:
        record = self.registry.remove(service_id)
        if record is not None:
            self._forget(record, why)

    def _forget(self, record: WorkerRecord, why: str) -> None:
        """A service dropped from the registry: listed as gone, its KV feed forgotten."""
        self.gone[record.service_id] = (record.heartbeat.role, time.time())
        self.kv.index.feeds.forget(record.service_id)
        log.warning("dropped %s %s: %s", record.heartbeat.role, record.service_id, why)

    async def _sweep(self) -> None:
        interval = min(0.25, self.beat_interval_s / 4)
        while True:
            due = time.monotonic() + interval
            await asyncio.sleep(interval)
            self.lag.observe(time.monotonic() - due)
            workers = sum(len(self.registry.ready(r)) for r in ("prefill", "decode"))
            for listener in self.on_sweep:
                listener(time.time(), workers)
            self.expire(time.monotonic())
            await self.kv.check(time.monotonic())

    def expire(self, now: float) -> None:
        """Drop the services that missed their heartbeats, each with a log line."""
        for sid in [s for s, (_, at) in self.gone.items() if time.time() - at > GONE_KEPT_S]:
            del self.gone[sid]  # (listed as gone that long, then forgotten)
        for record in self.registry.expire(now, grace_s=self.lag.seconds):
            self._forget(record, f"no heartbeat for {record.age(now):.1f} s")

    async def on_registry_query(self, query: RegistryQuery) -> RegistrySnapshot:
        now = time.monotonic()
        self.expire(now)
        stale = self.kv.stale()
        entries = [
            e.model_copy(
                update={
                    "breaker": self.breakers.state(e.service_id),
                    "kv_events": stale.get(e.service_id, "ok")
                    if e.role in ("prefill", "decode")
                    else "",
                }
            )
            for e in self.registry.entries(now, query.role)
        ]
        index = self.kv.report()
        return RegistrySnapshot(
            router_id=self.router_id,
            workers=entries,
            index_blocks=index["blocks"],
            index_bytes=index["bytes"],
        )

    def served_models(self) -> dict[str, float]:
        """Models that a ready prefill worker and a ready decode worker both serve (or a
        decode worker that takes whole requests), each with when its oldest decode worker
        started."""
        served: dict[str, float] = {}
        prefill = {m for r in self.registry.ready("prefill") for m in r.heartbeat.models}
        for record in self.registry.ready("decode"):
            for model in record.heartbeat.models:
                if model in prefill or record.heartbeat.whole:
                    started = record.heartbeat.started_at
                    served[model] = min(served.get(model, started), started)
        return served

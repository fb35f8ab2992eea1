"""The router process: the public HTTP API and the registry of live services."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack

from aiohttp import web

from services.router.registry import WorkerRegistry
from services.router.settings import RouterSettings
from shared.bus import Bus, subjects
from shared.messages.heartbeat import (
    ROLES,
    Heartbeat,
    RegistryQuery,
    RegistrySnapshot,
)
from shared.service import Service
from shared.settings import CommonSettings

log = logging.getLogger(__name__)


class RouterService(Service):
    role = "router"

    def __init__(self, common: CommonSettings, settings: RouterSettings) -> None:
        super().__init__(common, settings)
        self.registry = WorkerRegistry(missed_beats=settings.missed_heartbeats)

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        await bus.serve(
            subjects.ROUTER_REGISTRY, RegistryQuery, self.on_registry_query, subjects.ROUTER_QUEUE
        )
        sweeper = asyncio.create_task(self.sweep())
        stack.callback(sweeper.cancel)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        if self.registry.observe(hb, time.monotonic()):
            log.info("registered %s %s", hb.role, hb.service_id)
        elif hb.status == "stopped":
            log.info("%s %s stopped", hb.role, hb.service_id)

    async def sweep(self) -> None:
        """Drop services that missed their heartbeats, a few times per beat interval."""
        while True:
            await asyncio.sleep(min(0.25, self.common.heartbeat_interval_s / 4))
            for record in self.registry.expire(time.monotonic()):
                log.warning(
                    "dropped %s %s: no heartbeat for %.1f s",
                    record.heartbeat.role,
                    record.service_id,
                    record.age(time.monotonic()),
                )

    async def on_registry_query(self, query: RegistryQuery) -> RegistrySnapshot:
        now = time.monotonic()
        self.registry.expire(now)
        return RegistrySnapshot(
            router_id=self.service_id, workers=self.registry.entries(now, query.role)
        )

    def routes(self) -> list[web.RouteDef]:
        return [web.get("/v1/models", self.list_models)]

    async def health(self, request: web.Request) -> web.Response:
        """Each role with its services; 200 when every role has a ready one, else 503."""
        now = time.monotonic()
        self.registry.expire(now)
        roles = {
            role: [
                {
                    "id": e.service_id,
                    "status": e.status,
                    "address": e.addresses.get("http", ""),
                    "age_s": e.age_s,
                    "load": e.load.model_dump(),
                }
                for e in self.registry.entries(now, role)
            ]
            for role in ROLES
        }
        missing = self.registry.missing_roles()
        body = {
            "status": "degraded" if missing else "ok",
            "service_id": self.service_id,
            "missing": missing,
            "roles": roles,
        }
        return web.json_response(body, status=503 if missing or self.status != "ready" else 200)

    async def list_models(self, request: web.Request) -> web.Response:
        """Models that a ready prefill worker and a ready decode worker both serve."""
        served: dict[str, float] = {}
        prefill = {m for r in self.registry.ready("prefill") for m in r.heartbeat.models}
        for record in self.registry.ready("decode"):
            for model in record.heartbeat.models:
                if model in prefill:
                    started = record.heartbeat.started_at
                    served[model] = min(served.get(model, started), started)
        data = [
            {"id": m, "object": "model", "created": int(t), "owned_by": "kvmesh"}
            for m, t in sorted(served.items())
        ]
        return web.json_response({"object": "list", "data": data})

"""The router process: its request machinery (``core.py``) and the servers over it
(``api/server.py``), started in that order, then the batches it carries on. What the process
says of itself (load, addresses, the services it knows) comes from them."""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack
from pathlib import Path

from aiohttp import web

from services.router.api.server import Servers
from services.router.core import Core
from services.router.observe.capacity import RECOMMENDATION
from services.router.observe.estimates import ESTIMATES
from services.router.settings import RouterSettings
from shared.bus import Bus
from shared.messages.heartbeat import Load
from shared.model.catalog import ModelError
from shared.model.text import check_model
from shared.service import Service, ServiceSettings
from shared.settings import CommonSettings, SettingsError

log = logging.getLogger(__name__)


class RouterService(Service):
    role = "router"

    def __init__(self, common: CommonSettings, settings: RouterSettings) -> None:
        super().__init__(common, settings)
        self.settings: RouterSettings = settings
        self.core: Core | None = None
        self.servers: Servers | None = None

    @classmethod
    def check(cls, common: CommonSettings, settings: ServiceSettings) -> None:
        """Every model of KVMESH_MODELS is there and servable: the router renders them all."""
        for name in common.models:
            try:
                check_model(name, Path(common.state_dir), common.models)
            except ModelError as err:
                raise SettingsError(str(err)) from None

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        s = self.settings
        core = self.core = Core.build(self.service_id, self.started_at, s, self.common, bus)
        ESTIMATES.policy = core.dispatcher.policy  # (its estimates' errors on /metrics)
        RECOMMENDATION.capacity = core.recorder.capacity  # (the pools it needs, too)
        await core.start(stack)
        servers = self.servers = Servers(core, lambda: self.status)
        await servers.start(stack)
        if s.keys_file:
            log.info("auth on: API keys from %s; a request's tenant is its key's", s.keys_file)
        else:
            log.warning(
                "auth off: no keys file (KVMESH_ROUTER_KEYS_FILE); every request is let in "
                "and names its own tenant (x-kvmesh-tenant)"
            )
        await core.mesh.known()  # (its workers' next beats, at most a beat and a half)
        await servers.run_batches(stack)

    def routes(self) -> list[web.RouteDef]:
        assert self.servers is not None
        return self.servers.route_defs()

    def middlewares(self) -> list:
        assert self.servers is not None
        return self.servers.middlewares()

    async def health(self, request: web.Request) -> web.Response:
        assert self.servers is not None
        return await self.servers.operator.health(request)

    def addresses(self) -> dict[str, str]:
        grpc = self.servers.grpc_address if self.servers else ""
        return {**super().addresses(), "grpc": grpc}

    def load(self) -> Load:
        return Load(inflight=self.core.tenancy.inflight if self.core else 0)

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        if self.core is None:
            return []
        now = time.monotonic()
        workers = self.core.mesh.registry.workers()
        return [(r.heartbeat.role, r.service_id, r.age(now)) for r in workers]

    async def drain(self) -> None:
        if self.core is not None:
            await self.core.drained()

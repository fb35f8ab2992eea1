"""Every transport over the router's core: the HTTP routes, each with its envelope (the
generation endpoints, the operator's, the page's, files and batches), the envelope as HTTP
middleware, and the gRPC server with it as an interceptor; and the batch runner, which answers
batch lines through the same HTTP answer path."""

from __future__ import annotations

from contextlib import AsyncExitStack

from aiohttp import web

from services.router.api.adapters import AdapterApi
from services.router.api.dashboard import Dashboard
from services.router.api.grpc import GrpcApi, Interceptor, serve_grpc
from services.router.api.http import HttpApi
from services.router.api.middleware import TENANT, Gate, Route, current
from services.router.api.operator import OperatorApi
from services.router.batch.api import BatchApi
from services.router.core import Core


class Servers:
    def __init__(self, core: Core, status: object) -> None:
        """``status``: what the router process says it is (``Service.status``) when asked."""
        s = core.settings
        self.core = core
        self.gate = Gate(core.tenancy, core.recorder)
        self.http = HttpApi(core.preparer, core.answers, s, s.max_body_bytes)
        self.grpc = GrpcApi(core.preparer, core.answers)
        self.operator = OperatorApi(
            core.router_id,
            core.mesh,
            core.recorder.stats,
            status,
            s.keys_file is not None,
            core.recorder.capacity,
            core.upstreams,
            core.preparer.served,
        )
        self.adapters = AdapterApi(core.router_id, core.preparer, core.mesh)
        self.dashboard = Dashboard(
            core.router_id, core.mesh, core.recorder.stats, core.recorder.recent, core.bus, s
        )
        self.batches: BatchApi | None = None
        self.grpc_address = ""
        self.routes: list[Route] = []  # (each handler once: the envelopes are found by it)

    async def start(self, stack: AsyncExitStack) -> None:
        core = self.core
        self.grpc_address = await serve_grpc(
            stack, self.grpc, Interceptor(self.gate), core.settings, core.common
        )
        self.batches = await BatchApi.started(
            core.bus,
            core.settings,
            self.http.answer,
            core.router_id,
            online=lambda: core.tenancy.inflight,
            tenant_of=lambda request: current().kv.tenant,
        )
        self.routes = [
            *self.operator.routes(),
            *self.adapters.routes(),
            *self.http.routes(),
            *((route, TENANT) for route in self.batches.routes()),
            *self.dashboard.routes(),
        ]

    async def run_batches(self, stack: AsyncExitStack) -> None:
        """Carry on the batches this or another router left, and take new ones."""
        assert self.batches is not None
        self.batches.runner.start()
        stack.push_async_callback(self.batches.runner.stop)

    def middlewares(self) -> list:
        return [self.gate.middleware(self.routes)]

    def route_defs(self) -> list[web.RouteDef]:
        return [route for route, _ in self.routes]

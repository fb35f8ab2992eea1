"""The router process: the public HTTP API and the registry of live services."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from pathlib import Path

import grpc
from aiohttp import web

from services.router.batch_api import BatchApi
from services.router.batches import BatchRunner, BatchStore
from services.router.dashboard import GONE_KEPT_S, Dashboard
from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.workers import Breakers, LoopLag, WorkerRegistry
from services.router.files import Files
from services.router.frontend import Frontend
from services.router.grpc_api import GrpcApi
from services.router.http_api import HttpApi, api_error
from services.router.images import ImageLimits
from services.router.openai_api import ApiError
from services.router.openapi import document
from services.router.recorder import RecentRequests
from services.router.routing.policies import POLICIES
from services.router.routing.ttft import CostDefaults
from services.router.settings import RouterSettings
from services.router.stats import DAY_S, RollingStats, StatsMinute
from shared import __version__
from shared.bus import Bus, subjects
from shared.messages.heartbeat import (
    ROLES,
    Heartbeat,
    Load,
    RegistryQuery,
    RegistrySnapshot,
)
from shared.proto import api_pb2_grpc
from shared.security.handoff import HANDOFF_SECRET
from shared.security.secret import load_or_create
from shared.security.tls import add_port
from shared.service import Service
from shared.settings import CommonSettings, SettingsError

log = logging.getLogger(__name__)


class RouterService(Service):
    role = "router"

    def __init__(self, common: CommonSettings, settings: RouterSettings) -> None:
        super().__init__(common, settings)
        self.settings: RouterSettings = settings
        self.registry = WorkerRegistry(missed_beats=settings.missed_heartbeats)
        self.lag = LoopLag()
        self.breakers = Breakers(settings.breaker_faults, settings.breaker_cooldown_s)
        self.stats = RollingStats(self.service_id, self.started_at)
        self.frontend: Frontend | None = None
        self.grpc_address = ""
        self.bus: Bus | None = None
        self.gone: dict[str, tuple[str, float]] = {}  # services stopped or lost: role, when
        self.dashboard = Dashboard(self)

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        s = self.settings
        self.bus = bus
        await bus.subscribe(subjects.HEARTBEAT_ALL, Heartbeat, self.on_heartbeat)
        # The mesh's statistics: every router's minutes, this one's from before a restart too.
        await bus.ensure_stream(
            subjects.STATS_STREAM, [subjects.STATS_ALL], max_age_s=DAY_S, last_per_subject=True
        )
        await bus.follow(subjects.STATS_STREAM, subjects.STATS_ALL, StatsMinute, self.stats.merge)
        sharer = asyncio.create_task(self.share_stats(bus))
        stack.callback(sharer.cancel)
        stack.push_async_callback(self._share_stats, bus)  # the last minutes, when stopping
        await bus.serve(
            subjects.ROUTER_REGISTRY, RegistryQuery, self.on_registry_query, subjects.ROUTER_QUEUE
        )
        sweeper = asyncio.create_task(self.sweep())
        stack.callback(sweeper.cancel)
        policy = POLICIES[s.routing_policy](
            CostDefaults(prefill_tok_s=s.prefill_tok_s, load_tok_s=s.load_tok_s)
        )
        secrets_dir = self.common.resolved_secrets_dir
        handoff = load_or_create(secrets_dir, HANDOFF_SECRET)
        dispatcher = Dispatcher(
            bus, self.service_id, self.registry, self.breakers, policy, s, handoff
        )
        await dispatcher.start()
        image_limits = ImageLimits(
            max_bytes=s.image_max_bytes,
            max_pixels=self.common.image_max_pixels,
            per_request=s.images_per_request,
            allow_remote=s.allow_remote_images,
            remote_timeout_s=s.remote_image_timeout_s,
            encode_timeout_s=s.encode_timeout_s,
            grid=self.common.vision_grid,
            remote_private=s.remote_images_private,
        )
        self.frontend = Frontend(
            s,
            dispatcher,
            Path(self.common.state_dir),
            image_limits,
            self.stats,
            secrets_dir,
            self.lag,
        )
        self.http_api = HttpApi(self.frontend)
        files = Files(bus, s.files_max_bytes)
        await files.start()
        batch_store = BatchStore(bus)
        await batch_store.start()
        self.batches = BatchRunner(
            batch_store,
            files,
            self.http_api.answer,
            self.service_id,
            online=lambda: self.frontend.inflight,
            concurrency=s.batch_concurrency,
            lease_s=s.batch_lease_s,
            max_lines=s.batch_max_requests,
        )
        self.batch_api = BatchApi(self.frontend, files, batch_store, self.batches)
        if s.keys_file:
            log.info("auth on: API keys from %s; a request's tenant is its key's", s.keys_file)
        else:
            log.warning(
                "auth off: no keys file (KVMESH_ROUTER_KEYS_FILE); every request is let in "
                "and names its own tenant (x-kvmesh-tenant)"
            )
        size = s.max_body_bytes  # a gRPC message carries what an HTTP body would
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", size),
                ("grpc.max_send_message_length", size),
            ]
        )
        api_pb2_grpc.add_GenerationServicer_to_server(GrpcApi(self.frontend), server)
        port = add_port(server, f"{s.http_host}:{s.grpc_port}", self.common, mutual=False)
        if not port:
            raise SettingsError(f"cannot listen for gRPC on {s.http_host}:{s.grpc_port}")
        await server.start()
        stack.push_async_callback(server.stop, 1.0)
        self.grpc_address = f"{s.advertised_host()}:{port}"
        # A router joining a running mesh learns its workers from their next heartbeats:
        # it opens its API once it knows a ready prefill and decode worker, or after a beat
        # and a half (a mesh without them answers 503 as before).
        deadline = time.monotonic() + 1.5 * self.common.heartbeat_interval_s
        while time.monotonic() < deadline and not all(
            self.registry.ready(role) for role in ("prefill", "decode")
        ):
            await asyncio.sleep(0.05)
        self.batches.start()  # batches this or another router left, and new ones
        stack.push_async_callback(self.batches.stop)

    def addresses(self) -> dict[str, str]:
        return {**super().addresses(), "grpc": self.grpc_address}

    def load(self) -> Load:
        return Load(inflight=self.frontend.inflight if self.frontend else 0)

    def heartbeat_ages(self) -> list[tuple[str, str, float]]:
        now = time.monotonic()
        return [(r.heartbeat.role, r.service_id, r.age(now)) for r in self.registry.workers()]

    async def drain(self) -> None:
        while self.frontend and self.frontend.inflight:
            await asyncio.sleep(0.05)

    async def on_heartbeat(self, hb: Heartbeat) -> None:
        if self.registry.observe(hb, time.monotonic()):
            log.info("registered %s %s", hb.role, hb.service_id)
            self.breakers.success(hb.service_id)  # a new process: its breaker starts closed
            self.gone.pop(hb.service_id, None)
        elif hb.status == "stopped":
            log.info("%s %s stopped", hb.role, hb.service_id)
            self.gone[hb.service_id] = (hb.role, time.time())

    async def sweep(self) -> None:
        """Drop services that missed their heartbeats, a few times per beat interval."""
        interval = min(0.25, self.common.heartbeat_interval_s / 4)
        while True:
            due = time.monotonic() + interval
            await asyncio.sleep(interval)
            self.lag.observe(time.monotonic() - due)
            workers = sum(len(self.registry.ready(r)) for r in ("prefill", "decode"))
            self.stats.tick(time.time(), workers)
            self.expire(time.monotonic())

    def expire(self, now: float) -> None:
        """Drop services that missed their heartbeats, each with a log line (whichever call
        notices first: the sweep, /health or a registry query)."""
        for sid in [s for s, (_, at) in self.gone.items() if time.time() - at > GONE_KEPT_S]:
            del self.gone[sid]  # (listed as gone that long, then forgotten)
        for record in self.registry.expire(now, grace_s=self.lag.seconds):
            self.gone[record.service_id] = (record.heartbeat.role, time.time())
            log.warning(
                "dropped %s %s: no heartbeat for %.1f s",
                record.heartbeat.role,
                record.service_id,
                record.age(now),
            )

    async def share_stats(self, bus: Bus) -> None:
        while True:
            await asyncio.sleep(self.settings.stats_share_s)
            await self._share_stats(bus)

    async def _share_stats(self, bus: Bus) -> None:
        for minute in self.stats.to_share():
            try:
                await bus.publish_durable(subjects.stats(self.service_id, minute.minute), minute)
            except Exception as err:  # shared at the next round
                log.warning("statistics not shared: %s", err)
                self.stats.unshared(minute.minute)

    async def on_registry_query(self, query: RegistryQuery) -> RegistrySnapshot:
        now = time.monotonic()
        self.expire(now)
        entries = [
            e.model_copy(update={"breaker": self.breakers.state(e.service_id)})
            for e in self.registry.entries(now, query.role)
        ]
        return RegistrySnapshot(router_id=self.service_id, workers=entries)

    def routes(self) -> list[web.RouteDef]:
        assert self.frontend is not None
        return [
            web.get("/v1/models", self.list_models),
            web.get("/v1/stats", self.operator_stats),
            web.get("/openapi.json", self.openapi),
            *self.http_api.routes(),
            *self.batch_api.routes(),
            *self.dashboard.routes(),
        ]

    @property
    def recent(self) -> RecentRequests:
        assert self.frontend is not None
        return self.frontend.recorder.recent

    async def openapi(self, request: web.Request) -> web.Response:
        """The HTTP API as it is (services/router/openapi.py)."""
        auth = self.settings.keys_file is not None
        return web.json_response(document(request.app.router.routes(), __version__, auth))

    async def operator_stats(self, request: web.Request) -> web.Response:
        """The operator's summary (services/router/stats.py), overall and per traffic class.
        With auth on, for admin keys."""
        assert self.frontend is not None
        try:
            self.frontend.identify(request.headers, role="admin")
        except ApiError as err:
            return api_error(err)
        return web.json_response(self.stats.report(time.time()))

    async def health(self, request: web.Request) -> web.Response:
        """Each role with its services; 200 when every role has a ready one, else 503."""
        now = time.monotonic()
        self.expire(now)
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
        """Models that a ready prefill worker and a ready decode worker both serve. With auth
        on, for any valid key."""
        assert self.frontend is not None
        try:
            self.frontend.identify(request.headers)
        except ApiError as err:
            return api_error(err)
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

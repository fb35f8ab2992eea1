"""The operator's page: GET /dashboard (static files shipped in the package) and the API it
polls, every endpoint for admin keys when auth is on.

- /v1/dashboard/mesh: every service by role (state, load, queue, KV pool and memory tier use,
  heartbeat age, this router's breaker), and the ones gone lately;
- /v1/stats: DeepInfer's table (services/router/observe/stats.py; served by operator.py);
- /v1/dashboard/series: per-minute series over the last hours (TTFT p50/p99, hit ratio by
  tier, tokens/s in and out, requests by status);
- /v1/dashboard/requests: this router's recent requests; /v1/dashboard/requests/{id}: one of
  them with its routing decision and its spans, asked of every service over NATS (each keeps
  its recent spans in memory), not read from anyone's files.
"""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from services.router.api.middleware import ADMIN, PUBLIC, Route
from services.router.dispatch.mesh import Mesh
from services.router.errors import ApiError
from services.router.formats.wire import query_int
from services.router.observe.recorder import RecentRequests
from services.router.observe.stats import RollingStats
from services.router.settings import WorkerSettings
from shared.bus import Bus, subjects
from shared.messages.spans import SpansQuery, SpansReply

STATIC = Path(__file__).parent / "static"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
SPANS_WAIT_S = 0.5  # for every service's spans of a request
MAX_SERIES_MINUTES = 24 * 60
MAX_LISTED = 200  # recent requests a router keeps (RecentRequests)


class Dashboard:
    def __init__(
        self,
        router_id: str,
        mesh: Mesh,
        stats: RollingStats,
        recent: RecentRequests,
        bus: Bus,
        settings: WorkerSettings,
    ) -> None:
        self.router_id = router_id
        self.mesh = mesh
        self.stats = stats
        self.recent = recent
        self.bus = bus
        self.settings = settings

    def routes(self) -> list[Route]:
        return [
            (web.get("/dashboard", self.page), PUBLIC),
            *((web.get(f"/dashboard/{name}", self.asset), PUBLIC) for name in ASSETS),
            (web.get("/v1/dashboard/mesh", self.mesh_now), ADMIN),
            (web.get("/v1/dashboard/series", self.series), ADMIN),
            (web.get("/v1/dashboard/requests", self.requests), ADMIN),
            (web.get("/v1/dashboard/requests/{request_id}", self.request), ADMIN),
        ]

    # The page itself holds no figures: it asks for an admin key, then polls the API with it.

    async def page(self, request: web.Request) -> web.Response:
        return web.FileResponse(STATIC / "dashboard.html", headers=_NO_STORE)

    async def asset(self, request: web.Request) -> web.StreamResponse:
        name = request.path.rsplit("/", 1)[1]
        return web.FileResponse(STATIC / name, headers={"Content-Type": ASSETS[name], **_NO_STORE})

    async def mesh_now(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        self.mesh.expire(now)
        services = []
        stale = self.mesh.kv.stale()
        for e in self.mesh.registry.entries(now):
            services.append(
                {
                    "id": e.service_id,
                    "role": e.role,
                    "status": e.status,
                    "age_s": e.age_s,
                    "uptime_s": e.uptime_s,
                    "models": e.models,
                    "address": e.addresses.get("http", ""),
                    "load": e.load.model_dump(),
                    "breaker": self.mesh.breakers.state(e.service_id),
                    "kv_events": stale.get(e.service_id, "ok"),
                }
            )
        gone = [
            {"id": sid, "role": role, "status": "gone", "gone_s": round(time.time() - at, 1)}
            for sid, (role, at) in self.mesh.gone.items()  # (the last GONE_KEPT_S: expire)
        ]
        body = {
            "router": self.router_id,
            "heartbeat_s": self.mesh.beat_interval_s,
            "missed_heartbeats": self.settings.missed_heartbeats,
            "services": services,
            "gone": gone,
            "missing_roles": self.mesh.registry.missing_roles(),
            "kv_index": self.mesh.kv.report(),
        }
        return web.json_response(body, headers=_NO_STORE)

    async def series(self, request: web.Request) -> web.Response:
        minutes = query_int(request.query, "minutes", 180, MAX_SERIES_MINUTES)
        series = self.stats.series(time.time(), minutes)
        return web.json_response({"minutes": series}, headers=_NO_STORE)

    async def requests(self, request: web.Request) -> web.Response:
        limit = query_int(request.query, "limit", 25, MAX_LISTED)
        listed = [  # (the routing decision comes with one request's detail)
            {k: v for k, v in item.items() if k not in ("route", "workers")}
            for item in self.recent.latest(limit)
        ]
        return web.json_response({"requests": listed}, headers=_NO_STORE)

    async def request(self, request: web.Request) -> web.Response:
        rid = request.match_info["request_id"]
        item = self.recent.get(rid)
        if item is None:
            raise ApiError(404, f"no recent request {rid!r} on this router", param="id")
        spans: list[dict] = []
        if item.get("trace_id"):
            want = len(self.mesh.registry.entries(time.monotonic())) + 1  # (this router too)
            replies = await self.bus.gather(
                subjects.SPANS_QUERY,
                SpansQuery(trace_id=item["trace_id"]),
                SpansReply,
                SPANS_WAIT_S,
                want,
            )
            spans = sorted((s for r in replies for s in r.spans), key=lambda s: s["start_ns"])
        return web.json_response({**item, "spans": spans}, headers=_NO_STORE)


_NO_STORE = {"Cache-Control": "no-store"}

"""The operator's page: GET /dashboard (static files shipped in the package) and the API it
polls, every endpoint for admin keys when auth is on.

- /v1/dashboard/mesh: every service by role (state, load, queue, KV pool and memory tier use,
  heartbeat age, this router's breaker), and the ones gone lately;
- /v1/stats: DeepInfer's table (services/router/stats.py);
- /v1/dashboard/series: per-minute series over the last hours (TTFT p50/p99, hit ratio by
  tier, tokens/s in and out, requests by status);
- /v1/dashboard/requests: this router's recent requests; /v1/dashboard/requests/{id}: one of
  them with its routing decision and its spans, asked of every service over NATS (each keeps
  its recent spans in memory), not read from anyone's files.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from aiohttp import web

from services.router.dispatch.workers import Breakers, WorkerRegistry
from services.router.frontend import Frontend
from services.router.http_api import api_error, query_int
from services.router.openai_api import ApiError
from services.router.recorder import RecentRequests
from services.router.settings import RouterSettings
from services.router.stats import RollingStats
from shared.bus import Bus, subjects
from shared.messages.spans import SpansQuery, SpansReply
from shared.settings import CommonSettings

STATIC = Path(__file__).parent / "static"
ASSETS = {"app.js": "text/javascript", "style.css": "text/css"}
GONE_KEPT_S = 600.0  # a service gone is listed as gone this long
SPANS_WAIT_S = 0.5  # for every service's spans of a request
MAX_SERIES_MINUTES = 24 * 60
MAX_LISTED = 200  # recent requests a router keeps (RecentRequests)


class Router(Protocol):
    """What the page shows of its router (services/router/service.py's RouterService)."""

    service_id: str
    common: CommonSettings
    settings: RouterSettings
    registry: WorkerRegistry
    breakers: Breakers
    stats: RollingStats
    frontend: Frontend | None
    bus: Bus | None
    gone: dict[str, tuple[str, float]]

    @property
    def recent(self) -> RecentRequests: ...

    def expire(self, now: float) -> None: ...


class Dashboard:
    def __init__(self, router: Router) -> None:
        self.svc = router

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/dashboard", self.page),
            *(web.get(f"/dashboard/{name}", self.asset) for name in ASSETS),
            web.get("/v1/dashboard/mesh", self.mesh),
            web.get("/v1/dashboard/series", self.series),
            web.get("/v1/dashboard/requests", self.requests),
            web.get("/v1/dashboard/requests/{request_id}", self.request),
        ]

    # The page itself holds no figures: it asks for an admin key, then polls the API with it.

    async def page(self, request: web.Request) -> web.Response:
        return web.FileResponse(STATIC / "dashboard.html", headers=_NO_STORE)

    async def asset(self, request: web.Request) -> web.StreamResponse:
        name = request.path.rsplit("/", 1)[1]
        return web.FileResponse(STATIC / name, headers={"Content-Type": ASSETS[name], **_NO_STORE})

    def _admin(self, request: web.Request) -> None:
        assert self.svc.frontend is not None
        self.svc.frontend.identify(request.headers, role="admin")

    async def mesh(self, request: web.Request) -> web.Response:
        try:
            self._admin(request)
        except ApiError as err:
            return api_error(err)
        now = time.monotonic()
        self.svc.expire(now)
        services = []
        for e in self.svc.registry.entries(now):
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
                    "breaker": self.svc.breakers.state(e.service_id),
                }
            )
        gone = [
            {"id": sid, "role": role, "status": "gone", "gone_s": round(time.time() - at, 1)}
            for sid, (role, at) in self.svc.gone.items()  # (the last GONE_KEPT_S: expire)
        ]
        body = {
            "router": self.svc.service_id,
            "heartbeat_s": self.svc.common.heartbeat_interval_s,
            "missed_heartbeats": self.svc.settings.missed_heartbeats,
            "services": services,
            "gone": gone,
            "missing_roles": self.svc.registry.missing_roles(),
        }
        return web.json_response(body, headers=_NO_STORE)

    async def series(self, request: web.Request) -> web.Response:
        try:
            self._admin(request)
            minutes = query_int(request, "minutes", 180, MAX_SERIES_MINUTES)
        except ApiError as err:
            return api_error(err)
        series = self.svc.stats.series(time.time(), minutes)
        return web.json_response({"minutes": series}, headers=_NO_STORE)

    async def requests(self, request: web.Request) -> web.Response:
        try:
            self._admin(request)
            limit = query_int(request, "limit", 25, MAX_LISTED)
        except ApiError as err:
            return api_error(err)
        listed = [  # (the routing decision comes with one request's detail)
            {k: v for k, v in item.items() if k not in ("route", "workers")}
            for item in self.svc.recent.latest(limit)
        ]
        return web.json_response({"requests": listed}, headers=_NO_STORE)

    async def request(self, request: web.Request) -> web.Response:
        try:
            self._admin(request)
            rid = request.match_info["request_id"]
            item = self.svc.recent.get(rid)
            if item is None:
                raise ApiError(404, f"no recent request {rid!r} on this router", param="id")
        except ApiError as err:
            return api_error(err)
        spans: list[dict] = []
        if item.get("trace_id"):
            want = len(self.svc.registry.entries(time.monotonic())) + 1  # (this router too)
            assert self.svc.bus is not None
            replies = await self.svc.bus.gather(
                subjects.SPANS_QUERY,
                SpansQuery(trace_id=item["trace_id"]),
                SpansReply,
                SPANS_WAIT_S,
                want,
            )
            spans = sorted((s for r in replies for s in r.spans), key=lambda s: s["start_ns"])
        return web.json_response({**item, "spans": spans}, headers=_NO_STORE)


_NO_STORE = {"Cache-Control": "no-store"}

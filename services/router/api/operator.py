"""The operator's endpoints: GET /health (each role with its services, this router's KV index;
"degraded" while a worker's KV events are stale, a worker is failing, or a worker cannot write
the storage tier, each named; 503 while a role that serves requests has no ready one; the
upstream servers, each with what it is routed by),
/v1/models (what a ready prefill and decode worker both serve), /v1/stats (the operator's
summary: services/router/observe/stats.py) and /openapi.json (the HTTP API as it is:
``openapi.py``)."""

from __future__ import annotations

import time
from collections.abc import Callable

from aiohttp import web

from services.router.api.middleware import ADMIN, PUBLIC, USER, Route
from services.router.api.openapi import document
from services.router.dispatch.mesh import Mesh
from services.router.observe.capacity import Capacity
from services.router.observe.stats import RollingStats
from services.router.request.checks import ServedModels
from services.router.upstream.fleet import Upstreams
from shared import __version__
from shared.messages.heartbeat import ROLES


class OperatorApi:
    def __init__(
        self,
        router_id: str,
        mesh: Mesh,
        stats: RollingStats,
        status: Callable[[], str],
        auth: bool,
        capacity: Capacity,
        upstreams: Upstreams,
        served: ServedModels,
    ) -> None:
        self.router_id = router_id
        self.served = served  # (the names a request may give)
        self.mesh = mesh
        self.upstreams = upstreams
        self.stats = stats
        self.capacity = capacity
        self.status = status  # the router's own: ready, draining, stopped
        self.auth = auth

    def routes(self) -> list[Route]:
        return [
            (web.get("/v1/models", self.models), USER),
            (web.get("/v1/stats", self.operator_stats), ADMIN),
            (web.get("/v1/plan", self.plan), ADMIN),
            (web.get("/openapi.json", self.openapi), PUBLIC),
        ]

    async def health(self, request: web.Request) -> web.Response:
        """Each role with its services; 200 when every role but cachemeta has a ready one
        (and this router is ready), else 503."""
        now = time.monotonic()
        self.mesh.expire(now)
        roles = {
            role: [
                {
                    "id": e.service_id,
                    "status": e.status,
                    "address": e.addresses.get("http", ""),
                    "age_s": e.age_s,
                    "load": e.load.model_dump(),
                }
                for e in self.mesh.registry.entries(now, role)
            ]
            for role in ROLES
        }
        missing = self.mesh.registry.missing_roles()
        index = self.mesh.kv.report()
        services = [s for role in ROLES for s in roles[role]]
        failing = [s["id"] for s in services if s["status"] == "failing"]
        unwritten = {s["id"]: s["load"]["kv_store_error"] for s in services}
        unwritten = {sid: why for sid, why in unwritten.items() if why}
        # (in front of servers it did not start, it needs no worker of those roles)
        lacking = set(missing) - ({"prefill", "encoder"} if self.upstreams else set())
        needed = lacking - {"cachemeta"}
        body = {
            "status": "degraded" if lacking or index["stale"] or failing or unwritten else "ok",
            "service_id": self.router_id,
            "missing": missing,
            "failing": failing,
            "storage_unwritten": unwritten,
            "roles": roles,
            "kv_index": index,
        }
        if self.upstreams:  # (servers it did not start: each takes whole requests, no images)
            body["upstreams"] = self.upstreams.report(self.mesh.kv.stale())
        # Cachemeta away is not a router that cannot serve: it routes by its own index.
        ok = not needed and self.status() == "ready"
        return web.json_response(body, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        """Models that a ready prefill worker and a ready decode worker both serve and a
        request may name (a LoRA adapter with its base model as ``parent``, as vLLM lists
        them; one just unloaded is gone though a worker's last beat still lists it)."""
        data = []
        names = self.served.names
        for m, t in sorted(self.mesh.served_models().items()):
            if m not in names:
                continue
            model = {"id": m, "object": "model", "created": int(t), "owned_by": "kvmesh"}
            base = self.served.adapters.base_of(m)
            model.update({"root": m, "parent": base} if base else {"root": m, "parent": None})
            data.append(model)
        return web.json_response({"object": "list", "data": data})

    async def plan(self, request: web.Request) -> web.Response:
        """The prefill and decode pools this router's recent traffic needs for the targets,
        with what the recommendation rests on."""
        return web.json_response(self.capacity.plan())

    async def operator_stats(self, request: web.Request) -> web.Response:
        """The operator's summary, overall and per traffic class and tenant."""
        return web.json_response(self.stats.report(time.time()))

    async def openapi(self, request: web.Request) -> web.Response:
        served = self.mesh.registry.models_served
        routes = request.app.router.routes()
        return web.json_response(document(routes, __version__, self.auth, served))

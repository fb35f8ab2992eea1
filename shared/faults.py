"""Faults a test switches on inside a running process, by name: the code that can fail that
way checks for its name. Off unless the process runs with KVMESH_FAULT_HOOKS=true, which
serves ``PUT``/``DELETE /faults/{name}`` (never set in production: the route has no auth).

Names in use: ``kv_events`` (the worker's KV events are made but not published, as if NATS
refused them); ``kv_feed`` (a vLLM worker's engine cache events are dropped as they come, as
if its feed went quiet); ``engine_step`` (a decode step raises); ``engine_prefill`` (a prompt's
compute raises, on a prefill worker or decode's local prefill). A process that runs part of
itself elsewhere (decode's engine process) passes the switches on (``LISTENERS``).
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

ACTIVE: set[str] = set()
LISTENERS: list[Callable[[set[str]], None]] = []  # told of every switch


def on(name: str) -> bool:
    return name in ACTIVE


async def _switch(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if request.method == "PUT":
        ACTIVE.add(name)
    else:
        ACTIVE.discard(name)
    for listener in LISTENERS:
        listener(set(ACTIVE))
    return web.json_response({"faults": sorted(ACTIVE)})


def routes() -> list[web.RouteDef]:
    return [web.put("/faults/{name}", _switch), web.delete("/faults/{name}", _switch)]

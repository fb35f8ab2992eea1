"""No socket of the mesh holds a small write back until the peer acknowledges the one before
(Nagle's algorithm meeting a delayed ACK holds a stream's first chunk ~40 ms behind its
headers on a kept-alive connection, as the Rust router does): the HTTP server each service
runs and the NATS connection each one makes write at once (TCP_NODELAY). (gRPC's core sets
it on every connection it makes or takes.)"""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack

import aiohttp
from aiohttp import web

from shared.bus import Bus
from shared.service import ServiceSettings, serve_http
from shared.settings import CommonSettings


def nodelay(sock: socket.socket) -> bool:
    return bool(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))


async def test_a_services_http_server_writes_at_once() -> None:
    seen: list[bool | None] = []  # each request's socket: TCP_NODELAY set (None: no socket)

    async def handler(request: web.Request) -> web.Response:
        transport = request.transport
        seen.append(nodelay(transport.get_extra_info("socket")) if transport else None)
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", handler)
    async with AsyncExitStack() as stack:
        url = await serve_http(stack, app, CommonSettings(), ServiceSettings())
        async with aiohttp.ClientSession() as session:
            for _ in range(2):  # the second on the kept-alive connection
                async with session.get(url + "/") as resp:
                    assert await resp.text() == "ok"
    assert seen == [True, True]


async def test_a_services_nats_connection_writes_at_once(open_nats_url: str) -> None:
    bus = await Bus.connect(open_nats_url, "t-nodelay")
    try:
        writer = bus.nc._transport._io_writer  # (nats-py's stream to the server)
        assert nodelay(writer.get_extra_info("socket"))
    finally:
        await bus.close()

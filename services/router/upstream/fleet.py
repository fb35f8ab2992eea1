"""The servers this router routes to without having started them (``upstreams`` in its
settings), kept as workers of its mesh: each read every ``upstream_poll_s`` into the registry
(``server.py``), a ``dns://`` name resolved again every ``upstream_resolve_s`` (each A record
a server: a Kubernetes headless Service's pods as they come and go), and the requests the
dispatcher sends them made as HTTP calls (``call.py``) whose tokens come back as a worker's do.

The dispatcher asks this for the workers it does not reach over NATS (``owns``): a task "sent"
to one is a call started, its ack the server's answer to the call's headers, its cancel the
call's connection closed.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from urllib.parse import urlsplit, urlunsplit

import aiohttp

from services.router.dispatch.job import Attempt
from services.router.dispatch.mesh import Mesh
from services.router.errors import ApiError
from services.router.routing.route import RouteRequest
from services.router.settings import UpstreamSettings
from services.router.upstream.call import Call
from services.router.upstream.protocols import PROTOCOLS
from services.router.upstream.server import Server
from shared.messages.generate import TaskAck, TokenEvent
from shared.model.gguf import REAL_MODEL
from shared.model.text import TextModel

log = logging.getLogger(__name__)


class Upstreams:
    def __init__(self, settings: UpstreamSettings, mesh: Mesh) -> None:
        self.settings = settings
        self.mesh = mesh
        self.servers: dict[str, Server] = {}  # by worker id
        self.calls: dict[str, Call] = {}  # by request id
        self.deliver: Callable[[list[TokenEvent]], None] = lambda events: None
        self.text_model: Callable[[str], Awaitable[TextModel]] | None = None
        self._session: aiohttp.ClientSession | None = None
        self._pollers: dict[str, asyncio.Task] = {}  # by worker id
        self._polled = False
        self._entries = [_entry(e) for e in settings.upstreams]

    def __bool__(self) -> bool:
        return bool(self._entries)

    def connect(
        self,
        deliver: Callable[[list[TokenEvent]], None],
        text_model: Callable[[str], Awaitable[TextModel]],
    ) -> None:
        """Where the calls' token events go (the dispatcher's replies), and the models' text
        side (their fingerprints name the servers' blocks in the router's hashes)."""
        self.deliver, self.text_model = deliver, text_model

    async def start(self, stack: AsyncExitStack) -> None:
        if not self._entries:
            return
        connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=None)
        # (a chunk is a line: OpenAI's completions echo the prompt's ids in the first)
        self._session = aiohttp.ClientSession(connector=connector, read_bufsize=4 << 20)
        stack.push_async_callback(self.stop)
        await self._resolve()
        await asyncio.gather(*(self._poll(s) for s in list(self.servers.values())))
        for server in self.servers.values():
            self._pollers[server.id] = asyncio.create_task(self._polling(server))
        self._polled = True
        resolving = asyncio.create_task(self._resolving())
        stack.callback(resolving.cancel)

    async def stop(self) -> None:
        for call in list(self.calls.values()):
            call.cancel()
        for poller in self._pollers.values():
            poller.cancel()
        for server in self.servers.values():
            await server.stop()
        if self._session is not None:
            await self._session.close()

    # -- the servers ------------------------------------------------------------------------

    async def _resolving(self) -> None:
        while True:
            await asyncio.sleep(self.settings.upstream_resolve_s)
            await self._resolve()

    async def _resolve(self) -> None:
        """The servers as the settings name them now (dns:// names resolved again): new ones
        added, those gone dropped."""
        wanted: dict[str, tuple[str, str]] = {}  # server URL → its model, and its entry
        for model, entry in self._entries:
            found = await _addresses(entry)
            if found is None:  # (not resolved now: its servers stay as they were)
                found = [s.url for s in self.servers.values() if s.entry == entry]
            wanted.update(dict.fromkeys(found, (model, entry)))
        for url, (model, entry) in wanted.items():
            assert self.text_model is not None, "connect() first"
            fingerprint = (await self.text_model(model)).config.fingerprint
            server = Server(url, model, fingerprint, self.mesh.kv.apply_local, entry)
            if server.id not in self.servers:
                log.info("upstream %s (%s) added", url, model)
                self.servers[server.id] = server
                if self._polled:  # (at start, each is read once first, then followed)
                    self._pollers[server.id] = asyncio.create_task(self._polling(server))
        for sid, server in list(self.servers.items()):
            if server.url not in wanted:
                log.info("upstream %s gone from its name's records", server.url)
                del self.servers[sid]
                poller = self._pollers.pop(sid, None)
                if poller is not None:
                    poller.cancel()
                await server.stop()
                self.mesh.drop(sid, "no longer among its name's addresses")

    async def _polling(self, server: Server) -> None:
        """Each server read on its own schedule: a slow one delays no other."""
        while True:
            await asyncio.sleep(self.settings.upstream_poll_s)
            await self._poll(server)

    async def _poll(self, server: Server) -> None:
        """A read of the server's metrics as its heartbeat. A busy server may answer late: its
        beats' interval allows a read's timeout, and it is dropped when it refuses the
        connection (gone), not when it is slow; its calls in flight fail by themselves."""
        assert self._session is not None
        s = self.settings
        if await server.poll(self._session, s.upstream_timeout_s, s.upstream_events):
            interval = s.upstream_poll_s + s.upstream_timeout_s
            await self.mesh.on_heartbeat(server.heartbeat(interval))
        elif server.refused and self.mesh.registry.get(server.id) is not None:
            self.mesh.drop(server.id, f"its server refuses connections ({server.error})")

    # -- requests ---------------------------------------------------------------------------

    def owns(self, worker: str) -> bool:
        return worker in self.servers

    async def ask(self, attempt: Attempt, worker: str) -> TaskAck:
        """Start the attempt's call on the server; its answer to it (BusError: none)."""
        server = self.servers[worker]
        if attempt.job.images:
            raise ApiError(
                400,
                "images are not sent to upstream servers (their prompts' image embeddings are "
                "kvmesh's encoder's): serve this model with kvmesh's workers",
                param="messages",
            )
        assert self._session is not None
        rid = attempt.job.request_id
        call = Call(
            self._session,
            server.url,
            PROTOCOLS[server.protocol],
            server.served,
            worker,
            attempt.job,
            self.deliver,
            self.settings.upstream_timeout_s,
            expected_reuse(attempt.route, worker),
        )
        self.calls[rid] = call
        try:
            ack = await call.start()
        except BaseException:
            self.calls.pop(rid, None)
            raise
        if not ack.accepted:
            self.calls.pop(rid, None)
        else:
            assert call.task is not None
            call.task.add_done_callback(lambda _: self.calls.pop(rid, None))
        return ack

    def cancel(self, request_id: str) -> None:
        """The attempt ended unfinished: its call's connection is closed (the server aborts)."""
        call = self.calls.pop(request_id, None)
        if call is not None:
            call.cancel()

    def report(self, stale: dict[str, str]) -> list[dict]:
        """Each server as /health shows it, with what it is routed by (``stale``: the workers
        whose KV events are stale, and why)."""
        out = []
        for sid, server in sorted(self.servers.items()):
            said = server.report()
            why = stale.get(sid) or (server.events if not server.bridge else "")
            if not self.settings.upstream_events:
                why = "KV events off (upstream_events)"
            said["routed_by"] = f"load only: {why}" if why else "its cache and its load"
            out.append(said)
        return out


def expected_reuse(route: RouteRequest | None, worker: str) -> dict[str, int]:
    """The prompt tokens the router's index says the server will reuse, by tier: its own
    cache's (memory), and what its connector loads from the storage tier beyond them. The
    server says how many it reused only with the answer's end; the policy learns the prefill
    from the first token, so it is told these meanwhile."""
    if route is None:
        return {}
    size = max(1, route.block_size)
    usable = (route.n_prompt - 1) // size * size  # (the last token is always computed)
    memory = min(usable, route.memory_blocks(worker) * size)
    storage = max(memory, min(usable, route.store_blocks * size)) - memory
    return {"memory": memory, "storage": storage}


def _entry(entry: str) -> tuple[str, str]:
    """(the kvmesh model, the URL) of an ``upstreams`` entry ``[MODEL=]URL``."""
    head, sep, rest = entry.partition("=")
    if sep and "://" not in head:
        return head, rest
    return REAL_MODEL, entry


async def _addresses(url: str) -> list[str] | None:
    """The server URLs an entry names: itself, or (dns://) one per A record of its name
    (None when the name does not resolve now)."""
    parts = urlsplit(url)
    if parts.scheme != "dns":
        return [url.rstrip("/")]
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            parts.hostname, parts.port, family=socket.AF_INET, type=socket.SOCK_STREAM
        )
    except OSError as err:
        log.warning("upstream %s: %s", url, err)
        return None
    hosts = sorted({info[4][0] for info in infos})
    return [urlunsplit(("http", f"{h}:{parts.port}", "", "", "")) for h in hosts]

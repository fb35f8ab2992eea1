"""Token links: a worker's token events straight to the router that waits for them, on one
TCP connection per worker and router, instead of through the NATS server.

Each message through NATS wakes three processes (the worker's send, the server, the
router's read); on a VM each wake-up costs tens of microseconds of CPU on both sides, and a
32-token answer sent a step at a time spent most of its CPU there (bench/e2e.py's wake-ups).
A link takes the server out of the token path. Everything else stays on NATS: the tasks,
their acks, cancels; and a worker sends on NATS whenever it has no link up (the first
events of a router it has not reached yet, a router it cannot reach, a link that broke).

A router listens on ``token_port`` and puts its address and a key of its own in every task
it sends (tasks travel on the mesh's authenticated NATS: whoever shows the key had one). A
worker connects the first time it has events for that router, and shows the key in its
first frame; the router closes a connection that does not. With the mesh's TLS on, the
link is mutual TLS as well. Frames: a 4-byte big-endian length, then a message as the
reply subject carries it (``TokenEvents``' JSON).

Events of one request may come on both ways while a link comes up: each carries its index,
and the router puts them in order (services/router/dispatch/stream.py). Events written to a
link that then breaks may be lost: the router, seeing its end close, moves every answer in
flight on that worker (the answer goes on from the tokens its client has), and the worker
sends on NATS until it connects again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import ssl
import time
from collections.abc import Callable

from shared import faults
from shared.messages.generate import GenerateTask

log = logging.getLogger(__name__)

HEAD = 4  # bytes of a frame's length
MAX_FRAME = 16 << 20  # a frame at most (a step's events for a router: far less)
HELLO_S = 5.0  # a connection shows its key within this, or is closed
CONNECT_S = 2.0  # a worker gives up connecting after this (and sends on NATS meanwhile)
RETRY_S = 1.0  # after a failed connection or a broken link, NATS alone for this long
MAX_RETRY_S = 60.0  # ... doubled at each failure in a row, up to this
DRAIN_BYTES = 1 << 20  # a link's unsent bytes past this: the sender waits for the router
DRAIN_S = 5.0  # ... this long at most, then the link is taken for broken


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(HEAD, "big") + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes:
    """The next frame's payload (IncompleteReadError at the end; ValueError past
    ``MAX_FRAME``)."""
    size = int.from_bytes(await reader.readexactly(HEAD), "big")
    if size > MAX_FRAME:
        raise ValueError(f"a frame of {size} bytes (at most {MAX_FRAME})")
    return await reader.readexactly(size)


# -- the router's end ---------------------------------------------------------------------------


class TokenServer:
    """A router's listener: each message of a worker that showed ``key`` to ``on_message``;
    a worker's link closing (not by ``stop``) to ``on_lost`` with the worker's id."""

    def __init__(
        self,
        key: str,
        ssl_context: ssl.SSLContext | None = None,
        on_message: Callable[[bytes], None] = lambda _: None,
        on_lost: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.key = key
        self.on_message = on_message
        self.on_lost = on_lost
        self.ssl = ssl_context
        self.address = ""  # host:port workers reach it at, once started
        self.links: dict[asyncio.StreamWriter, str] = {}  # each open link: its worker
        self._server: asyncio.Server | None = None
        self._stopping = False

    async def start(self, host: str, port: int, advertised_host: str) -> None:
        self._server = await asyncio.start_server(self._serve, host, port, ssl=self.ssl)
        bound = self._server.sockets[0].getsockname()[1]
        self.address = f"{advertised_host}:{bound}"
        faults.LISTENERS.append(self.switched)  # (tests: the links dropped)

    async def stop(self) -> None:
        self._stopping = True
        if self.switched in faults.LISTENERS:
            faults.LISTENERS.remove(self.switched)
        if self._server is not None:
            self._server.close()
        self.drop_all()
        if self._server is not None:
            await self._server.wait_closed()

    def drop_all(self) -> None:
        """Close every link (the workers send on NATS, and connect again)."""
        for writer in list(self.links):
            writer.close()

    def switched(self, active: set[str]) -> None:
        """Tests' fault ``token_links`` (shared/faults.py): while on, every link is closed and
        none is taken."""
        if "token_links" in active:
            self.drop_all()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if faults.on("token_links"):
            writer.close()
            return
        try:
            hello = json.loads(await asyncio.wait_for(read_frame(reader), HELLO_S))
            worker, key = str(hello.get("worker", "")), str(hello.get("key", ""))
        except (OSError, ValueError, TimeoutError, asyncio.IncompleteReadError, AttributeError):
            writer.close()  # (nothing was delivered)
            return
        if not hmac.compare_digest(key.encode(), self.key.encode()):
            log.warning("refused a token link from %s: not this router's key", worker or "?")
            writer.close()
            return
        self.links[writer] = worker
        try:
            while True:
                self.on_message(await read_frame(reader))
        except (OSError, ValueError, asyncio.IncompleteReadError):
            pass
        finally:
            self.links.pop(writer, None)
            writer.close()
            if not self._stopping:
                log.info("%s's token link closed", worker)
                self.on_lost(worker)


# -- a worker's end -----------------------------------------------------------------------------


class TokenLinks:
    """A worker's links to the routers it answers, by their reply subjects (learnt from the
    tasks). ``send`` is False where there is no link up: the caller sends on NATS."""

    def __init__(self, worker_id: str, ssl_context: ssl.SSLContext | None = None) -> None:
        self.worker_id = worker_id
        self.ssl = ssl_context
        self._routes: dict[str, tuple[str, str]] = {}  # reply subject -> (address, key)
        self._links: dict[str, _Link] = {}  # by router address

    def learn(self, task: GenerateTask) -> None:
        """Where the task's router listens, if it does."""
        if not (task.reply_address and task.reply_key):
            return
        route = (task.reply_address, task.reply_key)
        old = self._routes.get(task.reply_subject)
        self._routes[task.reply_subject] = route
        moved = old is not None and old[0] != route[0]
        if moved and all(address != old[0] for address, _ in self._routes.values()):
            link = self._links.pop(old[0], None)  # (the router moved: its old link goes)
            if link is not None:
                link.close()

    async def send(self, subject: str, payload: bytes) -> bool:
        route = self._routes.get(subject)
        if route is None:
            return False
        address, key = route
        link = self._links.get(address)
        if link is None or link.key != key:  # (a router started again at the same address)
            if link is not None:
                link.close()
            link = self._links[address] = _Link(address, key, self.worker_id, self.ssl)
        return await link.send(payload)

    def close(self) -> None:
        for link in self._links.values():
            link.close()
        self._links.clear()


class _Link:
    """One connection to a router: connected in the background the first time it is
    wanted (meanwhile, and for ``RETRY_S`` after a failure, ``send`` says no); frames
    written in one event-loop turn go out in one write."""

    def __init__(self, address: str, key: str, worker_id: str, context: ssl.SSLContext | None):
        self.address, self.key, self.worker_id, self.ssl = address, key, worker_id, context
        self.writer: asyncio.StreamWriter | None = None
        self.connecting: asyncio.Task | None = None
        self.watching: asyncio.Task | None = None
        self.down_until = 0.0
        self.failures = 0  # connections that failed or broke since one held
        self.up_since = 0.0
        self.pending: list[bytes] = []  # frames of this event-loop turn

    async def send(self, payload: bytes) -> bool:
        writer = self.writer
        if writer is None or writer.is_closing():
            self._connect_later()
            return False
        if not self.pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self.pending.append(frame(payload))
        if writer.transport.get_write_buffer_size() > DRAIN_BYTES:
            try:  # the router reads slower than this sends: wait for it, a while
                await asyncio.wait_for(writer.drain(), DRAIN_S)
            except (OSError, TimeoutError):
                self._broken(f"the router did not read for {DRAIN_S:g} s")
        return True

    def _flush(self) -> None:
        frames, self.pending = self.pending, []
        if self.writer is not None and not self.writer.is_closing():
            self.writer.writelines(frames)

    def _connect_later(self) -> None:
        if self.connecting is None and time.monotonic() >= self.down_until:
            self.connecting = asyncio.create_task(self._connect())

    async def _connect(self) -> None:
        host, _, port = self.address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port), ssl=self.ssl), CONNECT_S
            )
            writer.write(frame(json.dumps({"key": self.key, "worker": self.worker_id}).encode()))
            await writer.drain()
        except (OSError, ValueError, TimeoutError) as err:
            if not self.failures:  # (said once, not at every try)
                log.warning("no token link to %s (tokens go on NATS): %s", self.address, err)
            self._wait()
        else:
            self.writer, self.up_since = writer, time.monotonic()
            self.watching = asyncio.create_task(self._watch(reader, writer))
        finally:
            self.connecting = None

    async def _watch(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """The router sends nothing: anything read, or the end, means the link is gone."""
        with contextlib.suppress(OSError):
            await reader.read(1)
        if self.writer is writer:
            self._broken("the router closed it")

    def _broken(self, why: str) -> None:
        if self.writer is not None:
            log.info("token link to %s lost (%s): tokens go on NATS", self.address, why)
            self.writer.close()
            self.writer = None
        self.pending.clear()
        if time.monotonic() - self.up_since > MAX_RETRY_S:
            self.failures = 0  # (it had held a good while: a break, not a link that flaps)
        self._wait()

    def _wait(self) -> None:
        """NATS alone a while: ``RETRY_S``, doubled at each failure since the link held."""
        self.down_until = time.monotonic() + min(MAX_RETRY_S, RETRY_S * 2**self.failures)
        self.failures += 1

    def close(self) -> None:
        for task in (self.connecting, self.watching):
            if task is not None:
                task.cancel()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

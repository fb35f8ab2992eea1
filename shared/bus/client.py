"""Typed NATS helpers: publish, subscribe, request/reply and JetStream over one connection.

A ``Bus`` owns one nats-py connection that reconnects forever when the server goes away;
subscriptions are restored by nats-py on reconnect. Payloads are ``Message`` models as JSON.
Requests carry the current trace context in their headers; handlers run inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import uuid
from asyncio import FIRST_COMPLETED
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import APIError as JsApiError
from nats.js.errors import (
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServerError,
    ServiceUnavailableError,
)

from shared.messages import Message
from shared.messages.encode import frame, unframe
from shared.telemetry.tracing import attached, extract, inject

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)
T = TypeVar("T")

# A reply carrying this header is an error raised by the responder; the value is its text.
ERROR_HEADER = "Kvmesh-Error"
PARTS_HEADER = "Kvmesh-Parts"  # a stored message in parts (put_last)
MSG_ID = "Nats-Msg-Id"  # JetStream stores a message once per id (within its window)
PART_MARGIN = 64 << 10  # room in a message for headers beside a part


# What a publish to a stream meets while no node stores it for a moment.
STORE_UNAVAILABLE = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    JsApiError,
)


DRAIN_TIMEOUT_S = 3.0
NO_PEERS = 10005  # JetStream's "no suitable peers for placement": its cluster still forming
ASK_RESEND_S = 0.5  # an ask not answered in this is sent again (``Bus.ask``)
DIRECT_READ_WAIT_S = 10.0  # for a new replicated stream's direct reads (``read_last``)
NO_RESPONDERS_RETRY_S = 0.1  # between asks of a subject nobody subscribes to at the moment


class ClusterForming(Exception):
    """A replicated stream asked of a JetStream cluster that does not know its peers yet."""


# What JetStream answers while a stream has no leader for a moment (a node lost or back, its
# streams electing) or its cluster is still forming: asked again, it answers.
LEADERLESS = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    NoStreamResponseError,
    ServiceUnavailableError,
    ServerError,
    ClusterForming,
)
LEADERLESS_WAIT_S = 15.0  # an election takes seconds; a longer gap is an outage


class BusError(Exception):
    """NATS could not be reached, or a request got no reply in time."""


class NoResponders(BusError):
    """Nobody subscribes to the subject now (gone, or its connection to NATS coming back)."""


class NoReply(BusError):
    """A request was not answered in time."""


class RemoteError(BusError):
    """The responder to a request raised; the message is its error text."""


async def riding_out(
    call: Callable[[], Awaitable[T]], what: str, within_s: float = LEADERLESS_WAIT_S
) -> T:
    """``call()``'s result, asked again while JetStream has no leader for it (``LEADERLESS``);
    BusError, naming ``what``, once that lasts past ``within_s``. ``call`` must be safe to
    repeat: an ask that timed out may have been done."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except LEADERLESS as err:
            if time.monotonic() > deadline:
                why = f"{what}: JetStream unavailable for {within_s:g} s: {err!r}"
                raise BusError(why) from None
            log.info("%s: JetStream without a leader for it (%r); asking again", what, err)
            await asyncio.sleep(0.5)


def _decoded(raw: Msg, msg_type: type[M], subject: str) -> M | None:
    """The message, or None for a malformed one (logged: it is dropped)."""
    try:
        return msg_type.from_bytes(raw.data)
    except ValueError as err:
        log.warning("dropped a malformed %s on %s: %s", msg_type.__name__, subject, err)
        return None


def lose_silent_server(nc: NATS, after_s: float) -> None:
    """The connection's socket dropped by the kernel once the server has acknowledged
    nothing sent to it for ``after_s`` (TCP_USER_TIMEOUT); nats-py then moves to another
    server of the cluster. A host cut off sends no reset: its connections stay open. nats-py's
    pings cannot tell under steady publishing, as they queue behind its flusher, which waits
    on the dead socket; they cover a quiet client. (nats-py keeps the socket on its
    transport; where it is not found, or off Linux, the pings alone.)"""
    writer = getattr(getattr(nc, "_transport", None), "_bare_io_writer", None)
    sock = writer.get_extra_info("socket") if writer is not None else None
    if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(after_s * 1000))


class Bus:
    """One NATS connection with typed helpers. Build with ``await Bus.connect(...)``."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.closing = False
        self.replicas = 1  # of the streams this connection creates (a cluster's: 3)
        # Called after each reconnect: what was published to this client while it was away
        # from NATS is lost (its subscriptions were gone from the cluster meanwhile).
        self.on_reconnect: list[Callable[[], None]] = []

    @classmethod
    async def connect(
        cls,
        url: str,
        name: str,
        timeout_s: float = 30.0,
        options: dict[str, Any] | None = None,
        lost_after_s: float = 4.0,
    ) -> Bus:
        """Connect, retrying until ``timeout_s`` so services may start before NATS is up.
        ``url``: one server or several, comma-separated (a cluster's). ``options``: nats-py's
        credentials and TLS arguments (``shared.bus.auth.connect_options``). Credentials the
        server refuses fail at once, not after ``timeout_s``. A server silent for
        ``lost_after_s`` is left for another of the cluster's (``lose_silent_server``)."""

        waiting_logged = False
        refused: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        closing: list[Bus] = []  # filled with the Bus, so a disconnect by close() is quiet

        async def on_disconnect() -> None:
            if not (closing and closing[0].closing):
                log.warning("disconnected from NATS at %s; reconnecting", url)

        async def on_reconnect() -> None:
            log.info("reconnected to NATS at %s", url)
            if closing:
                lose_silent_server(closing[0].nc, lost_after_s)
            for listener in closing[0].on_reconnect if closing else ():
                listener()

        async def on_error(err: Exception) -> None:
            nonlocal waiting_logged
            text = str(err)
            if "permissions violation" in text.lower():  # this identity may not do that
                log.warning("NATS refused: %s", text)
                return
            if "authorization violation" in text.lower() and not closing:
                if not refused.done():
                    refused.set_result(text)
                return
            if closing or waiting_logged:  # after the first connect, disconnects say it all
                log.debug("NATS: %s", err)
            else:
                log.info("waiting for NATS at %s (%s)", url, err)
                waiting_logged = True

        # With max_reconnect_attempts=-1 nats-py also retries the first connect forever,
        # so the wait is bounded here; afterwards it reconnects forever (NATS restarts).
        connecting = asyncio.ensure_future(
            nats.connect(
                [u.strip() for u in url.split(",")],
                name=name,
                connect_timeout=2,
                reconnect_time_wait=0.25,
                max_reconnect_attempts=-1,
                ping_interval=lost_after_s / 3,
                max_outstanding_pings=2,
                # Closing drains every subscription: bounded, as a handler that waits on a
                # reply (a stream's ack) whose own subscription drains first would not end.
                drain_timeout=DRAIN_TIMEOUT_S,
                disconnected_cb=on_disconnect,
                reconnected_cb=on_reconnect,
                error_cb=on_error,
                **(options or {}),
            )
        )
        await asyncio.wait([connecting, refused], timeout=timeout_s, return_when=FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            with contextlib.suppress(BaseException):
                await connecting
            if refused.done():
                raise BusError(f"NATS at {url} refused this client: {refused.result()}")
            raise BusError(f"cannot reach NATS at {url} within {timeout_s:g} s")
        nc = connecting.result()
        lose_silent_server(nc, lost_after_s)
        bus = cls(nc)
        closing.append(bus)
        return bus

    @property
    def connection(self) -> str:
        """This connection as nats-server names it: its server's id and the client id it
        gave this connection (both change on a reconnect)."""
        info = getattr(self.nc, "_server_info", None) or {}
        if not info.get("server_id") or self.nc.client_id is None:
            return ""
        return f"{info['server_id']}:{self.nc.client_id}"

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    def pending(self) -> tuple[int, int, int]:
        """What waits on this connection: bytes published but not yet written to NATS, and
        the messages (and their bytes) received but not yet handled by their subscriptions."""
        subs = list(self.nc._subs.values())  # nats-py lists a connection's subscriptions only here
        return (
            self.nc.pending_data_size,
            sum(sub.pending_msgs for sub in subs),
            sum(sub.pending_bytes for sub in subs),
        )

    async def close(self) -> None:
        """Flush what was published and close (subscriptions stop at once)."""
        if self.nc.is_closed:
            return
        self.closing = True
        try:
            await self.nc.drain()
        except Exception:  # no server to drain to (it is away or gone): drop the connection
            with contextlib.suppress(Exception):
                await self.nc.close()

    # -- core NATS ---------------------------------------------------------------------------

    async def publish(
        self, subject: str, msg: Message, headers: dict[str, str] | None = None
    ) -> None:
        await self.nc.publish(subject, msg.to_bytes(), headers=headers)

    async def publish_bytes(self, subject: str, data: bytes) -> None:
        """A message already encoded (``Message.to_bytes`` or its equal)."""
        await self.nc.publish(subject, data)

    async def subscribe(
        self,
        subject: str,
        msg_type: type[M],
        handler: Callable[[M], Awaitable[None]],
        queue: str = "",
    ) -> Subscription:
        """Call ``handler`` with each message; a malformed one is logged and dropped."""

        async def on_msg(raw: Msg) -> None:
            msg = _decoded(raw, msg_type, subject)
            if msg is not None:
                await handler(msg)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def serve(
        self,
        subject: str,
        req_type: type[M],
        handler: Callable[..., Awaitable[Message]],
        queue: str = "",
        framed: bool = False,
        concurrent: bool = False,
    ) -> Subscription:
        """Answer requests on ``subject``; an exception becomes an error reply, not a crash.
        ``framed``: requests carry binary data after the message, and the handler is called
        as ``handler(msg, blob)``. ``concurrent``: each request is handled in a task of its
        own (nats-py calls a subscription's handler for one message at a time)."""
        tasks: set[asyncio.Task] = set()

        async def answer(raw: Msg) -> None:
            with attached(extract(raw.headers)):  # the requester's span is the parent
                await respond(raw)

        async def respond(raw: Msg) -> None:
            try:
                if framed:
                    head, blob = unframe(raw.data)
                    reply = await handler(req_type.from_bytes(head), blob)
                else:
                    reply = await handler(req_type.from_bytes(raw.data))
            except Exception as err:  # any failure is the requester's to see
                log.warning("request on %s failed: %s", subject, err)
                await self.nc.publish(raw.reply, b"", headers={ERROR_HEADER: str(err) or "error"})
                return
            await self.nc.publish(raw.reply, reply.to_bytes())

        async def on_msg(raw: Msg) -> None:
            if not raw.reply:
                return
            if not concurrent:
                await answer(raw)
                return
            task = asyncio.create_task(answer(raw))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def request(
        self,
        subject: str,
        msg: Message,
        reply_type: type[R],
        timeout_s: float = 2.0,
        blob: bytes | None = None,
    ) -> R:
        """Ask and wait for the typed reply. ``blob``: binary data sent after the message
        (``frame``), for a handler served with ``serve(..., framed=True)``."""
        payload = msg.to_bytes() if blob is None else frame(msg, blob)
        try:
            raw = await self.nc.request(subject, payload, timeout=timeout_s, headers=inject())
        except nats.errors.NoRespondersError as err:
            raise NoResponders(f"nobody serves {subject}") from err
        except nats.errors.TimeoutError as err:
            raise NoReply(f"no reply on {subject} within {timeout_s:g} s") from err
        if raw.headers and ERROR_HEADER in raw.headers:
            raise RemoteError(raw.headers[ERROR_HEADER])
        return reply_type.from_bytes(raw.data)

    async def ask(
        self,
        subject: str,
        msg: Message,
        reply_type: type[R],
        timeout_s: float,
        resend_s: float = ASK_RESEND_S,
        nobody_again: bool | Callable[[], bool] = True,
        blob: bytes | None = None,
    ) -> R:
        """``request``, sent again until answered within ``timeout_s``: every ``resend_s``
        unanswered, and soon after "nobody serves" while ``nobody_again`` holds (False, or a
        check that says False: NoResponders at once; e.g. a worker its router has dropped).
        NATS delivers at most once: an ask written to a node as it dies is lost, as is one
        that reaches a node before a reconnecting subscriber is back. Only
        for a handler that takes the same message twice as once (``shared.worker.Tasks``); a
        late answer to an earlier send is dropped."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                wait = max(0.05, min(left, resend_s))
                return await self.request(subject, msg, reply_type, wait, blob)
            except NoResponders:
                again = nobody_again() if callable(nobody_again) else nobody_again
                if not again or left <= NO_RESPONDERS_RETRY_S:
                    raise
                await asyncio.sleep(NO_RESPONDERS_RETRY_S)
            except NoReply:
                if left <= resend_s:
                    raise NoReply(f"no reply on {subject} within {timeout_s:g} s") from None

    async def gather(
        self, subject: str, msg: Message, reply_type: type[R], timeout_s: float, want: int
    ) -> list[R]:
        """Ask everyone who serves ``subject`` (no queue group) and collect their replies:
        ``want`` of them, or what came within ``timeout_s``."""
        inbox = self.nc.new_inbox()
        replies: list[R] = []
        enough = asyncio.Event()

        async def on_reply(raw: Msg) -> None:
            reply = _decoded(raw, reply_type, subject)
            if reply is not None:
                replies.append(reply)
                if len(replies) >= want:
                    enough.set()

        sub = await self.nc.subscribe(inbox, cb=on_reply)
        try:
            await self.nc.publish(subject, msg.to_bytes(), reply=inbox, headers=inject())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(enough.wait(), timeout_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return replies

    # -- JetStream ---------------------------------------------------------------------------

    async def ensure_stream(
        self,
        name: str,
        subjects: list[str],
        max_age_s: float = 0,
        max_bytes: int = -1,
        memory: bool = False,
        last_per_subject: bool = False,
        create_only: bool = False,
        ready_s: float = 30.0,
    ) -> None:
        """Create the stream (file-backed unless ``memory``), or update it to this config if it
        exists (unless ``create_only``: a stream someone else configures).
        ``last_per_subject``: keep one message per subject, readable directly. JetStream not
        ready yet (a cluster electing its leaders) is waited for up to ``ready_s``."""
        await riding_out(
            lambda: self._ensure_stream(
                name, subjects, max_age_s, max_bytes, memory, last_per_subject, create_only
            ),
            f"stream {name}",
            ready_s,
        )

    async def _ensure_stream(
        self,
        name: str,
        subjects: list[str],
        max_age_s: float,
        max_bytes: int,
        memory: bool,
        last_per_subject: bool,
        create_only: bool,
    ) -> None:
        config = StreamConfig(
            name=name,
            subjects=subjects,
            storage=StorageType.MEMORY if memory else StorageType.FILE,
            max_age=max_age_s,
            max_bytes=max_bytes,
            max_msgs_per_subject=1 if last_per_subject else -1,
            allow_direct=last_per_subject,
            num_replicas=self.replicas,
        )
        try:
            await self.js.stream_info(name)
        except NotFoundError:
            try:
                await self.js.add_stream(config)
            except BadRequestError as err:  # made in between, by another process...
                if err.err_code == NO_PEERS:  # ...or the cluster not formed yet
                    raise ClusterForming(str(err)) from None
                if not create_only:
                    await self.js.update_stream(config)
        else:
            if not create_only:
                await self.js.update_stream(config)

    async def publish_durable(self, subject: str, msg: Message, retry_s: float = 0.0) -> int:
        """Publish to a JetStream stream and wait for the store; returns the sequence number.
        ``retry_s``: keep trying that long when no store answers (see ``_store``)."""
        return await self._store(subject, msg.to_bytes(), None, retry_s)

    async def publish_durable_bytes(self, subject: str, data: bytes, retry_s: float = 0.0) -> int:
        """``publish_durable`` of a message already encoded (one not in JSON)."""
        return await self._store(subject, data, None, retry_s)

    async def _store(
        self, subject: str, data: bytes, headers: dict[str, str] | None, retry_s: float
    ) -> int:
        """Publish to a stream and wait for its ack, trying again for ``retry_s`` while no
        store answers (a NATS node lost, a stream electing its leader); a message id the
        stream dedupes makes it stored once however many tries it took."""
        headers = {**(headers or {}), MSG_ID: uuid.uuid4().hex}
        deadline = time.monotonic() + retry_s
        wait = 0.1
        while True:
            try:
                ack = await self.js.publish(subject, data, timeout=2.0, headers=headers)
                return ack.seq
            except STORE_UNAVAILABLE as err:
                if time.monotonic() + wait > deadline:
                    raise BusError(f"{subject}: not stored: {err!r}") from None
                await asyncio.sleep(wait)
                wait = min(wait * 2, 1.0)

    async def put_last(
        self,
        subject: str,
        data: bytes,
        headers: dict[str, str] | None = None,
        retry_s: float = 0.0,
    ) -> None:
        """Store ``data`` as the message of ``subject`` on a last-per-subject stream (it
        replaces the one before). Data larger than a NATS message can hold goes in parts:
        parts 1.. on ``<subject>.part<k>`` first, then part 0 on ``subject`` saying how many,
        so whoever reads part 0 finds the others stored."""
        size = max(1, self.nc.max_payload - PART_MARGIN)
        view = memoryview(data)
        parts = [view[i : i + size] for i in range(0, len(data), size)] or [view]
        for k in range(1, len(parts)):
            await self._store(f"{subject}.part{k}", bytes(parts[k]), None, retry_s)
        if len(parts) > 1:
            headers = {**(headers or {}), PARTS_HEADER: str(len(parts))}
        await self._store(subject, bytes(parts[0]), headers, retry_s)

    async def read_last(self, stream: str, subject: str) -> tuple[bytes, dict[str, str]] | None:
        """The message of ``subject`` on a last-per-subject stream; None when there is none.
        A replicated stream just made answers direct reads only once its replicas are up:
        until then (``DIRECT_READ_WAIT_S`` at most) the read is asked again."""
        deadline = time.monotonic() + DIRECT_READ_WAIT_S
        while True:
            try:
                raw = await self.js.get_last_msg(stream, subject, direct=True)
                break
            except NotFoundError:
                return None
            except nats.errors.NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
        return await self._joined(stream, subject, raw.data or b"", raw.headers)

    async def latest(self, stream: str, subject: str) -> list[Msg]:
        """The last message of every subject matching ``subject`` on ``stream``, as stored
        when the call began. Read by a pull consumer: its pending count at creation is
        exact, where a push watcher's can say "none" while the first ones are in flight
        (nats-py's ``KeyValue.keys`` then answers empty)."""
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        sub = await self.js.pull_subscribe(subject, stream=stream, config=config)
        info = await sub.consumer_info()
        found: list[Msg] = []
        try:
            left = info.num_pending
            while left > 0:
                batch = await sub.fetch(min(left, 1024), timeout=5.0)
                found += batch
                left = batch[-1].metadata.num_pending if batch else 0
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(stream, info.name)
        return found

    async def wait_last(
        self, stream: str, subject: str, timeout_s: float
    ) -> tuple[bytes, dict[str, str]]:
        """The message of ``subject`` on a last-per-subject stream: at once when it is
        stored, else the one stored within ``timeout_s`` (BusError after that). While the
        cluster's JetStream is briefly unavailable (a node lost or back), asked again."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                stored = await self.read_last(stream, subject)
                if stored is not None:
                    return stored
                # Not there yet: a consumer starting at the subject's last message gets one
                # stored in between too, then the next one.
                sub = await self.js.subscribe(
                    subject, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
                )
                break
            except STORE_UNAVAILABLE as err:
                if time.monotonic() >= deadline:
                    raise BusError(f"{subject} unreadable for {timeout_s:g} s: {err}") from None
                await asyncio.sleep(0.25)
        try:
            msg = await sub.next_msg(timeout=max(0.01, deadline - time.monotonic()))
        except nats.errors.TimeoutError:
            raise BusError(f"nothing on {subject} within {timeout_s:g} s") from None
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return await self._joined(stream, subject, msg.data, msg.headers)

    async def _joined(
        self, stream: str, subject: str, first: bytes, headers: dict[str, str] | None
    ) -> tuple[bytes, dict[str, str]]:
        """Part 0 and the parts it names, read back as one (``put_last``)."""
        headers = dict(headers or {})
        n = int(headers.pop(PARTS_HEADER, "1"))
        rest = [
            self.js.get_last_msg(stream, f"{subject}.part{k}", direct=True) for k in range(1, n)
        ]
        try:
            parts = await asyncio.gather(*rest)
        except NotFoundError:
            raise BusError(f"{subject}: a part of its {n} is gone from {stream}") from None
        return b"".join([first, *(p.data or b"" for p in parts)]), headers

    async def follow(
        self,
        stream: str,
        subject: str,
        msg_type: type[M],
        handler: Callable[[M, bool], None],
        catch_up_s: float = 10.0,
    ) -> Subscription:
        """Every message of ``subject`` on ``stream`` from its start, then each new one, to
        ``handler(msg, replaying)``; returns once the ones stored before the call were
        handled (``replaying`` is True for those), or after ``catch_up_s`` (a warning)."""
        info = await self.js.stream_info(stream)
        caught_up = asyncio.Event()
        if not info.state.messages:
            caught_up.set()

        async def on_msg(raw: Msg) -> None:
            msg = _decoded(raw, msg_type, subject)
            if msg is not None:
                handler(msg, not caught_up.is_set())
            if not raw.metadata.num_pending:
                caught_up.set()

        sub = await self.js.subscribe(subject, ordered_consumer=True, cb=on_msg)
        try:
            await asyncio.wait_for(caught_up.wait(), catch_up_s)
        except TimeoutError:
            caught_up.set()
            log.warning(
                "%s: not caught up with %s within %g s; going on", subject, stream, catch_up_s
            )
        return sub

    async def consume_durable(
        self,
        subject: str,
        durable: str,
        msg_type: type[M],
        handler: Callable[[M, int], Awaitable[None]],
    ) -> Subscription:
        """Deliver each stored message to ``handler(msg, stream_seq)`` until it succeeds.

        The message is acked after the handler returns, so a crash mid-handler redelivers it.
        """

        async def on_msg(raw: Msg) -> None:
            msg = _decoded(raw, msg_type, subject)
            if msg is None:
                await raw.term()
                return
            await handler(msg, raw.metadata.sequence.stream)
            await raw.ack()

        return await self.js.subscribe(subject, durable=durable, cb=on_msg, manual_ack=True)

"""One envelope around every route, written once: the request's id, its record, who sent it,
its admission, and its errors rendered in its API's shape. The HTTP middleware here and the
gRPC interceptor (``grpc.py``) both wrap their handlers in it.

What a route gets is its ``Envelope``: every route its errors (an ``ApiError`` raised anywhere
below it becomes the status and body of its API: OpenAI's, or Anthropic's on ``/v1/messages``,
with ``Retry-After`` when the error says); ``USER`` and ``ADMIN`` routes the caller identified
(401, 403); ``TENANT`` routes its KV options too (retention, tenant); ``GENERATE`` routes all
of that, recorded (the request's span, log line, metrics and statistics) and admitted (429
when the router or the key is over its bounds). The handler finds what the envelope made in
``current()``.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from aiohttp import web

from services.router.errors import ApiError, unavailable
from services.router.formats import openai_writer
from services.router.observe.recorder import Outcome, RequestRecorder, request_ids
from services.router.tenancy.admission import PLAIN, KvOptions, Tenancy
from services.router.tenancy.keys import ANONYMOUS, Caller
from shared.bus import BusError

_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def request_id(header: str | None) -> str:
    """The client's X-Request-Id when it is a safe token, else a fresh one."""
    if header and _SAFE_ID.match(header):
        return header
    return uuid.uuid4().hex


@dataclass(frozen=True)
class Envelope:
    role: str | None = "user"  # who may call: None (anyone), "user" (any key), "admin"
    tenant: bool = False  # the caller's KV options from the headers
    admit: bool = False  # counted in progress; 429 when over the bounds
    record: bool = False  # a span, a log line, metrics, statistics, the recent list
    errors: Callable[[ApiError], dict] = openai_writer.error_body


PUBLIC = Envelope(role=None)
USER = Envelope()
ADMIN = Envelope(role="admin")
TENANT = Envelope(tenant=True)
GENERATE = Envelope(tenant=True, admit=True, record=True)


@dataclass
class Call:
    """One request as its envelope made it."""

    rid: str
    caller: Caller = ANONYMOUS
    kv: KvOptions = PLAIN
    outcome: Outcome = field(default_factory=Outcome)  # its handler says what became of it


_CALL: ContextVar[Call] = ContextVar("call")


def current() -> Call:
    """The request being handled (set by its envelope)."""
    return _CALL.get()


Route = tuple[web.RouteDef, Envelope]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Gate:
    """What the HTTP middleware and the gRPC interceptor share."""

    def __init__(self, tenancy: Tenancy, recorder: RequestRecorder) -> None:
        self.tenancy = tenancy
        self.recorder = recorder

    @contextlib.contextmanager
    def recorded(
        self, rid: str, endpoint: str, headers: Mapping[str, str], envelope: Envelope
    ) -> Iterator[Outcome]:
        if not envelope.record:
            yield Outcome()
            return
        with self.recorder.handling(rid, endpoint, headers) as outcome:
            yield outcome

    @contextlib.contextmanager
    def entered(
        self, rid: str, headers: Mapping[str, str], envelope: Envelope, outcome: Outcome
    ) -> Iterator[Call]:
        """The caller identified and admitted; its call current meanwhile."""
        tenancy = self.tenancy
        caller = tenancy.identify(headers, envelope.role) if envelope.role else ANONYMOUS
        with tenancy.admitted(caller) if envelope.admit else contextlib.nullcontext():
            kv = tenancy.kv_options(headers, caller) if envelope.tenant else PLAIN
            call = Call(rid, caller, kv, outcome)
            token = _CALL.set(call)
            try:
                yield call
            finally:
                _CALL.reset(token)

    def middleware(self, routes: list[Route]) -> Callable:
        """The HTTP middleware for ``routes`` (others, /health and /metrics, pass through)."""
        envelopes = {route.handler: envelope for route, envelope in routes}

        @web.middleware
        async def envelope(request: web.Request, handler: Handler) -> web.StreamResponse:
            wrapped = envelopes.get(request.match_info.handler)
            if wrapped is None:
                return await handler(request)
            rid = request_id(request.headers.get("x-request-id"))
            with self.recorded(rid, request.path, request.headers, wrapped) as outcome:
                try:
                    with self.entered(rid, request.headers, wrapped, outcome):
                        response = await handler(request)
                    outcome.status = response.status
                    return response
                except ApiError as err:
                    outcome.status = err.status
                    return error_response(err, wrapped, rid)
                except BusError as err:  # NATS, or a JetStream store, out past its waits
                    outcome.status = 503
                    return error_response(unavailable(f"{err}; retry shortly", 2), wrapped, rid)

        return envelope


def error_response(err: ApiError, envelope: Envelope, rid: str) -> web.Response:
    headers = request_ids(rid)  # (within the request's span: it names the trace)
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    return web.json_response(envelope.errors(err), status=err.status, headers=headers)

"""The life of a kvmesh process: connect, serve, heartbeat, and on a signal drain and exit.

Every service subclasses ``Service`` and is run by ``run_service``. The order is fixed:
connect to NATS → ``start`` (servers, subscriptions) → serve HTTP → heartbeats → "ready".
On SIGTERM/SIGINT: status becomes draining (announced at once), ``drain`` finishes in-flight
work within ``drain_timeout_s``, a last "stopped" heartbeat lets routers forget the service,
then one exit stack closes every server and the NATS connection. A second signal exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import sys
import time
from abc import ABC, abstractmethod
from contextlib import AsyncExitStack
from pathlib import Path
from typing import ClassVar

import uvloop
from aiohttp import web
from pydantic import Field

from shared import __version__, faults
from shared.bus import Bus, BusError, NoResponders, subjects
from shared.bus.auth import connect_options
from shared.httperrors import openai_errors
from shared.logs import setup_logging
from shared.messages.heartbeat import Heartbeat, Holder, Load, Role, Status, WhoIs
from shared.messages.spans import SpansQuery, SpansReply
from shared.offline import stay_offline
from shared.security.tls import server_context
from shared.settings import CommonSettings, KvmeshSettings, SettingsError, load_settings
from shared.telemetry.heap import HeapCollector, keep_trimmed
from shared.telemetry.memory import report_memory_on_signal
from shared.telemetry.metrics import LoadCollector, metrics_handler, register_load
from shared.telemetry.tracing import RECENT, setup_tracing

log = logging.getLogger(__name__)


class ServiceSettings(KvmeshSettings):
    """What every role's own settings have; each role subclasses it with its prefix."""

    http_host: str = Field(default="127.0.0.1", description="address of the HTTP server")
    http_port: int = Field(default=0, ge=0, le=65535, description="0: any free port")
    advertise_host: str = Field(
        default="", description="host others use to reach this service; empty: derived"
    )
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, description="HTTP request body at most (more: 413)"
    )
    max_header_bytes: int = Field(
        default=16384, ge=1024, description="one HTTP request line or header at most (more: 400)"
    )

    def advertised_host(self) -> str:
        """The host put in heartbeats: a wildcard bind address means "this machine's name"."""
        if self.advertise_host:
            return self.advertise_host
        return socket.gethostname() if self.http_host in ("0.0.0.0", "::") else self.http_host


class Service(ABC):
    """One kvmesh process of a role. Subclasses add their work in ``start`` and ``drain``."""

    role: ClassVar[Role]
    whole: ClassVar[bool] = False  # its engine owns its KV (decode: it takes whole requests)
    pd_only: bool = False  # (decode) it takes only prefill workers' hand-overs

    @classmethod
    def implementation(cls, settings: ServiceSettings) -> type[Service]:
        """The class that serves with ``settings`` (a role may have more than one)."""
        return cls

    def __init__(self, common: CommonSettings, settings: ServiceSettings) -> None:
        self.common = common
        self.settings = settings
        self.service_id = common.resolved_service_id(self.role)
        self.started_at = time.time()
        self.status: Status = "ready"
        self.http_url = ""
        self.beats_bus: Bus | None = None  # the connection heartbeats go over
        self.beat_now = asyncio.Event()  # set: the next heartbeat goes out at once
        self.last_beat: Heartbeat | None = None  # the last one sent

    @classmethod
    def check(cls, common: CommonSettings, settings: ServiceSettings) -> None:
        """What the settings name and must exist (a model's files): SettingsError, naming the
        setting, when it does not. Before anything starts; the process then exits 2."""
        return None

    @abstractmethod
    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        """Open what the service needs (subscriptions, servers); register their cleanup on stack."""

    async def recent_spans(self, query: SpansQuery) -> SpansReply:
        """This process's spans of a trace, from memory (the operator page's waterfall)."""
        return SpansReply(service_id=self.service_id, spans=RECENT.of(query.trace_id))

    async def drain(self) -> None:
        """Finish in-flight work; new work is already refused. Bounded by drain_timeout_s."""
        return None

    def routes(self) -> list[web.RouteDef]:
        """HTTP routes beyond GET /health (which every service has)."""
        return []

    def middlewares(self) -> list:
        """aiohttp middlewares of the service's own, inside the one that writes aiohttp's
        own errors (unknown path, wrong method) as OpenAI error bodies."""
        return []

    def models(self) -> list[str]:
        return []

    def load(self) -> Load:
        return Load()

    def addresses(self) -> dict[str, str]:
        return {"http": self.http_url}

    def heartbeat_ages(self) -> list[tuple[str, str, float]] | None:
        """(role, service id, seconds since its last heartbeat) of each service known here;
        None where the service keeps no registry (all but the router)."""
        return None

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(
            service_id=self.service_id,
            role=self.role,
            version=__version__,
            status=self.status,
            addresses=self.addresses(),
            models=self.models(),
            whole=self.whole,
            pd_only=self.pd_only,
            load=self.load(),
            connection=self.beats_bus.connection if self.beats_bus is not None else "",
            interval_s=self.common.heartbeat_interval_s,
            started_at=self.started_at,
            sent_at=time.time(),
        )

    async def health(self, request: web.Request) -> web.Response:
        status = 200 if self.status == "ready" else 503
        return web.json_response(self.heartbeat().model_dump(mode="json"), status=status)


async def serve_http(
    stack: AsyncExitStack, app: web.Application, common: CommonSettings, settings: ServiceSettings
) -> str:
    """Serve ``app`` until the stack closes (over TLS when the mesh has it); returns its
    advertised URL (the real port)."""
    host, port = settings.http_host, settings.http_port
    # handler_cancellation: a handler whose client went away is cancelled (and so, for the
    # router, is the request on its workers).
    runner = web.AppRunner(
        app,
        handle_signals=False,
        access_log=None,
        handler_cancellation=True,
        max_line_size=settings.max_header_bytes,
        max_field_size=settings.max_header_bytes,
    )
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    tls = server_context(common)
    site = web.TCPSite(runner, host, port, reuse_address=True, ssl_context=tls)
    try:
        await site.start()
    except OSError as err:
        raise SettingsError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    bound = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
    scheme = "https" if tls else "http"
    return f"{scheme}://{settings.advertised_host()}:{bound[1]}"


def build_app(service: Service) -> web.Application:
    """The service's HTTP application: GET /health, GET /metrics and its own routes."""
    app = web.Application(
        middlewares=[openai_errors, *service.middlewares()],
        client_max_size=service.settings.max_body_bytes,
    )
    bus = service.beats_bus
    pending = bus.pending if bus is not None else lambda: None
    register_load(LoadCollector(service.role, service.load, service.heartbeat_ages, pending))
    register_load(HeapCollector())
    app.add_routes(
        [
            web.get("/health", service.health),
            web.get("/metrics", metrics_handler),
            *service.routes(),
            *(FAULT_ROUTES if service.common.fault_hooks else ()),
        ]
    )
    return app


async def _switch_fault(request: web.Request) -> web.Response:
    on = request.method == "PUT"
    return web.json_response({"faults": faults.switch(request.match_info["name"], on)})


FAULT_ROUTES = (
    web.put("/faults/{name}", _switch_fault),
    web.delete("/faults/{name}", _switch_fault),
)


async def claim_id(service: Service, bus: Bus) -> None:
    """Refuse to start under an id a live process holds (SettingsError, naming it): two
    processes under one id would both take its tasks. Free, the id is answered for here."""
    sid = service.service_id
    subject = subjects.whois(sid)
    me = Holder(
        service_id=sid,
        role=service.role,
        host=socket.gethostname(),
        pid=os.getpid(),
        started_at=service.started_at,
    )
    setting = "KVMESH_SERVICE_ID"
    try:
        asker = WhoIs(asker=f"{me.host}:{me.pid}")
        holder = await bus.ask(subject, asker, Holder, 2.0, nobody_again=False)
    except NoResponders:  # nobody holds it (a holder that died let go with its connection)
        holder = None
    except BusError as err:
        raise SettingsError(
            f"{setting}={sid}: a process holds this id but does not answer ({err}); "
            "stop it, or give this one another id"
        ) from None
    if holder is not None:
        up = time.time() - holder.started_at
        raise SettingsError(
            f"{setting}={sid}: already in use by a running {holder.role} (pid {holder.pid} "
            f"on {holder.host}, up {up:.0f} s); stop it, or give this one another id"
        )

    async def answer(_: WhoIs) -> Holder:
        return me

    await bus.serve(subject, WhoIs, answer)


async def _publish_heartbeats(service: Service, bus: Bus) -> None:
    """A heartbeat every interval, or sooner when the service sets ``beat_now`` (room came
    back on a worker whose last beat said it was full: routers would refuse work meanwhile)."""
    subject = subjects.heartbeat(service.role)
    while True:
        service.beat_now.clear()
        if bus.connected:  # while NATS is away, stale beats would only pile up in the buffer
            try:
                service.last_beat = service.heartbeat()
                await bus.publish(subject, service.last_beat)
            except Exception as err:  # a beat lost to a reconnect is replaced by the next one
                log.debug("heartbeat not sent: %s", err)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(service.beat_now.wait(), service.common.heartbeat_interval_s)


async def _connect_unless_stopped(service: Service, stop: asyncio.Event) -> Bus | None:
    common = service.common
    connecting = asyncio.ensure_future(
        Bus.connect(
            common.nats_url,
            service.service_id,
            common.nats_connect_timeout_s,
            connect_options(common, service.role),
            lost_after_s=common.nats_lost_after_s,
        )
    )
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([connecting, stopping], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not connecting.done():
        connecting.cancel()
        return None
    bus = connecting.result()
    bus.replicas = common.jetstream_replicas
    return bus


# Objects made (and not yet freed) between two collections of the youngest generation.
# Python's default, 700, is a collection every few decode steps of a busy router; each
# walks what requests in flight hold. Cyclic garbage is rare on the request path (freed by
# reference counts), so collecting less often costs little memory.
GC_YOUNG_THRESHOLD = 50_000


def keep_for_good() -> None:
    """What exists now (modules, a model's weights and tokenizer, tables built at start)
    lives as long as the process: moved out of the garbage collector's sight, so that a
    collection scans only what requests made since; and the collector runs less often.
    Before, a router streaming to 256 clients spent a fifth of its time collecting."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])


async def _run(service: Service) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second %s: exiting now", signal.Signals(signum).name)
            os._exit(1)
        log.info("%s: draining", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    report_memory_on_signal(loop, Path(service.common.state_dir), service.service_id)

    async with AsyncExitStack() as stack:
        bus = await _connect_unless_stopped(service, stop)
        if bus is None:
            log.info("stopped before NATS was reached")
            return
        stack.push_async_callback(bus.close)
        await claim_id(service, bus)
        service.beats_bus = bus
        await service.start(stack, bus)
        await bus.serve(subjects.SPANS_QUERY, SpansQuery, service.recent_spans)
        service.http_url = await serve_http(
            stack, build_app(service), service.common, service.settings
        )
        beats = asyncio.create_task(_publish_heartbeats(service, bus))
        keep_for_good()
        trimming = asyncio.create_task(keep_trimmed(service.common.heap_trim_interval_s))
        stack.callback(trimming.cancel)
        log.info("%s ready: %s (http %s)", service.role, service.service_id, service.http_url)

        await stop.wait()
        # Stage 1: refuse new work, say so, finish what is in flight (bounded).
        service.status = "draining"
        with contextlib.suppress(Exception):
            await bus.publish(subjects.heartbeat(service.role), service.heartbeat())
        try:
            await asyncio.wait_for(service.drain(), service.common.drain_timeout_s)
        except TimeoutError:
            log.warning("drain took over %g s; stopping anyway", service.common.drain_timeout_s)
        beats.cancel()
        service.status = "stopped"
        with contextlib.suppress(Exception):
            await bus.publish(subjects.heartbeat(service.role), service.heartbeat())
        # Stage 2: the exit stack closes servers, subscriptions and the NATS connection.
    log.info("%s stopped", service.service_id)


def run_service(service_cls: type[Service], settings_cls: type[ServiceSettings]) -> int:
    """Entry point of ``python -m services.<role>``: settings, logging, uvloop, run. Exit code."""
    stay_offline()  # before any engine is imported (shared/offline.py)
    try:
        common = load_settings(CommonSettings)
        settings = load_settings(settings_cls)
        service_cls = service_cls.implementation(settings)
        service_cls.check(common, settings)
    except SettingsError as err:
        print(f"kvmesh {service_cls.role}: {err}", file=sys.stderr)
        return 2
    setup_logging(common.log_level)
    service = service_cls(common, settings)
    provider = setup_tracing(
        service.role,
        service.service_id,
        common.trace_exporter,
        common.trace_endpoint,
        common.trace_sample_ratio,
        common.state_dir,
        common.recent_traces,
        common.recent_traces_bytes,
    )
    try:
        uvloop.run(_run(service))
    except (SettingsError, BusError) as err:
        log.error("%s", err)
        return 1
    finally:
        provider.shutdown()  # the last spans out
    return 0

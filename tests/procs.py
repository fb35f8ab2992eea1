"""Helpers that run real kvmesh processes and a real nats-server for tests."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.natsconf import write_server_config
from kvmesh.natsserver import NatsServer, die_with_parent
from shared.bus import Bus
from shared.bus.auth import identity

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def secrets_dir(state_dir: Path) -> Path:
    return state_dir.parent / "secrets"


def mesh_nats(dir: Path, secrets: Path) -> NatsServer:
    """A nats-server (not started) configured as `kvmesh up` configures one: every role's
    identity from ``secrets`` with its permissions, nobody else let in."""
    config = write_server_config(dir / "nats-server.conf", secrets)
    return NatsServer(
        "127.0.0.1", free_port(), dir / "js", log_file=dir / "nats.log", config=config
    )


async def connect_as(url: str, role: str, secrets: Path) -> Bus:
    """A bus connection with ``role``'s identity on a mesh's NATS."""
    return await Bus.connect(url, f"test-{role}", 10, identity(secrets, role))


def service_env(nats_url: str, state_dir: Path, **extra: str) -> dict[str, str]:
    """A clean environment for a child process: only the KVMESH_ values a test sets."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(
        KVMESH_NATS_URL=nats_url,
        KVMESH_STATE_DIR=str(state_dir),
        # One mesh's secrets for every stack beside this one: stacks on one nats-server may
        # route to each other's workers (salts and handoff tokens must agree).
        KVMESH_SECRETS_DIR=str(secrets_dir(state_dir)),
        KVMESH_NATS_CONNECT_TIMEOUT_S="10",
        KVMESH_ROUTER_GRPC_PORT="0",
        # Tests are about the mesh unless they say otherwise: the tiny model, one thread each.
        KVMESH_PREFILL_MODEL="tiny",
        KVMESH_DECODE_MODEL="tiny",
        KVMESH_PREFILL_THREADS="1",
        KVMESH_DECODE_THREADS="1",
        KVMESH_PREFILL_KV_CACHE_TOKENS="4096",
        KVMESH_DECODE_KV_CACHE_TOKENS="4096",
    )
    env.update(extra)
    return env


class Proc:
    """A child process whose output goes to a file the test can read back."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.args, self.env = args, env  # (to start it again as it was)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115
        # The child dies with the test run, however it ends (no process left eating CPU).
        self.popen = subprocess.Popen(
            args,
            env=env,
            cwd=REPO,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_for(self, marker: str, timeout_s: float) -> None:
        """Until ``marker`` is in the output; failing (with the output's end) when the process
        exits first or the time runs out."""
        deadline = time.monotonic() + timeout_s
        while marker not in self.output():
            if not self.alive() or time.monotonic() > deadline:
                why = f"exit code {self.popen.returncode}" if not self.alive() else "timed out"
                tail = "\n".join(self.output().splitlines()[-40:])
                raise AssertionError(
                    f"{marker!r} never came ({why} after {timeout_s:g} s):\n{tail}"
                )
            time.sleep(0.1)

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        return self.popen.wait(timeout_s)

    def stop(self, timeout_s: float = 15) -> int:
        self.signal(signal.SIGTERM)
        return self.reap(timeout_s)

    def reap(self, timeout_s: float = 15) -> int:
        """Wait for the process to end (SIGKILL after ``timeout_s``); its exit code."""
        try:
            return self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            return self.popen.wait()
        finally:
            self._log.close()


def children_of(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:  # (the field after the command's closing parenthesis: state, then ppid)
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
    return found


def environment_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.decode().partition("=")[::2] for item in raw.split(b"\0") if item)


def start_service(role: str, env: dict[str, str], log_dir: Path, name: str = "") -> Proc:
    name = name or role
    return Proc([sys.executable, "-m", f"services.{role}"], env, log_dir / f"{name}.log")


def get_json(
    url: str, timeout_s: float = 5, context: ssl.SSLContext | None = None
) -> tuple[int, dict]:
    """GET a URL; returns (status, JSON body) for 2xx and error statuses alike. ``context``:
    what an https URL is verified with."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def metrics(url: str) -> dict[tuple[str, tuple], float]:
    """A service's /metrics now: (sample name, sorted labels) → value."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def wait_until(check, timeout_s: float, interval_s: float = 0.1, what: str = "condition"):
    """Poll ``check()`` until it returns a truthy value; return it, or fail with ``what``."""
    deadline = time.monotonic() + timeout_s
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        try:
            value = check()
            if value:
                return value
        except (OSError, ValueError) as err:  # not listening yet, half-written body
            last_err = err
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} ({last_err})")


async def until(check, timeout_s: float, what: str, interval_s: float = 0.05):  # noqa: ANN001, ANN201
    """``wait_until`` on the running loop (what else runs on it goes on): ``check()``, awaited
    where it is a coroutine, until it is truthy; return it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def kvmesh_pids(marker: str) -> list[int]:
    """Pids of live processes whose command line or environment contains ``marker``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            blob = (proc / "cmdline").read_bytes() + (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if marker.encode() in blob and state != "Z":
            pids.append(int(proc.name))
    return pids


def start_with(role: str, var: str, value: str) -> subprocess.CompletedProcess:
    """A service started with one setting and nothing else, run until it exits."""
    return subprocess.run(
        [sys.executable, "-m", f"services.{role}"],
        env={"PATH": "/usr/bin:/bin", var: value},
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )


def kvmesh_keys(path: Path, *args: str) -> str:
    """`kvmesh keys --file path ...`; its stdout (a new key, or the list)."""
    run = subprocess.run(
        [sys.executable, "-m", "kvmesh", "keys", "--file", str(path), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()

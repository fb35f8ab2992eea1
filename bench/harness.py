"""What the benchmarks share: progress on stderr, percentiles, free ports, waiting for a URL or a
process, the last line's JSON, and a `kvmesh up` stack of a bench's own on 127.0.0.1.

A bench prints its progress with ``say`` (stderr), its tables on stdout, and as its last line
``emit(figures)``: one JSON object with the figures its issue names.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def say(msg: str) -> None:
    """A progress line (stderr: stdout is the tables and the JSON line)."""
    print(msg, file=sys.stderr, flush=True)


def pct(values: Sequence[float], p: float, scale: float = 1.0) -> float:
    """The ``p``-th percentile (nearest rank: the value at ⌊p/100 · n⌋ of the sorted ones,
    the largest for p = 100) times ``scale`` (1e3: seconds as milliseconds); 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))] * scale


def emit(figures: dict) -> None:
    """The bench's last line: its figures as one JSON object."""
    print(json.dumps(figures, default=float), flush=True)


def own_venv(path: Path, packages: Sequence[str], made: Sequence[str]) -> Path:
    """A venv of the bench's own at ``path`` with ``packages`` from the package registry (made
    when one of the programs ``made`` names is missing: never the project's venv); its bin."""
    if not all((path / "bin" / name).exists() for name in made):
        say(f"installing {', '.join(packages)} into {path}")
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        pip = [str(path / "bin" / "pip"), "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, *packages], check=True)
    return path / "bin"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float = 60, proc: subprocess.Popen | None = None) -> None:
    """Until ``url`` answers 2xx; SystemExit when ``proc`` (what serves it) exits first or the
    time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{' '.join(map(str, proc.args[:4]))} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} did not answer in {timeout_s:g} s")


def stop(proc: subprocess.Popen, timeout_s: float = 30, group: bool = False) -> None:
    """Ctrl-C, as a person would stop it (its whole process group with ``group``); killed if
    it has not ended in ``timeout_s``."""
    signal_it = (lambda s: os.killpg(proc.pid, s)) if group else proc.send_signal
    with contextlib.suppress(ProcessLookupError):
        signal_it(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            signal_it(signal.SIGKILL)
        proc.wait()


def _waits(pid: int) -> int:
    """Voluntary context switches of all of a process's threads (/proc's per thread)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
    return total


class Up:
    """`kvmesh up ARGS` in a state dir of its own (a new temporary one unless ``state``), its
    NATS and router on free ports of 127.0.0.1, with ``env`` on top of the environment (less
    any KVMESH_ setting of the caller's); its output in ``state/up.log``.

        with Up(["--decode", "2"], {"KVMESH_DECODE_MODEL": "tiny"}) as up:
            up.wait_ready()
            ... up.url ...
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        state: Path | None = None,
        tls: bool = False,
    ) -> None:
        self.dir = state or Path(tempfile.mkdtemp(prefix="kvmesh-bench-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.tls = tls
        full = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        full.update(
            KVMESH_STATE_DIR=str(self.dir),
            KVMESH_NATS_URL=f"nats://127.0.0.1:{free_port()}",
            KVMESH_ROUTER_HTTP_PORT=str(self.port),
            KVMESH_ROUTER_GRPC_PORT="0",
            KVMESH_LOG_LEVEL="warning",
        )
        full.update(env or {})
        self.log = open(self.dir / "up.log", "wb")  # noqa: SIM115 (closed by stop)
        argv = [sys.executable, "-m", "kvmesh", "up", *(["--tls"] if tls else []), *args]
        self.proc = subprocess.Popen(
            argv, env=full, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT
        )
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.started_at = time.perf_counter()

    def __enter__(self) -> Up:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()

    def tail(self, chars: int = 3000) -> str:
        return (self.dir / "up.log").read_text(errors="replace")[-chars:]

    def wait_ready(self, timeout_s: float = 180, key: str = "", context: object = None) -> float:
        """Until the router lists a model (its workers registered); the seconds since the
        start. SystemExit, with the log's end, if `kvmesh up` exits first or time runs out."""
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        while time.monotonic() < deadline:
            try:
                req = urllib.request.Request(f"{self.url}/v1/models", headers=headers)
                with urllib.request.urlopen(req, timeout=2, context=context) as r:
                    if json.loads(r.read())["data"]:
                        return time.perf_counter() - self.started_at
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"kvmesh up exited; {self.dir / 'up.log'} ends:\n{self.tail()}")
            time.sleep(0.2)
        raise SystemExit(f"kvmesh up not ready in {timeout_s:g} s; see {self.dir / 'up.log'}")

    def stop(self, timeout_s: float = 30) -> None:
        stop(self.proc, timeout_s)
        self.log.close()

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds (user and system) of each process the stack runs, by what it is:
        router, prefill, decode, decode engine (the engine's own process), cachemeta,
        encoder, nats-server (several of a kind: added together)."""
        return {k: cpu for k, (cpu, _) in self.cpu_and_wakeups().items()}

    def cpu_and_wakeups(self) -> dict[str, tuple[float, int]]:
        """``cpu_seconds``, each with its process's voluntary context switches (its threads'
        waits for something to read: each message that woke it, about)."""
        import psutil  # (here: the extras install it, and most benches run without it)

        out: dict[str, tuple[float, int]] = {}
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.NoSuchProcess):
                line = " ".join(p.cmdline())
                if "shared.hosting.process" in line:
                    name = "decode engine"
                elif "nats-server" in line:
                    name = "nats-server"
                elif "services." in line:
                    name = line.split("services.", 1)[1].split()[0]
                else:
                    continue
                t, waits = p.cpu_times(), _waits(p.pid)
                cpu, woken = out.get(name, (0.0, 0))
                out[name] = (cpu + t.user + t.system, woken + waits)
        return out


class Stack(Up):
    """`kvmesh up` for this bench: ``model`` on both pools, ``threads`` each, every request's
    KV moved (no prefill on decode)."""

    def __init__(
        self,
        model: str,
        threads: int,
        extra: dict[str, str] | None = None,
        tls: bool = False,
        args: tuple[str, ...] = (),
    ) -> None:
        env = dict(
            KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",  # every request moves its KV
            KVMESH_PREFILL_MODEL=model,
            KVMESH_DECODE_MODEL=model,
            KVMESH_PREFILL_THREADS=str(threads),
            KVMESH_DECODE_THREADS=str(threads),
            KVMESH_PREFILL_KV_CACHE_TOKENS="16384",
            KVMESH_DECODE_KV_CACHE_TOKENS="16384",
        )
        super().__init__(args, {**env, **(extra or {})}, tls=tls)

    @property
    def ssl(self) -> ssl.SSLContext | None:
        """What a client trusts: the stack's local CA (made by `kvmesh up --tls`)."""
        return ssl.create_default_context(cafile=self.dir / "tls" / "ca.crt") if self.tls else None

    def wait_ready(self, timeout_s: float = 120, key: str = "") -> None:  # type: ignore[override]
        super().wait_ready(timeout_s, key, self.ssl)

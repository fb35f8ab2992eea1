"""`kvmesh up` and `kvmesh status` as a user runs them: one command starts the stack with its
own nats-server, the status table shows every service, Ctrl-C leaves no process behind."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from shared.messages.heartbeat import ROLES
from tests.procs import Proc, free_port, get_json, kvmesh_pids, service_env, wait_until

KVMESH = [sys.executable, "-m", "kvmesh"]


def up_env(state_dir: Path, nats_port: int, http_port: int) -> dict[str, str]:
    return service_env(
        f"nats://127.0.0.1:{nats_port}", state_dir, KVMESH_ROUTER_HTTP_PORT=str(http_port)
    )


def test_up_status_and_clean_stop(state_dir: Path) -> None:
    nats_port, http_port = free_port(), free_port()
    env = up_env(state_dir, nats_port, http_port)
    up = Proc([*KVMESH, "up", "--prefill", "2"], env, state_dir / "up.log")
    try:
        wait_until(lambda: "kvmesh is up" in up.output(), 60, what="kvmesh up to be ready")
        assert f"API at http://127.0.0.1:{http_port}" in up.output()
        # Each service's log lines are shown with its name in front.
        assert "prefill-1   | " in up.output()
        status, body = get_json(f"http://127.0.0.1:{http_port}/health")
        assert status == 200
        assert len(body["roles"]["prefill"]) == 2
        assert all(len(body["roles"][role]) >= 1 for role in ROLES)
        # NATS runs with JetStream, its store under the state dir.
        assert (state_dir / "nats" / "jetstream").is_dir()

        table = kvmesh(["status"], env)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0].split()[:3] == ["ROLE", "ID", "STATUS"]
        rows = {line.split()[1]: line.split() for line in lines[1:-1]}
        assert set(rows) == {
            "cachemeta-0",
            "router-0",
            "prefill-0",
            "prefill-1",
            "decode-0",
            "encoder-0",
        }
        assert all(row[2] == "ready" for row in rows.values())
        assert lines[-1] == "6 services, as seen by router router-0"

        assert len(kvmesh_pids(str(state_dir))) >= 7  # six services and nats-server
        up.signal(signal.SIGINT)
        assert up.wait(30) == 0
        wait_until(lambda: kvmesh_pids(str(state_dir)) == [], 5, what="no process left")
        assert "stopped nats-server" in up.output()
    finally:
        up.stop()


def kvmesh(args: list[str], env: dict[str, str], timeout_s: float = 120):
    return subprocess.run(
        [*KVMESH, *args], env=env, capture_output=True, text=True, timeout=timeout_s
    )


@contextlib.contextmanager
def occupied_port() -> Iterator[int]:
    """A port on 127.0.0.1 held by a listener that is not ours to use."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        yield squatter.getsockname()[1]


def test_status_without_a_stack_says_so(state_dir: Path) -> None:
    env = service_env(f"nats://127.0.0.1:{free_port()}", state_dir)
    done = kvmesh(["status", "--timeout", "1"], env)
    assert done.returncode == 1
    assert "cannot reach NATS" in done.stderr
    assert "kvmesh up" in done.stderr


def test_up_with_nats_port_taken_is_a_clear_error(state_dir: Path) -> None:
    with occupied_port() as port:
        done = kvmesh(["up"], up_env(state_dir, port, free_port()))
    assert done.returncode == 1
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr
    assert kvmesh_pids(str(state_dir)) == []


def test_up_with_router_port_taken_stops_everything(state_dir: Path) -> None:
    with occupied_port() as http_port:
        done = kvmesh(["up"], up_env(state_dir, free_port(), http_port))
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{http_port}" in done.stdout
    assert "router-0 (exit code 1) stopped while the stack was starting" in done.stderr
    assert kvmesh_pids(str(state_dir)) == []


def test_up_rejects_bad_counts(state_dir: Path) -> None:
    env = service_env(f"nats://127.0.0.1:{free_port()}", state_dir)
    done = kvmesh(["up", "--decode", "-1"], env)
    assert done.returncode == 2
    assert "--decode must be between 0 and 64 (got -1)" in done.stderr


def test_killing_kvmesh_up_leaves_no_process_behind(state_dir: Path) -> None:
    """SIGKILL gives `kvmesh up` no chance to stop anything: its children (and nats-server)
    go by themselves, with the parent-death signal they were started with."""
    env = up_env(state_dir, free_port(), free_port())
    up = Proc([*KVMESH, "up", "--encoder", "0"], env, state_dir / "up.log")
    try:
        wait_until(lambda: "kvmesh is up" in up.output(), 120, what="kvmesh up to be ready")
        assert len(kvmesh_pids(str(state_dir))) >= 6  # five services and nats-server
        up.popen.kill()
        up.wait(10)
        wait_until(lambda: kvmesh_pids(str(state_dir)) == [], 30, what="every child gone")
    finally:
        up.stop()

"""Five real service processes on a real nats-server: registration, expiry, shutdown, and
recovery from a NATS restart, as a user sees them through the router's HTTP API."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.natsserver import NatsServer
from shared.messages.heartbeat import ROLES
from tests.procs import (
    Proc,
    free_port,
    get_json,
    health_ids,
    service_env,
    start_service,
    wait_until,
)


@pytest.fixture(scope="module")
def mesh(
    nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, dict[str, Proc], Path]]:
    """One process per role; yields (router URL, processes by id, log dir)."""
    tmp = tmp_path_factory.mktemp("mesh")
    port = free_port()
    env = service_env(nats_server.url, tmp, KVMESH_ROUTER_HTTP_PORT=str(port))
    procs = {}
    for role in ROLES:
        procs[f"{role}-0"] = start_service(
            role, {**env, "KVMESH_SERVICE_ID": f"{role}-0"}, tmp, f"{role}-0"
        )
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: get_json(f"{url}/health")[0] == 200, 30, what="all roles healthy")
    yield url, procs, tmp
    for proc in procs.values():
        proc.stop()


def restart(procs: dict[str, Proc], service_id: str, log_dir: Path, nats_url: str) -> None:
    role = service_id.split("-")[0]
    env = service_env(nats_url, log_dir, KVMESH_SERVICE_ID=service_id)
    procs[service_id] = start_service(role, env, log_dir, f"{service_id}-again")


def test_health_lists_every_role(mesh) -> None:
    url, _, _ = mesh
    status, body = get_json(f"{url}/health")
    assert status == 200
    assert body["status"] == "ok"
    for role in ROLES:
        (worker,) = body["roles"][role]
        assert worker["id"] == f"{role}-0"
        assert worker["address"].startswith("http://127.0.0.1:")
        assert worker["age_s"] < 1.5
        # Every service answers on the address it advertises.
        assert get_json(f"{worker['address']}/health")[1]["service_id"] == worker["id"]


def test_models_in_openai_format(mesh) -> None:
    url, _, _ = mesh
    status, body = get_json(f"{url}/v1/models")
    assert status == 200
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]  # the test workers serve the tiny model
    assert body["data"][0]["object"] == "model"


def test_unknown_path_gets_openai_error(mesh) -> None:
    url, _, _ = mesh
    status, body = get_json(f"{url}/v1/nothing-here")
    assert status == 404
    assert body["error"]["type"] == "not_found_error"
    assert "/v1/nothing-here" in body["error"]["message"]


def test_killed_worker_leaves_within_4s(mesh, nats_url: str) -> None:
    url, procs, log_dir = mesh
    procs["decode-0"].popen.kill()  # SIGKILL: no goodbye, only missed heartbeats tell
    killed_at = time.monotonic()
    wait_until(lambda: "decode-0" not in health_ids(url)["decode"], 4.0, what="decode-0 dropped")
    assert time.monotonic() - killed_at > 2.0  # dropped for missed beats, not by chance
    status, body = get_json(f"{url}/health")
    assert (status, body["missing"]) == (503, ["decode"])
    assert get_json(f"{url}/v1/models")[1]["data"] == []  # nobody decodes: no model served

    restart(procs, "decode-0", log_dir, nats_url)
    wait_until(lambda: get_json(f"{url}/health")[0] == 200, 20, what="decode-0 back")


def test_sigterm_drains_and_leaves_at_once(mesh, nats_url: str) -> None:
    url, procs, log_dir = mesh
    proc = procs["encoder-0"]
    proc.signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    # The last beat says "stopped": gone at once, not after three missed beats.
    assert "encoder-0" not in health_ids(url)["encoder"]
    assert "draining" in proc.output()
    restart(procs, "encoder-0", log_dir, nats_url)
    wait_until(lambda: get_json(f"{url}/health")[0] == 200, 20, what="encoder-0 back")


def test_services_reregister_after_nats_restart(mesh, nats_server: NatsServer) -> None:
    url, procs, _ = mesh
    nats_server.stop()
    time.sleep(4.0)  # longer than three beats: the router forgets everyone else
    assert get_json(f"{url}/health")[0] == 503
    nats_server.start()
    wait_until(lambda: get_json(f"{url}/health")[0] == 200, 15, what="re-registration")
    ids = health_ids(url)
    assert {role: ids[role] for role in ROLES} == {role: [f"{role}-0"] for role in ROLES}
    assert all(proc.alive() for proc in procs.values())

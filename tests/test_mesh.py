"""Five real service processes on a real nats-server: registration, a death seen the moment
its connection closes, a freeze seen by missed beats, a duplicate id refused, shutdown, and
recovery from a NATS restart, as a user sees them through the router's HTTP API."""

from __future__ import annotations

import signal

import pytest

from kvmesh.natsserver import NatsServer
from shared.messages.heartbeat import ROLES
from tests.procs import get_json, wait_until
from tests.stack import Stack


@pytest.fixture(scope="module")
def mesh(stacks) -> Stack:
    """One process per role, with the tests' slack (10 missed beats: a busy core does not
    drop a worker); a killed worker is dropped on nats-server's word, a frozen one after its
    missed beats."""
    return stacks(tuple(f"{role}-0" for role in ROLES))


def healthy(mesh: Stack) -> bool:
    return get_json(f"{mesh.url}/health")[0] == 200


def test_health_lists_every_role(mesh: Stack) -> None:
    wait_until(lambda: healthy(mesh), 30, what="every role healthy")
    status, body = get_json(f"{mesh.url}/health")
    assert status == 200
    assert body["status"] == "ok"
    for role in ROLES:
        (worker,) = body["roles"][role]
        assert worker["id"] == f"{role}-0"
        assert worker["address"].startswith("http://127.0.0.1:")
        # Its last beat is recent: within the 3 beats a second after which it would be dropped.
        assert 0 <= worker["age_s"] < 3.0
        # Every service answers on the address it advertises.
        assert get_json(f"{worker['address']}/health")[1]["service_id"] == worker["id"]


def test_models_in_openai_format(mesh: Stack) -> None:
    status, body = get_json(f"{mesh.url}/v1/models")
    assert status == 200
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["tiny"]  # the test workers serve the tiny model
    assert body["data"][0]["object"] == "model"


def test_the_api_document_gives_the_served_models_as_examples(mesh: Stack) -> None:
    _, document = get_json(f"{mesh.url}/openapi.json")
    chat = document["components"]["schemas"]["ChatRequest"]["properties"]["model"]
    assert chat["examples"] == ["tiny"]


def test_unknown_path_gets_openai_error(mesh: Stack) -> None:
    status, body = get_json(f"{mesh.url}/v1/nothing-here")
    assert status == 404
    assert body["error"]["type"] == "not_found_error"
    assert "/v1/nothing-here" in body["error"]["message"]


def test_a_killed_worker_is_dropped_the_moment_its_connection_closes(mesh: Stack) -> None:
    """SIGKILL: no goodbye; nats-server says the connection closed, and the router drops the
    worker on that word, not after its missed beats (10 s here)."""
    mesh.procs["decode-0"].popen.kill()
    wait_until(lambda: "decode-0" not in mesh.ready_ids()["decode"], 30, what="decode-0 dropped")
    # Dropped on the server's word, not on missed beats (bench/faults.py times it: ~20 ms).
    assert "dropped decode decode-0: its NATS connection closed" in mesh.procs["router-0"].output()
    status, body = get_json(f"{mesh.url}/health")
    assert (status, body["missing"]) == (503, ["decode"])
    assert get_json(f"{mesh.url}/v1/models")[1]["data"] == []  # nobody decodes: no model served
    mesh.start("decode-0")
    wait_until(lambda: healthy(mesh), 60, what="decode-0 back")


def test_a_frozen_worker_is_dropped_for_its_missed_beats_and_comes_back(mesh: Stack) -> None:
    """SIGSTOP: its connection stays open, only the missed heartbeats tell (the bound itself
    is tested with an injected clock in tests/router/test_registry.py); SIGCONT: its next
    beat registers it again."""
    proc = mesh.procs["prefill-0"]
    proc.signal(signal.SIGSTOP)
    try:
        wait_until(  # (10 missed beats of 1 s)
            lambda: "prefill-0" not in mesh.ready_ids()["prefill"], 40, what="prefill-0 dropped"
        )
        assert "dropped prefill prefill-0: no heartbeat for" in mesh.procs["router-0"].output()
    finally:
        proc.signal(signal.SIGCONT)
    wait_until(lambda: healthy(mesh), 30, what="prefill-0 back")


def test_a_second_process_under_a_live_id_is_refused(mesh: Stack) -> None:
    """Two processes under one id would both take its tasks: the second exits at once,
    naming the one that holds the id; the first serves on."""
    first = mesh.procs["prefill-0"]
    mesh.start("prefill-0")  # while it runs
    second, mesh.procs["prefill-0"] = mesh.procs["prefill-0"], first
    assert second.wait(30) == 1
    assert "KVMESH_SERVICE_ID=prefill-0: already in use by a running prefill (pid" in (
        second.output()
    )
    wait_until(lambda: healthy(mesh), 10, what="the mesh still healthy")


def test_sigterm_drains_and_leaves_at_once(mesh: Stack) -> None:
    proc = mesh.procs["encoder-0"]
    proc.signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    # The last beat says "stopped": gone at once, not after its missed beats.
    assert "encoder-0" not in mesh.ready_ids()["encoder"]
    assert "draining" in proc.output()
    mesh.start("encoder-0")
    wait_until(lambda: healthy(mesh), 60, what="encoder-0 back")


def test_services_reregister_after_nats_restart(mesh: Stack, nats_server: NatsServer) -> None:
    nats_server.stop()
    # Longer than three beats: the router forgets everyone else.
    wait_until(lambda: not healthy(mesh), 30, what="the router to forget the others")
    nats_server.start()
    every = {role: [f"{role}-0"] for role in ROLES}

    def back() -> bool:  # every role (a router is healthy without cachemeta: wait for it too)
        ids = mesh.ready_ids()
        return {role: ids[role] for role in ROLES} == every

    wait_until(back, 60, what="re-registration")
    assert healthy(mesh)
    assert all(proc.alive() for proc in mesh.procs.values())

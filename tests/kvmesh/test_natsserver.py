"""The embedded nats-server as `kvmesh up` starts it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.natsserver import NatsServer
from tests.procs import environment_of, free_port


@pytest.mark.parametrize(("given", "runs_with"), [(None, "1"), ("2", "2")])
def test_the_embedded_server_schedules_on_one_core_unless_gomaxprocs_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str | None, runs_with: str
) -> None:
    if given is None:
        monkeypatch.delenv("GOMAXPROCS", raising=False)
    else:
        monkeypatch.setenv("GOMAXPROCS", given)
    server = NatsServer("127.0.0.1", free_port(), tmp_path / "js")
    server.start()
    try:
        assert server.pid is not None
        assert environment_of(server.pid)["GOMAXPROCS"] == runs_with
    finally:
        server.stop()

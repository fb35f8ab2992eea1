"""Shared fixtures: a real nats-server on a free port, started and stopped by the tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.natsserver import NatsServer
from tests.procs import free_port


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    store = tmp_path_factory.mktemp("nats")
    server = NatsServer("127.0.0.1", free_port(), store / "js", log_file=store / "nats.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir()
    return path

"""Shared fixtures: a real nats-server per module, the stack factory, the real model's text
side, and the logs of the live stacks attached to a failing test's report."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvmesh.natsserver import NatsServer
from shared.model.text import TextModel, load_text_model
from tests.procs import free_port, mesh_nats
from tests.stack import LIVE, Stack, start_stack

REAL = "smollm2-135m-instruct"


@pytest.fixture(scope="session")
def mesh_secrets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The secrets every stack of the run reads (tests.procs.secrets_dir of its state dir)."""
    return tmp_path_factory.getbasetemp() / "secrets"


@pytest.fixture(scope="module")
def nats_server(
    tmp_path_factory: pytest.TempPathFactory, mesh_secrets: Path
) -> Iterator[NatsServer]:
    """The module's nats-server, configured as `kvmesh up` configures one (identities and
    permissions per role): every stack test runs with the bus's permissions on."""
    server = mesh_nats(tmp_path_factory.mktemp("nats"), mesh_secrets)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def open_nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server that lets anyone in (kvmesh/nats.conf alone), for tests of the bus
    itself and for those that do what no role may (purge a stream)."""
    store = tmp_path_factory.mktemp("open-nats")
    server = NatsServer("127.0.0.1", free_port(), store / "js", log_file=store / "nats.log")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def nats_url(nats_server: NatsServer) -> str:
    return nats_server.url


@pytest.fixture(scope="module")
def open_nats_url(open_nats_server: NatsServer) -> str:
    return open_nats_server.url


@pytest.fixture
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh state dir beside the run's others, so its processes read the run's secrets
    (``mesh_secrets``: the identities the module's nats-server knows)."""
    return tmp_path_factory.mktemp("state")


StackFactory = Callable[..., Stack]


@pytest.fixture(scope="module")
def stacks(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    nats_server: NatsServer,  # set up first, so torn down after the stacks, which still use it
) -> Iterator[StackFactory]:
    """``stacks(ids, own_nats=False, **settings)`` starts a ready stack of ``ids`` on the
    module's nats-server (or one of its own); every stack made is stopped with the module."""
    made: list[Stack] = []
    shared_ids: set[str] = set()  # services on the module's nats-server: ids must not repeat

    def make(ids: tuple[str, ...], own_nats: bool = False, **settings: str) -> Stack:
        name = f"{request.module.__name__.rpartition('.')[2]}-{len(made)}"
        nats_url = None
        if not own_nats:
            taken = shared_ids & set(ids)
            assert not taken, f"{sorted(taken)} already run on this module's NATS: own_nats=True"
            shared_ids.update(ids)
            nats_url = nats_server.url
        stack = start_stack(name, tmp_path_factory.mktemp(name), ids, nats_url, **settings)
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.stop()


@pytest.fixture(scope="session")
def real_text(tmp_path_factory: pytest.TempPathFactory) -> TextModel:
    """The real model's text side (its tokenizer and chat template; the tiny models share
    them), loaded once for the whole run."""
    return load_text_model(REAL, tmp_path_factory.mktemp("text-state"))


VLLM_PREFILLS = ("prefill-vllm-a", "prefill-vllm-b")
VLLM_DECODE = "decode-vllm"


@pytest.fixture(scope="session")
def vllm_mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The vLLM modules' one stack (a vLLM engine takes ~25 s to start here), on a NATS of its
    own: two vLLM prefill workers and a vLLM decode worker, each engine on a core of its own
    role's. test_vllm.py's tests (whole requests, decoded in place) run on it first, then
    test_vllm_pd.py's (P/D), whose last tests stop and kill its workers."""
    cores = sorted(os.sched_getaffinity(0))
    stack = start_stack(
        "vllm",
        tmp_path_factory.mktemp("vllm"),
        ("cachemeta-0", "router-0", *VLLM_PREFILLS, VLLM_DECODE),
        KVMESH_PREFILL_ENGINE="vllm",
        KVMESH_DECODE_ENGINE="vllm",
        KVMESH_PREFILL_MODEL=REAL,
        KVMESH_DECODE_MODEL=REAL,
        KVMESH_PREFILL_CPU_CORES=str(cores[0]),
        KVMESH_DECODE_CPU_CORES=str(cores[-1]),
        KVMESH_FAULT_HOOKS="true",  # (a test quiets vLLM's cache events)
        KVMESH_PREFILL_ENABLE_LORA="true",  # (a test loads an adapter)
        KVMESH_DECODE_ENABLE_LORA="true",
        KVMESH_PREFILL_MAX_LORA_RANK="8",
        KVMESH_DECODE_MAX_LORA_RANK="8",
    )
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def own_vllm():  # noqa: ANN201 (Iterator[tests.vllm_answers.OwnVllm])
    """vLLM's own answers, one engine for the run (the vLLM modules share it)."""
    from tests.vllm_answers import OwnVllm

    own = OwnVllm()
    yield own
    own.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        for stack in LIVE:
            report.sections.append((f"logs of stack {stack.name}", stack.logs()))

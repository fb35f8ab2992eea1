"""`kvmesh up` and `kvmesh status` as a user runs them: one command starts the stack with its
own nats-server, the status table shows every service, Ctrl-C leaves no process behind."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from kvmesh.natsserver import port_in_use
from shared.bus import Bus, BusError, subjects
from shared.bus.auth import identity
from shared.messages.heartbeat import ROLES, RegistryQuery, RegistrySnapshot
from shared.proto import api_pb2, api_pb2_grpc, kv_pb2, kv_pb2_grpc
from shared.security.tls import client_context
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
        up.wait_for("kvmesh is up", 60)
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
        # The answering router's circuit breaker for each (nothing has failed), and each
        # worker's KV event feed as it sees it (whole).
        assert lines[0].split()[-3:] == ["BREAKER", "KV", "EVENTS"]
        assert all("closed" in row for row in rows.values())
        workers = [row for sid, row in rows.items() if sid.startswith(("prefill", "decode"))]
        assert workers and all(row[-1] == "ok" for row in workers)
        assert lines[-1].startswith("6 services, as seen by router router-0 (its KV index: ")

        assert len(kvmesh_pids(str(state_dir))) >= 7  # six services and nats-server
        up.signal(signal.SIGINT)
        assert up.wait(30) == 0
        wait_until(lambda: kvmesh_pids(str(state_dir)) == [], 5, what="no process left")
        assert "stopped nats-server" in up.output()
    finally:
        up.stop()


def test_up_tls_everywhere(state_dir: Path) -> None:
    """`kvmesh up --tls`: HTTPS and gRPC over TLS for clients that trust the local CA, mutual
    TLS for NATS and the KV handoff; plain clients and clients without the mesh's
    certificate are refused."""
    nats_port, http_port = free_port(), free_port()
    grpc_port = free_port()
    env = up_env(state_dir, nats_port, http_port)
    env["KVMESH_ROUTER_GRPC_PORT"] = str(grpc_port)
    env["KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS"] = "0"  # every prompt crosses the handoff
    up = Proc([*KVMESH, "up", "--tls", "--encoder", "0"], env, state_dir / "up.log")
    try:
        up.wait_for("kvmesh is up", 120)
        api = f"https://127.0.0.1:{http_port}"
        assert f"API at {api}" in up.output()
        tls_dir = state_dir / "tls"
        ca = ssl.create_default_context(cafile=str(tls_dir / "ca.crt"))

        # The official client, given the CA: a completion through prefill, the KV handoff
        # and decode, every hop over TLS.
        client = openai.OpenAI(
            base_url=f"{api}/v1",
            api_key="unused",
            max_retries=0,
            timeout=60,
            http_client=openai.DefaultHttpx2Client(verify=ca),
        )
        done = client.completions.create(
            model="tiny", prompt=list(range(100, 300)), max_tokens=8, temperature=0
        )
        assert done.usage.completion_tokens == 8

        # The workers' token links come up (mutual TLS too): tokens reach the router on them.
        def on_links() -> bool:
            client.completions.create(model="tiny", prompt="Hi", max_tokens=4)
            with urllib.request.urlopen(f"{api}/metrics", timeout=10, context=ca) as resp:
                text = resp.read().decode()
            return 'kvmesh_token_messages_total{path="link"}' in text

        wait_until(on_links, 30, interval_s=0.05, what="tokens on the token links")
        # Plain HTTP, and HTTPS from a client that does not trust the mesh's CA: no answer.
        for base, verify in ((f"http://127.0.0.1:{http_port}", True), (api, True)):
            plain = openai.OpenAI(
                base_url=f"{base}/v1",
                api_key="unused",
                max_retries=0,
                timeout=10,
                http_client=openai.DefaultHttpx2Client(verify=verify),
            )
            with pytest.raises(openai.APIConnectionError):
                plain.models.list()

        # gRPC: TLS with the CA works; a plain channel does not.
        request = api_pb2.GenerateRequest(model="tiny", prompt="Hi", max_tokens=2)
        credentials = grpc.ssl_channel_credentials((tls_dir / "ca.crt").read_bytes())
        with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
            reply = api_pb2_grpc.GenerationStub(channel).Generate(request, timeout=60)
            assert reply.usage.completion_tokens == 2
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                api_pb2_grpc.GenerationStub(channel).Generate(request, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE

        # NATS: a role's identity with the mesh's certificate gets in; without a certificate
        # (or without TLS) it does not. The KV handoff asks for the certificate too.
        nats_url = f"nats://127.0.0.1:{nats_port}"
        secrets = state_dir.parent / "secrets"
        cli = identity(secrets, "cli")
        with_cert = client_context(tls_dir / "ca.crt", tls_dir / "cli.crt", tls_dir / "cli.key")
        kv = asyncio.run(decode_kv_address(nats_url, {**cli, "tls": with_cert}))
        for options in ({**cli, "tls": client_context(tls_dir / "ca.crt")}, cli):
            with pytest.raises(BusError):
                asyncio.run(Bus.connect(nats_url, "no-cert", 1, options))
        with grpc.secure_channel(kv, credentials) as channel:  # the CA, no certificate
            call = kv_pb2_grpc.KvHandoffStub(channel).Handoff(iter([kv_pb2.KvChunk()]), timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                next(call)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        up.stop()


async def decode_kv_address(nats_url: str, options: dict) -> str:
    bus = await Bus.connect(nats_url, "test-tls", 10, options)
    try:
        snap = await bus.request(
            subjects.ROUTER_REGISTRY, RegistryQuery(role="decode"), RegistrySnapshot, 5.0
        )
    finally:
        await bus.close()
    return snap.workers[0].addresses["kv"]


def test_up_with_a_nats_cluster_and_two_routers_loses_nothing_to_a_node_or_a_router(
    state_dir: Path,
) -> None:
    """`kvmesh up --nats-cluster 3 --routers 2`: a NATS node killed while requests stream
    through both routers costs none of them, and every block stored meanwhile is indexed (the
    same prompts again come from the cache); a router killed, the other serves on."""
    nats_port, http_port = free_port_run(3), free_port_run(2)
    env = up_env(state_dir, nats_port, http_port)
    cmd = [*KVMESH, "up", "--nats-cluster", "3", "--routers", "2", "--encoder", "0"]
    up = Proc(cmd, env, state_dir / "up.log")
    try:
        up.wait_for("kvmesh is up", 120)
        urls = [f"http://127.0.0.1:{http_port + i}" for i in (0, 1)]
        assert f"API at {urls[0]}, {urls[1]}" in up.output()
        clients = [
            openai.OpenAI(base_url=f"{u}/v1", api_key="unused", max_retries=0, timeout=60)
            for u in urls
        ]
        prompts = [f"({i}) " + "the keeper lit the lamp at dusk " * 20 for i in range(24)]

        def ask(i: int) -> openai.types.Completion:
            return clients[i % 2].completions.create(
                model="tiny", prompt=prompts[i], max_tokens=6, temperature=0
            )

        answers = []
        for i in range(len(prompts)):
            if i == 8:  # one node of three, with whatever it held, gone mid-run
                (node,) = pids_with(state_dir, "kvmesh-1")
                os.kill(node, signal.SIGKILL)
            answers.append(ask(i))
        assert all(a.usage.completion_tokens == 6 for a in answers)
        # Every prompt's blocks were indexed, those stored while the node was down too.
        for i in range(len(prompts)):
            full = answers[i].usage.prompt_tokens // 64 * 64
            again = wait_until(
                lambda i=i, full=full: (
                    (a := ask(i)).usage.prompt_tokens_details.cached_tokens == full and a
                ),
                20,
                what=f"prompt {i} from the cache",
            )
            assert again.choices[0].text == answers[i].choices[0].text

        (router,) = pids_with(state_dir, "KVMESH_SERVICE_ID=router-0\0")
        os.kill(router, signal.SIGKILL)
        after = clients[1].completions.create(model="tiny", prompt="still there?", max_tokens=3)
        assert after.usage.completion_tokens == 3
    finally:
        up.stop()


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free ports (and their route ports, + 2000)."""
    for _ in range(100):
        first = free_port()
        ports = [first + i for i in range(n)] + [first + 2000 + i for i in range(n)]
        if not any(port_in_use("127.0.0.1", p) for p in ports):
            return first
    raise AssertionError("no run of free ports")


def pids_with(state_dir: Path, marker: str) -> list[int]:
    """The stack's processes (its state dir in their environment) that also carry ``marker``."""
    return sorted(set(kvmesh_pids(str(state_dir))) & set(kvmesh_pids(marker)))


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


def test_up_serves_two_checkpoints_by_path_each_on_its_own_workers_and_dies_with_no_trace(
    state_dir: Path, tmp_path: Path
) -> None:
    """Two models by path, each on its own workers, each with its own template and tool-call
    syntax. Then `kvmesh up` killed: SIGKILL gives it no chance to stop anything, and its
    children (and nats-server) go by themselves, with the parent-death signal they were
    started with."""
    from tests.checkpoints import gguf_checkpoint, hf_checkpoint
    from tests.templates import LLAMA

    hf_checkpoint(tmp_path / "alpha", "llama")
    config_file = tmp_path / "alpha" / "tokenizer_config.json"  # alpha's template: Llama 3's
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "chat_template": LLAMA})
    )
    beta = gguf_checkpoint(
        tmp_path / "beta.gguf", hf_checkpoint(tmp_path / "b", "qwen2", 1), "qwen2"
    )
    http_port = free_port()
    env = up_env(state_dir, free_port(), http_port)
    args = [
        "up",
        "--encoder",
        "0",
        "--model",
        f"alpha={tmp_path / 'alpha'}",
        "--model",
        f"beta={beta}",
    ]
    up = Proc([*KVMESH, *args], env, state_dir / "up.log")
    try:
        up.wait_for("kvmesh is up", 120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none")
        assert {m.id for m in client.models.list()} == {"alpha", "beta"}
        for model in ("alpha", "beta"):
            answer = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Hello " * 80}],  # through a prefill worker
                max_tokens=4,
                temperature=0,
            )
            assert answer.model == model
            assert set(answer.model_extra["kvmesh"]["workers"]) == {
                f"prefill-{model}-0",
                f"decode-{model}-0",
            }
        # A forced call in each model's own syntax (alpha: Llama 3's JSON; beta, whose
        # template has none: the Hermes tags), parsed back into tool_calls.
        tide = {
            "type": "object",
            "properties": {"port": {"enum": ["Oslo", "Bergen"]}},
            "required": ["port"],
            "additionalProperties": False,
        }
        tools = [{"type": "function", "function": {"name": "get_tide", "parameters": tide}}]
        for model in ("alpha", "beta"):
            answer = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "High tide in Oslo?"}],
                tools=tools,
                tool_choice="required",
                max_tokens=40,
            )
            (call,) = answer.choices[0].message.tool_calls or [answer]  # (the answer, if none)
            assert call.function.name == "get_tide", model
            assert json.loads(call.function.arguments)["port"] in ("Oslo", "Bergen")
            assert answer.choices[0].finish_reason == "tool_calls"

        assert len(kvmesh_pids(str(state_dir))) >= 6  # five services and nats-server
        up.popen.kill()
        up.wait(10)
        wait_until(lambda: kvmesh_pids(str(state_dir)) == [], 30, what="every child gone")
    finally:
        up.stop()


def test_up_with_a_model_path_that_does_not_exist_starts_nothing(state_dir: Path) -> None:
    env = up_env(state_dir, free_port(), free_port())
    done = kvmesh(["up", "--model", "mine=/nonexistent/model.gguf"], env)
    assert done.returncode == 2
    assert "--model mine:" in done.stderr and "/nonexistent/model.gguf" in done.stderr
    assert kvmesh_pids(str(state_dir)) == []


def test_up_serves_the_lora_adapters_it_is_given_checked_first(
    state_dir: Path, tmp_path: Path
) -> None:
    from kvmesh.up import with_loras
    from shared.settings import CommonSettings
    from tests.engine.lora_adapters import peft_adapter, tiny_shaped_base

    peft_adapter(tiny_shaped_base(), tmp_path / "sql", seed=1)
    common = CommonSettings(state_dir=state_dir)
    added = with_loras(common, [f"sql=tiny:{tmp_path / 'sql'}"])
    assert added.loras == {"sql": f"tiny:{tmp_path / 'sql'}"}
    with pytest.raises(ValueError, match="--lora sql: given twice"):
        with_loras(added, [f"sql=tiny:{tmp_path / 'sql'}"])
    # An adapter that does not fit its base: nothing starts, the file and the mismatch named.
    env = up_env(state_dir, free_port(), free_port())
    done = kvmesh(["up", "--lora", f"sql=smollm2-135m-instruct:{tmp_path / 'sql'}"], env)
    assert done.returncode == 2
    assert "--lora sql:" in done.stderr and "do not fit smollm2-135m-instruct" in done.stderr
    done = kvmesh(["up", "--lora", "sql=tiny"], env)
    assert done.returncode == 2 and "NAME=BASE:PATH" in done.stderr
    assert kvmesh_pids(str(state_dir)) == []


def test_each_vllm_worker_up_starts_gets_cores_of_its_own() -> None:
    """Left to itself, every vLLM engine on a host binds its threads to the same first core."""
    from kvmesh.up import pinned, workers

    def given(counts: dict[str, int], env: dict[str, str]) -> dict[str, str | None]:
        children = pinned(workers({"encoder": 1, **counts}, []), env)
        return {c.name: c.env.get(f"KVMESH_{c.role.upper()}_CPU_CORES") for c in children}

    cores = [str(c) for c in sorted(os.sched_getaffinity(0))]
    env = {"KVMESH_PREFILL_ENGINE": "vllm", "KVMESH_DECODE_ENGINE": "vllm"}
    one_each = given({"prefill": 1, "decode": len(cores) - 1}, env)
    assert sorted(v for v in one_each.values() if v) == sorted(cores)  # a core each
    assert one_each["encoder-0"] is None
    halves = given({"prefill": 0, "decode": 2}, env)  # the cores split between them
    assert (
        halves["decode-0"].split(",") + halves["decode-1"].split(",")
        == cores[: len(cores) // 2 * 2]
    )
    more = given({"prefill": 0, "decode": len(cores) + 1}, env)  # more than cores: round robin
    assert more[f"decode-{len(cores)}"] == cores[0]
    # Torch workers, and cores the operator set, are left as they are.
    env = {"KVMESH_DECODE_ENGINE": "vllm", "KVMESH_DECODE_CPU_CORES": "3"}
    assert set(given({"prefill": 1, "decode": 2}, env).values()) == {None}

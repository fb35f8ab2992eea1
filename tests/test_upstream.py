"""kvmesh's router in front of servers it did not start: two real `vllm serve` processes (the
vLLM CPU build, the bundled model exported, started with `kvmesh model vllm-serve`'s command:
KV events on a port, kvmesh's storage tier as their connector) behind a router with no kvmesh
worker at all.

The router hears both servers' KV events under its own hashes and routes a conversation's next
turn to the server that holds it; every API format is answered by servers that speak only
OpenAI's completions; a client that leaves aborts the server's request; a server killed
mid-answer leaves an answer that goes on, token for token, on the other (which reads the killed
one's KV from the storage tier); a server restarted without its events is flagged and routed by
load. The tests run in order: the later ones kill and restart a server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import pytest

from shared.engine.vllm.serve import serve_command
from shared.model.catalog import resolve
from shared.model.export import hf_directory
from shared.model.text import text_of
from shared.orphans import die_with_parent
from tests.conftest import REAL
from tests.procs import free_port, get_json, metrics, wait_until
from tests.stack import Stack

pytest.importorskip("vllm", reason="the vllm extra (make test installs it)")

COUNTING = "Count: " + ", ".join(str(i) for i in range(1, 40)) + ","  # (greedy goes on counting)


class VllmServer:
    """A `vllm serve` process of its own session (SIGKILL takes its engine core with it)."""

    def __init__(self, name: str, dir: Path, argv: list[str], core: str) -> None:
        self.name, self.argv, self.dir = name, argv, dir
        self.port = int(argv[argv.index("--port") + 1])
        self.env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": core,  # (one core each: two servers on two)
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, argv: list[str] | None = None) -> None:
        self.argv = argv or self.argv
        log = open(self.dir / f"{self.name}.log", "ab")  # noqa: SIM115

        def session() -> None:
            os.setsid()
            die_with_parent()

        self.proc = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=session
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 240) -> None:
        def answers() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.why()
            try:
                return get_json(f"{self.url}/v1/models")[0] == 200
            except OSError:
                return False

        wait_until(answers, timeout_s, interval_s=0.5, what=f"{self.name} serving")

    def why(self) -> str:
        """Why it exited: the log's error lines (the engine core's root cause comes before
        the traceback that ends the log), then its end."""
        text = self.log()
        errors = [line for line in text.splitlines() if "ERROR" in line or "Error:" in line]
        return "\n".join(errors[:20]) + "\n...\n" + text[-2000:]

    def running(self) -> float:
        return sum(
            v for (name, _), v in metrics(self.url).items() if name == "vllm:num_requests_running"
        )

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):  # (already gone)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def log(self) -> str:
        return (self.dir / f"{self.name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def mesh(stacks, tmp_path_factory) -> tuple[Stack, dict[str, VllmServer]]:
    """Two vLLM servers and a router with only them to route to (by id: up-127.0.0.1-PORT),
    no kvmesh worker."""
    dir = tmp_path_factory.mktemp("upstream")
    state = dir / "state"
    source = resolve(REAL, {})
    config = text_of(source, state).config
    model_dir = hf_directory(source, config, state)
    servers = {}
    for i in range(2):
        argv = serve_command(
            model_dir,
            REAL,
            free_port(),
            free_port(),
            config.fingerprint,
            state / "kvstore",
            host="127.0.0.1",
            eager=True,
        )
        server = VllmServer(f"vllm-{i}", dir, argv, str(i))
        servers[f"up-127.0.0.1-{server.port}"] = server
    try:  # (the servers go with the module, however it ends: they would eat the CPU)
        for server in servers.values():
            server.wait_ready()
        upstreams = [f"{REAL}={s.url}" for s in servers.values()]
        stack = stacks(
            ("cachemeta-0", "router-0"),  # (as `kvmesh up --upstream` starts them)
            own_nats=True,
            KVMESH_ROUTER_UPSTREAMS=json.dumps(upstreams),
        )
        wait_until(
            lambda: set(stack.ready_ids().get("decode", [])) == set(servers),
            60,
            what="both servers registered as workers",
        )
        yield stack, servers
    finally:
        for server in servers.values():
            server.kill()


def complete(stack: Stack, prompt: str, tenant: str = "harbour", **options):
    return stack.client().completions.create(
        model=REAL,
        prompt=prompt,
        temperature=0,
        extra_headers={"x-kvmesh-tenant": tenant},
        **{"max_tokens": 8, **options},
    )


def holder(answer) -> tuple[str, dict]:
    """The server that answered, and the router's terms for it (what its index held)."""
    (worker,) = answer.model_extra["kvmesh"]["workers"]
    terms = {c["worker"]: c for c in answer.model_extra["kvmesh"]["route"]["candidates"]}
    return worker, terms[worker]


def serving(servers: dict[str, VllmServer]) -> str:
    """The one server with a request running, by its /metrics (polled: vLLM sets its gauges
    from the engine's stats, a step or so behind)."""

    def one() -> str | None:
        busy = [sid for sid, s in servers.items() if s.running()]
        return busy[0] if len(busy) == 1 else None

    return wait_until(one, 5, interval_s=0.05, what="the server with the request running")


def test_both_servers_kv_events_reach_the_routers_index_under_its_hashes(mesh) -> None:
    stack, servers = mesh
    held: dict[str, str] = {}  # server → a prompt it computed
    for n in range(6):  # (cold prompts spread over the servers by their tokens to compute)
        prompt = f"Harbour log {n}: " + "the tide came in and went out again. " * 12
        worker, _ = holder(complete(stack, prompt))
        held.setdefault(worker, prompt)
        if len(held) == 2:
            break
    assert set(held) == set(servers)
    for worker, prompt in held.items():
        # The router's own index, fed by that server's events, holds the prompt's blocks there
        # (its full blocks of 32 tokens); another tenant's salt names other blocks.
        def seen(worker=worker, prompt=prompt) -> bool:
            again_worker, terms = holder(complete(stack, prompt))
            return again_worker == worker and terms["memory_tokens"] >= 96

        wait_until(seen, 10, what=f"{worker}'s blocks in the router's index")
        _, other = holder(complete(stack, prompt, tenant="customs"))
        assert other["memory_tokens"] == 0
    _, body = get_json(f"{stack.url}/health")
    assert body["status"] == "ok", body
    assert all(u["routed_by"] == "its cache and its load" for u in body["upstreams"])


def test_a_conversations_next_turn_goes_to_the_server_that_holds_it(mesh) -> None:
    stack, _ = mesh
    client = stack.client()
    turn = [{"role": "user", "content": "Describe a lighthouse keeper's day. " * 6}]
    first = client.chat.completions.create(model=REAL, messages=turn, max_tokens=12, temperature=0)
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And at night?"},
    ]
    second = client.chat.completions.create(model=REAL, messages=turn, max_tokens=12, temperature=0)
    assert second.model_extra["kvmesh"]["workers"] == first.model_extra["kvmesh"]["workers"]
    # The server's own prefix cache held the first turn (its usage says so).
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert reused >= first.usage.prompt_tokens // 32 * 32 - 32


def test_anthropic_and_responses_are_answered_by_servers_that_speak_only_openai(mesh) -> None:
    stack, _ = mesh
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = stack.client().chat.completions.create(
        model=REAL, messages=question, max_tokens=16, temperature=0
    )
    messages = anthropic.Anthropic(base_url=stack.url, api_key="none").messages.create(
        model=REAL, messages=question, max_tokens=16, extra_body={"temperature": 0}
    )
    responses = stack.client().responses.create(
        model=REAL, input=question, max_output_tokens=16, temperature=0
    )
    assert "Paris" in chat.choices[0].message.content
    assert messages.content[0].text == chat.choices[0].message.content
    assert responses.output_text == chat.choices[0].message.content


def test_a_client_that_leaves_aborts_the_servers_request(mesh) -> None:
    stack, servers = mesh
    stream = stack.client().completions.create(
        model=REAL, prompt=COUNTING, max_tokens=400, temperature=0, stream=True
    )
    for n, _ in enumerate(stream):
        if n == 5:
            break
    serving(servers)
    stream.close()
    wait_until(
        lambda: sum(s.running() for s in servers.values()) == 0, 15, what="the request aborted"
    )


def test_a_server_killed_mid_answer_leaves_the_answer_whole_on_the_other(mesh) -> None:
    stack, servers = mesh
    whole = complete(stack, COUNTING, max_tokens=120)
    expected = whole.choices[0].text
    stream = stack.client().completions.create(
        model=REAL,
        prompt=COUNTING,
        max_tokens=120,
        temperature=0,
        stream=True,
        extra_headers={"x-kvmesh-tenant": "harbour"},
    )
    text, killed = [], None
    for chunk in stream:
        text.append(chunk.choices[0].text if chunk.choices else "")
        if killed is None and len(text) >= 10:
            killed = serving(servers)
            servers[killed].kill()
    assert killed is not None
    assert "".join(text) == expected  # greedy: the same answer, no token lost or repeated
    # A turn first computed by the killed server, asked again: the survivor reads it from the
    # storage tier the killed one wrote as it went (vLLM's usage counts it as cached).
    again = complete(stack, COUNTING, max_tokens=4)
    (survivor,) = again.model_extra["kvmesh"]["workers"]
    assert survivor != killed
    prompt = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens >= 0.9 * (prompt // 32 * 32)


def test_a_server_restarted_without_events_is_flagged_and_routed_by_load(mesh) -> None:
    stack, servers = mesh
    down = [sid for sid, s in servers.items() if s.proc.poll() is not None]
    server = servers[down[0]] if down else next(iter(servers.values()))
    if not down:  # (run alone: the test before killed one)
        server.kill()
    argv = list(server.argv)
    at = argv.index("--kv-events-config")
    del argv[at : at + 2]
    server.start(argv)
    server.wait_ready()

    def flagged() -> bool:
        _, body = get_json(f"{stack.url}/health")
        said = {u["url"]: u for u in body["upstreams"]}[server.url]
        return said["answering"] and said["routed_by"].startswith("load only")

    wait_until(flagged, 30, what="the restarted server flagged as routed by load")
    # It still takes requests: by load, the two servers share a burst.
    with ThreadPoolExecutor(4) as pool:
        answers = list(
            pool.map(lambda n: complete(stack, f"Ship {n} reports " * 20, max_tokens=16), range(4))
        )
    assert {a.model_extra["kvmesh"]["workers"][0] for a in answers} == set(servers)

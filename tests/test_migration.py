"""No request lost (real processes, tiny model, the official `openai` client): a decode worker
killed or frozen mid-stream, and the client's stream goes on with the same answer, resumed on
the other decode worker from the blocks the first stored as they filled; a prefill worker
killed mid-prompt; circuit breakers that skip failing workers and ignore clients' mistakes."""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from kvmesh.trace import read_spans, request_trace
from tests.procs import get_json, wait_until
from tests.stack import Stack

ANSWER = 600  # tokens: long enough that a worker stopped after the first chunks was mid-answer
PROMPT = "Tell the long story of a lighthouse keeper and the ships she guided home. " * 3


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("router-0", "cachemeta-0", "prefill-0", "prefill-1", "decode-0", "decode-1"),
        KVMESH_ROUTER_TOKEN_TIMEOUT_S="3",  # a frozen one is given up on within 3 s
    )


def load(stack: Stack, sid: str) -> dict:
    return get_json(f"{stack.advertised(sid)}/health")[1]["load"]


def serving(stack: Stack, role: str = "decode") -> str:
    """The worker of ``role`` holding a request now (its own /health says so)."""

    def busy() -> list[str]:
        return [sid for sid in (f"{role}-0", f"{role}-1") if load(stack, sid)["inflight"]]

    return wait_until(busy, 30, interval_s=0.01, what=f"a {role} worker serving")[0]


def stream(client: openai.OpenAI, rid: str, **sampling: object):
    return client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=ANSWER,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={"x-request-id": rid},
        **sampling,
    )


def read_with(chunks, during=None, after: int = 300) -> tuple[str, int, str | None]:
    """The streamed text, the completion tokens counted, the finish reason; ``during()`` is
    called once ``after`` chunks have come."""
    text, usage, finish = [], 0, None
    for i, chunk in enumerate(chunks):
        if i == after and during is not None:
            during()
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage.completion_tokens
    return "".join(text), usage, finish


def attempts(stack: Stack, rid: str, n: int) -> list[dict]:
    """The request's "generate" spans (one per attempt), in order, once ``n`` are written."""

    def written() -> list[dict]:
        spans = request_trace(read_spans(stack.dir / "traces"), rid)
        found = [s for s in spans if s["name"] == "generate"]
        return sorted(found, key=lambda s: s["attributes"]["attempt"]) if len(found) >= n else []

    return wait_until(written, 30, what=f"{n} attempts in the request's trace")


REFERENCES: dict[str, tuple[str, int, str | None]] = {}  # uninterrupted answers, by sampling


@pytest.mark.parametrize(
    "sampling, stop",
    [
        ({"temperature": 0}, signal.SIGKILL),
        ({"temperature": 1.0, "seed": 1234}, signal.SIGKILL),
        ({"temperature": 0}, signal.SIGSTOP),
    ],
    ids=["greedy-killed", "seeded-killed", "greedy-frozen"],
)
def test_a_decode_worker_lost_mid_stream_and_the_answer_goes_on_unchanged(
    stack: Stack, sampling: dict, stop: signal.Signals
) -> None:
    """Killed: nats-server says its connection closed (gone at once). Frozen: asked through a
    router that would wait 30 missed heartbeats, so what moves it is the progress bound (3 s)."""
    client = stack.client()
    if stop == signal.SIGSTOP:
        url = stack.router("router-patient", KVMESH_ROUTER_MISSED_HEARTBEATS="30")
        client = stack.client(url, timeout=120)
    tag = f"{stop.name}-{sampling.get('seed', 'greedy')}"
    key = json.dumps(sampling, sort_keys=True)  # (the greedy one is asked once for both)
    if key not in REFERENCES:
        REFERENCES[key] = read_with(stream(client, f"ref-{tag}", **sampling))
    reference = REFERENCES[key]
    assert reference[1] == ANSWER, "the reference answer ran to its length"

    lost: list[str] = []

    def stop_its_decode_worker() -> None:
        sid = serving(stack)
        os.kill(stack.procs[sid].pid, stop)
        lost.append(sid)

    rid = f"moved-{tag}"
    try:
        answer = read_with(stream(client, rid, **sampling), during=stop_its_decode_worker)
    finally:
        (sid,) = lost
        if stop == signal.SIGSTOP:
            os.kill(stack.procs[sid].pid, signal.SIGCONT)
        else:
            stack.procs[sid].reap(10)
            stack.start(sid)
        stack.wait_ready([sid])
    # The client saw one answer, token for token the uninterrupted one.
    assert answer == reference
    # The trace shows the move: a second attempt that went on from the tokens sent, having
    # loaded most of them (stored by the lost worker as its blocks filled).
    first, second = attempts(stack, rid, 2)[:2]
    assert first["status"] == "error" and sid in first["error"]
    resumed = second["attributes"]["resumed_tokens"]
    assert 64 < resumed < ANSWER
    # The blocks the lost worker had filled, the answer's too, were loaded, not computed
    # again (but for the last one or two, which it may not have written when it stopped).
    n_prompt = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1)
    full_blocks = (n_prompt.usage.prompt_tokens + resumed) // 64
    assert second["attributes"]["reused_tokens"] >= 64 * (full_blocks - 2) > 64
    if stop == signal.SIGSTOP:  # the progress bound (3 s) moved it, not the request timeout
        assert "no next token within 3 s" in first["error"]
        stack.procs["router-patient"].stop()


def test_past_the_migration_limit_the_stream_ends_with_a_clear_error(stack: Stack) -> None:
    url = stack.router("router-nomove", KVMESH_ROUTER_MIGRATION_LIMIT="0")
    client = stack.client(url, timeout=60)
    lost: list[str] = []

    def kill_its_decode_worker() -> None:
        sid = serving(stack)
        stack.procs[sid].popen.kill()
        lost.append(sid)

    try:
        with pytest.raises(openai.APIError) as err:
            read_with(stream(client, "nomove", temperature=0), during=kill_its_decode_worker)
        assert "after 0 moves" in str(err.value) and lost[0] in str(err.value)
    finally:
        stack.procs[lost[0]].reap(10)
        stack.start(lost[0])
        stack.wait_ready([lost[0]])
        stack.procs["router-nomove"].stop()


def test_a_prefill_worker_killed_mid_prompt_and_the_request_is_answered_once(
    stack: Stack,
) -> None:
    """Frozen as soon as it holds the prompt, then killed: decode frees what it reserved for
    the handoff, the other prefill worker computes the prompt, one answer comes back."""
    client = stack.client()
    prompt = [100 + (i * 37) % 30000 for i in range(3800)]  # long: its prefill takes a while
    lost: list[str] = []

    def ask(rid: str) -> openai.types.Completion:
        return client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            extra_headers={"x-request-id": rid},
        )

    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(ask, "prefill-lost")
        sid = serving(stack, "prefill")
        os.kill(stack.procs[sid].pid, signal.SIGSTOP)
        os.kill(stack.procs[sid].pid, signal.SIGKILL)
        lost.append(sid)
        moved = answer.result(timeout=120)
    try:
        first, second = attempts(stack, "prefill-lost", 2)[:2]
        assert sid in first["error"] and second["attributes"]["resumed_tokens"] == 0
        assert sid not in moved.model_extra["kvmesh"]["workers"]
        # The same answer as a request nobody interrupted (its prompt now cached).
        again = ask("prefill-again")
        assert moved.choices[0].text == again.choices[0].text
        assert moved.usage.completion_tokens == 16
        # Nothing half-sent was decoded, and no reservation was left behind.
        wait_until(
            lambda: all(load(stack, d)["kv_blocks_used"] == 0 for d in ("decode-0", "decode-1")),
            30,
            what="decode's KV blocks freed",
        )
    finally:
        stack.procs[sid].reap(10)
        stack.start(sid)
        stack.wait_ready([sid])


def breaker_gauges(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'kvmesh_router_breaker_open\{worker="([^"]+)"\} (\S+)', text)
    return {worker: float(value) for worker, value in found}


def test_failing_workers_are_skipped_by_their_breakers_and_bad_requests_open_none(
    stack: Stack,
) -> None:
    """Both prefill workers frozen (a router that would wait 30 missed heartbeats, 1 s for an
    ack): each request costs both a fault; two requests open both breakers, and the next is
    refused at once instead of waiting on them. A storm of bad requests opened nothing."""
    url = stack.router(
        "router-breaker",
        KVMESH_ROUTER_MISSED_HEARTBEATS="30",
        KVMESH_ROUTER_ACK_TIMEOUT_S="1",
        KVMESH_ROUTER_BREAKER_FAULTS="2",
        KVMESH_ROUTER_BREAKER_COOLDOWN_S="4",
    )
    client = stack.client(url, timeout=60)
    for i in range(40):  # a client's 4xx is no worker's fault
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt=f"bad {i}", max_tokens=-1)
    gauges = breaker_gauges(url)
    assert {"prefill-0", "prefill-1"} <= set(gauges) and set(gauges.values()) == {0.0}

    def ask(i: int) -> openai.types.Completion:
        words = f"request {i}: " + "harbour lights at dawn " * 30  # prefilled off decode
        return client.completions.create(model="tiny", prompt=words, max_tokens=2)

    frozen = [stack.procs["prefill-0"], stack.procs["prefill-1"]]
    for proc in frozen:
        os.kill(proc.pid, signal.SIGSTOP)
    try:
        for i in range(2):
            with pytest.raises(openai.InternalServerError):
                ask(i)
        assert breaker_gauges(url) == {
            "prefill-0": 1.0,
            "prefill-1": 1.0,
            "decode-0": 0.0,
            "decode-1": 0.0,
        }
        with pytest.raises(openai.InternalServerError) as err:
            ask(2)
        # Refused without a task sent to either (no ack waited for): both are skipped.
        assert "every prefill worker serving 'tiny' is failing (breakers open)" in str(err.value)
        assert "did not answer" not in str(err.value)
    finally:
        for proc in frozen:
            os.kill(proc.pid, signal.SIGCONT)
    # After the cool-down a trial goes through, and its success closes the breaker.
    answered = wait_until(lambda: try_ask(ask), 30, interval_s=1, what="a trial answered")
    assert answered.usage.completion_tokens == 2
    wait_until(lambda: 0.0 in breaker_gauges(url).values(), 10, what="a breaker closed")
    stack.procs["router-breaker"].stop()


def try_ask(ask) -> openai.types.Completion | None:  # noqa: ANN001
    try:
        return ask(99)
    except openai.InternalServerError:
        return None

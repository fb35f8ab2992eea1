"""What a user sees when something goes wrong, through real processes (tiny model): a request
past its deadline (504), every worker busy (429), no decode room now (429) or ever (400),
a client that leaves while its prompt is prefilled, a worker draining, past its drain bound,
or signalled twice, an encoder cache that evicts, a prefill worker that gives up on
embeddings, gRPC's status codes and cancellation, and each routing policy serving."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import openai
import pytest

from kvmesh.trace import read_spans, request_trace
from services.router.routing.policies import POLICIES
from shared.proto import api_pb2, api_pb2_grpc
from tests.images import ask, data_url, image, png
from tests.mounts import small_tmpfs
from tests.procs import get_json, metrics, wait_until
from tests.stack import TINY_ENCODER, Stack

IMAGE_EMBEDS = 7 * 11 * 64 * 4  # a 300 × 200 image: 77 tokens of the tiny model's 64 floats


BASE = ("router-0", "cachemeta-0", "prefill-0", "decode-0", "encoder-0")


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        BASE,
        **TINY_ENCODER,
        KVMESH_ENCODER_CACHE_BYTES=str(IMAGE_EMBEDS * 3 // 2),  # room for one image's
        KVMESH_FAULT_HOOKS="true",  # (tests switch engine faults on: shared/faults.py)
        # An answer left with no decode worker (one worker here) waits 1 s for one, not 10
        KVMESH_ROUTER_RESUME_WAIT_S="1",
    )


@pytest.fixture(autouse=True)
def restored(stack: Stack) -> Iterator[None]:
    """After each test, however it ended, the module's services run again as the stack
    started them (a test that failed half way does not leave its settings, a stopped worker
    or a frozen one to the next)."""
    yield
    stack.restore(BASE)


def own_load(stack: Stack, sid: str) -> dict:
    """A service's load as it is now, from its own /health (not a heartbeat ago)."""
    return get_json(f"{stack.advertised(sid)}/health")[1]["load"]


def blocks_used(stack: Stack, sid: str = "decode-0") -> int:
    return own_load(stack, sid)["kv_blocks_used"]


def post(url: str, body: dict) -> tuple[int, dict, dict]:
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "text/json"})
        resp = conn.getresponse()
        return resp.status, dict(resp.headers), json.loads(resp.read())
    finally:
        conn.close()


def grpc_generate(address: str, content: str, model: str = "tiny", **fields: object):
    req = api_pb2.GenerateRequest(
        model=model,
        messages=[api_pb2.ChatMessage(role="user", content=content)],
        temperature=0,
        **fields,
    )
    with grpc.insecure_channel(address) as channel:
        return api_pb2_grpc.GenerationStub(channel).Generate(req, timeout=60)


LONG_ANSWER = dict(model="tiny", prompt="Tell me everything.", max_tokens=4000, temperature=0)


# -- the request's deadline: 504 ---------------------------------------------------------------


def test_a_request_past_its_deadline_gets_504_and_its_kv_is_freed(stack: Stack) -> None:
    url = stack.router("router-deadline", KVMESH_ROUTER_REQUEST_TIMEOUT_S="1")
    try:
        code, _, body = post(url, LONG_ANSWER)  # 4,000 tokens take the tiny model seconds
        assert code == 504, body
        assert body["error"]["code"] == "timeout" and "deadline" in body["error"]["message"]
        # Decode stopped the answer at its deadline: nothing keeps running for nobody (and the
        # next long answer finds room: 4,000 tokens take nearly all of the tiny stack's KV).
        wait_until(lambda: blocks_used(stack) == 0, 30, what="decode's KV freed")
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(stack.grpc_of("router-deadline"), "Tell me all.", max_tokens=4000)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_until(lambda: blocks_used(stack) == 0, 30, what="decode's KV freed")
    finally:
        stack.procs["router-deadline"].stop()


# -- overload and refusals: 429, 503 -----------------------------------------------------------


def test_every_worker_busy_gets_429_with_retry_after(stack: Stack) -> None:
    """Workers for another model that take no more work (0 queued at most): the router tries
    each, then answers 429 (and gRPC RESOURCE_EXHAUSTED)."""
    stack.start(
        "prefill-full",
        "decode-full",
        KVMESH_PREFILL_MODEL="tiny-swa",
        KVMESH_DECODE_MODEL="tiny-swa",
        KVMESH_PREFILL_MAX_QUEUED="0",
        KVMESH_DECODE_MAX_QUEUED="0",
    )
    try:
        stack.wait_ready(["prefill-full", "decode-full"])
        for prompt in ("word " * 200, "hi"):  # to the prefill worker; to decode (short)
            code, headers, body = post(stack.url, {"model": "tiny-swa", "prompt": prompt})
            assert code == 429, body
            assert headers["Retry-After"] == "1" and body["error"]["type"] == "rate_limit_error"
            assert "busy" in body["error"]["message"]
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(stack.grpc, "x " * 200, model="tiny-swa", max_tokens=4)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        stack.procs["prefill-full"].stop()
        stack.procs["decode-full"].stop()


def test_a_full_decode_worker_gets_429_whether_its_heartbeat_says_so_or_not(stack: Stack) -> None:
    """Decode's heartbeats 30 s apart. First its heartbeat is a beat old: the router thinks it
    has room, the prefill worker's KV push finds its pool taken. The request moves off decode
    (not off the prefill worker, which did nothing wrong); with no other decode worker, 429
    saying why. Then one answer reserves decode's whole pool (4,096 tokens); frozen there, the
    worker's last heartbeat says it has no room: the next request is refused at once, to be
    retried. Once the answer is cancelled, the worker says it has room again at once, not a
    heartbeat interval later: the retry is taken."""
    stack.restart("decode-0", KVMESH_HEARTBEAT_INTERVAL_S="30")  # its first beat: all free
    stack.wait_ready(["decode-0"])
    stream = stack.client().completions.create(stream=True, **{**LONG_ANSWER, "max_tokens": 4000})
    try:
        next(iter(stream))  # its 4,000 tokens reserved
        ids = [(i * 7919) % 40000 + 100 for i in range(300)]
        code, headers, body = post(stack.url, {"model": "tiny", "prompt": ids, "max_tokens": 10})
        assert code == 429 and headers["Retry-After"] == "1", body
        message = body["error"]["message"]
        assert message.startswith("every decode worker failed this request; retry shortly")
        assert "decode-0: KV cache full" in message
    finally:
        stream.close()
    wait_until(lambda: blocks_used(stack) == 0, 10, what="decode's pool free again")

    stream = stack.client().completions.create(stream=True, **{**LONG_ANSWER, "max_tokens": 4090})
    chunks = iter(stream)
    next(chunks)
    decode = stack.procs["decode-0"]
    try:
        wait_until(
            lambda: stack.health()["decode-0"]["load"]["kv_blocks_used"] == 64,
            30,
            what="decode's pool full in its heartbeat",
        )
        decode.signal(signal.SIGSTOP)
        code, headers, body = post(stack.url, {"model": "tiny", "prompt": "hello", "max_tokens": 4})
        assert code == 429 and headers["Retry-After"] == "1"
        assert body["error"]["message"] == (
            "no decode worker has room for this request; retry shortly"
        )
        with pytest.raises(grpc.RpcError) as err:
            grpc_generate(stack.grpc, "hello", max_tokens=4)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        decode.signal(signal.SIGCONT)
        stream.close()
    wait_until(
        lambda: stack.health()["decode-0"]["load"]["kv_blocks_used"] == 0,
        10,
        what="the router told at once that the pool is free",
    )
    code, _, body = post(stack.url, {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert code == 200, body


def test_a_request_no_decode_pool_could_hold_gets_400_naming_the_limit(stack: Stack) -> None:
    """A decode pool of 2 blocks (128 tokens): 300 prompt tokens and 10 more never fit there,
    however long the client waits: 400, naming the field and the limit (not a retry)."""
    stack.restart("decode-0", KVMESH_DECODE_KV_CACHE_TOKENS="128")
    stack.wait_ready(["decode-0"])
    ids = [(i * 7919) % 40000 + 100 for i in range(300)]
    code, _, body = post(stack.url, {"model": "tiny", "prompt": ids, "max_tokens": 10})
    assert code == 400, body
    assert body["error"]["param"] == "max_tokens"
    assert "need 310 tokens of KV; the largest decode worker holds 128" in body["error"]["message"]


def test_a_port_in_use_stops_a_service_at_start_naming_the_setting(stack: Stack) -> None:
    """A port another process holds, even one that lets others share it (SO_REUSEPORT, as a
    gRPC server does by default): the service exits at start naming the setting, instead of
    taking half of the other's connections."""
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        stack.start("decode-squat", KVMESH_DECODE_KV_PORT=str(port))
        stack.start("router-squat", KVMESH_ROUTER_GRPC_PORT=str(port), KVMESH_ROUTER_HTTP_PORT="0")
        for sid, setting in (
            ("decode-squat", "KVMESH_DECODE_KV_PORT"),
            ("router-squat", "KVMESH_ROUTER_GRPC_PORT"),
        ):
            proc = stack.procs.pop(sid)
            assert proc.wait(60) == 1, proc.output()
            assert f"{setting}: cannot listen for gRPC on " in proc.output()
            assert f":{port} (the port is in use" in proc.output()


# -- a client that goes away ---------------------------------------------------------------


def test_a_client_leaving_mid_prefill_stops_the_prefill(stack: Stack) -> None:
    """One token per forward pass: 4,000 prompt tokens take seconds. The client hangs up once
    the prefill worker is computing; the prefill stops between two passes. (Seen computing
    only once the passes had ended, on a loaded machine, the prompt was sent again: a client
    that left after its prefill cannot stop it.)"""
    stack.restart("prefill-0", KVMESH_PREFILL_PREFILL_CHUNK="1")
    stack.wait_ready(["prefill-0"])
    ended: list[str] = []  # the prefills that had ended before their client left
    for attempt in range(3):
        rid = f"leaves-mid-prefill-{attempt}"
        conn = http.client.HTTPConnection(stack.url.removeprefix("http://"), timeout=60)
        try:
            body = {"model": "tiny", "prompt": [7] * 4000, "max_tokens": 4, "stream": True}
            conn.request(
                "POST",
                "/v1/completions",
                json.dumps(body),
                {"Content-Type": "application/json", "x-request-id": rid},
            )
            sent = time.monotonic()
            wait_until(lambda: own_load(stack, "prefill-0")["inflight"] == 1, 30, what="computing")
            seen = time.monotonic() - sent
        finally:
            conn.close()  # the client is gone
        spans = wait_until(
            lambda rid=rid: [
                s
                for s in request_trace(read_spans(stack.dir / "traces"), rid)
                if s["name"] == "prefill" and s["status"] == "error"
            ],
            30,
            what="the prefill span",
        )
        error = spans[0]["error"]
        if "cancelled at token " in error:
            assert f"{rid} cancelled" in stack.procs["prefill-0"].output()
            done, total = error.split("cancelled at token ")[1].split(" of ")
            assert int(done) < int(total) == 4000  # stopped part way, not run to the end
            return
        ended.append(f"{rid}: seen computing {seen:.1f} s after it was sent; then {error!r}")
        assert seen > 1, ended  # seen within a second of its 4,000 passes: it had not ended
    raise AssertionError("no prefill was stopped part way: " + "; ".join(ended))


def test_a_grpc_client_cancelling_frees_decode(stack: Stack) -> None:
    rid = "grpc-cancelled"
    req = api_pb2.GenerateRequest(
        model="tiny",
        messages=[api_pb2.ChatMessage(role="user", content="Say a great deal.")],
        max_tokens=4000,
        temperature=0,
    )
    with grpc.insecure_channel(stack.grpc) as channel:
        call = api_pb2_grpc.GenerationStub(channel).GenerateStream(
            req, timeout=60, metadata=(("x-request-id", rid),)
        )
        first = next(call)
        assert first.id and not first.finish_reason  # (answering, not done)
        call.cancel()
    wait_until(lambda: f"dropped {rid}" in stack.procs["decode-0"].output(), 30, what="dropped")
    wait_until(lambda: blocks_used(stack) == 0, 30, what="decode's KV freed")


# -- draining ------------------------------------------------------------------------------


def streaming(stack: Stack, max_tokens: int):
    """A long streamed answer, its first chunk read, decode holding it."""
    stream = stack.client().completions.create(
        stream=True, **{**LONG_ANSWER, "max_tokens": max_tokens}
    )
    chunks = iter(stream)
    next(chunks)
    assert own_load(stack, "decode-0")["inflight"] == 1
    return stream, chunks


def test_sigterm_finishes_the_request_in_flight_then_exits(stack: Stack) -> None:
    # Long enough to be mid-answer when the signal comes, short enough to end well within the
    # drain bound (10 s) on a slow machine (the tiny model decodes ~140 tokens/s on two cores).
    stream, chunks = streaming(stack, 600)
    decode = stack.procs["decode-0"]
    decode.signal(signal.SIGTERM)
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(1 for c in rest if c.choices and c.choices[0].text) >= 1
    assert decode.wait(30) == 0
    assert "SIGTERM: draining" in decode.output()
    # The model is served, its one decode worker gone: 503, to retry (not a 404).
    wait_until(lambda: "decode-0" not in stack.health(), 10, what="decode-0 dropped")
    code, headers, body = post(stack.url, {"model": "tiny", "prompt": "hello", "max_tokens": 4})
    assert code == 503, body
    assert body["error"]["message"] == "no live decode worker serves 'tiny'; retry later"


def test_the_drain_bound_stops_a_worker_that_would_take_longer(stack: Stack) -> None:
    """Past its drain bound the worker stops anyway; the answer it held finds no decode worker
    to resume on (after a wait of 1 s here) and ends with an error naming it, not a hang."""
    stack.restart("decode-0", KVMESH_DRAIN_TIMEOUT_S="0.5")
    stack.wait_ready(["decode-0"])
    stream, chunks = streaming(stack, 4000)
    decode = stack.procs["decode-0"]
    decode.signal(signal.SIGTERM)
    assert decode.wait(30) == 0
    assert "drain took over 0.5 s; stopping anyway" in decode.output()
    with pytest.raises(openai.APIError) as err:
        list(chunks)
    assert "decode-0" in str(err.value)
    stream.close()


def engine_process_of(pid: int) -> int:
    """The pid of the decode worker ``pid``'s engine process (its child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid and b"shared.hosting.process" in command:
            return int(entry.name)
    raise AssertionError(f"no engine process under {pid}")


def test_a_decode_worker_whose_engine_process_dies_exits_as_if_it_crashed(stack: Stack) -> None:
    """The engine steps in a process of its own beside the worker. Killed, the worker cannot
    serve: it exits at once (a supervisor starts it again), and the answer it was giving ends
    with an error, not a hang."""
    stream, chunks = streaming(stack, 4000)
    decode = stack.procs["decode-0"]
    os.kill(engine_process_of(decode.pid), signal.SIGKILL)
    assert decode.wait(30) == 70
    assert "the engine's process ended" in decode.output()
    with pytest.raises(openai.APIError):
        list(chunks)
    stream.close()


def test_a_decode_step_that_raises_moves_its_answers_and_the_worker_says_it_is_failing(
    stack: Stack,
) -> None:
    """An engine hook makes the steps of the worker holding a streamed answer raise: the
    answer moves to the other decode worker at once and ends whole; the worker that failed
    says it is failing (503 on its /health, "failing" at the router) and gets no more work."""
    hooks = dict(KVMESH_FAULT_HOOKS="true", KVMESH_DECODE_MAX_ENGINE_FAILURES="1")
    stack.restart("decode-0", **hooks)
    stack.start("decode-spare", **hooks)
    try:
        stack.wait_ready(["decode-0", "decode-spare"])
        stream = stack.client().completions.create(
            stream=True, **{**LONG_ANSWER, "max_tokens": 400}
        )
        chunks = iter(stream)
        first = next(chunks)
        held = [s for s in ("decode-0", "decode-spare") if own_load(stack, s)["inflight"]]
        (broken,) = held
        other = "decode-spare" if broken == "decode-0" else "decode-0"
        request = urllib.request.Request(
            f"{stack.advertised(broken)}/faults/engine_step", method="PUT"
        )
        urllib.request.urlopen(request, timeout=5)
        rest = [first, *chunks]
        assert rest[-1].choices[0].finish_reason == "length"  # finished, on the other worker
        assert sum(len(c.choices[0].text) > 0 for c in rest if c.choices) >= 100
        status, body = get_json(f"{stack.advertised(broken)}/health")
        assert status == 503 and body["status"] == "failing"
        wait_until(
            lambda: stack.health()[broken]["status"] == "failing", 10, what="the router told"
        )
        assert own_load(stack, other)["inflight"] == 0
        answer = stack.client().completions.create(model="tiny", prompt="Hello", max_tokens=8)
        assert answer.model_extra["kvmesh"]["workers"][-1] == other  # none to the failing one
    finally:
        stack.procs["decode-spare"].stop()


def test_a_prefill_that_raises_moves_its_request_and_the_worker_says_it_is_failing(
    stack: Stack,
) -> None:
    """A prompt is cached on prefill-0, whose engine then raises on every prefill: a longer
    prompt after it goes there first (its prefix is there), fails with "unavailable", and is
    answered whole by the spare; prefill-0 says it is failing and gets no more work."""
    hooks = dict(KVMESH_FAULT_HOOKS="true", KVMESH_PREFILL_MAX_ENGINE_FAILURES="1")
    stack.restart("prefill-0", **hooks)
    try:
        stack.wait_ready(["prefill-0"])
        prompt = "Tide tables for the northern berths, hour by hour. " * 12  # ~130 tokens
        first = stack.client().completions.create(model="tiny", prompt=prompt, max_tokens=6)
        assert first.model_extra["kvmesh"]["workers"][0] == "prefill-0"
        stack.start("prefill-spare")
        stack.wait_ready(["prefill-spare"])
        urllib.request.urlopen(
            urllib.request.Request(
                f"{stack.advertised('prefill-0')}/faults/engine_prefill", method="PUT"
            ),
            timeout=5,
        )
        more = " And for the southern berths, by the quarter hour." * 8  # past decode's own
        moved = stack.client().completions.create(model="tiny", prompt=prompt + more, max_tokens=6)
        assert moved.choices[0].finish_reason == "length"
        assert moved.model_extra["kvmesh"]["workers"][0] == "prefill-spare"
        rid = moved.id.removeprefix("cmpl-")
        tried = f"{rid}: prefill-0: prefill failed: fault hook engine_prefill"
        assert tried in stack.procs["router-0"].output()  # it went there first, then moved
        status, body = get_json(f"{stack.advertised('prefill-0')}/health")
        assert status == 503 and body["status"] == "failing"
        failures = metrics(stack.advertised("prefill-0"))
        assert failures[("kvmesh_engine_failures_total", (("what", "prefill"),))] == 1
        wait_until(
            lambda: stack.health()["prefill-0"]["status"] == "failing", 10, what="the router told"
        )
        again = stack.client().completions.create(
            model="tiny", prompt=prompt + more.upper(), max_tokens=6
        )
        assert "prefill-0" not in again.model_extra["kvmesh"]["workers"]  # none to it now
    finally:
        if "prefill-spare" in stack.procs:
            stack.procs["prefill-spare"].stop()


def fault(stack: Stack, sid: str, name: str, on: bool = True) -> None:
    """Switch a fault hook of ``sid``'s on or off (shared/faults.py)."""
    url = f"{stack.advertised(sid)}/faults/{name}"
    urllib.request.urlopen(urllib.request.Request(url, method="PUT" if on else "DELETE"), timeout=5)


def test_a_router_losing_its_token_links_moves_the_answers_they_carried(stack: Stack) -> None:
    """Decode sends the router its tokens on a connection of its own (a token link). The
    router closes its links mid-answer (as a connection that broke would, events perhaps
    lost with it): the answer goes on from the tokens its client has, its tokens over NATS
    while no link is taken, and ends whole."""
    messages = "kvmesh_token_messages_total"
    resumed = ("kvmesh_request_moves_total", (("kind", "resumed"),))
    before = metrics(stack.url)
    stream, chunks = streaming(stack, 400)
    early = metrics(stack.url)
    assert early[(messages, (("path", "link"),))] > before.get((messages, (("path", "link"),)), 0)
    fault(stack, "router-0", "token_links")
    try:
        rest = list(chunks)
        after = metrics(stack.url)
    finally:
        fault(stack, "router-0", "token_links", on=False)
        stream.close()
    assert rest[-1].choices[0].finish_reason == "length"
    assert sum(len(c.choices[0].text) > 0 for c in rest if c.choices) >= 100
    assert after[resumed] - before.get(resumed, 0) >= 1  # it moved on from its tokens
    assert after[(messages, (("path", "nats"),))] > early.get((messages, (("path", "nats"),)), 0)
    # Once the links are taken again, the workers use them (they connect again by themselves).
    wait_until(
        lambda: (
            stack.client().completions.create(model="tiny", prompt="Hi", max_tokens=4)
            and metrics(stack.url)[(messages, (("path", "link"),))]
            > after[(messages, (("path", "link"),))]
        ),
        30,  # (a worker waits longer after each failed try, a few seconds here)
        what="tokens on a link again",
    )


def test_a_prefill_worker_stopping_moves_no_answer_it_handed_over(stack: Stack) -> None:
    """A prefill worker stops (SIGTERM) while an answer it prefilled streams from decode: its
    token link to the router closes, and the answer, which owes it nothing more, goes on
    where it is (a rolling restart of the prefill pool moves no answer)."""
    resumed = ("kvmesh_request_moves_total", (("kind", "resumed"),))
    on_link = ("kvmesh_token_messages_total", (("path", "link"),))
    client = stack.client()
    for n in range(2):  # (a prompt prefill computes; the second's first token on its link)
        prompt = [(i * 7919 + n) % 40000 + 100 for i in range(300)]
        seen = metrics(stack.url).get(on_link, 0)
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert metrics(stack.url).get(on_link, 0) == seen + 1  # (prefill's one event, on it)
    before = metrics(stack.url).get(resumed, 0)
    prompt = [(i * 7919 + 2) % 40000 + 100 for i in range(300)]
    stream = client.completions.create(
        stream=True, **{**LONG_ANSWER, "prompt": prompt, "max_tokens": 2000}
    )
    try:
        chunks = iter(stream)
        next(chunks)
        assert own_load(stack, "decode-0")["inflight"] == 1
        assert stack.procs["prefill-0"].stop() == 0
        rest = list(chunks)
    finally:
        stream.close()
    assert rest[-1].choices[0].finish_reason == "length"
    assert metrics(stack.url).get(resumed, 0) == before


def test_a_request_that_breaks_every_engine_fails_after_two_and_takes_no_worker_down(
    stack: Stack,
) -> None:
    """A poison request: each engine that computes its prompt raises. It is failed with a
    clear error after two workers (not moved on for ever), however often the client sends it
    the workers stay ready (each counts it once: the prompt's fault, not the engine's) and no
    breaker opens; everyone else is served."""
    poison = 4321  # (a token id the prompt below holds)
    stack.start("prefill-spare")
    try:
        stack.wait_ready(["prefill-spare"])
        for sid in ("prefill-0", "prefill-spare"):
            fault(stack, sid, f"poison_token_{poison}")
        prompt = [(i * 7919) % 40000 + 100 for i in range(300)]  # (past decode's own prefill)
        prompt[150] = poison
        for _ in range(4):
            code, _, body = post(stack.url, {"model": "tiny", "prompt": prompt, "max_tokens": 4})
            assert code == 500, body
            message = body["error"]["message"]
            assert body["error"]["code"] == "engine_error"
            assert message.startswith("the engine failed on this request on 2 workers")
            assert "prefill-0: prefill failed" in message
            assert "prefill-spare: prefill failed" in message
        health = stack.health()
        for sid in ("prefill-0", "prefill-spare"):
            assert health[sid]["status"] == "ready"
            assert get_json(f"{stack.advertised(sid)}/health")[0] == 200
        breakers = metrics(stack.url)
        for sid in ("prefill-0", "prefill-spare"):
            assert breakers.get(("kvmesh_router_breaker_open", (("worker", sid),)), 0) == 0
        prompt[150] = poison + 1  # another client's request
        code, _, body = post(stack.url, {"model": "tiny", "prompt": prompt, "max_tokens": 4})
        assert code == 200, body
    finally:
        fault(stack, "prefill-0", f"poison_token_{poison}", on=False)
        stack.procs["prefill-spare"].stop()


def test_a_full_storage_tier_is_shown_and_no_request_fails(stack: Stack, tmp_path: Path) -> None:
    """prefill-0's storage tier is a 16 KiB tmpfs: the prompts are answered all the same,
    the worker says its tier is full (its /health, its metric), and the router's /health
    names it until it is restarted on a tier that takes writes."""
    with small_tmpfs(tmp_path / "tier", 16) as tier:
        stack.restart("prefill-0", KVMESH_KV_STORE_DIR=str(tier))
        try:
            stack.wait_ready(["prefill-0"])
            for i in range(3):  # ~5 blocks each, more than 4 pages hold
                prompt = f"Harbour log {i}: " + "ships in, ships out, tide noted. " * 40
                answer = stack.client().completions.create(
                    model="tiny", prompt=prompt, max_tokens=4
                )
                assert answer.choices[0].finish_reason == "length"
            load = wait_until(
                lambda: (
                    own_load(stack, "prefill-0")["kv_store_error"] == "full"
                    and own_load(stack, "prefill-0")
                ),
                30,
                what="the worker to say its tier is full",
            )
            assert load["kv_store_error"] == "full"
            unstored = metrics(stack.advertised("prefill-0"))
            assert unstored[("kvmesh_kv_store_failures_total", (("op", "write"), ("why", "full")))]
            health = wait_until(
                lambda: get_json(f"{stack.url}/health")[1]["storage_unwritten"],
                10,
                what="the router told",
            )
            assert health == {"prefill-0": "full"}
        finally:
            stack.restart("prefill-0")
            stack.wait_ready(["prefill-0"])
    wait_until(
        lambda: not get_json(f"{stack.url}/health")[1]["storage_unwritten"],
        10,
        what="the router told",
    )


def test_a_second_signal_exits_at_once(stack: Stack) -> None:
    stream, _ = streaming(stack, 4000)
    decode = stack.procs["decode-0"]
    decode.signal(signal.SIGTERM)
    wait_until(lambda: "SIGTERM: draining" in decode.output(), 30, what="draining")
    decode.signal(signal.SIGTERM)
    assert decode.wait(30) == 1
    assert "second SIGTERM: exiting now" in decode.output()
    stream.close()


# -- images --------------------------------------------------------------------------------


def test_the_encoder_cache_evicts_and_an_evicted_image_is_encoded_again(stack: Stack) -> None:
    """Room for one image's embeddings: a second image evicts the first."""
    a, b = (ask("What is this?", image(data_url(png(seed)))) for seed in (40, 41))

    def source(messages: list[dict]) -> str:
        resp = stack.client().chat.completions.create(
            model="tiny", messages=messages, max_tokens=2, temperature=0
        )
        return resp.model_extra["kvmesh"]["images"][0]["source"]

    assert [source(a), source(a), source(b), source(a)] == [
        "encoded",
        "memory",
        "encoded",
        "encoded",  # evicted by b
    ]


def test_a_prefill_worker_gives_up_on_embeddings_that_do_not_come(stack: Stack) -> None:
    """The encoder frozen, prefill waits 1 s for the embeddings, then fails the request (503
    naming them) without waiting for the router's own 30 s encode timeout."""
    stack.restart("prefill-0", KVMESH_PREFILL_EMBEDS_WAIT_S="1")
    stack.wait_ready(["prefill-0"])
    encoder = stack.procs["encoder-0"]
    encoder.signal(signal.SIGSTOP)
    try:
        client = stack.client(timeout=20)  # a hang until the encode timeout fails here
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(
                model="tiny",
                messages=ask("Look: " + "words " * 100, image(data_url(png(42)))),
                max_tokens=2,
            )
        assert err.value.status_code == 503
        assert "embeddings did not come within 1 s" in err.value.message
    finally:
        encoder.signal(signal.SIGCONT)


# -- every routing policy serves -----------------------------------------------------------


def test_each_routing_policy_serves_in_a_live_router(stack: Stack) -> None:
    """A router of each policy (started at once, each with a prompt of its own: nothing
    cached) routes to the one prefill worker and answers."""
    policies = [p for p in POLICIES if p != "ttft"]
    urls = {
        p: stack.router(f"router-{p}", wait=False, KVMESH_ROUTER_ROUTING_POLICY=p) for p in policies
    }
    try:
        for policy, url in urls.items():
            stack.wait_ready(url=url)
            resp = stack.client(url).completions.create(
                model="tiny", prompt=f"{policy} " * 200, max_tokens=5, temperature=0
            )
            route = resp.model_extra["kvmesh"]["route"]
            assert route["policy"] == policy and route["chosen"] == "prefill-0", policy
            assert resp.usage.completion_tokens == 5
    finally:
        for policy in policies:
            stack.procs[f"router-{policy}"].stop()

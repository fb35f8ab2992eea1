"""The request path through real processes: router, 2 prefill and 2 decode workers (the tiny
model), a real nats-server, gRPC handoffs; driven with the official openai client."""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import openai
import pytest

from shared.engine.interface import EngineOptions
from shared.engine.torch.engine import TorchEngine
from shared.engine.torch.loader import load_model
from shared.messages.sampling import SamplingParams
from shared.proto import api_pb2, api_pb2_grpc
from tests.procs import children_of, wait_until
from tests.stack import Stack

LOCAL_MAX = 16  # prompts of at most this many tokens are prefilled on decode


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("router-0", "prefill-0", "prefill-1", "decode-0", "decode-1"),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS=str(LOCAL_MAX),
    )


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return stack.client()


@pytest.fixture(scope="module")
def reference(stack: Stack):
    """The same tiny model in this process: what the mesh must reproduce."""
    model = load_model("tiny", stack.dir)
    engine = TorchEngine(model, EngineOptions(block_size=64, kv_cache_tokens=4096))

    def run(ids: list[int], max_tokens: int) -> str:
        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        out = [engine.prefill("ref", ids, params).token_id]
        while engine.running:
            out += [o.token_id for o in engine.step()]
        engine.free("ref")
        return model.tokenizer.decode(out, skip_special_tokens=True)

    return model, run


def chat_ids(model, text: str) -> list[int]:
    rendered = model.chat_template.render([{"role": "user", "content": text}])
    return model.tokenizer.encode(rendered, add_special_tokens=False).ids


def post(url: str, body: bytes | dict) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def decode_blocks_used(stack: Stack) -> int:
    return sum(w["load"]["kv_blocks_used"] for sid, w in stack.health().items() if "decode" in sid)


# -- answers ---------------------------------------------------------------------------------


def test_the_router_and_a_decode_worker_serve_without_torch(client, stack) -> None:
    """After chat requests (template, tokens, routing, streaming, KV handed over) the live
    router has not loaded torch: libtorch is not mapped in its process; nor in the decode
    worker's, whose engine computes in a process of its own (that one holds torch). The
    prefill worker's engine is in its process, so the check sees torch where it is."""
    for stream in (False, True):
        resp = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Name a colour of the sea."}],
            max_tokens=4,
            temperature=0,
            stream=stream,
        )
        if stream:
            assert [c.choices[0].finish_reason for c in resp if c.choices][-1] == "length"
        else:
            assert resp.usage.completion_tokens == 4

    def torch_in(pid: int) -> bool:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()

    procs = stack.procs
    assert not torch_in(procs["router-0"].pid)
    assert not torch_in(procs["decode-0"].pid)
    assert [torch_in(pid) for pid in children_of(procs["decode-0"].pid)] == [True]
    assert torch_in(procs["prefill-0"].pid)


def test_chat_greedy_answer_equals_the_engine_in_one_process(client, reference) -> None:
    model, run = reference
    text = "Tell me about the sea and the ships that sail on it."
    raw = client.chat.completions.with_raw_response.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=24, temperature=0
    )
    resp = raw.parse()
    assert raw.headers["x-request-id"]
    ids = chat_ids(model, text)
    assert len(ids) > LOCAL_MAX  # so the KV moved from a prefill worker to a decode worker
    assert resp.choices[0].message.content == run(ids, 24)
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 24
    assert resp.usage.prompt_tokens_details.cached_tokens == 0
    timing = resp.model_extra["kvmesh"]
    assert timing["kv_bytes"] > 0 and any(w.startswith("prefill") for w in timing["workers"])


def test_streamed_chat_equals_the_whole_answer_and_ends_with_usage(client, reference) -> None:
    text = "Write about mountains, rivers and the weather in spring."
    whole = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": text}], max_tokens=20, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": text}],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_short_prompt_is_prefilled_on_decode_and_no_kv_moves(client, reference) -> None:
    model, run = reference
    ids = model.tokenizer.encode("Hello", add_special_tokens=False).ids
    assert len(ids) <= LOCAL_MAX
    resp = client.completions.create(model="tiny", prompt="Hello", max_tokens=12, temperature=0)
    assert resp.choices[0].text == run(ids, 12)
    timing = resp.model_extra["kvmesh"]
    assert timing["kv_bytes"] == 0 and all(w.startswith("decode") for w in timing["workers"])


def test_streamed_completion_with_a_stop_string(client) -> None:
    full = (
        client.completions.create(model="tiny", prompt=[5, 6, 7] * 10, max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # three characters from the middle
    assert stop.strip()
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=[5, 6, 7] * 10,
            max_tokens=16,
            temperature=0,
            stop=[stop],
            stream=True,
        )
    )
    text = "".join(c.choices[0].text for c in chunks)
    assert text == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seeded_sampling_through_the_mesh_is_reproducible(client) -> None:
    """The same seed, the same answer; another seed, or no sampling, another one (so the
    seed and the temperature did reach the engine)."""
    kw = dict(model="tiny", prompt="x " * 30, max_tokens=10, temperature=1.0, seed=11)
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first
    assert client.completions.create(**{**kw, "seed": 12}).choices[0].text != first
    assert client.completions.create(**{**kw, "temperature": 0}).choices[0].text != first


def test_grpc_unary_and_streaming_generate(stack, client) -> None:
    msgs = [api_pb2.ChatMessage(role="user", content="Tell me about the sea and the ships.")]
    req = api_pb2.GenerateRequest(model="tiny", messages=msgs, max_tokens=10, temperature=0)
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        whole, call = stub.Generate.with_call(
            req, timeout=30, metadata=(("x-request-id", "grpc-req-1"),)
        )
        meta = dict(call.initial_metadata())
        assert meta["x-request-id"] == "grpc-req-1" and len(meta["x-kvmesh-trace-id"]) == 32
        chunks = list(stub.GenerateStream(req, timeout=30))
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(api_pb2.GenerateRequest(model="tiny", messages=msgs, max_tokens=0))
    assert (
        err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in err.value.details()
    )
    http = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": msgs[0].content}],
        max_tokens=10,
        temperature=0,
    )
    assert whole.text == http.choices[0].message.content == "".join(c.text for c in chunks)
    assert whole.finish_reason == chunks[-1].finish_reason == "length"
    assert whole.usage.completion_tokens == chunks[-1].usage.completion_tokens == 10
    # The sampling extensions travel too: min_p 1 (or top_k 1) makes a seeded draw greedy.
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        seeded = {"model": "tiny", "messages": msgs, "max_tokens": 10, "temperature": 1, "seed": 3}
        drawn = stub.Generate(api_pb2.GenerateRequest(**seeded), timeout=30)
        kept = stub.Generate(api_pb2.GenerateRequest(**seeded, min_p=1.0), timeout=30)
        top = stub.Generate(api_pb2.GenerateRequest(**seeded, top_k=1), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(api_pb2.GenerateRequest(**seeded, min_tokens=11))
    assert drawn.text != whole.text and kept.text == top.text == whole.text
    assert "min_tokens" in err.value.details()
    # Several answers: each choice by its index, whole and streamed.
    with grpc.insecure_channel(stack.grpc) as channel:
        stub = api_pb2_grpc.GenerationStub(channel)
        two = api_pb2.GenerateRequest(
            model="tiny", messages=msgs, max_tokens=10, temperature=0, n=2
        )
        both = stub.Generate(two, timeout=30)
        streamed: dict[int, str] = {0: "", 1: ""}
        for chunk in stub.GenerateStream(two, timeout=30):
            streamed[chunk.index] += chunk.text
    assert [(c.index, c.text) for c in both.choices] == [(0, whole.text), (1, whole.text)]
    assert streamed == {0: whole.text, 1: whole.text} and both.usage.completion_tokens == 20


def test_concurrent_requests_spread_over_both_pools_and_all_complete(client) -> None:
    def ask(i: int) -> tuple[str, list[str]]:
        resp = client.chat.completions.create(
            model="tiny",
            messages=[
                {"role": "user", "content": f"Request number {i}: describe a city at night."}
            ],
            max_tokens=16,
            temperature=0,
        )
        return resp.choices[0].finish_reason, resp.model_extra["kvmesh"]["workers"]

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(ask, range(12)))
    assert all(finish == "length" for finish, _ in results)
    used = {w for _, workers in results for w in workers}
    assert {"prefill-0", "prefill-1", "decode-0", "decode-1"} <= used


# -- cancellation ------------------------------------------------------------------------------


def test_client_disconnect_frees_decode_kv(stack, client) -> None:
    wait_until(lambda: decode_blocks_used(stack) == 0, 30, what="decode pools idle")
    rid = "disconnect-test-1"
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Go on and on about anything you like, at length."}],
        max_tokens=4000,
        temperature=0,
        stream=True,
        extra_headers={"x-request-id": rid},
    )
    chunks = iter(stream)
    next(chunks)
    # The answer's blocks are held while it streams (seen in the next heartbeat).
    wait_until(lambda: next(chunks) and decode_blocks_used(stack) > 0, 30, what="KV in use")
    stream.close()
    wait_until(lambda: decode_blocks_used(stack) == 0, 30, what="decode KV back to its use before")
    logs = "".join(stack.procs[f"decode-{i}"].output() for i in (0, 1))
    assert f"dropped {rid}" in logs  # cancelled, not run to its 4000 tokens


# -- limits and bad input ---------------------------------------------------------------------


BAD_CHAT = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "tiny", "messages": "hi"}, 400, "messages"),
    (
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "temperature": "hot",
        },
        400,
        "temperature",
    ),
    (
        {"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]},
        400,
        "messages[0].role",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        400,
        "max_tokens",
    ),
    (
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
        400,
        "max_tokens",
    ),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 17}, 400, "n"),
    (
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "stop": ["a", "b", "c", "d", "e"],
        },
        400,
        "stop",
    ),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
]


@pytest.mark.parametrize("body, status, field", BAD_CHAT)
def test_bad_chat_requests_get_openai_errors_naming_the_field(stack, body, status, field) -> None:
    code, headers, resp = post(stack.url + "/v1/chat/completions", body)
    assert code == status, resp
    assert set(resp["error"]) >= {"message", "type", "param", "code"}
    assert resp["error"]["param"] == field
    if field:
        assert field.split(".")[0] in resp["error"]["message"]
    assert headers.get("x-request-id")


def test_prompt_beyond_the_context_is_refused(stack) -> None:
    code, _, resp = post(
        stack.url + "/v1/completions", {"model": "tiny", "prompt": [7] * 4100, "max_tokens": 1}
    )
    assert code == 400 and resp["error"]["code"] == "context_length_exceeded"
    assert "4096" in resp["error"]["message"]


def test_a_model_no_worker_serves_is_not_found(stack) -> None:
    """tiny-moe is a model kvmesh knows, that no worker here serves: 404, as OpenAI answers a
    model it does not have (a 503 is for a served model whose workers are all gone)."""
    code, _, resp = post(
        stack.url + "/v1/completions", {"model": "tiny-moe", "prompt": "hi", "max_tokens": 2}
    )
    assert code == 404 and resp["error"]["code"] == "model_not_found"
    assert resp["error"]["message"] == "model 'tiny-moe' does not exist here (served: 'tiny')"


def test_the_service_still_serves_after_bad_input(stack: Stack, client) -> None:
    for body, status, _ in BAD_CHAT * 3:  # each refused, the router none the worse
        assert post(stack.url + "/v1/chat/completions", body)[0] == status
    resp = client.completions.create(model="tiny", prompt="still here", max_tokens=3)
    assert resp.usage.completion_tokens == 3


def test_full_router_answers_429_with_retry_after(stack: Stack) -> None:
    """A second router that admits one request at a time, over the same workers."""
    url = stack.router("router-small", KVMESH_ROUTER_MAX_INFLIGHT="1")
    small = stack.client(url)
    stream = small.completions.create(
        model="tiny", prompt="long " * 20, max_tokens=2000, stream=True
    )
    next(iter(stream))  # the one admitted request is now streaming
    code, headers, resp = post(url + "/v1/completions", {"model": "tiny", "prompt": "hi"})
    stream.close()
    assert code == 429 and headers.get("Retry-After") == "1"
    assert resp["error"]["type"] == "rate_limit_error"
    wait_until(
        lambda: (
            post(url + "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})[0]
            == 200
        ),
        30,
        what="the router to admit again after the stream closed",
    )
    stack.procs["router-small"].stop()


def test_a_router_running_far_behind_refuses_new_requests_until_it_catches_up(
    stack: Stack,
) -> None:
    """Frozen for a while (as if it had more tokens to write than it could), a router's
    loop wakes far behind: new requests get 429 until it catches up, and its workers, whose
    beats waited in its queue meanwhile, are not dropped."""
    url = stack.router(
        "router-lag", KVMESH_ROUTER_MISSED_HEARTBEATS="2", KVMESH_ROUTER_MAX_LOOP_LAG_S="0.25"
    )
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    wait_until(lambda: post(url + "/v1/completions", body)[0] == 200, 60, what="router-lag up")
    proc = stack.procs["router-lag"]
    conn = http.client.HTTPConnection(url.removeprefix("http://"), timeout=30)
    proc.signal(signal.SIGSTOP)
    try:
        time.sleep(2.5)  # frozen past its workers' two beats (the fault's length)
        # Sent while it is frozen (the kernel holds the connection and the bytes): read once
        # it wakes, after its late timer has said so.
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
    finally:
        proc.signal(signal.SIGCONT)
    answer = conn.getresponse()
    code, headers, resp = answer.status, dict(answer.headers), json.loads(answer.read())
    conn.close()
    assert code == 429 and headers.get("Retry-After") == "1"
    assert "behind" in resp["error"]["message"] and resp["error"]["code"] == "overloaded"
    wait_until(lambda: post(url + "/v1/completions", body)[0] == 200, 10, what="caught up")
    assert "dropped decode" not in proc.output() and "dropped prefill" not in proc.output()
    proc.stop()


# -- workers that stop answering ---------------------------------------------------------------


def test_a_silent_worker_costs_one_retry_then_503(stack: Stack) -> None:
    """SIGSTOP freezes a prefill worker: still in the registry, answering nothing. The one
    frozen is the one the router picks now (the faster it has measured), so it is tried first;
    the task goes to the other once the ack timeout (2 s on this router) has passed."""
    url = stack.router("router-acks", KVMESH_ROUTER_ACK_TIMEOUT_S="2")
    client, procs = stack.client(url), stack.procs
    probe = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Probe: " + "word " * 30}], max_tokens=1
    )
    first, other = (
        ("prefill-0", "prefill-1")
        if probe.model_extra["kvmesh"]["route"]["chosen"] == "prefill-0"
        else ("prefill-1", "prefill-0")
    )
    frozen = [procs[first]]
    os.kill(procs[first].pid, signal.SIGSTOP)
    try:

        def ask(i: int) -> tuple[str, list[str]]:
            resp = client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Retry {i}: describe a harbour at dawn."}],
                max_tokens=8,
            )
            return resp.choices[0].finish_reason, resp.model_extra["kvmesh"]["workers"]

        with ThreadPoolExecutor(2) as pool:  # the first is routed to the frozen worker
            answers = list(pool.map(ask, range(2)))
        assert [finish for finish, _ in answers] == ["length", "length"]
        assert all(other in workers and first not in workers for _, workers in answers)

        frozen.append(procs[other])
        os.kill(procs[other].pid, signal.SIGSTOP)
        code, _, resp = post(
            url + "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": "x " * 40}]},
        )
        assert code == 503 and resp["error"]["type"] == "service_unavailable"
    finally:
        for proc in frozen:
            os.kill(proc.pid, signal.SIGCONT)
        procs["router-acks"].stop()
    stack.wait_ready(["prefill-0", "prefill-1"])
    # Woken up, they drop the tasks the router gave up on, and serve new ones.
    again = stack.client().completions.create(model="tiny", prompt="y " * 30, max_tokens=2)
    assert again.usage.completion_tokens == 2


@pytest.mark.parametrize(
    "headers, says",
    [
        ({"x-kvmesh-retention": "forever"}, "x-kvmesh-retention: one of chat, agent"),
        ({"x-kvmesh-tenant": "t" * 257}, "x-kvmesh-tenant: at most 256 characters"),
    ],
)
def test_bad_kv_headers_are_refused_naming_the_header(stack, headers, says) -> None:
    body = json.dumps({"model": "tiny", "prompt": "hi", "max_tokens": 2}).encode()
    req = urllib.request.Request(
        stack.url + "/v1/completions", body, {"Content-Type": "application/json", **headers}
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    error = json.loads(err.value.read())["error"]
    assert err.value.code == 400 and says in error["message"]
    assert error["param"] == next(iter(headers))


def test_an_unsafe_request_id_is_replaced(client) -> None:
    for unsafe in ("a b", "x" * 65, "id;drop", "../etc", "<script>"):
        raw = client.completions.with_raw_response.create(
            model="tiny", prompt="hi", max_tokens=1, extra_headers={"x-request-id": unsafe}
        )
        rid = raw.headers["x-request-id"]
        assert rid != unsafe and len(rid) == 32 and int(rid, 16) >= 0
    safe = client.completions.with_raw_response.create(
        model="tiny", prompt="hi", max_tokens=1, extra_headers={"x-request-id": "mine-1_A"}
    )
    assert safe.headers["x-request-id"] == "mine-1_A"

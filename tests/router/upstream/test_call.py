"""One attempt on a server kvmesh did not start (services/router/upstream/call.py), against a
stand-in HTTP server that answers as vLLM's generate endpoint does (the real servers are in
tests/test_upstream.py): the server's answer to the call is the worker's ack (200 taken, 429
busy, another 4xx the client's error with the server's message, no answer a BusError); the
stream's tokens come back as token events in order, the first saying the reuse the router
expected and the last the server's own count; a stream that breaks mid-answer is the server's
failure; the settings refuse an upstream that is no URL, naming it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import aiohttp
import pytest
from aiohttp import web

from services.router.dispatch.job import Job
from services.router.errors import ApiError
from services.router.routing.route import RouteRequest
from services.router.settings import UpstreamSettings
from services.router.upstream.call import Call
from services.router.upstream.fleet import _addresses, _entry, expected_reuse
from services.router.upstream.protocols import PROTOCOLS
from shared.bus import BusError
from shared.messages.kvevents import STORE, memory_location
from shared.messages.sampling import SamplingParams

JOB = Job("r1", "m", list(range(100)), SamplingParams(max_tokens=3, temperature=0), 0.0)


def chunk(ids: list[int], finish: str | None = None) -> bytes:
    body = {"choices": [{"index": 0, "token_ids": ids, "finish_reason": finish}]}
    return f"data: {json.dumps(body)}\n\n".encode()


async def serve(handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/inference/v1/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def attempt(handler, reuse: dict[str, int] | None = None, job: Job = JOB):
    """Run one call against ``handler``: (its ack or the error it raised, the events)."""
    runner, url = await serve(handler)
    events = []
    try:
        async with aiohttp.ClientSession() as session:
            call = Call(
                session,
                url,
                PROTOCOLS["generate"],
                "m",
                "up-x",
                job,
                events.extend,
                5.0,
                reuse or {},
            )
            try:
                ack = await call.start()
            except (ApiError, BusError) as err:
                return err, events
            if call.task is not None:
                await asyncio.wait_for(call.task, 10)
            return ack, events
    finally:
        await runner.cleanup()


def test_a_streamed_answer_comes_back_as_token_events_in_order() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        assert body["token_ids"] == list(range(100)) and body["stream"]
        response = web.StreamResponse()
        await response.prepare(request)
        for piece in (chunk([5]), chunk([6, 7], "length")):
            await response.write(piece)
        usage = {"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 64}}}
        await response.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        return response

    ack, events = asyncio.run(attempt(handler, {"memory": 96, "storage": 0}))
    assert ack.accepted
    assert [(e.index, e.token_ids) for e in events] == [(0, [5]), (1, [6, 7])]
    assert events[0].cached_tokens == 96 and events[0].prefill_s is not None  # (expected)
    assert events[-1].finish_reason == "length" and events[-1].cached_tokens == 64  # (its own)
    assert all(e.worker_id == "up-x" for e in events)


def test_the_servers_answer_to_the_call_is_the_ack() -> None:
    async def busy(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "full"}}, status=429)

    async def refused(request: web.Request) -> web.Response:
        message = {"error": {"message": "This model's maximum context length is 8192"}}
        return web.json_response(message, status=400)

    ack, _ = asyncio.run(attempt(busy))
    assert not ack.accepted and ack.reason == "busy"
    err, _ = asyncio.run(attempt(refused))
    assert isinstance(err, ApiError) and err.status == 400 and "8192" in err.message

    async def gone() -> Exception:
        async with aiohttp.ClientSession() as session:
            call = Call(
                session,
                "http://127.0.0.1:9",
                PROTOCOLS["generate"],
                "m",
                "up-x",
                JOB,
                lambda e: None,
                2.0,
                {},
            )
            try:
                await call.start()
            except BusError as e:
                return e
        raise AssertionError("a server that is not there answered")

    assert "up-x" in str(asyncio.run(gone()))


def test_a_stream_that_breaks_mid_answer_is_the_servers_failure() -> None:
    async def dies(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(chunk([5]))
        request.transport.close()  # type: ignore[union-attr]
        return response

    ack, events = asyncio.run(attempt(dies))
    assert ack.accepted
    assert events[0].token_ids == [5]
    assert events[-1].error_code == "unavailable" and events[-1].worker_id == "up-x"


def test_the_reuse_expected_is_the_servers_own_cache_then_the_storage_tiers() -> None:
    route = RouteRequest("r", 200, 32, counts={memory_location("up-a"): 2, STORE: 5})
    assert expected_reuse(route, "up-a") == {"memory": 64, "storage": 96}
    assert expected_reuse(route, "up-b") == {"memory": 0, "storage": 160}
    whole = RouteRequest("r", 64, 32, counts={memory_location("up-a"): 2})
    assert expected_reuse(whole, "up-a") == {"memory": 32, "storage": 0}  # (the last computed)


def test_entries_name_their_model_and_dns_names_their_addresses() -> None:
    assert _entry("http://h:8000") == ("smollm2-135m-instruct", "http://h:8000")
    assert _entry("tiny=dns://vllm:8000") == ("tiny", "dns://vllm:8000")
    assert asyncio.run(_addresses("dns://localhost:8001")) == ["http://127.0.0.1:8001"]
    assert asyncio.run(_addresses("dns://no-such-name.invalid:1")) is None
    with pytest.raises(ValueError, match="upstreams: 'vllm:8000' is not"):
        UpstreamSettings(upstreams=["vllm:8000"])


def test_prompt_scores_are_refused_before_the_server_is_asked() -> None:
    """Servers stream their answers, and vLLM's and SGLang's streams carry no prompt
    log-probabilities: a 400 naming the field, nothing sent."""
    asked = []

    async def handler(request: web.Request) -> web.Response:
        asked.append(request)
        return web.json_response({})

    scored = replace(JOB, sampling=replace(JOB.sampling, prompt_logprobs=1))
    err, events = asyncio.run(attempt(handler, job=scored))
    assert isinstance(err, ApiError) and err.status == 400 and err.param == "prompt_logprobs"
    assert not asked and not events

"""Token links (shared/bus/tokens.py) over a real socket: a router's listener and a worker's
links in one event loop."""

from __future__ import annotations

import asyncio
import json

import pytest

from shared.bus import tokens
from shared.bus.tokens import TokenLinks, TokenServer
from shared.messages.generate import GenerateTask
from shared.messages.sampling import SamplingParams

SUBJECT = "kvmesh.replies.router-0"


def task(address: str, key: str, rid: str = "r") -> GenerateTask:
    return GenerateTask(
        request_id=rid,
        model="tiny",
        sampling=SamplingParams(),
        reply_subject=SUBJECT,
        reply_address=address,
        reply_key=key,
        decode_id="decode-0",
        decode_kv_address="127.0.0.1:1",
        deadline=0.0,
    )


async def until(check, what: str, timeout_s: float = 5.0) -> None:  # noqa: ANN001
    try:
        async with asyncio.timeout(timeout_s):
            while not check():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}") from None


class Router:
    """A listener, what it was sent, and the links it saw close."""

    def __init__(self, key: str = "the-key") -> None:
        self.got: list[dict] = []
        self.lost: list[str] = []
        self.server = TokenServer(
            key,
            on_message=lambda payload: self.got.append(json.loads(payload)),
            on_lost=self.lost.append,
        )


async def test_events_sent_in_bursts_arrive_each_requests_in_order_and_none_lost() -> None:
    router = Router()
    await router.server.start("127.0.0.1", 0, "127.0.0.1")
    links = TokenLinks("decode-0")
    links.learn(task(router.server.address, router.server.key))
    try:
        assert not await links.send(SUBJECT, b"{}")  # not up yet: the caller uses NATS
        await until(lambda: router.server.links, "the link up")
        sent = 0
        for burst in range(50):  # bursts of messages in one event-loop turn (coalesced)
            for rid in range(5):
                message = {"rid": rid, "index": burst, "pad": "x" * (burst * 97 % 5000)}
                assert await links.send(SUBJECT, json.dumps(message).encode())
                sent += 1
            if burst % 7 == 0:
                await asyncio.sleep(0)
        await until(lambda: len(router.got) == sent, "every message")
        for rid in range(5):
            assert [m["index"] for m in router.got if m["rid"] == rid] == list(range(50))
    finally:
        links.close()
        await router.server.stop()
    assert router.lost == []  # (a listener stopping is no link lost)


async def test_a_link_without_the_routers_key_delivers_nothing() -> None:
    router = Router()
    await router.server.start("127.0.0.1", 0, "127.0.0.1")
    links = TokenLinks("decode-0")
    links.learn(task(router.server.address, "not-the-key"))
    try:
        for _ in range(30):  # (it connects, is closed, and stays on NATS)
            assert not await links.send(SUBJECT, b'{"forged": true}')
            await asyncio.sleep(0.02)
        assert router.got == [] and router.server.links == {}
    finally:
        links.close()
        await router.server.stop()


async def test_a_link_the_router_closes_is_told_and_the_worker_connects_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tokens, "RETRY_S", 0.1)
    router = Router()
    await router.server.start("127.0.0.1", 0, "127.0.0.1")
    links = TokenLinks("decode-0")
    links.learn(task(router.server.address, router.server.key))
    try:
        await links.send(SUBJECT, b"{}")
        await until(lambda: router.server.links, "the link up")
        router.server.drop_all()
        await until(lambda: router.lost == ["decode-0"], "the router told")

        async def sent_on_the_link() -> bool:
            return await links.send(SUBJECT, b'{"after": true}')

        async with asyncio.timeout(5):  # NATS meanwhile, then the link again
            while not await sent_on_the_link():
                await asyncio.sleep(0.02)
        await until(lambda: {"after": True} in router.got, "a message on the new link")
    finally:
        links.close()
        await router.server.stop()

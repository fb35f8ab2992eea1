"""A worker's KV events on a real NATS: blocks of new KV computed wait for the "stored" events
that announce them, oldest first, so an earlier computation's late event never hides a later
one's silence (a quiet engine feed is told by how long its blocks have waited)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from shared.bus import subjects
from shared.kvindex.publisher import KvEventPublisher
from shared.messages.kvevents import STORE, memory_location
from tests.procs import connect_as

HERE = memory_location("v-0")


def hashes(n: int, seed: int) -> list[str]:
    return [f"{seed:02x}{i:030x}" for i in range(n)]


async def test_new_blocks_wait_for_their_own_announcement(
    nats_url: str, mesh_secrets: Path
) -> None:
    async with AsyncExitStack() as stack:
        bus = await connect_as(nats_url, "decode", mesh_secrets)
        stack.push_async_callback(bus.close)
        await bus.ensure_stream(
            subjects.KV_EVENTS_STREAM, [subjects.KV_EVENTS_ALL], create_only=True
        )  # (as a worker does: it may not change the stream)
        now = [100.0]  # the publisher's clock, moved by the test
        events = KvEventPublisher(
            bus, "decode", "v-0", epoch=1.0, bound_s=0.3, clock=lambda: now[0]
        )
        assert events.unannounced_s() == 0.0
        events.computed(3, HERE)  # request A
        now[0] += 0.05
        events.computed(3, HERE)  # request B, whose events will never come
        now[0] += 0.01
        await events.publish("stored", HERE, hashes(3, 1))  # A's, late
        assert events.unannounced_s() == pytest.approx(0.01)  # B's wait, from when B computed
        await events.publish("stored", STORE, hashes(3, 1))  # the storage tier's: not B's
        now[0] += 0.4
        assert events.unannounced_s() == pytest.approx(0.41)  # past the bound: flagged
        # Events flow again: B's blocks, older than the bound before this event, are not
        # to be announced any more; the new request's are, and are.
        events.computed(2, HERE)
        now[0] += 0.02
        await events.publish("removed", HERE, hashes(1, 1))
        assert events.unannounced_s() == pytest.approx(0.02)
        await events.publish("stored", HERE, hashes(2, 2))
        assert events.unannounced_s() == 0.0
        assert (events.made, events.lost) == (4, 0)


async def test_an_event_that_comes_before_its_blocks_are_told_computed_announces_them(
    nats_url: str, mesh_secrets: Path
) -> None:
    """vLLM's cache events and its answers are two streams: the event for a prompt's blocks
    may come before the worker tells what it computed. Those blocks are announced; a quiet
    feed is still told once what came ahead is older than the bound."""
    async with AsyncExitStack() as stack:
        bus = await connect_as(nats_url, "decode", mesh_secrets)
        stack.push_async_callback(bus.close)
        await bus.ensure_stream(
            subjects.KV_EVENTS_STREAM, [subjects.KV_EVENTS_ALL], create_only=True
        )  # (as a worker does: it may not change the stream)
        now = [100.0]
        events = KvEventPublisher(
            bus, "decode", "v-0", epoch=1.0, bound_s=0.3, clock=lambda: now[0]
        )
        await events.publish("stored", HERE, hashes(3, 1))  # the engine's event, first
        now[0] += 0.01
        events.computed(3, HERE)  # then the answer's first token
        now[0] += 1.0
        assert events.unannounced_s() == 0.0
        await events.publish("stored", HERE, hashes(2, 2))  # ahead, and never told computed
        now[0] += 0.5
        events.computed(2, HERE)  # the feed went quiet: what came ahead is too old to count
        now[0] += 0.4
        assert events.unannounced_s() == pytest.approx(0.4)

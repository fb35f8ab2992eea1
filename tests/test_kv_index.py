"""Every router keeps the block index itself (real processes, real NATS): it routes by its
own copy with cachemeta frozen or killed, a router started mid-run finds the same blocks, a
worker whose KV events are cut while it keeps answering (a fault hook, or nats-server's
permissions reloaded) is flagged and routed by load until a resync makes its feed whole, two
routers decide alike, and a block used through one router only
is kept alive everywhere against its TTL."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from kvmesh.natsserver import NatsServer
from shared.bus import subjects
from shared.messages.kvevents import STORE
from tests.procs import get_json, wait_until
from tests.stack import Stack


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("cachemeta-0", "router-0", "prefill-0", "prefill-1", "decode-0"),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
        KVMESH_ROUTER_TOUCH_INTERVAL_S="0.5",
        KVMESH_CACHEMETA_SNAPSHOT_INTERVAL_S="2",
        KVMESH_CACHEMETA_GC_INTERVAL_S="1",
        KVMESH_FAULT_HOOKS="true",  # (a test cuts a worker's KV events)
    )


def conversation(seed: int, n: int = 600) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(n)]


def route(stack: Stack, ids: list[int], url: str = "") -> dict:
    """The routing decision of a request, every candidate explained."""
    client = stack.client(url) if url else stack.client()
    r = client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=1,
        temperature=0,
        extra_headers={"x-kvmesh-explain": "all"},
    )
    return r.model_extra["kvmesh"]["route"]


def memory(decision: dict) -> dict[str, int]:
    return {c["worker"]: c["memory_tokens"] for c in decision["candidates"]}


def router_health(stack: Stack, url: str = "") -> dict:
    _, body = get_json(f"{url or stack.url}/health")
    return body


def in_memory_of(stack: Stack, ids: list[int]) -> str:
    """The worker whose memory tier holds the prompt's blocks, once the routers know it."""
    hashes = stack.hashes(ids)
    found: list[str] = []

    def held() -> bool:
        counts = stack.lookup(hashes) or {}
        found[:] = [loc[4:] for loc, n in counts.items() if loc != STORE and n == len(hashes)]
        return bool(found)

    wait_until(held, 30, what="the prompt's blocks in a worker's memory tier")
    return found[0]


def home_of(stack: Stack, seed: int) -> tuple[list[int], str]:
    """A conversation run once, and the worker that holds it."""
    ids = conversation(seed)
    route(stack, ids)
    return ids, in_memory_of(stack, ids)


def test_routing_goes_on_by_the_routers_own_index_while_cachemeta_is_frozen_or_killed(
    stack: Stack,
) -> None:
    ids, home = home_of(stack, 1)
    cachemeta = stack.procs["cachemeta-0"]
    cachemeta.signal(signal.SIGSTOP)
    try:
        decision = route(stack, ids + conversation(2, 100))
        assert decision["chosen"] == home and memory(decision)[home] >= 512
    finally:
        cachemeta.signal(signal.SIGCONT)
    cachemeta.signal(signal.SIGKILL)
    cachemeta.wait(10)
    # Blocks stored while it is gone are indexed by the routers all the same.
    fresh = conversation(3)
    before = router_health(stack)["kv_index"]["blocks"]
    first = route(stack, fresh)
    wait_until(  # (the new blocks' events: stored behind the first token)
        lambda: router_health(stack)["kv_index"]["blocks"] >= before + 9,
        30,
        what="the new blocks in the router's index",
    )
    decision = route(stack, fresh + conversation(4, 100))
    assert decision["chosen"] == first["chosen"] and memory(decision)[first["chosen"]] >= 512
    # Restarted, cachemeta catches up from its snapshot and the stream.
    stack.start("cachemeta-0")
    stack.wait_ready(["cachemeta-0"])
    assert in_memory_of(stack, fresh) == first["chosen"]


def test_a_router_started_mid_run_finds_the_same_blocks(stack: Stack) -> None:
    ids, home = home_of(stack, 5)
    wait_until(  # a snapshot is taken with them; more blocks come after it
        lambda: set(stack.hashes(ids)) <= stack.snapshot_hashes(),
        30,
        what="the conversation in cachemeta's snapshot",
    )
    later, later_home = home_of(stack, 6)
    url = stack.router("router-1")
    index = router_health(stack, url)["kv_index"]
    assert index["caught_up"] and index["blocks"] >= 2 * 9 and index["start_s"] < 10
    for prompt, where in ((ids, home), (later, later_home)):
        decision = route(stack, prompt + conversation(7, 64), url)
        assert decision["chosen"] == where and memory(decision)[where] >= 512


def test_two_routers_given_the_same_events_decide_alike(stack: Stack) -> None:
    """Prompts whose full blocks are held already (so asking changes no index): each asked of
    both routers, their decisions and what they say each worker holds are the same."""
    url = stack.router("router-2")
    held = [home_of(stack, seed)[0] for seed in (11, 12, 13)]
    for ids in held:
        for blocks in (3, 6, 9):
            prompt = ids[: blocks * 64] + [7] * 10  # (a partial block is never stored)
            a, b = route(stack, prompt), route(stack, prompt, url)
            assert a["chosen"] == b["chosen"]
            assert memory(a) == memory(b) and max(memory(a).values()) == blocks * 64
            stored = {c["worker"]: c["storage_tokens"] for c in a["candidates"]}
            assert stored == {c["worker"]: c["storage_tokens"] for c in b["candidates"]}


def fault(stack: Stack, sid: str, name: str, on: bool) -> None:
    import urllib.request

    url = f"{stack.advertised(sid)}/faults/{name}"
    urllib.request.urlopen(urllib.request.Request(url, method="PUT" if on else "DELETE"), timeout=5)


def test_a_worker_whose_events_are_cut_is_flagged_routed_by_load_then_resynced(
    stack: Stack,
) -> None:
    ids, hooked = home_of(stack, 21)
    fault(stack, hooked, "kv_events", on=True)
    try:
        cut_at = time.monotonic()
        # It keeps answering: the conversation's next turn goes to it (its memory tier still
        # trusted), and the new blocks it computes make events that never come.
        assert route(stack, ids + conversation(30, 200))["chosen"] == hooked
        wait_until(
            lambda: hooked in router_health(stack)["kv_index"]["stale"],
            10,
            what="the cut feed flagged",
        )
        flagged_s = time.monotonic() - cut_at
        health = router_health(stack)
        assert (
            health["status"] == "degraded"
            and "have not come" in health["kv_index"]["stale"][hooked]
        )
        # Its memory tier is unknown now: the conversation it holds is routed by load.
        decision = route(stack, ids + conversation(40, 64))
        assert memory(decision)[hooked] == 0
    finally:
        fault(stack, hooked, "kv_events", on=False)
    # The router asks for a resync; once its events are whole, its memory counts again.
    wait_until(
        lambda: hooked not in router_health(stack)["kv_index"]["stale"],
        30,
        what="the feed whole again after a resync",
    )
    assert "KV events resync" in stack.procs[hooked].output()
    # (the turn routed by load may have put the prefix on another worker too: either may take
    # the next turn, from memory)
    decision = route(stack, ids + conversation(41, 64))
    held = memory(decision)
    assert held[hooked] >= 512 and held[decision["chosen"]] >= 512, decision
    print(f"stopped feed flagged in {flagged_s:.1f} s")


def reload(server: NatsServer, config: str) -> None:
    """nats-server given ``config`` (SIGHUP), once its log says it reloaded."""
    assert server.log_file is not None
    done = server.log_file.read_text().count("Reloaded server configuration")
    server.config.write_text(config)
    os.kill(server.pid, signal.SIGHUP)
    wait_until(
        lambda: server.log_file.read_text().count("Reloaded server configuration") > done,
        10,
        what="nats-server to reload its configuration",
    )


def test_a_worker_nats_will_not_let_publish_its_events_is_flagged_then_made_whole(
    stack: Stack, nats_server: NatsServer
) -> None:
    """The real fault behind a lost event: nats-server's configuration, reloaded, no longer
    lets the prefill role publish its KV events. The worker says what NATS refused, routers
    flag its tier stale; the permission given back, the feed is whole again."""
    subject = json.dumps(subjects.kv_events("prefill")) + ", "
    config = nats_server.config.read_text()
    assert subject in config
    ids, holder = home_of(stack, 51)
    reload(nats_server, config.replace(subject, "", 1))
    try:
        # Its next turn goes to it (its tier still trusted): new blocks, their event refused.
        assert route(stack, ids + conversation(52, 128))["chosen"] == holder
        wait_until(
            lambda: (
                f"permissions violation for publish to {subject[:-2]}"
                in stack.procs[holder].output()
            ),
            30,
            what="the worker to say NATS refused its KV events",
        )
        wait_until(
            lambda: holder in router_health(stack)["kv_index"]["stale"],
            15,
            what="the refused feed flagged",
        )
    finally:
        reload(nats_server, config)
    route(stack, ids + conversation(53, 64))  # (an event that comes asks for the resync)
    wait_until(
        lambda: not router_health(stack)["kv_index"]["stale"],
        60,
        what="the feed whole again",
    )


def test_touches_through_one_router_keep_a_block_alive_everywhere(stack: Stack) -> None:
    """With a chat TTL of 6 s, a conversation used every 2 s through router-1 only outlives
    it (at cachemeta, in the storage tier and in router-0's index); one left alone expires."""
    stack.procs["cachemeta-0"].stop()
    stack.start("cachemeta-0", KVMESH_CACHEMETA_TTL_CHAT_S="6")
    stack.wait_ready(["cachemeta-0"])
    other = stack.router("router-3")
    used, left = conversation(50), conversation(51)
    route(stack, used, other)
    route(stack, left, other)
    used_hashes, left_hashes = stack.hashes(used), stack.hashes(left)
    wait_until(lambda: (stack.lookup(left_hashes) or {}).get(STORE) == 9, 30, what="stored")
    until = time.monotonic() + 12
    while time.monotonic() < until:
        route(stack, used, other)
        time.sleep(2)
    assert (stack.lookup(left_hashes) or {}).get(STORE, 0) == 0  # expired and deleted
    assert left_hashes[0] not in stack.store
    assert (stack.lookup(used_hashes) or {}).get(STORE) == 9
    assert all(h in stack.store for h in used_hashes)
    # Router-0 never saw either used: it applied the touches and the removal all the same.
    kept = route(stack, used + [7] * 10)["candidates"]
    gone = route(stack, left + [7] * 10)["candidates"]
    assert max(c["storage_tokens"] + c["memory_tokens"] for c in kept) >= 512
    assert all(c["storage_tokens"] == 0 for c in gone)

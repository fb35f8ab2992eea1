"""The storage tier and cachemeta through real processes (tiny model): blocks written behind,
reused from files, expired by TTL, evicted by capacity, damaged files caught, the write-behind
queue's overflow counted, cachemeta restarted from its snapshot and the stream, or from the
stream alone when the snapshot is unreadable; cachemeta given malformed events, or failing to
save its snapshot or to delete a file."""

from __future__ import annotations

import asyncio
import signal
import statistics
import time

import msgspec
import openai
import pytest

from shared.bus.subjects import KV_EVENTS_STREAM, kv_events
from shared.messages.kvevents import STORE, KvEvent, KvRecord, pack_events
from tests.procs import connect_as, get_json, metrics, secrets_dir, wait_until
from tests.stack import Stack

BLOCK = 64
IDS = ("cachemeta-0", "router-0", "prefill-0", "decode-0")
# No memory tier: every hit here comes from the files (the memory tier has its own test in
# test_real_model_chat.py); every prompt is prefilled on the prefill worker.
FILES_ONLY = dict(
    KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
    KVMESH_PREFILL_MEMORY_TIER_BYTES="0",
    KVMESH_DECODE_MEMORY_TIER_BYTES="0",
)


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        IDS,
        KVMESH_CACHEMETA_TTL_AGENT_S="2",
        KVMESH_CACHEMETA_GC_INTERVAL_S="0.3",
        KVMESH_CACHEMETA_SNAPSHOT_INTERVAL_S="1",
        **FILES_ONLY,
    )


def prompt_ids(seed: int, n: int = 300) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def complete(stack: Stack, ids: list[int], **headers: str):
    return stack.client().completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_headers=headers
    )


def indexed(stack: Stack, hashes: list[str]) -> int:
    """Leading blocks cachemeta says the storage tier holds (0 while none answers)."""
    return (stack.lookup(hashes) or {}).get(STORE, 0)


def test_blocks_are_written_behind_indexed_and_reused_from_files(stack: Stack) -> None:
    ids = prompt_ids(1)
    first = complete(stack, ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hashes = stack.hashes(ids)
    assert len(hashes) == 4  # 300 tokens: 4 full blocks
    wait_until(lambda: indexed(stack, hashes) == 4, 30, what="4 blocks indexed")
    assert all(h in stack.store for h in hashes)
    again = complete(stack, ids)
    assert again.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
    assert again.model_extra["kvmesh"]["cached_tokens_by_tier"] == {"memory": 0, "storage": 256}
    assert again.choices[0].text == first.choices[0].text
    # Another tenant shares nothing.
    other = complete(stack, ids, **{"x-kvmesh-tenant": "someone-else"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_agent_blocks_expire_files_deleted_and_lookups_stop(stack: Stack) -> None:
    ids = prompt_ids(2)
    complete(stack, ids, **{"x-kvmesh-retention": "agent"})  # TTL 2 s in this stack
    hashes = stack.hashes(ids)
    wait_until(lambda: all(h in stack.store for h in hashes), 30, what="blocks stored")
    # (Not polling with lookups: a lookup is a use, and a use extends the TTL.)
    wait_until(lambda: not any(h in stack.store for h in hashes), 30, what="files deleted")
    assert stack.lookup(hashes) == {}


def test_a_damaged_block_file_is_a_miss_and_the_answer_is_right(stack: Stack) -> None:
    ids = prompt_ids(3)
    first = complete(stack, ids)
    hashes = stack.hashes(ids)
    wait_until(lambda: indexed(stack, hashes) == 4, 30, what="blocks indexed")
    path = stack.store.path(hashes[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the KV: same length, bad checksum
    path.write_bytes(bytes(data))
    again = complete(stack, ids)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == BLOCK  # block 0 only
    # The damaged file was deleted; the blocks were computed again and stored anew.
    wait_until(lambda: indexed(stack, hashes) == 4, 30, what="blocks stored again")
    assert complete(stack, ids).usage.prompt_tokens_details.cached_tokens == 4 * BLOCK


def cachemeta_health(stack: Stack) -> dict:
    return get_json(f"{stack.advertised('cachemeta-0')}/health")[1]


def test_the_event_streams_size_and_bound_are_on_cachemetas_metrics(stack: Stack) -> None:
    """What the earlier tests' events hold on NATS, beside the bound (the default, 2 GiB)."""

    def held() -> dict[str, float]:
        found = metrics(stack.advertised("cachemeta-0"))
        return {
            of: found.get(("kvmesh_stream_bytes", (("of", of), ("stream", KV_EVENTS_STREAM))), 0)
            for of in ("held", "limit")
        }

    figures = wait_until(lambda: (f := held())["held"] > 0 and f, 10, what="the stream's size")
    assert figures["limit"] == 2 << 30 and figures["held"] < figures["limit"]


def test_cachemeta_drops_malformed_events_and_goes_on_indexing(stack: Stack) -> None:
    """Three bad events on the stream, as a buggy worker could publish them: each dropped
    and counted by cachemeta and the router alike; the events after them are applied."""
    good = KvEvent(kind="stored", location=STORE, hashes=["0" * 32], sizes=[1], at=time.time())
    bad = [
        good.to_bytes(),  # JSON: not the stream's encoding
        pack_events([msgspec.structs.replace(KvRecord.of(good), hashes=b"\0" * 15)]),  # short
        pack_events([msgspec.structs.replace(KvRecord.of(good), sizes=b"\1" * 8)]),  # 2 sizes
    ]
    urls = [stack.advertised("cachemeta-0"), stack.url]
    malformed = ("kvmesh_kv_events_malformed_total", ())
    before = [metrics(url).get(malformed, 0) for url in urls]

    async def publish() -> None:
        bus = await connect_as(stack.nats_url, "prefill", secrets_dir(stack.dir))
        try:
            for data in bad:
                await bus.js.publish(kv_events("prefill"), data)
        finally:
            await bus.close()

    asyncio.run(publish())
    for url, was in zip(urls, before, strict=True):
        wait_until(lambda u=url, w=was: metrics(u)[malformed] >= w + 3, 30, what="3 counted")
    ids = prompt_ids(8)
    complete(stack, ids)
    wait_until(lambda: indexed(stack, stack.hashes(ids)) == 4, 30, what="later events applied")
    assert "dropped a malformed KV event" in stack.procs["cachemeta-0"].output()


def test_cachemeta_survives_a_snapshot_that_cannot_be_written(stack: Stack) -> None:
    """Where the snapshot goes is a directory now (its rename fails): cachemeta counts it,
    says so on /health, goes on indexing, and saves again once the path is free."""
    path = stack.snapshot_path
    path.unlink(missing_ok=True)
    (path / "in-the-way").mkdir(parents=True)
    try:
        complete(stack, prompt_ids(9))  # something new to save
        health = wait_until(
            lambda: cachemeta_health(stack)["failing"].get("snapshot") and cachemeta_health(stack),
            30,
            what="the failed snapshot shown",
        )
        assert health["health"] == "degraded" and "not saved" in health["failing"]["snapshot"]
        counted = ("kvmesh_cachemeta_failures_total", (("what", "snapshot"),))
        assert metrics(stack.advertised("cachemeta-0"))[counted] >= 1
    finally:
        (path / "in-the-way").rmdir()
        path.rmdir()
    complete(stack, prompt_ids(10))
    wait_until(lambda: not cachemeta_health(stack)["failing"], 30, what="snapshots saved again")
    assert path.is_file() and stack.snapshot().seq > 0


def test_a_block_file_gc_cannot_delete_stays_indexed_until_it_can(stack: Stack) -> None:
    """An expired agent block whose file is a directory GC cannot unlink: the others go, it
    stays indexed and /health says why; once it can be deleted, the next pass does."""
    ids = prompt_ids(11)
    complete(stack, ids, **{"x-kvmesh-retention": "agent"})  # TTL 2 s in this stack
    hashes = stack.hashes(ids)
    wait_until(lambda: all(h in stack.store for h in hashes), 30, what="blocks stored")
    stuck = stack.store.path(hashes[2])
    stuck.unlink()
    (stuck / "in-the-way").mkdir(parents=True)
    try:
        why = wait_until(
            lambda: cachemeta_health(stack)["failing"].get("gc"), 30, what="the failed GC shown"
        )
        assert "1 of" in why and "could not be deleted" in why
        assert not any(stack.store.path(h).exists() for h in hashes if h != hashes[2])
    finally:
        (stuck / "in-the-way").rmdir()
        stuck.rmdir()
    wait_until(lambda: not cachemeta_health(stack)["failing"], 30, what="GC working again")
    assert stack.lookup(hashes) == {}


def purge_events_before(stack: Stack, seq: int) -> None:
    async def purge() -> None:
        bus = await connect_as(stack.nats_url, "cachemeta", secrets_dir(stack.dir))
        try:
            await bus.js.purge_stream(KV_EVENTS_STREAM, seq=seq)
        finally:
            await bus.close()

    asyncio.run(purge())


def test_an_unreadable_snapshot_is_rebuilt_from_the_stream(stack: Stack) -> None:
    ids = prompt_ids(7)
    complete(stack, ids)
    hashes = stack.hashes(ids)
    wait_until(lambda: indexed(stack, hashes) == 4, 30, what="blocks indexed")
    stack.procs["cachemeta-0"].stop()  # it saves a snapshot on the way out
    stack.snapshot_path.write_text('{"seq": 12, "rows": [[')
    stack.start("cachemeta-0")
    wait_until(lambda: indexed(stack, hashes) == 4, 30, what="the index rebuilt")
    assert "index snapshot unreadable" in stack.procs["cachemeta-0"].output()


def test_cachemeta_restarted_takes_the_snapshot_then_the_stream_after_it(stack: Stack) -> None:
    """Blocks indexed before a snapshot come back from the snapshot alone (their events are
    purged from the stream); blocks indexed after it come back from the stream alone (the
    process is killed before it snapshots again)."""
    before = prompt_ids(4)
    complete(stack, before)
    old = stack.hashes(before)
    wait_until(lambda: indexed(stack, old) == 4, 30, what="blocks indexed")
    stack.procs["cachemeta-0"].stop()  # SIGTERM: the last snapshot is written on the way out
    saved = stack.snapshot()  # (cachemeta stopped: the file stays as it is)
    assert saved is not None and set(old) <= stack.snapshot_hashes()
    purge_events_before(stack, saved.seq + 1)
    stack.start("cachemeta-0", KVMESH_CACHEMETA_SNAPSHOT_INTERVAL_S="3600")
    wait_until(lambda: indexed(stack, old) == 4, 30, what="the index back from the snapshot")

    after = prompt_ids(5)
    complete(stack, after)
    new = stack.hashes(after)
    wait_until(lambda: indexed(stack, new) == 4, 30, what="new blocks indexed")
    stack.procs["cachemeta-0"].signal(signal.SIGKILL)  # no snapshot this time
    stack.procs["cachemeta-0"].wait(10)
    assert not set(new) & stack.snapshot_hashes()
    stack.start("cachemeta-0")
    wait_until(lambda: indexed(stack, old) == 4, 30, what="the index back")
    assert stack.lookup(new) == {STORE: 4}


# -- limits: capacity, the chat class's TTL, the write-behind queue ----------------------------

BLOCK_FILE = 65_552  # a tiny-model block file: 4 layers × K,V × 64 tokens × 2 heads × 16 × 4 B


@pytest.fixture(scope="module")
def small(stacks) -> Stack:
    """Room for 10 blocks in the storage tier; chat blocks kept 3 s."""
    return stacks(
        IDS,
        own_nats=True,
        KVMESH_CACHEMETA_STORE_CAPACITY_BYTES=str(10 * BLOCK_FILE + 1000),
        KVMESH_CACHEMETA_TTL_CHAT_S="3",
        KVMESH_CACHEMETA_GC_INTERVAL_S="0.3",
        **FILES_ONLY,
    )


def test_a_full_storage_tier_evicts_its_least_recent_blocks(small: Stack) -> None:
    prompts = [prompt_ids(20 + i) for i in range(3)]  # 4 blocks each: 12 > 10 × 0.9
    hashes = [small.hashes(ids) for ids in prompts]
    for ids, h in zip(prompts, hashes, strict=True):
        complete(small, ids, **{"x-kvmesh-retention": "agent"})
        wait_until(lambda h=h: all(x in small.store for x in h), 30, what="blocks stored")
    assert sum(f.stat().st_size for f in small.dir.glob("kvstore/*/*.kvb")) > 0
    # Past the high watermark (9 blocks) it goes down to the low one (8): the first prompt's
    # blocks were the least recently used.
    wait_until(lambda: not any(x in small.store for x in hashes[0]), 30, what="evicted")
    assert all(x in small.store for x in hashes[2])
    assert (small.lookup(hashes[0]) or {}).get(STORE, 0) == 0
    assert complete(small, prompts[0]).usage.prompt_tokens_details.cached_tokens == 0


def test_chat_blocks_expire_after_the_chat_ttl(small: Stack) -> None:
    ids = prompt_ids(30)
    complete(small, ids)  # chat is the default class
    hashes = small.hashes(ids)
    wait_until(lambda: all(h in small.store for h in hashes), 30, what="blocks stored")
    wait_until(lambda: not any(h in small.store for h in hashes), 30, what="chat TTL passed")
    assert small.lookup(hashes) == {}


def test_a_conversation_whose_blocks_expired_is_told_so(small: Stack) -> None:
    messages = [
        {"role": "system", "content": "You answer for the harbour master. " * 12},
        {"role": "user", "content": "Which berths are free on the morning tide? " * 5},
    ]
    client = small.client()
    store = small.dir / "kvstore"
    earlier = set(store.glob("*/*.kvb"))
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert first.model_extra["kvmesh"].get("cache_miss") is None
    full_blocks = first.usage.prompt_tokens // 64
    rid = first.id.removeprefix("chatcmpl-")

    def stored() -> set:
        return set(store.glob("*/*.kvb")) - earlier

    wait_until(lambda: len(stored()) >= full_blocks, 30, what="blocks stored")
    wait_until(lambda: not stored(), 30, what="chat TTL passed")
    messages += [
        {"role": "assistant", "content": "Berths 2 and 4."},
        {"role": "user", "content": "Book 4."},
    ]
    again = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    explained = again.model_extra["kvmesh"]["cache_miss"]
    assert explained["kind"] == "evicted_or_expired" and explained["cached_tokens"] == 0
    assert explained["allowed_tokens"] == full_blocks * 64 > 0
    assert explained["earlier_request_id"] == rid
    assert (explained["first_uncached_block"], explained["message"], explained["char"]) == (0, 0, 0)


def test_a_pinned_conversation_outlives_eviction_and_its_ttl_until_its_pin_ends(
    small: Stack,
) -> None:
    """x-kvmesh-cache-ttl-s 8: its blocks stay through the pressure that evicts an unpinned
    prompt's and past the chat class's 3 s, and go once the pin has ended. The router keeps
    no more pinned than the tenant's quota (a conversation's blocks counted once)."""
    pinned, plain = prompt_ids(50), prompt_ids(51)
    complete(small, pinned, **{"x-kvmesh-cache-ttl-s": "8"})
    started = time.monotonic()
    complete(small, plain, **{"x-kvmesh-retention": "agent"})
    kept, gone = small.hashes(pinned), small.hashes(plain)
    wait_until(lambda: all(h in small.store for h in kept), 30, what="pinned blocks stored")
    wait_until(lambda: gone[-1] in small.store, 30, what="the unpinned prompt stored")
    for seed in (52, 53):  # 16 blocks into room for 10: the least recent unpinned go first
        complete(small, prompt_ids(seed), **{"x-kvmesh-retention": "agent"})
    wait_until(lambda: not any(h in small.store for h in gone), 30, what="unpinned evicted")
    assert time.monotonic() - started < 6
    wait_until(lambda: time.monotonic() - started > 4, 10, what="the chat TTL over")
    assert all(h in small.store for h in kept)  # pinned past its class's TTL
    assert complete(small, pinned).usage.prompt_tokens_details.cached_tokens == 4 * 64
    wait_until(lambda: not any(h in small.store for h in kept), 30, what="the pin over")

    url = small.router("router-pins", KVMESH_ROUTER_PINNED_BYTES_PER_TENANT="300000")
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

    def ask(ids: list[int], ttl: str):  # noqa: ANN202
        return client.completions.create(
            model="tiny", prompt=ids, max_tokens=2, extra_headers={"x-kvmesh-cache-ttl-s": ttl}
        )

    ask(prompt_ids(60), "30")  # 4 blocks of 64 KiB and the answer's room: 264,192 bytes
    ask(prompt_ids(60), "30")  # its blocks again: the answer's room only
    with pytest.raises(openai.RateLimitError) as err:
        ask(prompt_ids(61), "30")
    assert err.value.body["param"] == "x-kvmesh-cache-ttl-s"
    assert "past its quota of 300000 bytes (266240 pinned now)" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        ask(prompt_ids(62), "7200")
    assert "at most 3600 s" in str(err.value)


def test_a_full_write_behind_queue_skips_blocks_and_says_so(small: Stack) -> None:
    small.restart("prefill-0", KVMESH_PREFILL_WRITE_QUEUE_BYTES="0")
    small.wait_ready(["prefill-0"])
    try:
        ids = prompt_ids(40)
        resp = complete(small, ids)
        assert resp.choices[0].finish_reason == "length"  # the answer is unharmed
        wait_until(
            lambda: small.health()["prefill-0"]["load"]["kv_write_skips"] == 4,
            30,
            what="4 skipped blocks in prefill-0's heartbeat",
        )
        assert not any(h in small.store for h in small.hashes(ids))
        assert "write-behind queue full: 4 blocks not stored" in small.procs["prefill-0"].output()
    finally:
        small.restart("prefill-0")
        small.wait_ready(["prefill-0"])


# -- write-behind stays off the first token's path ---------------------------------------------


def ttft_ms(client: openai.OpenAI, ids: list[int], tenant: str) -> float:
    started = time.perf_counter()
    stream = client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=2,
        temperature=0,
        stream=True,
        extra_headers={"x-kvmesh-tenant": tenant},
    )
    next(iter(stream))
    took = (time.perf_counter() - started) * 1e3
    stream.close()
    return took


def settled(stack: Stack, ids: list[int], tenant: str, stored: bool) -> bool:
    """The request's work behind the path is done: its decode freed, its blocks indexed."""
    decode_idle = stack.health()["decode-0"]["load"]["kv_blocks_used"] == 0
    return decode_idle and (not stored or indexed(stack, stack.hashes(ids, tenant)) == 15)


def test_write_behind_never_delays_the_first_token(stack: Stack, stacks) -> None:
    """Same prompts (a new tenant each time: nothing cached, 15 blocks written each), storage
    on (the module's stack) and off (one of its own, on a NATS of its own): the first token
    comes as fast. Both stacks run at once and take turns, so a slow moment of this machine
    falls on both alike; each request starts once the previous one's work behind the path is
    done. The bound leaves a loaded machine its noise; the mechanism (the queue never waits
    for the disk) is tests/shared/test_tiers.py's."""
    ids = prompt_ids(6, n=1000)
    off = dict(KVMESH_PREFILL_KV_STORE="false", KVMESH_DECODE_KV_STORE="false")
    runs = {"true": stack, "false": stacks(IDS, own_nats=True, **off, **FILES_ONLY)}
    times: dict[str, list[float]] = {store: [] for store in runs}
    for store, run in runs.items():
        ttft_ms(run.client(), ids, "warm-up")
        wait_until(lambda s=store: settled(runs[s], ids, "warm-up", s == "true"), 30, what="idle")
    for i in range(7):
        for store in ("true", "false") if i % 2 else ("false", "true"):
            times[store].append(ttft_ms(runs[store].client(), ids, f"t{i}"))
            wait_until(
                lambda s=store, i=i: settled(runs[s], ids, f"t{i}", s == "true"),
                30,
                what="the work behind the path done",
            )
    assert any(runs["true"].dir.glob("kvstore/*/*.kvb"))
    assert not any(runs["false"].dir.glob("kvstore/*/*.kvb"))
    medians = {store: statistics.median(t) for store, t in times.items()}
    assert medians["true"] <= medians["false"] * 1.5 + 20, times
    runs["false"].stop()

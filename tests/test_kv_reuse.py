"""The storage tier and cachemeta through real processes (tiny model): blocks written behind,
reused from files, expired by TTL, damaged files caught, cachemeta restarted."""

from __future__ import annotations

import asyncio
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from kvmesh.natsserver import NatsServer
from shared.bus import Bus, BusError, subjects
from shared.kvstore.backend import FileStore
from shared.kvstore.hashing import block_hashes
from shared.messages.kvevents import STORE, LookupReply, LookupRequest
from shared.model.text import load_text_model
from tests.procs import Proc, free_port, service_env, start_service, start_services, wait_until
from tests.test_request_path import workers_ready

BLOCK = 64


def start_stack(nats_url: str, tmp: Path, **extra: str) -> tuple[str, dict[str, Proc], dict]:
    """cachemeta, router, one prefill and one decode worker (ids: <role>-0)."""
    port = free_port()
    env = service_env(
        nats_url,
        tmp,
        KVMESH_ROUTER_HTTP_PORT=str(port),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
        # No memory tier: every hit here comes from the files (the memory tier has its own
        # test in test_real_model_chat.py).
        KVMESH_PREFILL_MEMORY_TIER_BYTES="0",
        KVMESH_DECODE_MEMORY_TIER_BYTES="0",
        **extra,
    )
    procs = start_services(("cachemeta-0", "router-0", "prefill-0", "decode-0"), env, tmp)
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: workers_ready(url) == 2, 60, what="workers ready")
    return url, procs, env


@pytest.fixture(scope="module")
def stack(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("kv-reuse")
    url, procs, env = start_stack(
        nats_server.url,
        tmp,
        KVMESH_CACHEMETA_TTL_AGENT_S="2",
        KVMESH_CACHEMETA_GC_INTERVAL_S="0.3",
        KVMESH_CACHEMETA_SNAPSHOT_INTERVAL_S="1",
    )
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    yield {
        "url": url,
        "procs": procs,
        "env": env,
        "dir": tmp,
        "client": client,
        "nats": nats_server.url,
        "store": FileStore(tmp / "kvstore"),
    }
    for proc in procs.values():
        proc.stop()


def prompt_ids(seed: int, n: int = 300) -> list[int]:
    return [(seed * 7919 + i * 104729) % 40000 + 100 for i in range(n)]


def complete(stack: dict, ids: list[int], **headers: str):
    return stack["client"].completions.create(
        model="tiny", prompt=ids, max_tokens=8, temperature=0, extra_headers=headers
    )


def hashes_of(stack: dict, ids: list[int], tenant: str = "") -> list[str]:
    config = load_text_model("tiny", stack["dir"]).config
    return block_hashes(ids, BLOCK, config.fingerprint, tenant)


def lookup(stack: dict, hashes: list[str]) -> dict[str, int] | None:
    """Cachemeta's answer; None while no cachemeta answers (restarting)."""

    async def ask() -> dict[str, int] | None:
        bus = await Bus.connect(stack["nats"], "test-lookup")
        try:
            reply = await bus.request(
                subjects.CACHEMETA_LOOKUP, LookupRequest.of(hashes), LookupReply, 5.0
            )
            return reply.counts
        except BusError:
            return None
        finally:
            await bus.close()

    return asyncio.run(ask())


def test_blocks_are_written_behind_indexed_and_reused_from_files(stack) -> None:
    ids = prompt_ids(1)
    first = complete(stack, ids)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    hashes = hashes_of(stack, ids)
    assert len(hashes) == 4  # 300 tokens: 4 full blocks
    wait_until(lambda: lookup(stack, hashes).get(STORE) == 4, 10, what="4 blocks indexed")
    assert all(h in stack["store"] for h in hashes)
    again = complete(stack, ids)
    assert again.usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
    assert again.model_extra["kvmesh"]["cached_tokens_by_tier"] == {"memory": 0, "storage": 256}
    assert again.choices[0].text == first.choices[0].text
    # Another tenant shares nothing.
    other = complete(stack, ids, **{"x-kvmesh-tenant": "someone-else"})
    assert other.usage.prompt_tokens_details.cached_tokens == 0


def test_agent_blocks_expire_files_deleted_and_lookups_stop(stack) -> None:
    ids = prompt_ids(2)
    complete(stack, ids, **{"x-kvmesh-retention": "agent"})  # TTL 2 s in this stack
    hashes = hashes_of(stack, ids)
    wait_until(lambda: all(h in stack["store"] for h in hashes), 10, what="blocks stored")
    # (Not polling with lookups: a lookup is a use, and a use extends the TTL.)
    wait_until(lambda: not any(h in stack["store"] for h in hashes), 10, what="files deleted")
    assert lookup(stack, hashes) == {}


def test_a_damaged_block_file_is_a_miss_and_the_answer_is_right(stack) -> None:
    ids = prompt_ids(3)
    first = complete(stack, ids)
    hashes = hashes_of(stack, ids)
    wait_until(lambda: lookup(stack, hashes).get(STORE) == 4, 10, what="blocks indexed")
    path = stack["store"].path(hashes[1])
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte inside the KV: same length, bad checksum
    path.write_bytes(bytes(data))
    again = complete(stack, ids)
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == BLOCK  # block 0 only
    # The damaged file was deleted; the blocks were computed again and stored anew.
    wait_until(lambda: lookup(stack, hashes).get(STORE) == 4, 10, what="blocks stored again")
    assert complete(stack, ids).usage.prompt_tokens_details.cached_tokens == 4 * BLOCK


def test_cachemeta_killed_and_restarted_keeps_its_index(stack) -> None:
    before = prompt_ids(4)
    complete(stack, before)
    old = hashes_of(stack, before)
    wait_until(lambda: lookup(stack, old).get(STORE) == 4, 10, what="blocks indexed")
    time.sleep(1.5)  # in a snapshot now
    after = prompt_ids(5)
    complete(stack, after)  # only in the stream: the kill comes before the next snapshot
    new = hashes_of(stack, after)
    wait_until(lambda: lookup(stack, new).get(STORE) == 4, 10, what="new blocks indexed")
    proc = stack["procs"]["cachemeta-0"]
    proc.signal(signal.SIGKILL)
    proc.wait(10)
    env = {**stack["env"], "KVMESH_SERVICE_ID": "cachemeta-0"}
    stack["procs"]["cachemeta-0"] = start_service("cachemeta", env, stack["dir"], "cachemeta-again")
    wait_until(lambda: (lookup(stack, old) or {}).get(STORE) == 4, 15, what="the index back")
    assert lookup(stack, new) == {STORE: 4}


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


def test_write_behind_never_delays_the_first_token(tmp_path: Path) -> None:
    """Same prompts (a new tenant each time: nothing cached, 15 blocks written each), storage
    on and off: the first token comes as fast. Both stacks run at once (each with a NATS of its
    own) and take turns, so a slow moment of this machine falls on both alike; each request
    starts once the previous one's work behind the path (handoff, files, events) is done."""
    ids = prompt_ids(6, n=1000)
    clients, times = {}, {}
    with ExitStack() as running:
        for store in ("true", "false"):
            (tmp_path / store).mkdir()
            nats = NatsServer("127.0.0.1", free_port(), tmp_path / store / "js")
            nats.start()
            running.callback(nats.stop)
            url, procs, _ = start_stack(
                nats.url,
                tmp_path / store,
                KVMESH_PREFILL_KV_STORE=store,
                KVMESH_DECODE_KV_STORE=store,
            )
            for proc in procs.values():
                running.callback(proc.stop)
            clients[store] = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
            ttft_ms(clients[store], ids, "warm-up")
            times[store] = []
        for i in range(11):
            for store in ("true", "false") if i % 2 else ("false", "true"):
                time.sleep(0.3)
                times[store].append(ttft_ms(clients[store], ids, f"t{i}"))
    assert any((tmp_path / "true" / "kvstore").rglob("*.kvb"))
    assert not any((tmp_path / "false" / "kvstore").rglob("*.kvb"))
    medians = {store: statistics.median(t) for store, t in times.items()}
    assert medians["true"] <= medians["false"] * 1.3 + 3, times

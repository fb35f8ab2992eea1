"""The live router with two prefill workers: a repeated long conversation goes where the
TTFT cost model says, and the response explains the choice."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvmesh.natsserver import NatsServer
from tests.procs import free_port, service_env, start_services, wait_until
from tests.test_kv_reuse import hashes_of, lookup
from tests.test_request_path import workers_ready


@pytest.fixture(scope="module")
def stack(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("live-routing")
    port = free_port()
    env = service_env(
        nats_server.url,
        tmp,
        KVMESH_ROUTER_HTTP_PORT=str(port),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
    )
    ids = ("cachemeta-l", "router-l", "prefill-l0", "prefill-l1", "decode-l")
    procs = start_services(ids, env, tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: workers_ready(url) == 3, 60, what="workers ready")
        yield {"url": url, "nats": nats_server.url, "dir": tmp}
    finally:
        for proc in procs.values():
            proc.stop()


def test_a_repeated_conversation_goes_where_its_prefix_is(stack: dict) -> None:
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    turn1 = [(i * 7919) % 40000 + 100 for i in range(600)]  # 9 full blocks of 64

    def ask(ids: list[int]):
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
        return r, r.model_extra["kvmesh"]

    _, first = ask(turn1)
    route = first["route"]
    assert route["policy"] == "ttft" and len(route["candidates"]) == 2
    assert {"queue_s", "compute_s", "load_s", "ttft_s", "memory_tokens"} <= set(
        route["candidates"][0]
    )
    home = route["chosen"]
    # Once its blocks are indexed in that worker's memory tier, the next turn goes there.
    turn2 = turn1 + [(i * 104729) % 40000 + 100 for i in range(100)]

    hashes = hashes_of(stack, turn1)
    wait_until(
        lambda: (lookup(stack, hashes) or {}).get(f"mem:{home}") == len(hashes),
        15,
        what="turn 1 indexed in its worker's memory tier",
    )
    resp, timing = ask(turn2)
    assert timing["route"]["chosen"] == home
    by_worker = {c["worker"]: c for c in timing["route"]["candidates"]}
    other = next(w for w in by_worker if w != home)
    assert by_worker[home]["memory_tokens"] >= 512 and by_worker[other]["memory_tokens"] == 0
    assert by_worker[home]["ttft_s"] <= by_worker[other]["ttft_s"]
    assert resp.usage.prompt_tokens_details.cached_tokens >= 512


def test_every_candidate_is_explained_on_request(stack: dict) -> None:
    client = openai.OpenAI(base_url=stack["url"] + "/v1", api_key="unused", max_retries=0)
    r = client.completions.create(
        model="tiny", prompt=[5] * 100, max_tokens=1, extra_headers={"x-kvmesh-explain": "all"}
    )
    route = r.model_extra["kvmesh"]["route"]
    assert {c["worker"] for c in route["candidates"]} == {"prefill-l0", "prefill-l1"}
    assert "others" not in route

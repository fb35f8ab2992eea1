"""The real model through the whole mesh: `make run`'s promise, and a two-turn conversation
whose second turn, on another prefill worker, reuses the first from the storage tier."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvmesh.natsserver import NatsServer
from tests.procs import free_port, service_env, start_services, wait_until
from tests.test_request_path import workers_ready

REAL = "smollm2-135m-instruct"

LONG_TEXT = " ".join(
    f"Section {i}: the storage tier keeps every computed block of the conversation so that "
    f"any prefill worker can reuse it later, which saves time on turn {i} and beyond."
    for i in range(1, 26)
)


@pytest.fixture(scope="module")
def real_stack(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("real-chat")
    port = free_port()
    env = service_env(
        nats_server.url,
        tmp,
        KVMESH_ROUTER_HTTP_PORT=str(port),
        KVMESH_PREFILL_MODEL=REAL,
        KVMESH_DECODE_MODEL=REAL,
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",  # the KV moves, as for any real prompt
    )
    ids = ("cachemeta-r", "router-r", "prefill-r0", "prefill-r1", "decode-r")
    procs = start_services(ids, env, tmp)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: workers_ready(url) == 3, 120, what="real-model workers ready")
        yield {"url": url, "procs": procs}
    finally:
        for proc in procs.values():
            proc.stop()


def chat(url: str, messages: list[dict], **headers: str):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(
        model=REAL, messages=messages, max_tokens=40, temperature=0, extra_headers=headers
    )


def test_real_model_names_paris_through_the_mesh(real_stack) -> None:
    url = real_stack["url"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    resp = chat(url, question)
    assert "Paris" in resp.choices[0].message.content
    assert resp.model_extra["kvmesh"]["kv_bytes"] > 0  # prefilled on one worker, decoded on another
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=REAL, messages=question, max_tokens=40, temperature=0, stream=True
        )
    )
    assert streamed == resp.choices[0].message.content


def test_second_turn_on_another_worker_reuses_the_first_from_storage(real_stack) -> None:
    url, procs = real_stack["url"], real_stack["procs"]
    turn1 = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": LONG_TEXT + "\nWhat does the storage tier keep?"},
    ]
    first = chat(url, turn1)
    served = next(w for w in first.model_extra["kvmesh"]["workers"] if w.startswith("prefill"))
    # That worker goes away (its memory tier with it): turn 2 must find turn 1 in the files.
    procs[served].stop()
    wait_until(lambda: workers_ready(url) == 2, 15, what=f"{served} gone")
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Say it in five words."},
    ]
    second = chat(url, turn2)
    timing = second.model_extra["kvmesh"]
    assert served not in timing["workers"]
    cached, prompt = second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens
    assert cached >= 0.9 * prompt, (cached, prompt)
    assert timing["cached_tokens_by_tier"]["storage"] == cached
    # The same conversation computed cold (another tenant shares no blocks) says the same.
    cold = chat(url, turn2, **{"x-kvmesh-tenant": "cold"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == second.choices[0].message.content
    # Asked again on the same worker, turn 2 now comes from its memory tier.
    again = chat(url, turn2)
    assert again.model_extra["kvmesh"]["cached_tokens_by_tier"]["memory"] >= cached

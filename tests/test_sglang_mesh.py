"""The mesh around SGLang workers (``KVMESH_<WORKER>_ENGINE=sglang``), their engine replaced by
``ScriptedSglang`` (tests/stand_ins/sglang: SGLang needs CUDA; its answer is the prompt's own
first tokens, so what reached the engine shows in the answer). Real: the router, cachemeta,
NATS, the worker processes with kvmesh's SGLang engine code, and SGLang's own KV event
recorder and publisher inside the stand-in.

- Aggregated: the decode worker takes whole requests; its heartbeat says SGLang's hash
  scheme and the router hashes the model's prompts in it; the engine's cache events reach
  cachemeta under those hashes, per tenant; a second turn is routed where its prefix is.
- SGLang's own P/D: the prefill worker advertises its engine's bootstrap server, the decode
  worker takes only hand-overs; the prompt reaches the decode engine through a room at the
  prefill engine's bootstrap port (the stand-in's ``fake`` transfer), and the prefill
  worker's reuse figures reach the client.
- LoRA: an adapter loaded at run time is SGLang's own (the stand-in answers an adapter's
  request backwards), its pages indexed under the adapter's own hashes."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.kvstore.hashing import SGLANG
from shared.messages.kvevents import memory_location
from shared.model.text import TextModel
from tests.conftest import REAL
from tests.procs import free_port, get_json, wait_until
from tests.sglang_release import load
from tests.stack import Stack

STAND_IN = str(Path(__file__).resolve().parent / "stand_ins")
DECODE, PREFILL = "decode-sglang", "prefill-sglang"


@pytest.fixture(scope="module")
def release() -> None:
    load()  # (skips where make test did not fetch SGLang's code: the stand-in runs on it)


@pytest.fixture(scope="module")
def aggregated(stacks, release) -> Stack:
    return stacks(
        ("cachemeta-0", "router-0", DECODE),
        KVMESH_DECODE_ENGINE="sglang",
        KVMESH_DECODE_MODEL=REAL,
        KVMESH_PREFILL_MODEL=REAL,
        KVMESH_DECODE_ENABLE_LORA="true",
        KVMESH_DECODE_MAX_LORA_RANK="8",
        PYTHONPATH=STAND_IN,
    )


@pytest.fixture(scope="module")
def disaggregated(stacks, release) -> Stack:
    return stacks(
        ("cachemeta-0", "router-0", PREFILL, DECODE),
        own_nats=True,  # (its workers are not the aggregated stack's kind)
        KVMESH_PREFILL_ENGINE="sglang",
        KVMESH_DECODE_ENGINE="sglang",
        KVMESH_PREFILL_PD_TRANSFER="fake",
        KVMESH_DECODE_PD_TRANSFER="fake",
        KVMESH_PREFILL_BOOTSTRAP_PORT=str(free_port()),
        KVMESH_DECODE_MODEL=REAL,
        KVMESH_PREFILL_MODEL=REAL,
        PYTHONPATH=STAND_IN,
    )


def heartbeat(stack: Stack, sid: str) -> dict:
    """What the worker says of itself (its /health: its heartbeat)."""
    return get_json(f"{stack.advertised(sid)}/health")[1]


def ask(stack: Stack, ids: list[int], tenant: str, max_tokens: int = 5, model: str = REAL):  # noqa: ANN201
    return stack.client().completions.create(
        model=model,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0,
        extra_headers={"x-kvmesh-tenant": tenant},
    )


def test_an_sglang_worker_serves_whole_requests_under_sglangs_hashes(
    aggregated: Stack, real_text: TextModel
) -> None:
    beat = heartbeat(aggregated, DECODE)
    assert beat["load"]["kv_hash"] == SGLANG and not beat["pd_only"]
    ids = list(range(1000, 1200))  # three full blocks of 64
    first = ask(aggregated, ids, "harbour")
    assert first.choices[0].text == real_text.tokenizer.decode(ids[:5])  # the engine's echo
    assert first.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0

    here = memory_location(DECODE)
    hashes = aggregated.hashes(ids, tenant="harbour", model=REAL, scheme=SGLANG)
    wait_until(
        lambda: (aggregated.lookup(hashes) or {}).get(here) == 3,
        20,
        what="SGLang's three pages in cachemeta, under the router's SGLang hashes",
    )
    other = aggregated.hashes(ids, tenant="customs", model=REAL, scheme=SGLANG)
    assert here not in (aggregated.lookup(other) or {})
    assert ask(aggregated, ids, "harbour").model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 192
    assert ask(aggregated, ids, "customs").model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0


def test_sglangs_own_pd_moves_the_prompt_engine_to_engine(
    disaggregated: Stack, real_text: TextModel
) -> None:
    assert heartbeat(disaggregated, DECODE)["pd_only"]
    assert "bootstrap" in heartbeat(disaggregated, PREFILL)["addresses"]
    for n in (300, 20):  # a long prompt, and a short one (never prefilled on decode here)
        ids = list(range(2000, 2000 + n))
        answer = ask(disaggregated, ids, "harbour", max_tokens=4)
        # What the decode engine answers is what it got through the room.
        assert answer.choices[0].text == real_text.tokenizer.decode(ids[:4])
        assert answer.usage.completion_tokens == 4
    again = ask(disaggregated, list(range(2000, 2300)), "harbour", max_tokens=4)
    # The prefill worker's figures: its engine found the prompt's four pages this time.
    assert again.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 256


def test_an_adapter_on_an_sglang_worker_is_sglangs_own_under_its_own_hashes(
    aggregated: Stack, real_text: TextModel, tmp_path: Path
) -> None:
    import requests

    from bench.lora import write_adapter

    spec = write_adapter(tmp_path / "harbour", real_text.config, 8, seed=0)
    body = {"lora_name": "smol-harbour", "lora_path": spec.path}
    loaded = requests.post(f"{aggregated.url}/v1/load_lora_adapter", json=body, timeout=30)
    assert loaded.status_code == 200 and loaded.json()["served_by"] == [DECODE], loaded.text
    try:
        ids = list(range(3000, 3200))  # (three full pages of 64, no other test's)
        first = ask(aggregated, ids, "harbour", model="smol-harbour")
        assert first.choices[0].text == real_text.tokenizer.decode(ids[::-1][:5])  # its LoRA's
        hashes = aggregated.hashes(ids, "harbour", REAL, SGLANG, adapter=spec.digest)
        here = memory_location(DECODE)
        wait_until(
            lambda: (aggregated.lookup(hashes) or {}).get(here) == 3,
            20,
            what="the adapter's three pages in cachemeta, under its own hashes",
        )
        again = ask(aggregated, ids, "harbour", model="smol-harbour")
        assert again.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 192
        base = ask(aggregated, ids, "harbour")  # (the base model shares none of it)
        assert base.choices[0].text == real_text.tokenizer.decode(ids[:5])
        assert base.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0
        wait_until(
            lambda: heartbeat(aggregated, DECODE)["load"]["adapters"] == ["smol-harbour"],
            10,
            what="the adapter loaded in SGLang, in the worker's next beat",
        )
    finally:
        body = {"lora_name": "smol-harbour"}
        requests.post(f"{aggregated.url}/v1/unload_lora_adapter", json=body, timeout=30)

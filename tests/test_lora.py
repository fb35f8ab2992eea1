"""LoRA adapters through a real mesh (tiny model, prefill and decode workers, KV handed over):
an adapter named in the settings and one loaded at run time are served as models of their own
(listed with their base as parent), answer what the engine computes under them, keep their KV
apart from the base model's and from each other's (and share it between their own requests),
and are unloaded at run time; a bad adapter is refused naming its file, the mesh serving on."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
import requests

from shared.engine.torch.loader import load_model
from shared.kvstore.hashing import XXH3, scheme_block_hashes
from shared.messages.sampling import SamplingParams
from shared.model.lora import AdapterSpec, digest_of, kv_fingerprint
from shared.model.text import load_config, load_text_model
from tests.engine.conftest import make_engine
from tests.engine.lora_adapters import peft_adapter, tiny_shaped_base
from tests.procs import metrics, wait_until
from tests.stack import Stack

IDS = ("cachemeta-0", "router-0", "prefill-0", "prefill-1", "decode-0")
PROMPT = [(i * 104729) % 40000 + 100 for i in range(200)]


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    base = tiny_shaped_base()
    dirs = {"fixed": root / "fixed", "loaded": root / "loaded", "bad": root / "bad"}
    peft_adapter(base, dirs["fixed"], seed=1)
    peft_adapter(base, dirs["loaded"], seed=2, targets=["q_proj", "v_proj", "down_proj"])
    peft_adapter(base, dirs["bad"], seed=3)
    config = json.loads((dirs["bad"] / "adapter_config.json").read_text())
    config["target_modules"] = ["q_proj", "lm_head"]
    (dirs["bad"] / "adapter_config.json").write_text(json.dumps(config))
    return dirs


@pytest.fixture(scope="module")
def stack(stacks, adapter_dirs: dict[str, Path]) -> Stack:
    return stacks(
        IDS,
        KVMESH_LORAS=json.dumps({"tiny-fixed": f"tiny:{adapter_dirs['fixed']}"}),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",  # (every prompt's KV handed to decode)
    )


@pytest.fixture(scope="module")
def expected(adapter_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    """What the engine alone answers, greedy, 8 tokens, under each adapter ("": none)."""
    engine = make_engine(load_model("tiny", tmp_path_factory.mktemp("tiny")))
    for name in ("fixed", "loaded"):
        path = adapter_dirs[name]
        engine.register_adapter(AdapterSpec(f"tiny-{name}", "tiny", str(path), digest_of(path)))
    tokenizer = load_text_model("tiny", tmp_path_factory.mktemp("text")).tokenizer
    answers = {}
    for adapter in ("", "tiny-fixed", "tiny-loaded"):
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, adapter=adapter)
        ids = [engine.prefill("s", PROMPT, params).token_id]
        while engine.running:
            ids += [o.token_id for o in engine.step()]
        engine.free("s")
        answers[adapter] = tokenizer.decode(ids)
    assert len(set(answers.values())) == 3, "adapters that change nothing prove nothing"
    return answers


def complete(stack: Stack, model: str) -> tuple[str, int]:
    """The answer's text and its prompt tokens found cached."""
    r = stack.client().completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens


def models(stack: Stack) -> dict[str, str | None]:
    body = requests.get(f"{stack.url}/v1/models", timeout=10).json()
    return {m["id"]: m["parent"] for m in body["data"]}


def post(stack: Stack, path: str, body: dict) -> requests.Response:
    return requests.post(f"{stack.url}{path}", json=body, timeout=30)


def test_an_adapter_is_served_as_its_own_model_with_its_own_kv(
    stack: Stack,
    expected,
    adapter_dirs,  # noqa: ANN001
) -> None:
    assert models(stack) == {"tiny": None, "tiny-fixed": "tiny"}
    assert complete(stack, "tiny-fixed") == (expected["tiny-fixed"], 0)
    # Its own KV: a second request of the adapter reuses the first's, through the tiers...
    text, cached = complete(stack, "tiny-fixed")
    assert text == expected["tiny-fixed"] and cached >= 128
    # ... and the base model shares none of it (nor the adapter the base's).
    assert complete(stack, "tiny") == (expected[""], 0)
    assert complete(stack, "tiny")[1] >= 128
    # In the storage tier, each under its own hashes (the adapter's fingerprint in them).
    config = load_config("tiny", stack.dir)
    digest = digest_of(adapter_dirs["fixed"])
    ours = scheme_block_hashes(XXH3, PROMPT, 64, kv_fingerprint(config.fingerprint, digest), "")
    base = stack.hashes(PROMPT)
    assert wait_until(lambda: all(h in stack.store for h in ours + base), timeout_s=10)
    assert not set(ours) & set(base)
    # The decode worker says it holds the adapter resident (its next heartbeat), and what
    # loading it took.
    wait_until(lambda: stack.health()["decode-0"]["load"]["adapters"] == ["tiny-fixed"], 5)
    found = metrics(stack.health()["decode-0"]["address"])
    assert found[("kvmesh_lora", (("what", "resident"),))] == 1
    assert found[("kvmesh_lora", (("what", "loads"),))] == 1
    assert found[("kvmesh_lora", (("what", "load_seconds"),))] > 0  # (measured)


def test_every_api_format_serves_an_adapter_by_its_name(stack: Stack) -> None:
    import anthropic

    said = "Name three rivers."
    answers = {}
    for model in ("tiny", "tiny-fixed"):
        chat = stack.client().chat.completions.create(
            model=model, messages=[{"role": "user", "content": said}], max_tokens=6, temperature=0
        )
        assert chat.model == model
        messages = anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0)
        message = messages.messages.create(  # (the SDK names no sampling field)
            model=model,
            messages=[{"role": "user", "content": said}],
            max_tokens=6,
            extra_body={"temperature": 0},
        )
        response = stack.client().responses.create(
            model=model, input=said, max_output_tokens=6, temperature=0
        )
        texts = (chat.choices[0].message.content, message.content[0].text, response.output_text)
        assert len(set(texts)) == 1, texts  # (one conversation, whichever format carried it)
        answers[model] = texts[0]
    assert answers["tiny"] != answers["tiny-fixed"]


def test_requests_of_an_adapter_go_to_the_prefill_worker_holding_it(stack: Stack) -> None:
    def resident() -> dict[str, list[str]]:
        health = stack.health()
        return {p: health[p]["load"]["adapters"] for p in ("prefill-0", "prefill-1")}

    # (the test before computed it on one of the two; its heartbeat says so)
    holder = wait_until(
        lambda: [p for p, held in resident().items() if "tiny-fixed" in held], timeout_s=5
    )
    for k in range(4):  # prompts nothing cached favors: balanced, but for the adapter's load
        ids = [(k * 7919 + i * 31) % 40000 + 100 for i in range(200)]
        r = stack.client().completions.create(
            model="tiny-fixed", prompt=ids, max_tokens=2, temperature=0
        )
        assert r.choices[0].text is not None
    assert [p for p, held in resident().items() if "tiny-fixed" in held] == holder
    # ... while prompts of the base model are spread over both
    before = {p: computed(stack, p) for p in ("prefill-0", "prefill-1")}
    for k in range(8):  # (by tokens given each: the one given less first)
        ids = [(k * 6007 + i * 37) % 40000 + 100 for i in range(200)]
        stack.client().completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)
    after = {p: computed(stack, p) for p in ("prefill-0", "prefill-1")}
    assert all(after[p] > before[p] for p in after), (before, after)


def computed(stack: Stack, service: str) -> float:
    """Prompt tokens the worker computed, by its /metrics."""
    found = metrics(stack.health()[service]["address"])
    return found.get(("kvmesh_prefill_tokens_total", (("kind", "computed"),)), 0.0)


def test_an_adapter_loaded_at_run_time_is_served_then_unloaded(
    stack: Stack, expected, adapter_dirs
) -> None:  # noqa: ANN001
    path = str(adapter_dirs["loaded"])
    r = post(stack, "/v1/load_lora_adapter", {"lora_name": "tiny-loaded", "lora_path": path})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["base_model"] == "tiny" and body["rank"] == 4
    assert sorted(body["served_by"]) == ["decode-0", "prefill-0", "prefill-1"]
    assert not body["not_served_by"]
    assert models(stack)["tiny-loaded"] == "tiny"
    assert complete(stack, "tiny-loaded") == (expected["tiny-loaded"], 0)
    assert complete(stack, "tiny-loaded")[1] >= 128
    assert complete(stack, "tiny-fixed")[0] == expected["tiny-fixed"]  # (the other unchanged)

    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "tiny-loaded"})
    assert r.status_code == 200 and r.json()["unloaded"]
    assert "tiny-loaded" not in models(stack)
    with pytest.raises(openai.NotFoundError, match="tiny-loaded"):
        complete(stack, "tiny-loaded")
    r = post(stack, "/v1/unload_lora_adapter", {"lora_name": "tiny-loaded"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_a_bad_adapter_is_refused_naming_its_file(stack: Stack, adapter_dirs, expected) -> None:  # noqa: ANN001
    bad = adapter_dirs["bad"]
    cases = [
        ({"lora_name": "x", "lora_path": str(bad)}, "lora_path", f"{bad}/adapter_config.json"),
        ({"lora_name": "x", "lora_path": "/nonexistent"}, "lora_path", "/nonexistent"),
        ({"lora_name": "x y", "lora_path": str(bad)}, "lora_name", "lora_name"),
        ({"lora_name": "tiny", "lora_path": str(bad)}, "lora_name", "base model's name"),
        ({"lora_name": "tiny-fixed", "lora_path": str(bad)}, "lora_name", "KVMESH_LORAS"),
        ({"lora_name": "x", "lora_path": str(bad), "base_model": "nope"}, "base_model", "nope"),
    ]
    for body, param, said in cases:
        r = post(stack, "/v1/load_lora_adapter", body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and said in error["message"], (body, error)
    assert "x" not in models(stack)
    assert complete(stack, "tiny-fixed")[0] == expected["tiny-fixed"]

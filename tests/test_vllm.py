"""vLLM as a decode engine that owns its KV (`KVMESH_DECODE_ENGINE=vllm`): the real SmolLM2
(its GGUF exported to a Hugging Face directory once per machine) served by a vLLM worker that
takes whole requests (a short prompt is prefilled where it is decoded); what it answers through
the mesh is what vLLM itself answers for the same prompt, token for token (greedy, eager mode).
The stack is the vLLM modules' one (``vllm_mesh``): P/D, and its workers lost, are
test_vllm_pd.py's."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import anthropic
import pytest

from shared.kvstore.hashing import XXH3, scheme_block_hashes
from shared.messages.kvevents import memory_location
from shared.model.catalog import resolve
from shared.model.text import load_config, text_of
from shared.offline import OFFLINE
from tests.conftest import REAL, VLLM_DECODE, VLLM_PREFILLS
from tests.procs import children_of, environment_of, get_json, metrics, wait_until
from tests.stack import Stack
from tests.vllm_answers import OwnVllm, answered_as_vllm

vllm = pytest.importorskip("vllm", reason="the vllm extra (make test installs it)")

WORKER = VLLM_DECODE
PROMPT = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    1780,
    314,
    260,
    3575,
    282,
    4649,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
]  # fmt: skip  (SmolLM2's chat template around "What is the capital of France?")


@pytest.fixture(scope="module")
def vllm_stack(vllm_mesh: Stack) -> Stack:
    return vllm_mesh


@pytest.fixture(scope="module")
def own_answer(vllm_stack: Stack, own_vllm: OwnVllm, started: list[str]) -> list[int]:
    return own_vllm.answer(Path(vllm_stack.dir), PROMPT, started)


@pytest.fixture(scope="module")
def started() -> list[str]:
    """The order two requests queued in vLLM started (``own_greedy_answer``)."""
    return []


def test_the_model_is_served_by_its_vllm_worker_alone(vllm_stack: Stack) -> None:
    client = vllm_stack.client()
    assert REAL in {m.id for m in client.models.list()}
    answer = client.chat.completions.create(
        model=REAL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24,
        temperature=0,
    )
    assert "Paris" in answer.choices[0].message.content
    assert answer.model_extra["kvmesh"]["workers"] == [WORKER]  # short: vLLM does it all


def test_greedy_through_the_mesh_is_vllms_own_answer_token_for_token(
    vllm_stack: Stack, own_answer: list[int]
) -> None:
    assert answered_as_vllm(vllm_stack, PROMPT, own_answer)["workers"] == [WORKER]


def test_a_requests_class_reaches_vllms_scheduler(own_answer: list[int], started: list[str]):  # noqa: ANN201
    """Asked first, the batch-ranked request starts after the priority one queued later."""
    assert own_answer and started == ["high", "low"]


def test_the_anthropic_and_responses_formats_get_the_same_answer(vllm_stack: Stack) -> None:
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = vllm_stack.client().chat.completions.create(
        model=REAL, messages=question, max_tokens=24, temperature=0
    )
    messages = anthropic.Anthropic(base_url=vllm_stack.url, api_key="none").messages.create(
        model=REAL, messages=question, max_tokens=24, extra_body={"temperature": 0}
    )
    responses = vllm_stack.client().responses.create(
        model=REAL, input=question, max_output_tokens=24, temperature=0
    )
    text = chat.choices[0].message.content
    assert messages.content[0].text == text
    assert responses.output_text == text


BERTH = {
    "type": "object",
    "properties": {"berth": {"type": "integer", "minimum": 1, "maximum": 12}},
    "required": ["berth"],
    "additionalProperties": False,
}


def test_structured_outputs_and_a_forced_tool_call_are_vllms_to_keep(vllm_stack: Stack) -> None:
    client = vllm_stack.client()
    question = [{"role": "user", "content": "Which berth is free? Answer as JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "berth", "schema": BERTH}}
    answer = client.chat.completions.create(
        model=REAL, messages=question, response_format=fmt, max_tokens=30, temperature=0.8, seed=3
    )
    assert 1 <= json.loads(answer.choices[0].message.content)["berth"] <= 12
    tools = [{"type": "function", "function": {"name": "book_berth", "parameters": BERTH}}]
    called = client.chat.completions.create(
        model=REAL, messages=question, tools=tools, tool_choice="required", max_tokens=40
    )
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "book_berth"
    assert 1 <= json.loads(call.function.arguments)["berth"] <= 12


def test_seeds_logprobs_and_stop_strings(vllm_stack: Stack) -> None:
    client = vllm_stack.client()
    question = [{"role": "user", "content": "Tell me about the sea."}]

    def ask(**options):
        return client.chat.completions.create(
            model=REAL, messages=question, max_tokens=20, **options
        )

    a, b = ask(temperature=1.0, seed=11), ask(temperature=1.0, seed=11)
    assert a.choices[0].message.content == b.choices[0].message.content  # vLLM's per-request seed
    scored = ask(temperature=0, logprobs=True, top_logprobs=2)
    content = scored.choices[0].logprobs.content
    assert len(content) == scored.usage.completion_tokens
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in content)
    reference = ask(temperature=0).choices[0].message.content
    stop = reference.split()[2]
    cut = ask(temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == reference[: reference.index(stop)]


def test_the_sampling_extensions_are_applied_by_vllm(vllm_stack: Stack) -> None:
    """ignore_eos, min_tokens, stop_token_ids, repetition_penalty and min_p, as vLLM's own
    sampler applies them."""
    client = vllm_stack.client()
    eos = text_of(resolve(REAL, {}), Path(vllm_stack.dir)).config.eos_ids[0]

    def ask(**options):
        out = client.completions.create(
            model=REAL, prompt=PROMPT, max_tokens=8, **{"temperature": 0, **options}
        )
        return out.choices[0], out.usage.completion_tokens

    to_end = {str(eos): 100}
    assert ask(logit_bias=to_end)[0].finish_reason == "stop"
    held, count = ask(logit_bias=to_end, extra_body={"ignore_eos": True})
    assert (held.finish_reason, count) == ("length", 8)
    least, count = ask(logit_bias=to_end, extra_body={"min_tokens": 3})
    assert least.finish_reason == "stop" and 3 <= count <= 4  # (vLLM counts its end token)
    stopped, count = ask(logit_bias={"77": 100}, extra_body={"stop_token_ids": [77]})
    assert stopped.finish_reason == "stop" and count == 1
    forced = ask(logit_bias={"77": 100})[0].text
    penalized = ask(logit_bias={"77": 100}, extra_body={"repetition_penalty": 10})[0].text
    assert len(set(forced)) == 1 and penalized[0] == forced[0] and forced[0] not in penalized[1:]
    greedy = ask()[0].text
    assert ask(temperature=1, seed=5, extra_body={"min_p": 1.0})[0].text == greedy


def test_several_answers_and_the_prompt_scored_through_vllm(vllm_stack: Stack) -> None:
    """n and batched prompts (each candidate a request of its own, vLLM's prefix cache
    sharing the prompt), echo with logprobs and max_tokens 0 (vLLM computes the prompt's
    scores, its cache skipped for them), and vLLM's prompt_logprobs."""
    client = vllm_stack.client()
    ask = {"model": REAL, "max_tokens": 6, "temperature": 0}
    one = client.completions.create(prompt=PROMPT, **ask).choices[0].text
    other = client.completions.create(prompt="The harbour at dawn", **ask).choices[0].text
    both = client.completions.create(prompt=[PROMPT, PROMPT[:20]], n=2, **ask)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == one
    batch = client.completions.create(prompt=["The harbour at dawn", "x"], **ask)
    assert batch.choices[0].text == other
    scored = client.completions.create(
        model=REAL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1
    ).choices[0]
    values = scored.logprobs.token_logprobs
    assert values[0] is None and len(values) == len(PROMPT)
    assert all(v <= 0 for v in values[1:]) and scored.logprobs.tokens
    listed = client.completions.create(
        prompt=PROMPT, extra_body={"prompt_logprobs": 0}, **ask
    ).choices[0]
    entries = listed.model_extra["prompt_logprobs"]
    assert entries[0] is None
    assert [entries[i][str(PROMPT[i])]["logprob"] for i in range(1, len(PROMPT))] == (
        pytest.approx(values[1:], abs=1e-3)
    )


def test_vllms_cache_is_in_cachemeta_under_kvmeshs_hashes_and_tenants_stay_apart(
    vllm_stack: Stack,
) -> None:
    client = vllm_stack.client()
    ids = list(range(1000, 1200))  # three full blocks of 64

    def ask(tenant: str):
        return client.completions.create(
            model=REAL,
            prompt=ids,
            max_tokens=4,
            temperature=0,
            extra_headers={"x-kvmesh-tenant": tenant},
        )

    first = ask("harbour")
    assert first.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0
    here = memory_location(WORKER)
    hashes = vllm_stack.hashes(ids, tenant="harbour", model=REAL)
    wait_until(
        lambda: (vllm_stack.lookup(hashes) or {}).get(here) == 3,
        20,
        what="vLLM's three blocks in cachemeta, under kvmesh's hashes",
    )
    assert ask("harbour").model_extra["kvmesh"]["prompt_cache_hit_tokens"] >= 192  # vLLM's own
    assert ask("customs").model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0  # another salt
    other = vllm_stack.hashes(ids, tenant="nobody", model=REAL)
    assert here not in (vllm_stack.lookup(other) or {})


def test_a_lora_adapter_through_vllm_answers_as_the_torch_engine_computes_it(
    vllm_stack: Stack, tmp_path: Path
) -> None:
    import requests

    from bench.lora import write_adapter
    from shared.engine.interface import EngineOptions
    from shared.engine.torch.engine import TorchEngine
    from shared.engine.torch.loader import load_model
    from shared.messages.sampling import SamplingParams
    from shared.model.lora import kv_fingerprint

    model = load_model(REAL, tmp_path / "state")
    spec = write_adapter(tmp_path / "harbour", model.config, 8, seed=0, b_scale=0.3)
    body = {"lora_name": "smol-harbour", "lora_path": spec.path}
    loaded = requests.post(f"{vllm_stack.url}/v1/load_lora_adapter", json=body, timeout=30)
    assert loaded.status_code == 200, loaded.text
    assert set(loaded.json()["served_by"]) == {*VLLM_PREFILLS, VLLM_DECODE}
    try:
        ids = list(range(2000, 2200))  # (three full blocks of 64, no other test's)
        engine = TorchEngine(model, EngineOptions(block_size=64, kv_cache_tokens=4096))
        engine.register_adapter(replace(spec, name="smol-harbour"))
        expected = {}
        for name in ("", "smol-harbour"):
            params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, adapter=name)
            out = [engine.prefill("s", ids, params).token_id]
            while engine.running:
                out += [o.token_id for o in engine.step()]
            engine.free("s")
            expected[name or REAL] = engine.tokenizer.decode(out)
        assert expected[REAL] != expected["smol-harbour"]

        def ask(name: str):  # noqa: ANN202
            return vllm_stack.client().completions.create(
                model=name,
                prompt=ids,
                max_tokens=10,
                temperature=0,
                extra_body={"ignore_eos": True},
            )

        first = ask("smol-harbour")
        assert first.choices[0].text == expected["smol-harbour"]  # vLLM's LoRA, token for token
        assert first.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0
        # vLLM's cache of it is indexed under the adapter's own hashes...
        fingerprint = kv_fingerprint(load_config(REAL, vllm_stack.dir).fingerprint, spec.digest)
        ours = scheme_block_hashes(XXH3, ids, 64, fingerprint, "")
        wait_until(
            lambda: max((vllm_stack.lookup(ours) or {}).values(), default=0) == 3,
            20,
            what="the adapter's three blocks in cachemeta, under its own hashes",
        )
        assert ask("smol-harbour").model_extra["kvmesh"]["prompt_cache_hit_tokens"] >= 192
        # ... and the base model shares none of it
        base = ask(REAL)
        assert base.choices[0].text == expected[REAL]
        assert base.model_extra["kvmesh"]["prompt_cache_hit_tokens"] == 0
    finally:
        body = {"lora_name": "smol-harbour"}
        requests.post(f"{vllm_stack.url}/v1/unload_lora_adapter", json=body, timeout=30)


def test_a_vllm_worker_whose_cache_events_stop_while_it_computes_is_flagged(
    vllm_stack: Stack,
) -> None:
    """vLLM's cache events are dropped as they come (its feed gone quiet): the worker computes
    new blocks nobody hears of, and the router flags it as stale within a few beats; once its
    events flow again, it is whole. (A prompt of four blocks: computed on a prefill worker,
    each of which has its feed quiet.)"""
    client = vllm_stack.client()

    def stale() -> dict:
        return get_json(f"{vllm_stack.url}/health")[1]["kv_index"]["stale"]

    def fault(on: bool) -> None:
        import urllib.request

        for sid in VLLM_PREFILLS:
            url = f"{vllm_stack.advertised(sid)}/faults/kv_feed"
            request = urllib.request.Request(url, method="PUT" if on else "DELETE")
            urllib.request.urlopen(request, timeout=5)

    assert not set(VLLM_PREFILLS) & set(stale())
    fault(True)
    try:
        answer = client.completions.create(model=REAL, prompt=list(range(5000, 5256)), max_tokens=2)
        computed = answer.model_extra["kvmesh"]["workers"][0]
        assert computed in VLLM_PREFILLS
        wait_until(lambda: computed in stale(), 20, what=f"{computed}'s quiet feed flagged")
        assert "while it computes" in stale()[computed]
    finally:
        fault(False)
    for n in range(8):  # (until the flagged worker computes again: its next events flow)
        again = list(range(6000 + 256 * n, 6256 + 256 * n))
        answer = client.completions.create(model=REAL, prompt=again, max_tokens=2)
        if answer.model_extra["kvmesh"]["workers"][0] == computed:
            break
    wait_until(lambda: computed not in stale(), 30, what=f"{computed}'s feed whole again")


def test_vllms_engine_core_starts_with_usage_reports_and_the_hub_off(vllm_stack: Stack) -> None:
    """The worker was started without them (a test's environment): it sets them itself, so
    vLLM's engine core, its child, runs with no usage report and no Hub look-up."""
    worker = vllm_stack.procs[WORKER]
    assert "VLLM_NO_USAGE_STATS" not in environment_of(worker.pid)
    children = children_of(worker.pid)
    assert children  # (the engine core, and whatever else vLLM started)
    for child in children:
        env = environment_of(child)
        assert {k: env.get(k) for k in OFFLINE} == OFFLINE


def test_a_streamed_answer_closed_early_is_aborted_in_vllm(vllm_stack: Stack) -> None:
    client = vllm_stack.client()
    left = ("/v1/chat/completions", "499")
    before = router_requests(vllm_stack).get(left, 0)
    stream = client.chat.completions.create(
        model=REAL,
        messages=[{"role": "user", "content": "Write a long story about the sea."}],
        max_tokens=2000,
        temperature=0,
        stream=True,
    )
    for n, chunk in enumerate(stream):
        assert not (chunk.choices and chunk.choices[0].finish_reason), "it ended by itself"
        if n == 5:
            break
    wait_until(  # (the worker's heartbeat says so a beat later)
        lambda: vllm_stack.health()[WORKER]["load"]["inflight"] == 1, 5, what="still answering"
    )
    stream.close()
    wait_until(
        lambda: vllm_stack.health()[WORKER]["load"]["inflight"] == 0,
        15,
        what="vLLM running nothing once the client has gone",
    )
    # The router counts it as a client that left before its answer was out.
    wait_until(lambda: router_requests(vllm_stack).get(left, 0) == before + 1, 5, what="a 499")


def router_requests(stack: Stack) -> dict[tuple[str, str], float]:
    """The router's answered requests so far: (endpoint, status) → count."""
    return {
        (dict(labels)["endpoint"], dict(labels)["status"]): value
        for (name, labels), value in metrics(stack.url).items()
        if name == "kvmesh_requests_total"
    }


def test_a_mesh_of_two_engines_routes_each_model_to_its_own(vllm_stack: Stack) -> None:
    torch_workers = ("prefill-tiny", "decode-tiny")
    vllm_stack.start(
        *torch_workers,
        KVMESH_PREFILL_MODEL="tiny",
        KVMESH_DECODE_MODEL="tiny",
        KVMESH_PREFILL_ENGINE="torch",
        KVMESH_DECODE_ENGINE="torch",
    )
    try:
        vllm_stack.wait_ready(torch_workers)
        client = vllm_stack.client()
        assert {REAL, "tiny"} <= {m.id for m in client.models.list()}
        vllm_workers = {WORKER, *VLLM_PREFILLS}
        for model, workers in ((REAL, vllm_workers), ("tiny", set(torch_workers))):
            answer = client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "Hello " * 80}],  # past prefill on decode
                max_tokens=4,
                temperature=0,
            )
            served = answer.model_extra["kvmesh"]["workers"]
            assert len(served) == 2 and set(served) <= workers, (model, served)
    finally:
        for sid in torch_workers:
            vllm_stack.procs[sid].stop()

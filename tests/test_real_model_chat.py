"""The real model through the whole mesh: `make run`'s promise, and a two-turn conversation
whose second turn, on another prefill worker, reuses the first from the storage tier; beside
it, a team's own checkpoint by path (a tiny Qwen2 in a Hugging Face directory) served by
workers of its own in the same mesh."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from tests.checkpoints import hf_checkpoint
from tests.conftest import REAL
from tests.procs import wait_until
from tests.stack import Stack

LONG_TEXT = " ".join(
    f"Section {i}: the storage tier keeps every computed block of the conversation so that "
    f"any prefill worker can reuse it later, which saves time on turn {i} and beyond."
    for i in range(1, 26)
)


OWN = "team-qwen"  # the second model: a checkpoint by path
OWN_WORKERS = ("prefill-own", "decode-own")


@pytest.fixture(scope="module")
def real_stack(stacks, tmp_path_factory: pytest.TempPathFactory) -> Stack:
    checkpoint = tmp_path_factory.mktemp("checkpoint") / "team-qwen"
    hf_checkpoint(checkpoint, "qwen2")
    stack = stacks(
        ("cachemeta-0", "router-0", "prefill-0", "prefill-1", "decode-0"),
        KVMESH_PREFILL_MODEL=REAL,
        KVMESH_DECODE_MODEL=REAL,
        KVMESH_MODELS=json.dumps({OWN: str(checkpoint)}),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",  # the KV moves, as for any real prompt
        KVMESH_DECODE_KV_CACHE_TOKENS="12288",  # room for 8 answers at once (tools below)
    )
    stack.start(*OWN_WORKERS, KVMESH_PREFILL_MODEL=OWN, KVMESH_DECODE_MODEL=OWN)
    stack.wait_ready(OWN_WORKERS)
    return stack


def chat(stack: Stack, messages: list[dict], **headers: str):
    return stack.client().chat.completions.create(
        model=REAL, messages=messages, max_tokens=40, temperature=0, extra_headers=headers
    )


def test_real_model_names_paris_through_the_mesh(real_stack: Stack) -> None:
    client = real_stack.client()
    question = [{"role": "user", "content": "What is the capital of France?"}]
    resp = chat(real_stack, question)
    assert "Paris" in resp.choices[0].message.content
    assert resp.model_extra["kvmesh"]["kv_bytes"] > 0  # prefilled on one worker, decoded on another
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=REAL, messages=question, max_tokens=40, temperature=0, stream=True
        )
    )
    assert streamed == resp.choices[0].message.content


def test_second_turn_on_another_worker_reuses_the_first_from_storage(real_stack: Stack) -> None:
    procs = real_stack.procs
    turn1 = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": LONG_TEXT + "\nWhat does the storage tier keep?"},
    ]
    first = chat(real_stack, turn1)
    served = next(w for w in first.model_extra["kvmesh"]["workers"] if w.startswith("prefill"))
    # That worker goes away (its memory tier with it): turn 2 must find turn 1 in the files.
    procs[served].stop()  # its last heartbeat says "stopped": the router forgets it at once
    wait_until(lambda: served not in real_stack.ready_ids()["prefill"], 30, what=f"{served} gone")
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Say it in five words."},
    ]
    second = chat(real_stack, turn2)
    timing = second.model_extra["kvmesh"]
    assert served not in timing["workers"]
    cached, prompt = second.usage.prompt_tokens_details.cached_tokens, second.usage.prompt_tokens
    assert cached >= 0.9 * prompt, (cached, prompt)
    assert timing["cached_tokens_by_tier"]["storage"] == cached
    # The same conversation computed cold (another tenant shares no blocks) says the same.
    cold = chat(real_stack, turn2, **{"x-kvmesh-tenant": "cold"})
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert cold.choices[0].message.content == second.choices[0].message.content
    # Asked again on the same worker, turn 2 now comes from its memory tier.
    again = chat(real_stack, turn2)
    assert again.model_extra["kvmesh"]["cached_tokens_by_tier"]["memory"] >= cached


# -- tools and structured outputs with the real model ----------------------------------------

TOOLS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "search_web": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 80},
            "results": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
    "send_email": {
        "type": "object",
        "properties": {
            "to": {"type": "string", "maxLength": 60},
            "subject": {"type": "string", "maxLength": 60},
            "body": {"type": "string", "maxLength": 200},
        },
        "required": ["to", "subject", "body"],
        "additionalProperties": False,
    },
}
ASKS = [
    "What's the weather like in {city} today?",
    "Find recent news about {topic}.",
    "Email {person} that the meeting about {topic} moved to Friday.",
    "Is it going to rain in {city} tomorrow? Use fahrenheit.",
    "Look up the population of {city}.",
]
CITIES = ["Oslo", "Lima", "Nairobi", "Osaka", "Porto", "Quebec", "Hanoi", "Perth", "Cork", "Tunis"]
TOPICS = ["solar power", "the harbour strike", "chess", "rail fares", "coral reefs"]
PEOPLE = ["ana@example.com", "raj@example.com", "li@example.com"]


def prompts(n: int) -> list[str]:
    return [
        ASKS[i % len(ASKS)].format(
            city=CITIES[i % len(CITIES)],
            topic=TOPICS[(i // 2) % len(TOPICS)],
            person=PEOPLE[i % len(PEOPLE)],
        )
        for i in range(n)
    ]


def in_parallel(fn, items: list) -> list:  # noqa: ANN001 (one request per item)
    with ThreadPoolExecutor(8) as pool:  # the decode worker batches them
        return list(pool.map(fn, items))


def test_sixteen_forced_tool_calls_all_parse_and_validate(real_stack: Stack) -> None:
    client = real_stack.client()
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOLS.items()
    ]

    def ask(i_prompt: tuple[int, str]):
        i, prompt = i_prompt
        return client.chat.completions.create(
            model=REAL,
            messages=[{"role": "user", "content": prompt}],
            tools=tools,
            tool_choice="required",
            max_tokens=160,
            temperature=0.7,
            seed=i,
        )

    answers = in_parallel(ask, list(enumerate(prompts(16))))  # (two batches of 8)
    valid = 0
    for a in answers:
        (call,) = a.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[call.function.name])
        valid += a.choices[0].finish_reason == "tool_calls"
    assert valid == 16
    # Not one tool for every prompt: the model picks among them.
    assert len({a.choices[0].message.tool_calls[0].function.name for a in answers}) > 1


def test_sixteen_json_schema_answers_all_validate(real_stack: Stack) -> None:
    client = real_stack.client()
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population_millions": {"type": "number", "minimum": 0, "maximum": 50},
            "coastal": {"type": "boolean"},
        },
        "required": ["city", "country", "population_millions", "coastal"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}

    def ask(i: int):
        return client.chat.completions.create(
            model=REAL,
            messages=[{"role": "user", "content": f"Describe {CITIES[i % 10]} as JSON."}],
            response_format=fmt,
            max_tokens=120,
            temperature=0.7,
            seed=i,
        )

    for a in in_parallel(ask, list(range(16))):
        assert a.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(a.choices[0].message.content), schema)


def test_auto_tool_choice_answers_in_text_when_no_tool_is_needed(real_stack: Stack) -> None:
    tools = [
        {"type": "function", "function": {"name": n, "parameters": s}} for n, s in TOOLS.items()
    ]
    answer = real_stack.client().chat.completions.create(
        model=REAL,
        messages=[{"role": "user", "content": "Say hello to me in French, in one word."}],
        tools=tools,
        tool_choice="auto",
        max_tokens=20,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert choice.message.content and "<tool_call>" not in choice.message.content


# -- two models in one mesh (the last tests: the second model's workers stop) ----------------


def test_two_models_each_answered_by_its_own_workers_never_sharing_kv(real_stack: Stack) -> None:
    client = real_stack.client()
    listed = {m.id for m in client.models.list()}
    assert {REAL, OWN} <= listed and "tiny" not in listed  # no worker serves tiny here
    prompt = [{"role": "user", "content": LONG_TEXT[:600] + "\nSummarize."}]

    def ask(model: str):
        return client.chat.completions.create(
            model=model, messages=prompt, max_tokens=8, temperature=0
        )

    real = [ask(REAL), ask(REAL)]
    own = [ask(OWN), ask(OWN)]
    for answer in real:
        assert answer.model == REAL
        assert not set(answer.model_extra["kvmesh"]["workers"]) & set(OWN_WORKERS)
    for answer in own:
        assert answer.model == OWN
        assert set(answer.model_extra["kvmesh"]["workers"]) == set(OWN_WORKERS)
    # The same text, two models: each one's second ask finds its first in the cache, and the
    # first ask of the other model found none of it (its blocks have other hashes).
    assert real[1].usage.prompt_tokens_details.cached_tokens > 0
    assert own[0].usage.prompt_tokens_details.cached_tokens == 0
    assert own[1].usage.prompt_tokens_details.cached_tokens > 0
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        ask("no-such-model")


def test_a_model_whose_workers_are_gone_is_503_naming_it(real_stack: Stack) -> None:
    for sid in OWN_WORKERS:
        real_stack.procs[sid].stop()
    wait_until(
        lambda: not set(OWN_WORKERS) & set(real_stack.health()),
        30,
        what="the second model's workers gone",
    )
    client = real_stack.client()
    with pytest.raises(openai.InternalServerError, match=OWN) as err:
        client.chat.completions.create(
            model=OWN, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert err.value.status_code == 503
    assert OWN not in {m.id for m in client.models.list()}
    paris = chat(real_stack, [{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in paris.choices[0].message.content  # the other model still answers

"""The API formats through real processes, with the official SDKs: Anthropic's Messages
(`anthropic`: whole and streamed, count_tokens, images, stop sequences, errors in Anthropic's
shape) and OpenAI's Responses (`openai`: whole and streamed, stateless refusals); one
conversation renders the same tokens, and hits the same cache, in every format."""

from __future__ import annotations

import base64
import json
import urllib.request
import uuid

import anthropic
import jsonschema
import openai
import pytest

from shared.messages.sampling import SamplingParams
from shared.model.catalog import resolve
from shared.model.text import text_of
from tests.images import data_url, png
from tests.procs import metrics
from tests.stack import TINY_ENCODER, Stack

SYSTEM = "You are a careful assistant for a harbour office. Answer plainly. " * 8


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    # Keep-alives after 2 ms without a token: every stream here has some before its first
    # token, and every SDK must read through them.
    return stacks(
        ("router-0", "cachemeta-0", "prefill-0", "decode-0", "encoder-0"),
        KVMESH_ROUTER_STREAM_PING_S="0.002",
        **TINY_ENCODER,
    )


@pytest.fixture(scope="module")
def client(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120)


GREEDY = {"temperature": 0}  # the SDK names no sampling fields: they go as extra body fields


def test_a_message_whole_and_streamed_is_the_same_answer(client: anthropic.Anthropic) -> None:
    ask = {
        "model": "tiny",
        "max_tokens": 12,
        "system": [{"type": "text", "text": SYSTEM}, {"type": "text", "text": "Be brief."}],
        "messages": [{"role": "user", "content": "Which berth is free today?"}],
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**ask)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert whole.usage.output_tokens == 12
    with client.messages.stream(**ask) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text and text
    assert final.stop_reason == "max_tokens"
    # One count, three fields: the prompt is cache reads + cache writes + the rest.
    counted = client.messages.count_tokens(
        model="tiny", system=ask["system"], messages=ask["messages"]
    ).input_tokens
    for usage in (whole.usage, final.usage):
        parts = usage.input_tokens + usage.cache_read_input_tokens
        assert parts + usage.cache_creation_input_tokens == counted
    # The second time, the prompt's full blocks come from the cache.
    assert final.usage.cache_read_input_tokens == counted // 64 * 64 > 0


def test_a_stop_sequence_ends_the_answer_and_is_named(client: anthropic.Anthropic) -> None:
    ask = {
        "model": "tiny",
        "max_tokens": 24,
        "messages": [{"role": "user", "content": "List the ships due this week."}],
        "extra_body": GREEDY,
    }
    reference = client.messages.create(**ask).content[0].text
    words = reference.split()
    assert len(words) > 3
    stop = words[3]
    cut = client.messages.create(**ask, stop_sequences=["~never~", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == reference[: reference.index(stop)]


def test_an_image_block_is_read_like_an_openai_image_part(
    client: anthropic.Anthropic, stack: Stack
) -> None:
    data = base64.b64encode(png(7)).decode()
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
        {"type": "text", "text": "What is in this picture?"},
    ]
    answer = client.messages.create(
        model="tiny", max_tokens=4, messages=[{"role": "user", "content": content}]
    )
    assert answer.usage.output_tokens == 4
    counted = client.messages.count_tokens(
        model="tiny", messages=[{"role": "user", "content": content}]
    )
    chat = stack.client().chat.completions.create(
        model="tiny",
        max_tokens=1,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            }
        ],
    )
    assert counted.input_tokens == chat.usage.prompt_tokens


def test_one_conversation_renders_the_same_in_both_apis_and_hits_the_cache_across_them(
    client: anthropic.Anthropic, stack: Stack
) -> None:
    turns = [
        ("user", "A ship asks for berth 4 at dawn. " * 20),
        ("assistant", "Berth 4 is free from five until noon."),
        ("user", "Then book it, and tell the pilot. " * 10),
    ]
    chat_messages = [{"role": "system", "content": SYSTEM}] + [
        {"role": r, "content": t} for r, t in turns
    ]
    messages = [{"role": r, "content": t} for r, t in turns]
    as_chat = stack.client().chat.completions.create(
        model="tiny", messages=chat_messages, max_tokens=2
    )
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=messages)
    assert counted.input_tokens == as_chat.usage.prompt_tokens
    # The next turn, sent as Messages after the turn sent as Chat: its history is cached.
    messages += [
        {"role": "assistant", "content": "Booked."},
        {"role": "user", "content": "Thank you."},
    ]
    follow = client.messages.create(model="tiny", system=SYSTEM, messages=messages, max_tokens=2)
    assert follow.usage.cache_read_input_tokens >= 0.9 * as_chat.usage.prompt_tokens // 64 * 64


def hf_prompt(stack: Stack, messages: list[dict]) -> list[int]:
    """The prompt as transformers renders and tokenizes it, from the model's own template
    and tokenizer: not kvmesh's renderer."""
    import transformers

    text = text_of(resolve("tiny", {}), stack.dir)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=text.tokenizer)
    tokenizer.chat_template = text.chat_template.source
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def test_one_conversation_is_the_same_tokens_in_every_format(
    client: anthropic.Anthropic, stack: Stack
) -> None:
    """Chat, Messages, Responses and count_tokens give the prompt transformers renders,
    token for token: the same count, and the same greedy answer as its ids sent raw (a
    different token anywhere would change the answer of the tiny model's random weights)."""
    turns = [
        {"role": "user", "content": "Tide at berth 7?"},
        {"role": "assistant", "content": "High water at 14:10."},
        {"role": "user", "content": "And the pilot, is she free then?"},
    ]
    ids = hf_prompt(stack, [{"role": "system", "content": SYSTEM}, *turns])
    oai = stack.client()
    raw = oai.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    chat = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": SYSTEM}, *turns],
        max_tokens=8,
        temperature=0,
    )
    message = client.messages.create(
        model="tiny", system=SYSTEM, messages=turns, max_tokens=8, extra_body=GREEDY
    )
    response = oai.responses.create(
        model="tiny", instructions=SYSTEM, input=turns, max_output_tokens=8, temperature=0
    )
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=turns)
    used = message.usage
    assert raw.usage.prompt_tokens == len(ids)
    assert chat.usage.prompt_tokens == response.usage.input_tokens == len(ids)
    assert counted.input_tokens == len(ids)
    assert used.input_tokens + (used.cache_read_input_tokens or 0) == len(ids)
    answer = raw.choices[0].text
    assert chat.choices[0].message.content == answer
    assert message.content[0].text == answer and response.output_text == answer


@pytest.mark.parametrize(
    "change, error, says",
    [
        ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
        ({"frobnicate": 1}, anthropic.BadRequestError, "frobnicate: not a field"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 64}},
            anthropic.BadRequestError,
            "thinking",
        ),
        (
            {"tools": [{"name": "x", "input_schema": {"type": "object"}, "type": "bash_2025"}]},
            anthropic.BadRequestError,
            "tools",
        ),
        ({"stop_sequences": [""]}, anthropic.BadRequestError, "stop_sequences"),
        ({"messages": []}, anthropic.BadRequestError, "messages"),
        ({"model": "no-such-model"}, anthropic.NotFoundError, "no-such-model"),
    ],
)
def test_bad_requests_get_anthropics_error_shape_naming_the_field(
    client: anthropic.Anthropic, change: dict, error: type, says: str
) -> None:
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
    }
    extra = {k: v for k, v in change.items() if k not in body}
    ask = {**body, **{k: v for k, v in change.items() if k in body}}
    with pytest.raises(error) as err:
        client.messages.create(**ask, extra_body=extra)
    assert says in str(err.value)
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] in ("invalid_request_error", "not_found_error")


# -- OpenAI Responses, the third format of the same conversation ------------------------------


def test_responses_whole_and_streamed_and_the_conversation_renders_the_same(
    client: anthropic.Anthropic, stack: Stack
) -> None:
    oai = stack.client()
    items = [
        {"role": "user", "content": "A ship asks for berth 4 at dawn. " * 20},
        {"role": "assistant", "content": "Berth 4 is free from five until noon."},
        {"role": "user", "content": "Then book it, and tell the pilot. " * 10},
    ]
    whole = oai.responses.create(
        model="tiny", instructions=SYSTEM, input=items, max_output_tokens=6, temperature=0
    )
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 6
    counted = client.messages.count_tokens(model="tiny", system=SYSTEM, messages=items)
    assert whole.usage.input_tokens == counted.input_tokens  # the same prompt, token for token
    # Sent before, its full blocks are cached now, whichever format asked first.
    cached = whole.usage.input_tokens_details.cached_tokens
    assert cached >= 0.9 * (counted.input_tokens // 64 * 64)
    events = list(
        oai.responses.create(
            model="tiny",
            instructions=SYSTEM,
            input=items,
            max_output_tokens=6,
            temperature=0,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("previous_response_id", "resp_123", "stateless"),
        ("store", True, "stateless"),
        ("tools", [{"type": "function", "name": "f", "parameters": {"type": 7}}], "tools"),
        ("max_output_tokens", 0, "max_output_tokens"),
    ],
)
def test_responses_refuses_what_it_does_not_serve_naming_it(
    stack: Stack, field: str, value: object, says: str
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        stack.client().responses.create(model="tiny", input="hi", extra_body={field: value})
    assert says in str(err.value) and err.value.body["param"].startswith(field)


# -- Chat Completions and Completions: every parameter served or refused by name ---------------


def test_chat_logprobs_whole_and_streamed_are_the_engines(stack: Stack) -> None:
    oai = stack.client()
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name three harbour cranes."}],
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    whole = oai.chat.completions.create(**ask)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    answer = b"".join(bytes(t.bytes) for t in content).decode()
    assert answer == whole.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].token == t.token  # greedy: the most likely token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    streamed = [
        t
        for chunk in oai.chat.completions.create(**ask, stream=True)
        if chunk.choices and chunk.choices[0].logprobs
        for t in chunk.choices[0].logprobs.content
    ]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    plain = oai.chat.completions.create(**{**ask, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_completions_logprobs_name_each_token_and_its_offset(stack: Stack) -> None:
    out = stack.client().completions.create(
        model="tiny", prompt="The tide tables say", max_tokens=6, temperature=0, logprobs=2
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(
        len(top) <= 2 and max(top.values()) >= v
        for top, v in zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    )


def test_logit_bias_and_penalties_reach_the_engine(stack: Stack) -> None:
    oai = stack.client()
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Say anything."}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
    }
    forced = oai.chat.completions.create(**ask, logit_bias={"77": 100})
    assert {t.token for t in forced.choices[0].logprobs.content} == {
        forced.choices[0].logprobs.content[0].token
    }
    assert len(forced.choices[0].logprobs.content) == 6
    both = {"77": 100, "78": 100}  # the tiny model prefers 77 of the two, every time
    free = oai.chat.completions.create(**{**ask, "max_tokens": 30}, logit_bias=both)
    spread = oai.chat.completions.create(
        **{**ask, "max_tokens": 30}, logit_bias=both, frequency_penalty=2
    )

    def distinct(r) -> int:
        return len({t.token for t in r.choices[0].logprobs.content})

    tokens = [t.token for t in free.choices[0].logprobs.content]
    assert max(tokens.count(t) for t in set(tokens)) >= 25
    spread_tokens = [t.token for t in spread.choices[0].logprobs.content]
    assert distinct(spread) == 2 and max(spread_tokens.count(t) for t in set(spread_tokens)) <= 22


@pytest.mark.parametrize(
    "field, value, says",
    [
        ("tools", [{"type": "function", "function": {"name": "no spaces"}}], "tools"),
        ("tool_choice", "required", "tool_choice"),  # with no tools
        ("response_format", {"type": "json_schema"}, "response_format.json_schema"),
        (
            "response_format",
            {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
            "response_format.json_schema.schema",
        ),
        ("top_logprobs", 2, "top_logprobs"),  # without logprobs: true
        ("top_logprobs", 21, "top_logprobs"),
        ("logit_bias", {"999999": 5}, "logit_bias"),
        ("logit_bias", {"77": 500}, "logit_bias"),
        ("frequency_penalty", 3, "frequency_penalty"),
        ("n", 0, "n"),
        ("store", True, "store"),
        ("reasoning_effort", "high", "reasoning_effort"),
        ("modalities", ["text", "audio"], "modalities"),
        ("service_tier", "scale", "service_tier"),  # (priority, default, flex: classes)
        ("min_p", 1.5, "min_p"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("min_tokens", -1, "min_tokens"),
        ("min_tokens", 3, "min_tokens"),  # more than max_tokens
        ("stop_token_ids", [10**8], "stop_token_ids"),
        ("stream_options", {"continuous_usage": True}, "stream_options.continuous_usage"),
        ("mini_p", 0.1, "mini_p"),  # not a field at all: a typo is not ignored
    ],
)
def test_chat_refuses_what_it_does_not_serve_naming_it(
    stack: Stack, field: str, value: object, says: str
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        stack.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={field: value},
        )
    assert says in err.value.body["message"] and err.value.body["param"].startswith(field)


@pytest.mark.parametrize(
    "field, value", [("suffix", "end"), ("logprobs", 6), ("prompt_logprobs", 21)]
)
def test_completions_refuse_what_they_do_not_serve_naming_it(
    stack: Stack, field: str, value: object
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        stack.client().completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={field: value}
        )
    assert err.value.body["param"] == field


def test_identifiers_and_cache_hints_are_accepted(stack: Stack) -> None:
    out = stack.client().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        user="u-1",
        metadata={"ticket": "42"},
        service_tier="auto",
        extra_body={
            "prompt_cache_key": "harbour",
            "prompt_cache_retention": "24h",
            "safety_identifier": "s-1",
            "top_k": 5,
            "presence_penalty": 0.5,
        },
    )
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 2


def eos_id(stack: Stack) -> int:
    return text_of(resolve("tiny", {}), stack.dir).config.eos_ids[0]


def test_ignore_eos_min_tokens_and_stop_token_ids_decide_where_the_answer_ends(
    stack: Stack,
) -> None:
    """Every token steered to the end of the answer: it ends at once; with ignore_eos it runs
    to max_tokens; with min_tokens it ends right after that many; a stop token id ends it."""
    oai = stack.client()
    ask = {"model": "tiny", "prompt": "The harbour master said", "max_tokens": 9, "temperature": 0}
    to_end = {str(eos_id(stack)): 100}

    def run(**extra) -> tuple[int, str]:
        out = oai.completions.create(**ask, logit_bias=to_end, extra_body=extra)
        return out.usage.completion_tokens, out.choices[0].finish_reason

    assert run() == (1, "stop")
    assert run(ignore_eos=True) == (9, "length")
    assert run(min_tokens=4) == (5, "stop")  # four tokens, then the end-of-answer token
    steered = oai.completions.create(
        **ask, logit_bias={"77": 100}, extra_body={"stop_token_ids": [77]}
    )
    assert steered.usage.completion_tokens == 1 and steered.choices[0].finish_reason == "stop"


def test_repetition_penalty_and_min_p_reach_the_engine(stack: Stack) -> None:
    oai = stack.client()
    prompt = list(range(100, 130))  # token ids: 77 is not among them

    def answer(**asked) -> str:
        return (
            oai.completions.create(model="tiny", prompt=prompt, max_tokens=12, **asked)
            .choices[0]
            .text
        )

    steered = {"77": 100}
    forced = answer(temperature=0, logit_bias=steered)
    assert len(set(forced)) == 1  # one character, every token
    # Once in the answer, 77's logit is divided by 10: the model's own choices come back.
    penalized = answer(temperature=0, logit_bias=steered, extra_body={"repetition_penalty": 10})
    assert penalized[0] == forced[0] and forced[0] not in penalized[1:]
    # min_p 1 keeps only the likeliest token: a seeded draw is the greedy answer.
    greedy = answer(temperature=0)
    assert answer(temperature=1, seed=5) != greedy
    assert answer(temperature=1, seed=5, extra_body={"min_p": 1.0}) == greedy


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(stack: Stack) -> None:
    chunks = list(
        stack.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Count the cranes."}],
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    counts = [c.usage.completion_tokens for c in chunks]
    assert all(c.usage is not None for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 10
    assert len(set(counts)) >= 5  # it grows as the answer does
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def stream_lines(url: str, body: dict) -> list[str]:
    """A streamed answer's non-empty lines, as sent."""
    ask = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(ask, timeout=60) as resp:
        return [line for line in resp.read().decode().splitlines() if line]


def test_a_slow_first_token_opens_the_stream_with_keep_alives(stack: Stack) -> None:
    long_prompt = "Cargo manifest line, checked and signed. " * 300  # prefill takes a while
    body = {
        "model": "tiny",
        "max_tokens": 3,
        "stream": True,
        "messages": [{"role": "user", "content": long_prompt + uuid.uuid4().hex}],
    }
    events = [x[7:] for x in stream_lines(f"{stack.url}/v1/messages", body) if x[:7] == "event: "]
    first_block = events.index("content_block_start")
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "ping" in events[1:first_block]  # kept alive until the answer's first block
    body["messages"][0]["content"] = long_prompt + uuid.uuid4().hex
    lines = stream_lines(f"{stack.url}/v1/chat/completions", body)
    # The opening chunk (the role), keep-alives, then the answer's chunks.
    assert lines[1] == ": ping" and '"role":"assistant"' in lines[0]
    assert lines[-1] == "data: [DONE]"


# -- cache-miss explanations ---------------------------------------------------------------


def history(tag: str, picture: bytes | None = None) -> list[dict]:
    """Five messages of a conversation, each several blocks long, unique to ``tag``."""
    first: str | list = "Berth request for the morning tide, three ships waiting. " * 8
    if picture is not None:
        first = [
            {"type": "text", "text": first},
            {"type": "image_url", "image_url": {"url": data_url(picture)}},
        ]
    return [
        {"role": "system", "content": f"[{tag}] " + SYSTEM},
        {"role": "user", "content": first},
        {"role": "assistant", "content": "Berth 4 is free from five until noon. " * 7},
        {"role": "user", "content": "Book it and tell the pilot what to expect. " * 7},
        {"role": "assistant", "content": "Booked; the pilot boards at the outer mark. " * 7},
    ]


NEXT_TURN = [{"role": "user", "content": "And the tugs?"}]


def edited(messages: list[dict], i: int, at: int) -> list[dict]:
    out = [dict(m) for m in messages]
    text = out[i]["content"]
    out[i]["content"] = text[:at] + "#" + text[at + 1 :]
    return out


def turn(stack: Stack, messages: list[dict], tenant: str) -> tuple[dict | None, str | None]:
    """The explanation in the `kvmesh` extension, and the x-kvmesh-cache header."""
    raw = stack.client().chat.completions.with_raw_response.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        temperature=0,
        extra_headers={"x-kvmesh-tenant": tenant},
    )
    return raw.parse().model_extra["kvmesh"].get("cache_miss"), raw.headers.get("x-kvmesh-cache")


@pytest.mark.parametrize(
    "case, change, kind, message, part, char",
    [
        ("system", lambda h: edited(h, 0, 150), "system_changed", 0, 0, 150),
        ("middle", lambda h: edited(h, 2, 101), "message_edited", 2, 0, 101),
        ("swapped", lambda h: [h[0], h[3], h[2], h[1], h[4]], "messages_reordered", 1, 0, 0),
        ("removed", lambda h: [h[0], h[1], h[4]], "message_removed", 2, 0, 0),
    ],
)
def test_a_cache_miss_says_where_the_prompt_broke_from_the_last_turn(
    stack: Stack, case: str, change, kind: str, message: int, part: int, char: int
) -> None:
    """Every kind a client's history can break in, found where it broke."""
    tenant = f"explain-{case}-{uuid.uuid4().hex[:6]}"
    before = history(tenant)
    assert turn(stack, before, tenant) == (None, None)  # the first turn: nothing to compare
    explained, header = turn(stack, change(before) + NEXT_TURN, tenant)
    assert explained is not None, "a broken history must be explained"
    assert (explained["kind"], explained["message"], explained["part"], explained["char"]) == (
        kind,
        message,
        part,
        char,
    )
    assert explained["field"] == f"messages[{message}]"  # as the request named it
    assert explained["cached_tokens"] < explained["allowed_tokens"]
    assert explained["first_uncached_block"] == explained["cached_tokens"] // 64
    assert f"kind={kind}" in header and f"field=messages[{message}]; char={char}" in header


def test_a_break_is_named_in_the_format_the_turn_came_in(
    client: anthropic.Anthropic, stack: Stack
) -> None:
    """Turn one as Chat Completions, turn two as Messages with an edited history: the
    explanation names Anthropic's field (its system prompt is not in `messages`)."""
    tenant = f"explain-format-{uuid.uuid4().hex[:6]}"
    before = history(tenant)
    turn(stack, before, tenant)
    after = edited(before, 3, 57) + NEXT_TURN
    raw = client.messages.with_raw_response.create(
        model="tiny",
        max_tokens=2,
        system=after[0]["content"],
        messages=after[1:],
        extra_headers={"x-kvmesh-tenant": tenant},
    )
    explained = raw.parse().model_extra["kvmesh"]["cache_miss"]
    assert (explained["kind"], explained["field"], explained["char"]) == (
        "message_edited",
        "messages[2]",
        57,
    )
    assert "field=messages[2]; char=57" in raw.headers["x-kvmesh-cache"]


def test_a_replaced_image_is_named_and_a_kept_history_says_nothing(stack: Stack) -> None:
    tenant = f"explain-image-{uuid.uuid4().hex[:6]}"
    before = history(tenant, picture=png(11))
    assert turn(stack, before, tenant) == (None, None)
    # The next turn, history kept: the whole prefix is cached, nothing to say.
    kept = before + [{"role": "assistant", "content": "Two tugs."}] + NEXT_TURN
    assert turn(stack, kept, tenant) == (None, None)
    explained, _ = turn(stack, history(tenant, picture=png(12)) + NEXT_TURN, tenant)
    assert explained is not None
    assert (explained["kind"], explained["message"], explained["part"]) == ("image_changed", 1, 1)
    assert explained["field"] == "messages[1].content[1]"
    # Another tenant's conversation with the same words is not this one's to explain.
    assert turn(stack, edited(before, 2, 40), f"{tenant}-other") == (None, None)


# -- answers constrained to JSON ------------------------------------------------------------

BERTH = {
    "type": "object",
    "properties": {
        "berth": {"enum": [1, 2, 3]},
        "pilot": {"type": "boolean"},
    },
    "required": ["berth", "pilot"],
    "additionalProperties": False,
}


def test_a_json_schema_answer_matches_whole_and_streamed(stack: Stack) -> None:
    """The tiny model's weights are random: only the grammar makes its answer JSON."""
    oai = stack.client()
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Which berth, and is a pilot needed?"}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 5,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "berth", "schema": BERTH, "strict": True},
        },
    }
    whole = oai.chat.completions.create(**ask)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), BERTH)
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in oai.chat.completions.create(**ask, stream=True)
        if c.choices
    )
    assert streamed == whole.choices[0].message.content
    free = oai.chat.completions.create(**{**ask, "response_format": {"type": "text"}})
    with pytest.raises(ValueError):
        json.loads(free.choices[0].message.content)  # the same request, unconstrained


def test_responses_text_format_json_schema(stack: Stack) -> None:
    out = stack.client().responses.create(
        model="tiny",
        input="Which berth?",
        max_output_tokens=40,
        temperature=1.0,
        text={"format": {"type": "json_schema", "name": "berth", "schema": BERTH}},
    )
    jsonschema.validate(json.loads(out.output_text), BERTH)


# -- the writers' bytes are what a client reads ---------------------------------------------

VOLATILE = {"created", "created_at", "kvmesh"}  # the moment's, not the answer's


def sse_frames(raw: bytes) -> list[bytes]:
    """A stream's events, keep-alives left out (a comment, or Anthropic's ping)."""
    return [
        f
        for f in raw.split(b"\n\n")
        if f and not f.startswith(b":") and not f.startswith(b"event: ping")
    ]


def steady(frame: bytes) -> bytes:
    """The frame with its moment's fields blanked, encoded again as the writers encode JSON
    (so every other byte must be the writer's own)."""
    head, _, data = frame.rpartition(b"data: ")
    if data == b"[DONE]":
        return frame

    def blank(obj: object) -> object:
        if isinstance(obj, dict):
            if obj.get("type") == "message_start":  # (its usage is from before any token)
                obj["message"]["usage"] = None
            return {k: (0 if k in VOLATILE else blank(v)) for k, v in obj.items()}
        return [blank(v) for v in obj] if isinstance(obj, list) else obj

    parsed = json.loads(data)
    assert json.dumps(parsed, separators=(",", ":")).encode() == data  # the writers' encoding
    return head + b"data: " + json.dumps(blank(parsed), separators=(",", ":")).encode()


def pieces_of(path: str, frames: list[bytes]) -> list[str]:
    """The text pieces a stream carried, in order."""
    out = []
    for f in frames:
        data = json.loads(f.rpartition(b"data: ")[2]) if not f.endswith(b"[DONE]") else {}
        if path == "/v1/chat/completions" and data.get("choices"):
            out.append(data["choices"][0]["delta"].get("content") or "")
        elif data.get("type") == "content_block_delta":
            out.append(data["delta"]["text"])
        elif data.get("type") == "response.output_text.delta":
            out.append(data["delta"])
    return [p for p in out if p]


STREAMED = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Name a berth."}],
        "stream_options": {"include_usage": True},
    },
    "/v1/messages": {"messages": [{"role": "user", "content": "Name a berth."}]},
    "/v1/responses": {"input": "Name a berth."},
}


@pytest.mark.parametrize("path", list(STREAMED))
def test_a_stream_is_byte_for_byte_its_formats_writer(
    stack: Stack,
    real_text,
    path: str,  # noqa: ANN001
) -> None:
    from services.router.dispatch.job import Job
    from services.router.formats.endpoints import ENDPOINTS
    from services.router.request.answer import Delta
    from services.router.request.prepare import Prepared, Usage
    from shared.messages.sampling import SamplingParams

    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    ask = {"model": "tiny", "temperature": 0, limit: 6, "stream": True, **STREAMED[path]}
    rid = f"bytes-{uuid.uuid4().hex[:12]}"
    req = urllib.request.Request(
        stack.url + path,
        data=json.dumps(ask).encode(),
        headers={"Content-Type": "application/json", "x-request-id": rid},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        live = sse_frames(resp.read())
    last = json.loads(live[-2 if path == "/v1/chat/completions" else -1].rpartition(b"data: ")[2])
    usage = last.get("usage") or last.get("response", {}).get("usage")
    if path == "/v1/messages":
        usage = json.loads(live[-2].rpartition(b"data: ")[2])["usage"]
        n_in = sum(
            usage[k]
            for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
        )  # noqa: E501
        counts = Usage(n_in, usage["output_tokens"], usage["cache_read_input_tokens"])
    elif path == "/v1/responses":
        cached = usage["input_tokens_details"]["cached_tokens"]
        counts = Usage(usage["input_tokens"], usage["output_tokens"], cached)
    else:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        counts = Usage(usage["prompt_tokens"], usage["completion_tokens"], cached)
    # The same answer, written in this process from the same body and the stream's texts.
    endpoint = ENDPOINTS[path]
    job = Job(rid, "tiny", [1] * counts.prompt_tokens, SamplingParams(max_tokens=6), 0.0)
    conv = endpoint.adapter(json.dumps(ask).encode())
    writer = endpoint.writer(Prepared(job, conv, real_text, counts, block_size=64))
    ours = writer.start()
    for piece in pieces_of(path, live):
        ours += writer.text(Delta(piece))
    ours += writer.end(Delta("", "length"))
    ours = sse_frames(b"".join(ours))
    assert [steady(f) for f in ours] == [steady(f) for f in live]


# -- Several answers: n, best_of, batched prompts ----------------------------------------------


def prefill_computed(stack: Stack) -> float:
    """Prompt tokens computed, on every worker (decode prefills a prompt it holds most of)."""
    health = stack.health()
    key = ("kvmesh_prefill_tokens_total", (("kind", "computed"),))
    return sum(metrics(health[w]["address"]).get(key, 0.0) for w in ("prefill-0", "decode-0"))


def test_n_answers_share_one_prefill_of_the_prompt(stack: Stack) -> None:
    """n=3 seeded: three different answers, numbered, the prompt counted and prefilled once
    (the other two compute only its last, partial block); the same request, the same three."""
    oai = stack.client()
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"{uuid.uuid4()} " + "Tide and berth. " * 60}],
        "max_tokens": 12,
        "temperature": 1,
        "seed": 7,
        "n": 3,
    }
    before = prefill_computed(stack)
    out = oai.chat.completions.create(**ask)
    computed = prefill_computed(stack) - before
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.message.content for c in out.choices]
    assert len(set(texts)) == 3
    prompt = out.usage.prompt_tokens
    assert prompt < computed <= prompt + 2 * 64  # (blocks of 64 tokens here)
    assert 3 <= out.usage.completion_tokens <= 36  # every answer's tokens
    again = oai.chat.completions.create(**ask)
    assert [c.message.content for c in again.choices] == texts
    assert again.usage.prompt_tokens_details.cached_tokens >= prompt // 64 * 64 - 64


def test_n_answers_share_the_prompts_kv_in_decode(stack: Stack) -> None:
    """n=4 from a ~1,400-token prompt: the other three candidates share the first's prompt
    blocks in the decode worker (copy on write: each computes and writes only the prompt's
    last, partial block and its own answer), so decode holds the prompt once while all four
    decode: under two prompts' worth of blocks, where four copies would not fit its pool."""
    oai = stack.client()
    words = " ".join(f"berth{i}" for i in range(290))
    stream = oai.completions.create(
        model="tiny",
        prompt=f"{uuid.uuid4()} {words}",
        max_tokens=100,
        temperature=1,
        seed=3,
        n=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    decode = stack.health()["decode-0"]["address"]
    seen: set[int] = set()
    peak, usage, texts = 0, None, {i: "" for i in range(4)}
    for chunk in stream:
        for c in chunk.choices:
            seen.add(c.index)
            texts[c.index] += c.text
        if chunk.usage is not None:
            usage = chunk.usage
        if len(seen) == 4 and not peak:  # all four decoding (none ends before 100 tokens)
            peak = urllib.request.urlopen(f"{decode}/health").read()
            peak = json.loads(peak)["load"]["kv_blocks_used"]
    assert usage is not None and usage.completion_tokens == 400
    prompt_blocks = usage.prompt_tokens // 64
    one = -(-(usage.prompt_tokens + 100) // 64)  # one candidate's blocks, unshared
    assert one + 3 * (one - prompt_blocks) >= peak > one
    assert 4 * one > 64  # (four unshared copies would not fit decode's pool of 64)
    assert len(set(texts.values())) == 4


def test_greedy_n_answers_are_the_same_whole_and_streamed(stack: Stack) -> None:
    oai = stack.client()
    ask = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Name the harbour's cranes."}],
        "max_tokens": 10,
        "temperature": 0,
        "n": 2,
    }
    whole = oai.chat.completions.create(**ask)
    one = oai.chat.completions.create(**{**ask, "n": 1}).choices[0].message.content
    assert [c.message.content for c in whole.choices] == [one, one]
    streamed: dict[int, str] = {0: "", 1: ""}
    finishes, usages = {}, []
    for chunk in oai.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usages.append(chunk.usage)
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert streamed == {0: one, 1: one} and finishes == {0: "length", 1: "length"}
    (usage,) = usages  # once, at the end: both answers' tokens, the prompt once
    assert usage.completion_tokens == 20 and usage.prompt_tokens == whole.usage.prompt_tokens


def test_batched_prompts_are_answered_in_order_each_from_its_own_cache(stack: Stack) -> None:
    oai = stack.client()
    warm = f"{uuid.uuid4()} " + "The quay's cranes lift containers. " * 30
    cold = f"{uuid.uuid4()} " + "Pilots board ships at the breakwater. " * 30
    first = oai.completions.create(model="tiny", prompt=warm, max_tokens=6, temperature=0)
    alone = oai.completions.create(model="tiny", prompt="Short one.", max_tokens=6, temperature=0)
    batch = oai.completions.create(
        model="tiny", prompt=[warm, cold, "Short one."], max_tokens=6, temperature=0, n=2
    )
    assert [c.index for c in batch.choices] == list(range(6))
    texts = [c.text for c in batch.choices]
    assert texts[0] == texts[1] == first.choices[0].text
    assert texts[4] == texts[5] == alone.choices[0].text
    usage = batch.usage
    after = oai.completions.create(model="tiny", prompt=cold, max_tokens=6, temperature=0)
    assert texts[2] == texts[3] == after.choices[0].text
    sizes = [r.usage.prompt_tokens for r in (first, after, alone)]
    assert usage.prompt_tokens == sum(sizes)  # each prompt once, whatever its n
    # The warm prompt's full blocks (all but one token's) came from the cache; the cold one
    # and the short one (under a block) were computed.
    assert usage.prompt_tokens_details.cached_tokens == (sizes[0] - 1) // 64 * 64
    assert usage.completion_tokens == 6 * 6


def test_best_of_returns_the_likeliest_candidates(stack: Stack) -> None:
    """best_of=3, n=1: of the three seeded candidates (what n=3 with the same seed answers),
    the one whose tokens' log-probabilities sum highest; its logprobs only when asked."""
    oai = stack.client()
    ask = {"model": "tiny", "prompt": "The harbour at dawn", "max_tokens": 8, "temperature": 1}
    every = oai.completions.create(**ask, seed=11, n=3, logprobs=0)
    scores = [sum(c.logprobs.token_logprobs) for c in every.choices]
    likeliest = every.choices[scores.index(max(scores))].text
    best = oai.completions.create(**ask, seed=11, best_of=3)
    (choice,) = best.choices
    assert choice.text == likeliest and choice.logprobs is None
    assert best.usage.completion_tokens == 24  # every candidate's tokens were computed
    two = oai.completions.create(**ask, seed=11, n=2, best_of=3, logprobs=1)
    ranked = sorted(scores, reverse=True)[:2]
    # (the same tokens, computed in other batches: equal to float32's rounding)
    assert [sum(c.logprobs.token_logprobs) for c in two.choices] == pytest.approx(ranked, abs=1e-3)


def test_too_many_answers_or_prompts_are_refused_naming_the_field(stack: Stack) -> None:
    import openai

    oai = stack.client()
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=2, n=17)
    assert err.value.body["param"] == "n" and "at most 16" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=2, best_of=17)
    assert err.value.body["param"] == "best_of"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="tiny", prompt=["hi"] * 65, max_tokens=2)
    assert err.value.body["param"] == "prompt" and "64" in err.value.body["message"]


# -- The prompt scored: echo, max_tokens 0, prompt_logprobs ----------------------------------


def reference_scores(stack: Stack, ids: list[int]) -> list[float]:
    """The prompt's tokens' log-probabilities from the tiny model in this process: one pass,
    nothing cached."""
    from shared.engine.torch.loader import load_model
    from tests.engine.conftest import make_engine

    engine = make_engine(load_model("tiny", stack.dir), block_size=64, prefill_chunk=4096)
    out = engine.prefill("ref", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    return [s.logprob for s in out.prompt_logprobs]


def test_echo_with_logprobs_scores_the_prompt_cached_or_not(stack: Stack) -> None:
    """lm-evaluation-harness's request: echo, logprobs, max_tokens 0. The prompt back with
    its tokens' log-probabilities (the first has none), equal to a run with no cache, again
    once the prompt is cached (a cached block has no logits: the prompt is computed whole)."""
    oai = stack.client()
    prompt = f"{uuid.uuid4()} The pilot boards at the breakwater and takes the ship in. " * 6
    ask = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 1, "temperature": 0}
    scored = oai.completions.create(**ask, max_tokens=0)
    (choice,) = scored.choices
    lp = choice.logprobs
    assert choice.text == prompt and "".join(lp.tokens) == prompt
    assert scored.usage.completion_tokens == 0 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    ids = text_of(resolve("tiny", {}), stack.dir).tokenizer.encode(prompt).ids
    assert len(ids) == len(lp.tokens) == scored.usage.prompt_tokens
    assert lp.token_logprobs[1:] == pytest.approx(reference_scores(stack, ids), abs=1e-4)
    again = oai.completions.create(**ask, max_tokens=0)  # the prompt now cached
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs)
    answered = oai.completions.create(**ask, max_tokens=4)
    both = answered.choices[0].logprobs
    assert answered.choices[0].text.startswith(prompt) and len(both.tokens) == len(lp.tokens) + 4
    assert both.token_logprobs[: len(lp.tokens)] == pytest.approx(lp.token_logprobs)
    streamed = list(oai.completions.create(**ask, max_tokens=3, stream=True))
    assert streamed[0].choices[0].text == prompt
    assert streamed[0].choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(**{**ask, "echo": False}, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"


def test_vllms_prompt_logprobs_in_chat_and_completions(stack: Stack) -> None:
    oai = stack.client()
    chat = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Score the harbour's prompt."}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 2},
    )
    scores = chat.choices[0].model_extra["prompt_logprobs"]
    assert len(scores) == chat.usage.prompt_tokens and scores[0] is None
    streamed = [
        c.model_extra["prompt_logprobs"]
        for chunk in oai.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Score the harbour's prompt."}],
            max_tokens=2,
            stream=True,
            stop=["\n\n\n"],  # (text that could begin a stop is held back: the scores are not)
            extra_body={"prompt_logprobs": 2},
        )
        for c in chunk.choices
        if c.model_extra.get("prompt_logprobs")
    ]
    assert streamed == [scores]  # once, in the stream's first chunks
    for entry in scores[1:]:
        ranked = sorted((v for v in entry.values() if "rank" in v), key=lambda v: v["rank"])
        assert [v["rank"] for v in ranked] == [1, 2]
        assert ranked[0]["logprob"] >= ranked[1]["logprob"]
        assert all(v["logprob"] <= ranked[0]["logprob"] + 1e-6 for v in entry.values())
    text = "The tide tables say"
    echoed = oai.completions.create(model="tiny", prompt=text, max_tokens=0, echo=True, logprobs=0)
    plain = oai.completions.create(
        model="tiny", prompt=text, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    (entries,) = [c.model_extra["prompt_logprobs"] for c in plain.choices]
    values = [next(iter(e.values()))["logprob"] for e in entries[1:]]
    assert values == pytest.approx(echoed.choices[0].logprobs.token_logprobs[1:])

"""The API formats through real processes, with the official SDKs: Anthropic's Messages
(`anthropic`: whole and streamed, count_tokens, images, stop sequences, errors in Anthropic's
shape) and OpenAI's Responses (`openai`: whole and streamed, stateless refusals); one
conversation renders the same tokens, and hits the same cache, in every format."""

from __future__ import annotations

import base64

import anthropic
import pytest

from tests.images import png
from tests.stack import TINY_ENCODER, Stack

SYSTEM = "You are a careful assistant for a harbour office. Answer plainly. " * 8


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("router-0", "cachemeta-0", "prefill-0", "decode-0", "encoder-0"),
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
            {"tools": [{"name": "x", "input_schema": {"type": "object"}}]},
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
        ("tools", [{"type": "function", "name": "f"}], "tools"),
        ("max_output_tokens", 0, "max_output_tokens"),
    ],
)
def test_responses_refuses_what_it_does_not_serve_naming_it(
    stack: Stack, field: str, value: object, says: str
) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        stack.client().responses.create(model="tiny", input="hi", extra_body={field: value})
    assert says in str(err.value) and err.value.body["param"] == field

"""Tool calls in every API format through real processes: forced calls (the grammar makes
even the tiny model's random weights write a valid call) whole and streamed, the same tool
conversation rendered the same in Chat Completions, Messages and Responses and cached across
them, and bad tool input refused in each format's shape."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.stack import Stack

TIDE = {
    "type": "object",
    "properties": {
        "port": {"type": "string", "maxLength": 16},
        "day": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["port", "day"],
    "additionalProperties": False,
}
BERTH = {
    "type": "object",
    "properties": {"berth": {"enum": [1, 2, 3]}, "ship": {"type": "string", "maxLength": 12}},
    "required": ["berth", "ship"],
    "additionalProperties": False,
}
SCHEMAS = {"get_tide": TIDE, "book_berth": BERTH}
DESCRIBED = {"get_tide": "Tide times for a port.", "book_berth": "Book a berth for a ship."}
CHAT_TOOLS = [
    {"type": "function", "function": {"name": n, "description": DESCRIBED[n], "parameters": s}}
    for n, s in SCHEMAS.items()
]
MESSAGES_TOOLS = [
    {"name": n, "description": DESCRIBED[n], "input_schema": s} for n, s in SCHEMAS.items()
]
RESPONSES_TOOLS = [
    {"type": "function", "name": n, "description": DESCRIBED[n], "parameters": s}
    for n, s in SCHEMAS.items()
]
SYSTEM = "You run the harbour office's tools. " * 20
QUESTION = "When is high tide in Bergen on day 3, and book berth 2 for the Nordlys. " * 3


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(("router-0", "cachemeta-0", "prefill-0", "decode-0"))


@pytest.fixture(scope="module")
def claude(stack: Stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.url, api_key="unused", max_retries=0, timeout=120)


SAMPLED = {"temperature": 1.0, "seed": 11}


def test_a_forced_call_in_chat_completions_whole_and_streamed(stack: Stack) -> None:
    oai = stack.client()
    ask = {
        "model": "tiny",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "tools": CHAT_TOOLS,
        "tool_choice": "required",
        "max_tokens": 80,
        **SAMPLED,
    }
    whole = oai.chat.completions.create(**ask)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    pieces, ids, names = [], [], []
    finish = None
    for chunk in oai.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for t in c.delta.tool_calls or ():
                ids += [t.id] if t.id else []
                names += [t.function.name] if t.function and t.function.name else []
                pieces.append(t.function.arguments or "" if t.function else "")
    assert names == [call.function.name] and len(ids) == 1 and finish == "tool_calls"
    assert "".join(pieces) == call.function.arguments
    assert sum(1 for p in pieces if p) > 1  # the arguments came in pieces
    named = oai.chat.completions.create(
        **{**ask, "tool_choice": {"type": "function", "function": {"name": "book_berth"}}}
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "book_berth"
    jsonschema.validate(json.loads(call.function.arguments), BERTH)


def test_a_forced_tool_use_in_messages_whole_and_streamed(claude: anthropic.Anthropic) -> None:
    ask = {
        "model": "tiny",
        "system": SYSTEM,
        "messages": [{"role": "user", "content": QUESTION}],
        "tools": MESSAGES_TOOLS,
        "tool_choice": {"type": "any"},
        "max_tokens": 80,
        "extra_body": {"temperature": 0},  # (Messages has no seed: greedy, to compare)
    }
    whole = claude.messages.create(**ask)
    assert whole.stop_reason == "tool_use"
    (use,) = [b for b in whole.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_")
    jsonschema.validate(use.input, SCHEMAS[use.name])
    with claude.messages.stream(**ask) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (streamed,) = [b for b in final.content if b.type == "tool_use"]
    assert (streamed.name, streamed.input) == (use.name, use.input)
    assert "input_json" in kinds  # the SDK's event for each input_json_delta
    forced = claude.messages.create(**{**ask, "tool_choice": {"type": "tool", "name": "get_tide"}})
    (use,) = [b for b in forced.content if b.type == "tool_use"]
    assert use.name == "get_tide"
    jsonschema.validate(use.input, TIDE)


def test_a_forced_function_call_in_responses_whole_and_streamed(stack: Stack) -> None:
    oai = stack.client()
    ask = {
        "model": "tiny",
        "instructions": SYSTEM,
        "input": QUESTION,
        "tools": RESPONSES_TOOLS,
        "tool_choice": "required",
        "max_output_tokens": 80,
        "temperature": 1.0,
    }
    whole = oai.responses.create(**ask)
    (call,) = [o for o in whole.output if o.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    events = list(oai.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(deltas) == done.arguments
    (item,) = [e.item for e in events if e.type == "response.output_item.done"]
    assert item.type == "function_call" and item.arguments == done.arguments
    jsonschema.validate(json.loads(done.arguments), SCHEMAS[item.name])
    assert kinds[-1] == "response.completed"


# -- one tool conversation, any format --------------------------------------------------------

CALL_ARGS = {"port": "Bergen", "day": 3}
RESULT = "High tide in Bergen on day 3 is at 06:12 and 18:40."


def as_chat(call_id: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "get_tide", "arguments": json.dumps(CALL_ARGS)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": RESULT},
        {"role": "user", "content": "Thanks. And the berth?"},
    ]


def as_messages(call_id: str) -> list[dict]:
    return [
        {"role": "user", "content": QUESTION},
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": call_id, "name": "get_tide", "input": CALL_ARGS}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": call_id, "content": RESULT},
                {"type": "text", "text": "Thanks. And the berth?"},
            ],
        },
    ]


def as_responses(call_id: str) -> list[dict]:
    return [
        {"role": "user", "content": QUESTION},
        {
            "type": "function_call",
            "call_id": call_id,
            "name": "get_tide",
            "arguments": json.dumps(CALL_ARGS),
        },
        {"type": "function_call_output", "call_id": call_id, "output": RESULT},
        {"role": "user", "content": "Thanks. And the berth?"},
    ]


def test_a_tool_conversation_is_the_same_prompt_in_every_format(
    stack: Stack, claude: anthropic.Anthropic
) -> None:
    oai = stack.client()
    chat = oai.chat.completions.create(
        model="tiny", messages=as_chat("call_1"), tools=CHAT_TOOLS, max_tokens=1
    )
    counted = claude.messages.count_tokens(
        model="tiny", system=SYSTEM, messages=as_messages("toolu_9"), tools=MESSAGES_TOOLS
    ).input_tokens
    responses = oai.responses.create(
        model="tiny",
        instructions=SYSTEM,
        input=as_responses("fc_x"),
        tools=RESPONSES_TOOLS,
        max_output_tokens=1,
    )
    # Ids differ by format and are not in the prompt: the same tokens, to the token.
    assert chat.usage.prompt_tokens == counted == responses.usage.input_tokens


@pytest.mark.parametrize("second", ["chat", "messages", "responses"])
def test_a_forced_call_then_its_result_hits_the_cache_in_any_format(
    stack: Stack, claude: anthropic.Anthropic, second: str
) -> None:
    """Turn 1 (Chat) makes a forced call; turn 2 sends it back with its result in another
    format: everything turn 1 had, and its answer, is cached."""
    oai = stack.client()
    system = f"[{second}] {SYSTEM}"
    first = oai.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": QUESTION}],
        tools=CHAT_TOOLS,
        tool_choice="required",
        max_tokens=80,
        **SAMPLED,
    )
    (call,) = first.choices[0].message.tool_calls
    name, arguments = call.function.name, call.function.arguments
    allowed = first.usage.prompt_tokens // 64 * 64
    if second == "chat":
        history = as_chat(call.id)
        history[0]["content"] = system
        history[2]["tool_calls"][0]["function"] = {"name": name, "arguments": arguments}
        out = oai.chat.completions.create(
            model="tiny", messages=history, tools=CHAT_TOOLS, max_tokens=1
        )
        cached = out.usage.prompt_tokens_details.cached_tokens
    elif second == "messages":
        history = as_messages(call.id)
        history[1]["content"][0].update(name=name, input=json.loads(arguments))
        out = claude.messages.create(
            model="tiny", system=system, messages=history, tools=MESSAGES_TOOLS, max_tokens=1
        )
        cached = out.usage.cache_read_input_tokens
    else:
        history = as_responses(call.id)
        history[1].update(name=name, arguments=arguments)
        out = oai.responses.create(
            model="tiny",
            instructions=system,
            input=history,
            tools=RESPONSES_TOOLS,
            max_output_tokens=1,
        )
        cached = out.usage.input_tokens_details.cached_tokens
    assert cached >= allowed > 0
    assert cached >= 0.9 * (first.usage.prompt_tokens + first.usage.completion_tokens) // 64 * 64


# -- bad tool input, in each format's shape ---------------------------------------------------


def test_bad_tool_input_is_refused_naming_the_field(
    stack: Stack, claude: anthropic.Anthropic
) -> None:
    oai = stack.client()
    user = [{"role": "user", "content": "hi"}]
    cases = [
        (
            lambda: oai.chat.completions.create(
                model="tiny",
                messages=user,
                tools=CHAT_TOOLS,
                max_tokens=2,
                tool_choice={"type": "function", "function": {"name": "sink_ship"}},
            ),
            "tool_choice",
        ),
        (
            lambda: oai.chat.completions.create(
                model="tiny",
                messages=user,
                max_tokens=2,
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
                ],
            ),
            "tools[0].function.parameters",
        ),
        (
            lambda: oai.chat.completions.create(
                model="tiny",
                messages=as_chat("call_1")[:3]
                + [{"role": "tool", "tool_call_id": "call_404", "content": "?"}],
                tools=CHAT_TOOLS,
                max_tokens=2,
            ),
            "messages[3].tool_call_id",
        ),
        (
            lambda: oai.responses.create(
                model="tiny",
                input=[{"type": "function_call_output", "call_id": "c9", "output": "?"}],
                tools=RESPONSES_TOOLS,
                max_output_tokens=2,
            ),
            "input[0].call_id",
        ),
        (
            lambda: oai.responses.create(
                model="tiny",
                input="hi",
                tools=RESPONSES_TOOLS,
                max_output_tokens=2,
                tool_choice={"type": "function", "name": "sink_ship"},
            ),
            "tool_choice",
        ),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            call()
        assert err.value.body["param"] == param and param in err.value.body["message"]
    anthropic_cases = [
        ({"tool_choice": {"type": "tool", "name": "sink_ship"}}, "tool_choice"),
        ({"tools": [{"name": "f", "input_schema": {"type": "nope"}}]}, "tools[0].input_schema"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_404", "content": "?"}
                        ],
                    }
                ]
            },
            "messages[0].content[0].tool_use_id",
        ),
    ]
    for change, param in anthropic_cases:
        ask = {
            "model": "tiny",
            "max_tokens": 2,
            "messages": user,
            "tools": MESSAGES_TOOLS,
            **change,
        }
        with pytest.raises(anthropic.BadRequestError) as err:
            claude.messages.create(**ask)
        assert err.value.body["error"]["type"] == "invalid_request_error"
        assert param in err.value.body["error"]["message"]
    # The service keeps serving.
    assert oai.chat.completions.create(model="tiny", messages=user, max_tokens=2).choices

"""The format adapters as functions: a body in, the ``Conversation`` it carries out (the
sampling as the engine takes it), or a 400 naming the field; and the writers: deltas in, each
API's bytes out (bodies, tool calls, errors mid-stream)."""

from __future__ import annotations

import json

import pytest

from services.router.dispatch.job import Job
from services.router.errors import ApiError
from services.router.formats import anthropic, openai, responses
from services.router.formats.endpoints import ENDPOINTS
from services.router.request.answer import Delta
from services.router.request.conversation import Image, Text, ToolCall, ToolResult
from services.router.request.prepare import Prepared, Usage
from services.router.request.toolcalls import CallEvent
from shared.messages.sampling import SamplingParams
from shared.model.text import TextModel

PNG_URL = "data:image/png;base64,iVBORw0KGgo="


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def chat(**fields: object):  # noqa: ANN201
    return openai.conversation(body(model="tiny", **fields), chat=True)


def refused(adapter, raw: bytes, param: str | None, says: str) -> None:  # noqa: ANN001
    with pytest.raises(ApiError) as err:
        adapter(raw)
    assert err.value.status == 400 and err.value.param == param, err.value.message
    assert says in err.value.message


def test_a_chat_body_is_its_conversation_with_the_sampling_the_engine_takes() -> None:
    conv = chat(
        messages=[
            {"role": "developer", "content": "Be terse."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look:"},
                    {"type": "image_url", "image_url": {"url": PNG_URL}},
                ],
            },  # noqa: E501
        ],
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop=["\n\n", "END"],
        presence_penalty=0.25,
        logit_bias={"42": -100, "7": 3.5},
        logprobs=True,
        top_logprobs=2,
        max_completion_tokens=30,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert conv.chat and conv.stream and conv.include_usage
    assert [m.role for m in conv.messages] == ["system", "user"]
    assert conv.messages[1].parts == (
        Text("Look:"),
        Image(PNG_URL, "messages[1].content[1].image_url"),
    )
    assert conv.sampling == SamplingParams(
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=7,
        stop=("\n\n", "END"),
        presence_penalty=0.25,
        logit_bias=((42, -100), (7, 3.5)),
        logprobs=2,
    )
    assert (conv.max_tokens, conv.max_tokens_field) == (30, "max_completion_tokens")


def test_unset_sampling_fields_take_the_engines_defaults() -> None:
    conv = chat(messages=[{"role": "user", "content": "hi"}])
    assert conv.sampling == SamplingParams() and conv.max_tokens is None


def test_tools_their_calls_and_results_become_the_conversations() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "berth", "arguments": '{"n": 4}'}}
    conv = chat(
        messages=[
            {"role": "user", "content": "Which berth?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "free"},
        ],
        tools=[{"type": "function", "function": {"name": "berth"}}],
        tool_choice={"type": "function", "function": {"name": "berth"}},
        response_format={"type": "json_object"},
    )
    assert conv.messages[1].parts == (ToolCall("c1", "berth", {"n": 4}),)
    assert conv.messages[2].parts == (ToolResult("c1", "free", "messages[2].tool_call_id"),)
    (tool,) = conv.tools
    assert tool.parameters == {"type": "object", "properties": {}}
    assert conv.forced_tools == conv.tools and conv.calls_tools
    assert conv.json is not None and conv.json.param == "response_format"


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"temperature": 3}, "temperature", "less than or equal to 2"),
        ({"temperature": "0.5"}, "temperature", "valid number"),
        ({"n": 129}, "n", "less than or equal to 128"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "at most 4"),
        ({"logit_bias": {"x": 1}}, "logit_bias.x", "should match pattern '^[0-9]{1,9}$'"),
        ({"logit_bias": {"7": 101}}, "logit_bias.7", "less than or equal to 100"),
        ({"stop": ["a", ""]}, "stop[1]", "at least 1 character"),
        ({"top_logprobs": 2}, "top_logprobs", "needs logprobs"),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        ({"colour": "blue"}, "colour", "not a field this API accepts"),
    ],
)
def test_a_bad_chat_body_is_a_400_naming_the_field(fields: dict, param: str, says: str) -> None:
    raw = body(model="tiny", messages=[{"role": "user", "content": "hi"}], **fields)
    refused(lambda b: openai.conversation(b, chat=True), raw, param, says)


def test_a_message_without_what_it_needs_is_named_by_its_place() -> None:
    raw = body(
        model="tiny", messages=[{"role": "user", "content": "a"}, {"role": "tool", "content": "x"}]
    )
    refused(
        lambda b: openai.conversation(b, chat=True), raw, "messages[1].tool_call_id", "required"
    )
    refused(lambda b: openai.conversation(b, chat=True), b"{nope", None, "not valid JSON")
    refused(lambda b: openai.conversation(b, chat=True), b"[]", None, "a JSON object")


def test_a_completion_takes_prompts_as_text_or_token_ids() -> None:
    text = openai.conversation(body(model="tiny", prompt=["Once"], logprobs=3), chat=False)
    assert text.prompt == "Once" and not text.chat and text.sampling.logprobs == 3
    assert text.batch == () and [c.prompt for c in text.prompts()] == ["Once"]
    ids = openai.conversation(body(model="tiny", prompt=[5, 6, 7]), chat=False)
    assert ids.prompt == (5, 6, 7) and ids.prompt_field == "prompt"
    several = openai.conversation(body(model="tiny", prompt=["a", "b"], n=2), chat=False)
    assert [c.prompt for c in several.prompts()] == ["a", "b"] and several.n == 2
    lists = openai.conversation(body(model="tiny", prompt=[[5], [6, 7]]), chat=False)
    assert [c.prompt for c in lists.prompts()] == [(5,), (6, 7)]
    ranked = openai.conversation(body(model="tiny", prompt="a", n=2, best_of=3), chat=False)
    assert (ranked.n, ranked.best_of) == (2, 3)
    completion = lambda b: openai.conversation(b, chat=False)  # noqa: E731
    refused(completion, body(model="tiny", prompt=[[5], []]), "prompt[1]", "at least 1")
    refused(completion, body(model="tiny", prompt="a", n=3, best_of=2), "best_of", "at least n")
    streamed = body(model="tiny", prompt="a", best_of=2, stream=True)
    refused(completion, streamed, "best_of", "cannot stream")
    refused(
        lambda b: openai.conversation(b, chat=False),
        body(model="tiny", prompt="a", suffix="z"),
        "suffix",
        "not served",
    )  # noqa: E501


def test_an_anthropic_message_is_the_same_conversation_as_openais() -> None:
    conv = anthropic.conversation(
        body(
            model="tiny",
            max_tokens=20,
            system=[
                {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
                {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}},
            ],
            messages=[
                {"role": "user", "content": "Which berth?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": "c1", "name": "berth", "input": {"n": 4}}
                    ],
                },  # noqa: E501
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "c1", "content": "free"},
                        {"type": "text", "text": "Thanks."},
                    ],
                },  # noqa: E501
            ],
            stop_sequences=["END"],
            temperature=0.3,
            top_k=5,
            tools=[{"name": "berth", "input_schema": {"type": "object"}}],
            tool_choice={"type": "any"},
        )
    )
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool", "user"]
    assert conv.messages[0].parts == (Text("Be terse."),)  # the volatile header dropped
    assert conv.messages[3].parts == (
        ToolResult("c1", "free", "messages[2].content[0].tool_use_id"),
    )  # noqa: E501
    assert conv.sampling == SamplingParams(temperature=0.3, top_k=5, stop=("END",))
    assert conv.max_tokens == 20 and conv.tool_choice.kind == "required"
    openai_side = chat(
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Which berth?"},
        ]
    )
    assert conv.messages[:2] == tuple(
        m.__class__(m.role, m.parts, conv.messages[i].param, conv.messages[i].listed)
        for i, m in enumerate(openai_side.messages)
    )


def test_anthropic_refuses_what_it_does_not_serve_in_its_words() -> None:
    raw = body(
        model="tiny",
        max_tokens=5,
        messages=[{"role": "user", "content": "a"}],
        thinking={"type": "enabled"},
    )
    refused(anthropic.conversation, raw, "thinking", "extended thinking")
    raw = body(model="tiny", messages=[{"role": "user", "content": "a"}])
    refused(anthropic.conversation, raw, "max_tokens", "Field required")


def test_a_responses_body_joins_calls_to_their_turn_and_refuses_state() -> None:
    conv = responses.conversation(
        body(
            model="tiny",
            instructions="Be terse.",
            input=[
                {"role": "user", "content": "Which berth?"},
                {"role": "assistant", "content": "Let me look."},
                {"type": "function_call", "call_id": "c1", "name": "berth", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "free"},
            ],
            max_output_tokens=9,
            text={"format": {"type": "json_schema", "name": "b", "schema": {"type": "object"}}},
        )
    )
    assert [m.role for m in conv.messages] == ["system", "user", "assistant", "tool"]
    assert conv.messages[2].parts == (Text("Let me look."), ToolCall("c1", "berth", {}))
    assert (conv.max_tokens, conv.max_tokens_field) == (9, "max_output_tokens")
    assert conv.json is not None and conv.json.schema == {"type": "object"}
    raw = body(model="tiny", input="hi", previous_response_id="resp_1")
    refused(responses.conversation, raw, "previous_response_id", "keeps no responses")
    refused(
        responses.conversation, body(model="tiny", input="hi", store=True), "store", "stateless"
    )


# -- writers -------------------------------------------------------------------------------


def prepared(path: str, real_text: TextModel, raw: bytes) -> Prepared:
    conv = ENDPOINTS[path].adapter(raw)
    job = Job("r1", "tiny", [1] * 70, SamplingParams(max_tokens=4), 0.0)
    return Prepared(job, conv, real_text, Usage(70, 4, 64), block_size=64)


BODIES = {
    "/v1/chat/completions": body(model="tiny", messages=[{"role": "user", "content": "hi"}]),
    "/v1/completions": body(model="tiny", prompt="hi"),
    "/v1/messages": body(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]),  # noqa: E501
    "/v1/responses": body(model="tiny", input="hi"),
}


@pytest.mark.parametrize("path", list(BODIES))
def test_a_whole_answer_in_each_format(path: str, real_text: TextModel) -> None:
    writer = ENDPOINTS[path].writer(prepared(path, real_text, BODIES[path]))
    out = writer.whole([Delta("Berth four.", "length")])
    text = {
        "/v1/chat/completions": lambda b: b["choices"][0]["message"]["content"],
        "/v1/completions": lambda b: b["choices"][0]["text"],
        "/v1/messages": lambda b: b["content"][0]["text"],
        "/v1/responses": lambda b: b["output"][0]["content"][0]["text"],
    }[path](out)
    assert text == "Berth four." and "kvmesh" in out
    if path == "/v1/messages":  # one count of cached tokens, Anthropic's three fields
        assert out["usage"] == {
            "input_tokens": 6,
            "cache_read_input_tokens": 64,
            "cache_creation_input_tokens": 0,
            "output_tokens": 4,
            "service_tier": "standard",  # (the default class, in Anthropic's name)
        }
        assert out["stop_reason"] == "max_tokens"
    if path == "/v1/responses":
        assert out["status"] == "incomplete" and out["usage"]["input_tokens"] == 70


def frames(chunks: list[bytes]) -> list[tuple[str, dict | str]]:
    """Server-sent events as (event name or "", their data)."""
    out = []
    for chunk in chunks:
        name, data = "", ""
        for line in chunk.decode().strip().split("\n"):
            key, _, value = line.partition(": ")
            name, data = (value, data) if key == "event" else (name, value)
        out.append((name, data if data == "[DONE]" else json.loads(data)))
    return out


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses"])
def test_a_streamed_tool_call_in_each_format(path: str, real_text: TextModel) -> None:
    writer = ENDPOINTS[path].writer(prepared(path, real_text, BODIES[path]))
    calls = [
        CallEvent(0, id="abc", name="berth"),
        CallEvent(0, arguments='{"n": '),
        CallEvent(0, arguments="4}"),
        CallEvent(0, done=True),
    ]
    events = frames(
        writer.start() + writer.text(Delta("", calls=calls)) + writer.end(Delta("", "stop"))
    )
    dumped = json.dumps(events)
    assert "berth" in dumped and '{\\"n\\": ' in dumped and "4}" in dumped
    if path == "/v1/chat/completions":
        assert events[-2][1] == "[DONE]" or events[-1][1] == "[DONE]"
        assert any(
            c["choices"] and c["choices"][0]["finish_reason"] == "tool_calls"
            for _, c in events
            if isinstance(c, dict)
        )  # noqa: E501
    if path == "/v1/messages":
        assert [n for n, _ in events][-2:] == ["message_delta", "message_stop"]
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    if path == "/v1/responses":
        done = [d for n, d in events if n == "response.function_call_arguments.done"]
        assert done[0]["arguments"] == '{"n": 4}'


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        (  # (the body a plain 503 has: its type by status)
            "/v1/chat/completions",
            lambda e: (
                e[0][1]["error"]
                == {
                    "message": "gone",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "unavailable",
                }
            ),
        ),
        (
            "/v1/messages",
            lambda e: (
                e[0]
                == (
                    "error",
                    {"type": "error", "error": {"type": "overloaded_error", "message": "gone"}},
                )
            ),
        ),  # noqa: E501
        ("/v1/responses", lambda e: e[0][0] == "error" and e[0][1]["code"] == "unavailable"),
    ],
)
def test_an_error_mid_stream_is_in_the_formats_shape(
    path: str, shape, real_text: TextModel
) -> None:  # noqa: ANN001
    writer = ENDPOINTS[path].writer(prepared(path, real_text, BODIES[path]))
    writer.start()
    assert shape(frames(writer.error(ApiError(503, "gone", code="unavailable"))))

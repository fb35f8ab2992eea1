"""Tools in the model's own syntax: a template that renders tools gets them (and the calls
and results) as Hugging Face passes them, a forced call is written in that template's form,
and the answer's calls are parsed in it; a template with none gets the Hermes fallback."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from services.router.errors import ApiError
from services.router.formats import openai as openai_api
from services.router.request.render import Renderer
from services.router.request.toolcalls import call_parser, calls_of
from shared.model.text import TextModel
from shared.model.tokenizer import ChatTemplate
from shared.model.tools import FALLBACK, ToolSyntax, short_call_id, tool_syntax
from tests.templates import TEMPLATES

TIDE = {
    "type": "object",
    "properties": {"port": {"type": "string", "maxLength": 20}, "days": {"type": "integer"}},
    "required": ["port"],
}
TOOLS = [{"type": "function", "function": {"name": "get_tide", "parameters": TIDE}}]
CONVERSATION = {
    "model": "tiny",
    "tools": TOOLS,
    "messages": [
        {"role": "system", "content": "You keep the harbour's books."},
        {"role": "user", "content": "When is high tide in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_0123456789abcdef",
                    "type": "function",
                    "function": {"name": "get_tide", "arguments": '{"port": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "14:05 at 1.2 m"},
        {"role": "user", "content": "And tomorrow?"},
    ],
}


def with_template(text: TextModel, kind: str) -> TextModel:
    return replace(text, chat_template=ChatTemplate(TEMPLATES[kind], "<s>", "</s>"))


def rendered(text: TextModel, body: dict) -> str:
    renderer = Renderer(100_000)
    renderer.add("tiny", text)
    conv = openai_api.conversation(json.dumps(body).encode(), chat=True)
    ids = asyncio.run(renderer.render(conv, text, [])).ids
    return text.tokenizer.decode(ids, skip_special_tokens=False)


def test_each_template_is_read_as_its_syntax_and_chatml_gets_the_fallback(
    real_text: TextModel,
) -> None:
    assert {k: tool_syntax(t) for k, t in TEMPLATES.items()} == {
        k: ToolSyntax(k, native=True) for k in TEMPLATES
    }
    assert real_text.chat_template.tool_syntax == FALLBACK  # SmolLM2's ChatML has no tools


def test_qwen_style_renders_tools_calls_and_results_with_its_own_template(
    real_text: TextModel,
) -> None:
    text = rendered(with_template(real_text, "hermes"), CONVERSATION)
    assert text.startswith("<|im_start|>system\nYou keep the harbour's books.\n\n# Tools")
    assert json.dumps(TOOLS[0]) in text
    call = '<tool_call>\n{"name": "get_tide", "arguments": {"port": "Oslo"}}\n</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert "<|im_start|>user\n<tool_response>\n14:05 at 1.2 m\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama_style_puts_the_call_as_json_and_the_result_in_an_ipython_turn(
    real_text: TextModel,
) -> None:
    text = rendered(with_template(real_text, "llama3"), CONVERSATION)
    assert "Environment: ipython\nYou keep the harbour's books." in text
    assert json.dumps(TOOLS[0], indent=4) + "\n\nWhen is high tide in Oslo?" in text
    assert '\n\n{"name": "get_tide", "parameters": {"port": "Oslo"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n14:05 at 1.2 m<|eot_id|>" in text


def test_mistral_style_pairs_a_call_and_its_result_by_a_nine_character_id(
    real_text: TextModel,
) -> None:
    text = rendered(with_template(real_text, "mistral"), CONVERSATION)
    short = short_call_id("call_0123456789abcdef")
    assert len(short) == 9 and short.isalnum()
    call = f'{{"name": "get_tide", "arguments": {{"port": "Oslo"}}, "id": "{short}"}}'
    assert f"[TOOL_CALLS][{call}]</s>" in text
    assert f'"call_id": "{short}"' in text
    assert text.index("[AVAILABLE_TOOLS]") > text.index("[TOOL_RESULTS]")  # before the last ask


def test_a_template_that_refuses_the_conversation_is_a_400_naming_messages(
    real_text: TextModel,
) -> None:
    body = json.loads(json.dumps(CONVERSATION))
    body["messages"][2]["tool_calls"] *= 2  # the Llama style takes one call at a time
    with pytest.raises(ApiError) as err:
        rendered(with_template(real_text, "llama3"), body)
    assert err.value.status == 400 and "single tool-calls" in str(err.value)


def feed_all(kind: str, text: str, step: int) -> tuple[str, list]:
    parser = call_parser(ToolSyntax(kind, native=True), streamed=False)
    out, events = "", []
    for i in range(0, len(text), step):
        t, e = parser.feed(text[i : i + step])
        out, events = out + t, events + e
    t, e = parser.finish()
    return out + t, events + e


@pytest.mark.parametrize("step", [1, 4, 1000])
@pytest.mark.parametrize(
    ("kind", "answer"),
    [
        ("llama3", '{"name": "get_tide", "parameters": {"port": "Oslo"}}'),
        (
            "llama3",
            '{"name": "get_tide", "parameters": {"port": "Oslo"}}; {"name": "get_tide", '
            '"parameters": {"port": "Bergen", "days": 2}}',
        ),
        ("mistral", '[TOOL_CALLS][{"name": "get_tide", "arguments": {"port": "Oslo"}}]'),
        (
            "mistral",
            ' [{"name": "get_tide", "arguments": {"port": "Oslo"}}, '
            '{"name": "get_tide", "arguments": {"port": "Bergen", "days": 2}}]',
        ),  # marker unseen
    ],
)
def test_leading_calls_parse_in_the_templates_form(kind: str, answer: str, step: int) -> None:
    text, events = feed_all(kind, answer, step)
    calls = calls_of(events)
    assert text == ""
    assert [json.loads(c.arguments)["port"] for c in calls] == ["Oslo", "Bergen"][: len(calls)]
    assert len(calls) == answer.count('"name"') and all(c.name == "get_tide" for c in calls)


@pytest.mark.parametrize("kind", ["llama3", "mistral"])
@pytest.mark.parametrize(
    "answer",
    [
        "High tide is at 14:05.",
        '{"port": "Oslo"}',  # JSON, but not a call
        "[1, 2, 3] are the berths",
        '{"name": "get_tide", "parameters": {"port": "Os',  # cut short: text, as written
    ],
)
def test_anything_else_stays_text_as_written(kind: str, answer: str) -> None:
    assert feed_all(kind, answer, 3) == (answer, [])

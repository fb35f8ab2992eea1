"""The chat template's sandbox: what it renders is what Jinja's own immutable sandbox renders
(the reads it takes straight give the same values), and what the sandbox refuses it still
refuses, a model's template being code from a file the mesh did not write."""

from __future__ import annotations

import pytest
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shared.model.text import TextModel
from shared.model.tokenizer import ChatTemplate, ChatTemplateError
from tests.templates import TEMPLATES

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_tide",
            "description": "High tide at a port",
            "parameters": {"type": "object", "properties": {"port": {"type": "string"}}},
        },
    }
]
CALL = {"id": "abcdefghi", "type": "function"}
CHAT = [
    {"role": "system", "content": "You keep the harbour's books."},
    {"role": "user", "content": "When is high tide in Oslo?", "name": "clerk"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{**CALL, "function": {"name": "get_tide", "arguments": {"port": "Oslo"}}}],
    },
    {"role": "tool", "content": '{"at": "14:05"}', "tool_call_id": "abcdefghi"},
    {"role": "assistant", "content": "At 14:05."},
    {"role": "user", "content": "And tomorrow? {{ not a template }} <|im_end|>"},
]


def jinjas_own(source: str, **context) -> str:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = ChatTemplate(source).template.environment.filters["tojson"]
    env.globals.update(ChatTemplate(source).template.environment.globals)
    return env.from_string(source).render(**context)


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_a_familys_template_renders_as_jinjas_own_sandbox_renders_it(family: str) -> None:
    source = TEMPLATES[family]
    for tools in (None, TOOLS):
        ours = ChatTemplate(source).render(CHAT, tools=tools)
        extra = {"tools": tools} if tools else {}
        own = jinjas_own(
            source, messages=CHAT, add_generation_prompt=True, bos_token="", eos_token="", **extra
        )
        assert ours == own and "Oslo" in ours


def test_the_bundled_models_template_renders_as_jinjas_own(real_text: TextModel) -> None:
    template = real_text.chat_template
    chat = [m for m in CHAT if m["role"] != "tool"]
    for messages in (chat, chat[1:]):  # (without a system prompt it writes its own)
        own = jinjas_own(
            template.source,
            messages=messages,
            add_generation_prompt=True,
            bos_token=template.bos,
            eos_token=template.eos,
        )
        assert template.render(messages) == own


LOOPS = "{% for message in messages %}{{ loop.index }}/{{ loop.length }}:{{ message.role }}"
READS = [
    # a message's key as an attribute, a missing one undefined, a dict's own method
    ("{{ messages[0].content }}|{{ messages[0].nothing }}|{{ messages[0].keys() | list }}", ""),
    (LOOPS + "{% if loop.first %}^{% endif %}{% if loop.last %}${% endif %} {% endfor %}", ""),
    ("{% for m in messages %}{{ loop.previtem.role if loop.previtem }}{% endfor %}", ""),
    ("{% for m in messages %}{{ loop.cycle('a', 'b') }}{{ loop.changed(m.role) }}{% endfor %}", ""),
]


@pytest.mark.parametrize("source", [s for s, _ in READS])
def test_the_reads_taken_straight_give_what_the_sandbox_gives(source: str) -> None:
    ours = ChatTemplate(source).render(CHAT, add_generation_prompt=False)
    assert ours == jinjas_own(source, messages=CHAT, add_generation_prompt=False)


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages[0].__class__ }}",
        "{{ messages[0].__class__.__mro__ }}",
        "{% for m in messages %}{{ loop.__class__.__init__.__globals__ }}{% endfor %}",
        "{% for m in messages %}{{ loop._iterator }}{% endfor %}",
        "{{ messages.append(1) }}",
        "{{ messages[0].update({'role': 'system'}) }}",
        "{{ messages[0].pop('role') }}",
        "{{ raise_exception.__globals__ }}",
    ],
)
def test_what_the_sandbox_refuses_it_still_refuses(source: str) -> None:
    """Refused as Jinja's sandbox refuses it: an error, or (a private attribute, read and
    printed) nothing; the messages are never changed."""
    try:
        own = jinjas_own(source, messages=CHAT, add_generation_prompt=True)
    except TemplateError:
        with pytest.raises(ChatTemplateError):
            ChatTemplate(source).render(CHAT)
    else:
        assert own == "" and ChatTemplate(source).render(CHAT) == ""
    assert CHAT[0] == {"role": "system", "content": "You keep the harbour's books."}

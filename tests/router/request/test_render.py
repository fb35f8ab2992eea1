"""The one renderer: messages stay where the client put them (no system prompt hoisted), and
a conversation renders to the same tokens from every format's adapter."""

from __future__ import annotations

import asyncio
import json

from services.router.formats import anthropic as anthropic_api
from services.router.formats import openai as openai_api
from services.router.formats import responses as responses_api
from services.router.request.render import Renderer
from shared.model.text import TextModel


def render(model: TextModel, conv) -> list[int]:
    renderer = Renderer(100_000)
    renderer.add(conv.model, model)
    return asyncio.run(renderer.render(conv, model, [])).ids


def test_a_system_message_mid_conversation_stays_where_it_is(real_text: TextModel) -> None:
    body = {
        "model": "tiny",
        "messages": [
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "first answer"},
            {"role": "system", "content": "from now on, answer in French"},
            {"role": "user", "content": "second question"},
        ],
    }
    conv = openai_api.conversation(json.dumps(body).encode(), chat=True)
    text = real_text.tokenizer.decode(render(real_text, conv), skip_special_tokens=False)
    order = [text.index(s) for s in ("first answer", "answer in French", "second question")]
    assert order == sorted(order)


def test_one_conversation_is_the_same_tokens_from_every_adapter(real_text: TextModel) -> None:
    system = "You keep the harbour's books."
    turns = [
        {"role": "user", "content": "Which berth is free?"},
        {"role": "assistant", "content": "Berth four."},
        {"role": "user", "content": "Book it."},
    ]
    chat = {"model": "tiny", "messages": [{"role": "system", "content": system}, *turns]}
    messages = {"model": "tiny", "system": system, "messages": turns, "max_tokens": 4}
    responses = {"model": "tiny", "instructions": system, "input": turns}
    ids = [
        render(real_text, openai_api.conversation(json.dumps(chat).encode(), chat=True)),
        render(real_text, anthropic_api.conversation(json.dumps(messages).encode())),
        render(real_text, responses_api.conversation(json.dumps(responses).encode())),
    ]
    assert ids[0] == ids[1] == ids[2]

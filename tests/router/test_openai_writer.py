"""The OpenAI writer's chunks: a text chunk made from its precomputed bytes is the very chunk
the response shape describes, whatever the text holds."""

from __future__ import annotations

import json

import pytest

from services.router import sse
from services.router.dispatch.job import Job
from services.router.generation import Delta, Prepared
from services.router.openai_api import Shape, Usage
from services.router.openai_writer import OpenAIWriter
from shared.messages.generate import Sampling
from shared.model.text import TextModel

TEXTS = [
    "hi",
    ' "quoted" \\ back',
    "line\nbreak\t",
    "naïve 日本語 🎉",
    "\u2028\x00\x1f",
    "</script>",
]


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("include_usage", [True, False])
def test_a_text_chunk_is_the_shapes_chunk_byte_for_byte(
    real_text: TextModel, chat: bool, include_usage: bool
) -> None:
    job = Job(
        request_id="r1", model="m", prompt_ids=[1], sampling=Sampling(max_tokens=8), deadline=0.0
    )
    shape = Shape(chat=chat, response_id="chatcmpl-r1", model="m")
    p = Prepared(job, shape, real_text, [], True, include_usage, Usage(prompt_tokens=1))
    writer = OpenAIWriter(p, dict)
    for text in TEXTS:
        (chunk,) = writer.text(Delta(text))
        assert chunk == sse.data(shape.chunk(text, with_usage_field=include_usage))
        body = json.loads(chunk.removeprefix(b"data: "))
        choice = body["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == text

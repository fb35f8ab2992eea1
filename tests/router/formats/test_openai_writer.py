"""The OpenAI writer's chunks: a text chunk made from its precomputed bytes is the very chunk
the response shape describes, whatever the text holds."""

from __future__ import annotations

import json

import pytest

from services.router.dispatch.job import Job
from services.router.formats import wire
from services.router.formats.openai_writer import OpenAIWriter
from services.router.request.answer import Delta
from services.router.request.conversation import Conversation
from services.router.request.prepare import Prepared, Usage
from shared.messages.sampling import SamplingParams
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
    sampling = SamplingParams(max_tokens=8)
    job = Job(request_id="r1", model="m", prompt_ids=[1], sampling=sampling, deadline=0.0)
    conv = Conversation("m", prompt=None if chat else "hi", include_usage=include_usage)
    writer = OpenAIWriter(Prepared(job, conv, real_text, Usage(prompt_tokens=1)))
    bodies = writer.bodies
    for text in TEXTS:
        (chunk,) = writer.text(Delta(text))
        assert chunk == wire.data(bodies.chunk(text, with_usage_field=include_usage))
        body = json.loads(chunk.removeprefix(b"data: "))
        choice = body["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == text

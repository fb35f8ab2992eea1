"""Every generation endpoint's format, in one table: its adapter in (a body → a
``Conversation``), its writer out (a prepared request → the answer's body or stream), how its
errors are written, and its body's model. The HTTP API serves these routes, a batch may run
lines of any of them, and the OpenAPI document describes them from here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from pydantic import BaseModel

from services.router.errors import ApiError
from services.router.formats import anthropic, anthropic_writer, openai, openai_writer, responses
from services.router.formats.anthropic_writer import MessageWriter
from services.router.formats.openai_writer import OpenAIWriter
from services.router.formats.responses_writer import ResponseWriter
from services.router.request.answer import Writer
from services.router.request.conversation import Conversation
from services.router.request.prepare import Prepared


@dataclass(frozen=True)
class Endpoint:
    path: str
    adapter: Callable[[bytes], Conversation]
    writer: Callable[[Prepared], Writer]
    error_body: Callable[[ApiError], dict]
    body: type[BaseModel]


ENDPOINTS: dict[str, Endpoint] = {
    e.path: e
    for e in (
        Endpoint(
            "/v1/chat/completions",
            partial(openai.conversation, chat=True),
            OpenAIWriter,
            openai_writer.error_body,
            openai.ChatRequest,
        ),
        Endpoint(
            "/v1/completions",
            partial(openai.conversation, chat=False),
            OpenAIWriter,
            openai_writer.error_body,
            openai.CompletionRequest,
        ),
        Endpoint(
            "/v1/messages",
            anthropic.conversation,
            MessageWriter,
            anthropic_writer.error_body,
            anthropic.MessagesRequest,
        ),
        Endpoint(
            "/v1/responses",
            responses.conversation,
            ResponseWriter,
            openai_writer.error_body,
            responses.ResponsesRequest,
        ),
    )
}

# Anthropic's token count: the Messages body's prompt, counted (no answer, no writer).
COUNT_TOKENS = "/v1/messages/count_tokens"
count_conversation = anthropic.count_conversation
count_error_body = anthropic_writer.error_body

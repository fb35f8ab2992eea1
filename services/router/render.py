"""The one renderer: a conversation to the token ids the workers see.

Messages go through the model's chat template (images as unguessable markers, then each as
its placeholder tokens, hashed by content); a raw prompt is tokenized as it is, or taken as
token ids. The same conversation gives the same ids whichever API format carried it.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from dataclasses import dataclass

from services.router.conversation import Conversation, Image, Text, Tool, ToolCall, ToolResult
from services.router.dispatch.encodes import ImageInput
from services.router.images import join_prompt
from services.router.openai_api import ApiError
from services.router.tokens import PromptTokenizer, Segments
from shared.messages.generate import ImageRef
from shared.model.grammar import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from shared.model.text import TextModel
from shared.telemetry.tracing import tracer

LONG_TEXT_CHARS = 8192  # above this, tokenizing takes milliseconds: off the event loop


@dataclass(frozen=True)
class Rendered:
    ids: list[int]
    segments: Segments  # what the ids were tokenized from (a next turn reuses their hashes)
    images: tuple[ImageRef, ...] = ()  # each image's placeholder tokens


class Renderer:
    def __init__(self, token_cache_tokens: int) -> None:
        self.token_cache_tokens = token_cache_tokens
        self._tokenizers: dict[str, PromptTokenizer] = {}

    def add(self, name: str, model: TextModel) -> None:
        """Render for the model ``name`` from now on (its tokenizer, with a cache of
        segments)."""
        self._tokenizers[name] = PromptTokenizer(model.tokenizer, self.token_cache_tokens)

    async def render(
        self, conv: Conversation, model: TextModel, images: list[ImageInput]
    ) -> Rendered:
        """``images``: the conversation's, read and checked, in order."""
        if conv.chat:
            nonce = uuid.uuid4().hex  # a client cannot forge a marker it cannot guess
            marker = f"\x00kvmesh-image-{nonce}-"
            text = model.chat_template.render(chat_messages(conv, marker))
            return await self._with_images(conv.model, text, marker, images)
        if isinstance(conv.prompt, str):
            return Rendered(*await self.encode(conv.model, conv.prompt))
        assert conv.prompt is not None
        vocab = model.config.vocab_size
        bad = next((t for t in conv.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary", param="prompt")
        return Rendered(list(conv.prompt), ())

    async def encode(self, model: str, text: str) -> tuple[list[int], Segments]:
        """Token ids and their segments; a long text is tokenized on a thread, so other
        requests keep moving."""
        with tracer.start_as_current_span("tokenize") as span:
            tokenizer = self._tokenizers[model]
            if len(text) < LONG_TEXT_CHARS:
                ids, segments = tokenizer.encode_segments(text)
            else:
                loop = asyncio.get_running_loop()
                ids, segments = await loop.run_in_executor(None, tokenizer.encode_segments, text)
            span.set_attributes({"chars": len(text), "tokens": len(ids)})
        return ids, segments

    async def _with_images(
        self, model: str, rendered: str, marker: str, images: list[ImageInput]
    ) -> Rendered:
        """Token ids of a rendered chat whose images are markers: the text between them
        tokenized, each image as its placeholder tokens (hashed by its content)."""
        if not images:
            return Rendered(*await self.encode(model, rendered))
        pieces = re.split(re.escape(marker) + r"(\d+)\x00", rendered)
        order = [int(k) for k in pieces[1::2]]
        if order != list(range(len(images))):
            raise ApiError(500, "the chat template lost or reordered images", code="internal")
        parts: list = []
        for n, piece in enumerate(pieces):
            if n % 2:
                parts.append(images[int(piece)])
            elif piece:
                parts.append(await self.encode(model, piece))
        return Rendered(*join_prompt(parts))


# Tools in the prompt (the model's own template has no tool syntax): a Hermes-style preamble
# at the end of the system prompt, each call as <tool_call> JSON, results as <tool_response>
# in a user turn. One form whichever API carried them, so a tool-heavy conversation keeps its
# cache hits across formats.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    "{tools}\n</tools>\n\nFor each function call, return a json object with function name "
    "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tool_spec(tool: Tool) -> str:
    spec: dict = {"name": tool.name}
    if tool.description:
        spec["description"] = tool.description
    spec["parameters"] = tool.parameters
    return json.dumps({"type": "function", "function": spec}, ensure_ascii=False)


def call_text(call: ToolCall) -> str:
    """A call as the model writes it (and as the grammar forces it)."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def result_text(result: ToolResult) -> str:
    return f"<tool_response>\n{result.content}\n</tool_response>"


def chat_messages(conv: Conversation, marker: str) -> list[dict[str, str]]:
    """The messages for the chat template; image k (in order) as ``{marker}{k}\\0``; tool
    results as user turns (consecutive ones in one), tools described in the system prompt."""
    out: list[dict[str, str]] = []
    k = 0
    last_was_tool = False
    for m in conv.messages:
        if m.role == "tool":
            text = "\n".join(result_text(p) for p in m.parts if isinstance(p, ToolResult))
            if last_was_tool:
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
            last_was_tool = True
            continue
        last_was_tool = False
        text, calls = [], []
        for part in m.parts:
            if isinstance(part, Text):
                text.append(part.text)
            elif isinstance(part, Image):
                text.append(f"{marker}{k}\x00")
                k += 1
            elif isinstance(part, ToolCall):
                calls.append(call_text(part))
        content = "".join(text)
        if calls:
            sep = "" if not content or content.endswith("\n") else "\n"
            content += sep + "\n".join(calls)
        out.append({"role": m.role, "content": content})
    if conv.tools:
        preamble = TOOLS_PREAMBLE.format(tools="\n".join(tool_spec(t) for t in conv.tools))
        if out and out[0]["role"] == "system":
            out[0]["content"] += "\n\n" + preamble
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out

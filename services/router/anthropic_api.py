"""The Anthropic Messages format's adapter: `POST /v1/messages` and its `count_tokens`.

A body is checked (every field Anthropic's API defines either works or is refused with a 400
naming it; unknown fields are refused too) and turned into the same ``Conversation`` the
OpenAI formats make, so a conversation renders to the same tokens whichever way it arrives.
The answer is written back as Anthropic's message, or its stream of events; errors in
Anthropic's shape.

Cache-safe normalisation: system blocks are joined with one fixed separator; `cache_control`
is accepted anywhere Anthropic allows it and changes no token (kvmesh caches every block
anyway); a system block that is an agent client's volatile attribution line
(``x-anthropic-billing-header: ...``) is dropped, since it changes on every request and would
break the prompt's cache from its first token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from services.router import conversation as conv
from services.router import sse
from services.router.openai_api import ApiError, parse_body, refuse_unserved
from services.router.toolcalls import calls_of

if TYPE_CHECKING:
    from services.router.generation import Delta, Prepared

SYSTEM_SEPARATOR = "\n"  # between system blocks: one, always (peers differ: "" or "\n")
VOLATILE_SYSTEM_PREFIXES = ("x-anthropic-billing-header:",)
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")

# HTTP status → Anthropic's error type.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


class _Body(BaseModel):
    # Strict, and nothing silently ignored: a field this server does not know is refused.
    model_config = ConfigDict(strict=True, extra="forbid")


class CacheControl(_Body):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list | None = None


class Base64Source(_Body):
    type: Literal["base64"]
    media_type: Literal["image/jpeg", "image/png", "image/gif", "image/webp"]
    data: str = Field(min_length=1)


class UrlSource(_Body):
    type: Literal["url"]
    url: str = Field(min_length=1)


class ImageBlock(_Body):
    type: Literal["image"]
    source: Annotated[Base64Source | UrlSource, Field(discriminator="type")]
    cache_control: CacheControl | None = None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    input: dict
    cache_control: CacheControl | None = None


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False  # rendered as the result's first word: "Error: ..."
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = (
            self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)
        )
        return f"Error: {text}" if self.is_error else text


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


class ToolDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class ToolChoiceIn(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1)
    disable_parallel_tool_use: bool | None = None  # a forced choice makes one call anyway

    def choice(self) -> conv.ToolChoice:
        if self.type == "tool":
            if self.name is None:
                raise ApiError(
                    400, "tool_choice.name: required with type tool", param="tool_choice.name"
                )
            return conv.ToolChoice("named", self.name)
        return conv.ToolChoice({"any": "required"}.get(self.type, self.type))


class Message(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Metadata(_Body):
    user_id: str | None = Field(default=None, max_length=256)


class MessagesRequest(_Body):
    model: str = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # top-level automatic caching: a no-op here
    service_tier: Literal["auto", "standard_only"] | None = None
    # Defined by Anthropic, not served (yet): refused with a 400 naming them.
    thinking: dict | None = None
    output_config: dict | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceIn | None = None
    mcp_servers: list | None = None
    container: str | None = None

    @field_validator("stop_sequences")
    @classmethod
    def _check_stops(cls, stops: list[str] | None) -> list[str] | None:
        if stops is not None and (len(stops) > 4 or not all(stops)):
            raise ValueError("at most 4 non-empty strings")
        return stops


class CountRequest(_Body):
    """`count_tokens`: what renders the prompt, nothing about the answer."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    cache_control: CacheControl | None = None
    thinking: dict | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceIn | None = None


NOT_SERVED = {
    "thinking": "extended thinking is not served by this model",
    "output_config": "output_config is not served yet",
    "mcp_servers": "MCP servers are not served",
    "container": "containers are not served",
}


def _system(system: str | list[TextBlock] | None) -> conv.Message | None:
    if system is None:
        return None
    blocks = [system] if isinstance(system, str) else [b.text for b in system]
    kept = [b for b in blocks if not b.lstrip().lower().startswith(VOLATILE_SYSTEM_PREFIXES)]
    if not kept:
        return None
    return conv.Message("system", (conv.Text(SYSTEM_SEPARATOR.join(kept)),), "system")


def _messages_of(m: Message, i: int) -> list[conv.Message]:
    """A message as the conversation's: a user message's tool results come first, as a
    tool message of their own (as OpenAI's formats send them)."""
    where = f"messages[{i}]"
    if isinstance(m.content, str):
        return [conv.Message(m.role, (conv.Text(m.content),), where)]
    results: list[conv.Part] = []
    parts: list[conv.Part] = []
    for j, b in enumerate(m.content):
        if isinstance(b, TextBlock):
            parts.append(conv.Text(b.text))
        elif isinstance(b, ToolUseBlock):
            if m.role != "assistant":
                param = f"{where}.content[{j}]"
                raise ApiError(400, f"{param}: tool_use blocks are the assistant's", param=param)
            parts.append(conv.ToolCall(b.id, b.name, b.input))
        elif isinstance(b, ToolResultBlock):
            param = f"{where}.content[{j}].tool_use_id"
            if m.role != "user":
                raise ApiError(400, f"{param}: tool_result blocks are the user's", param=param)
            results.append(conv.ToolResult(b.tool_use_id, b.text(), param))
        else:
            source = b.source
            if isinstance(source, Base64Source):
                url = f"data:{source.media_type};base64,{source.data}"
            else:
                url = source.url
            parts.append(conv.Image(url, f"{where}.content[{j}].source"))
    out = [conv.Message("tool", tuple(results), where, True)] if results else []
    if parts or not results:
        out.append(conv.Message(m.role, tuple(parts), where, True))
    return out


def _messages(req: MessagesRequest | CountRequest) -> tuple[conv.Message, ...]:
    system = _system(req.system)
    turns = tuple(t for i, m in enumerate(req.messages) for t in _messages_of(m, i))
    return ((system,) if system else ()) + turns


def _tools(req: MessagesRequest | CountRequest) -> dict:
    tools = tuple(
        conv.Tool(t.name, t.description or "", t.input_schema, f"tools[{i}].input_schema")
        for i, t in enumerate(req.tools or ())
    )
    choice = req.tool_choice.choice() if req.tool_choice else conv.ToolChoice()
    return {"tools": tools, "tool_choice": choice}


def conversation(body: bytes) -> conv.Conversation:
    """A Messages body as the conversation it carries."""
    req = parse_body(body, MessagesRequest)
    assert isinstance(req, MessagesRequest)
    refuse_unserved(req, NOT_SERVED)
    asked = conv.Asked(
        max_tokens=req.max_tokens,
        max_field="max_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        stop=tuple(req.stop_sequences or ()),
    )
    return conv.Conversation(req.model, asked, _messages(req), stream=req.stream, **_tools(req))


def count_conversation(body: bytes) -> conv.Conversation:
    """A count_tokens body: the conversation whose prompt is counted."""
    req = parse_body(body, CountRequest)
    assert isinstance(req, CountRequest)
    refuse_unserved(req, NOT_SERVED)
    return conv.Conversation(req.model, conv.Asked(max_tokens=1), _messages(req), **_tools(req))


# -- the answer ------------------------------------------------------------------------------


def error_body(err: ApiError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def stop_reason(finish: str, stop_sequence: str | None, called: bool = False) -> str:
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


def usage(prompt_tokens: int, cached: int, output: int, block_size: int) -> dict:
    """Anthropic's counts from kvmesh's one count: tokens read from the cache, tokens this
    request newly stored (its prompt's full blocks not cached before), and the rest."""
    stored = max(0, prompt_tokens // block_size * block_size - cached) if block_size else 0
    return {
        "input_tokens": prompt_tokens - cached - stored,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": stored,
        "output_tokens": output,
    }


def message(
    msg_id: str,
    model: str,
    content: list[dict],
    finish: str | None,
    stop_sequence: str | None,
    counts: dict,
) -> dict:
    """The whole message (``finish`` None: the one ``message_start`` carries, before any)."""
    called = any(b["type"] == "tool_use" for b in content)
    reason = stop_reason(finish, stop_sequence, called) if finish else None
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": reason,
        "stop_sequence": stop_sequence if reason == "stop_sequence" else None,
        "usage": counts,
    }


def tool_use(call_id: str, name: str, arguments: str) -> dict:
    try:
        args = json.loads(arguments)
    except ValueError:  # a call the answer's length cut short: what it has
        args = {}
    return {"type": "tool_use", "id": f"toolu_{call_id}", "name": name, "input": args}


class MessageWriter:
    """The answer as Anthropic's message, or its events: message_start, ping, then for each
    content block (text, or a tool_use) content_block_start, its deltas (text_delta,
    input_json_delta) and content_block_stop; message_delta (stop reason, usage),
    message_stop."""

    def __init__(self, p: Prepared, kvmesh: Callable[[], dict], block_size: int) -> None:
        self.p, self.kvmesh, self.block_size = p, kvmesh, block_size
        self.msg_id = f"msg_{p.job.request_id}"
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the kind of the block open now: "text", "tool_use"
        self.called = False

    def _usage(self) -> dict:
        u = self.p.usage
        return usage(u.prompt_tokens, u.cached_tokens, u.completion_tokens, self.block_size)

    def whole(self, answer: Delta) -> dict:
        content = [{"type": "text", "text": answer.text}] if answer.text else []
        content += [tool_use(c.id, c.name, c.arguments) for c in calls_of(answer.calls)]
        if not content:
            content = [{"type": "text", "text": ""}]
        body = message(
            self.msg_id,
            self.p.job.model,
            content,
            answer.finish_reason,
            answer.stop_sequence,
            self._usage(),
        )
        return {**body, "kvmesh": self.kvmesh()}

    def start(self) -> list[bytes]:
        start = message(self.msg_id, self.p.job.model, [], None, None, self._usage())
        return [
            sse.event("message_start", {"type": "message_start", "message": start}),
            sse.event("ping", {"type": "ping"}),
        ]

    def _open(self, block: dict) -> list[bytes]:
        out = self._close()
        self.open = block["type"]
        body = {"type": "content_block_start", "index": self.blocks, "content_block": block}
        self.blocks += 1
        return [*out, sse.event("content_block_start", body)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        body = {"type": "content_block_stop", "index": self.blocks - 1}
        return [sse.event("content_block_stop", body)]

    def _delta(self, delta: dict) -> bytes:
        body = {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}
        return sse.event("content_block_delta", body)

    def text(self, delta: Delta) -> list[bytes]:
        out = []
        if delta.text:
            if self.open != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": delta.text}))
        for e in delta.calls:
            if e.name:
                self.called = True
                block = tool_use(e.id, e.name, "{}")
                out += self._open(block)
            if e.arguments:
                out.append(self._delta({"type": "input_json_delta", "partial_json": e.arguments}))
            if e.done:
                out += self._close()
        return out

    def end(self, last: Delta) -> list[bytes]:
        assert last.finish_reason is not None
        out = self._close()
        if not self.blocks:  # an empty answer still has its (empty) text block
            out = [*self._open({"type": "text", "text": ""}), *self._close()]
        reason = stop_reason(last.finish_reason, last.stop_sequence, self.called)
        delta = {
            "stop_reason": reason,
            "stop_sequence": last.stop_sequence if reason == "stop_sequence" else None,
        }
        body = {
            "type": "message_delta",
            "delta": delta,
            "usage": self._usage(),
            "kvmesh": self.kvmesh(),
        }
        return [
            *out,
            sse.event("message_delta", body),
            sse.event("message_stop", {"type": "message_stop"}),
        ]

    def ping(self) -> bytes:
        return sse.event("ping", {"type": "ping"})

    def error(self, err: ApiError) -> list[bytes]:
        return [sse.event("error", error_body(err))]

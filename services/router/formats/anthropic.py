"""The Anthropic Messages format's adapter: `POST /v1/messages` and its `count_tokens`.

A body is checked (every field Anthropic's API defines either works or is refused with a 400
naming it; unknown fields are refused too) and turned into the same ``Conversation`` the
OpenAI formats make, so a conversation renders to the same tokens whichever way it arrives.
The answer is written back by ``anthropic_writer.py``.

Cache-safe normalisation: system blocks are joined with one fixed separator; `cache_control`
is accepted anywhere Anthropic allows it and changes no token (kvmesh caches every block
anyway); a system block that is an agent client's volatile attribution line
(``x-anthropic-billing-header: ...``) is dropped, since it changes on every request and would
break the prompt's cache from its first token.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from services.router.formats.wire import (
    NonEmpty,
    Unserved,
    integer,
    parse_body,
    refuse_unserved,
    sampling_of,
    unserved,
)
from services.router.formats.wire import StrictBody as _Body
from services.router.request import conversation as conv

SYSTEM_SEPARATOR = "\n"  # between system blocks: one, always (peers differ: "" or "\n")
VOLATILE_SYSTEM_PREFIXES = ("x-anthropic-billing-header:",)
MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


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


# What each side may send: tool results are the user's, tool calls the assistant's.
UserBlock = Annotated[TextBlock | ImageBlock | ToolResultBlock, Field(discriminator="type")]
AssistantBlock = Annotated[TextBlock | ImageBlock | ToolUseBlock, Field(discriminator="type")]
Block = UserBlock | AssistantBlock


class ToolDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class _Choice(_Body):
    disable_parallel_tool_use: bool | None = None  # a forced choice makes one call anyway


class AutoChoice(_Choice):
    type: Literal["auto"]


class AnyChoice(_Choice):
    type: Literal["any"]


class ToolNamedChoice(_Choice):
    type: Literal["tool"]
    name: str = Field(min_length=1)


class NoneChoice(_Body):
    type: Literal["none"]


ToolChoiceIn = Annotated[
    AutoChoice | AnyChoice | ToolNamedChoice | NoneChoice, Field(discriminator="type")
]


def _choice(choice: ToolChoiceIn | None) -> conv.ToolChoice:
    if choice is None:
        return conv.ToolChoice()
    if isinstance(choice, ToolNamedChoice):
        return conv.ToolChoice("named", choice.name)
    return conv.ToolChoice({"any": "required"}.get(choice.type, choice.type))


class UserMessage(_Body):
    role: Literal["user"]
    content: str | list[UserBlock]


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str | list[AssistantBlock]


Message = Annotated[UserMessage | AssistantMessage, Field(discriminator="role")]


class Metadata(_Body):
    user_id: str | None = Field(default=None, max_length=256)


class MessagesRequest(_Body):
    model: str = Field(min_length=1)
    max_tokens: integer(ge=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[NonEmpty], Field(max_length=4)] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: integer(ge=0) | None = None
    metadata: Metadata | None = None
    cache_control: CacheControl | None = None  # top-level automatic caching: a no-op here
    service_tier: Literal["auto", "standard_only"] | None = None
    # Defined by Anthropic, not served (yet): refused with a 400 naming them.
    thinking: Unserved = unserved("extended thinking is not served by this model")
    output_config: Unserved = unserved("output_config is not served")
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceIn | None = None
    mcp_servers: Unserved = unserved("MCP servers are not served")
    container: Unserved = unserved("containers are not served")


class CountRequest(_Body):
    """`count_tokens`: what renders the prompt, nothing about the answer."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    cache_control: CacheControl | None = None
    thinking: Unserved = unserved("extended thinking is not served by this model")
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoiceIn | None = None


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
            parts.append(conv.ToolCall(b.id, b.name, b.input))
        elif isinstance(b, ToolResultBlock):
            param = f"{where}.content[{j}].tool_use_id"
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
    return {"tools": tools, "tool_choice": _choice(req.tool_choice)}


def conversation(body: bytes) -> conv.Conversation:
    """A Messages body as the conversation it carries."""
    req = parse_body(body, MessagesRequest)
    assert isinstance(req, MessagesRequest)
    refuse_unserved(req)
    return conv.Conversation(
        req.model,
        _messages(req),
        sampling=sampling_of(req, stop=tuple(req.stop_sequences or ())),
        max_tokens=req.max_tokens,
        stream=req.stream,
        # (Anthropic's standard_only: the standard class, the key's default never raised)
        service_tier="default" if req.service_tier == "standard_only" else None,
        **_tools(req),
    )


def count_conversation(body: bytes) -> conv.Conversation:
    """A count_tokens body: the conversation whose prompt is counted."""
    req = parse_body(body, CountRequest)
    assert isinstance(req, CountRequest)
    refuse_unserved(req)
    return conv.Conversation(req.model, _messages(req), max_tokens=1, **_tools(req))

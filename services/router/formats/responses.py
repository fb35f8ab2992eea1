"""The OpenAI Responses format's adapter: `POST /v1/responses`, stateless.

``input`` (a string, or message items with text and image parts) and ``instructions`` become
the same ``Conversation`` the other formats make; the answer is written back as a response
object, or its stream of events (``responses_writer.py``). kvmesh keeps no responses:
``previous_response_id`` and ``store: true`` are refused with a 400 saying so, as is every
field it does not serve.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Literal

from pydantic import Field

from services.router.formats.wire import (
    NonEmpty,
    ServiceTier,
    Unserved,
    integer,
    parse_body,
    refuse_unserved,
    sampling_of,
    unserved,
)
from services.router.formats.wire import StrictBody as _Body
from services.router.request import conversation as conv


class InputText(_Body):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None


class InputImage(_Body):
    type: Literal["input_image"]
    image_url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] = "auto"


class Item(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Annotated[InputText | InputImage, Field(discriminator="type")]]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str
    id: str | None = None
    status: str | None = None


InputItem = Annotated[
    Item | FunctionCallItem | FunctionOutputItem, Field(union_mode="left_to_right")
]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedChoice(_Body):
    type: Literal["function"]
    name: str = Field(min_length=1)


class PlainText(_Body):
    type: Literal["text"]

    def answer(self) -> conv.JsonAnswer | None:
        return None


class JsonObject(_Body):
    type: Literal["json_object"]

    def answer(self) -> conv.JsonAnswer | None:
        return conv.JsonAnswer(None, "text.format")


class JsonSchemaText(_Body):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None

    def answer(self) -> conv.JsonAnswer | None:
        return conv.JsonAnswer(self.schema_, "text.format.schema")


TextFormat = Annotated[PlainText | JsonObject | JsonSchemaText, Field(discriminator="type")]


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str = Field(min_length=1)
    input: NonEmpty | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: Unserved = unserved("kvmesh keeps no responses (stateless); leave store unset or false")
    previous_response_id: Unserved = unserved(
        "kvmesh keeps no responses (stateless); send the whole conversation as input"
    )
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextOptions | None = None
    # Accepted, as in Chat Completions (openai_api.ChatRequest says why).
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    service_tier: ServiceTier | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced choice makes one call; auto, any
    # Defined by OpenAI, not served (yet): refused with a 400 naming them.
    reasoning: Unserved = unserved("reasoning is not served by this model")
    include: Unserved = unserved("no extra output is served")
    background: Unserved = unserved(
        "background responses are not served (kvmesh keeps no responses)"
    )


def conversation(body: bytes) -> conv.Conversation:
    req = parse_body(body, ResponsesRequest)
    assert isinstance(req, ResponsesRequest)
    refuse_unserved(req)
    messages: list[conv.Message] = []
    if req.instructions:
        messages.append(conv.Message("system", (conv.Text(req.instructions),), "instructions"))
    if isinstance(req.input, str):
        messages.append(conv.Message("user", (conv.Text(req.input),), "input"))
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, item, i)
    tools = tuple(
        conv.Tool(
            t.name,
            t.description or "",
            t.parameters if t.parameters is not None else conv.NO_PARAMETERS,
            f"tools[{i}].parameters",
        )
        for i, t in enumerate(req.tools or ())
    )
    choice = req.tool_choice
    named = choice.name if isinstance(choice, NamedChoice) else None
    return conv.Conversation(
        req.model,
        tuple(messages),
        sampling=sampling_of(req),
        max_tokens=req.max_output_tokens,
        max_tokens_field="max_output_tokens",
        json=req.text.format.answer() if req.text and req.text.format else None,
        stream=req.stream,
        tools=tools,
        tool_choice=conv.ToolChoice.of(choice if isinstance(choice, str) else None, named),
        service_tier=None if req.service_tier == "auto" else req.service_tier,
    )


def _add_item(messages: list[conv.Message], item: InputItem, i: int) -> None:
    """One input item onto the conversation: a function call joins the assistant message
    before it (an answer's text and its calls are one turn, as the other formats send it)."""
    where = f"input[{i}]"
    if isinstance(item, FunctionCallItem):
        args = conv.arguments_object(item.arguments, f"{where}.arguments")
        call = conv.ToolCall(item.call_id, item.name, args)
        last = messages[-1] if messages else None
        if last is not None and last.role == "assistant":
            messages[-1] = replace(last, parts=(*last.parts, call))
        else:
            messages.append(conv.Message("assistant", (call,), where, True))
    elif isinstance(item, FunctionOutputItem):
        result = conv.ToolResult(item.call_id, item.output, f"{where}.call_id")
        messages.append(conv.Message("tool", (result,), where))
    else:
        messages.append(_message(item, i))


def _message(item: Item, i: int) -> conv.Message:
    role = "system" if item.role == "developer" else item.role
    if isinstance(item.content, str):
        return conv.Message(role, (conv.Text(item.content),), f"input[{i}]")
    parts: list[conv.Part] = []
    for j, part in enumerate(item.content):
        if isinstance(part, InputText):
            parts.append(conv.Text(part.text))
        else:
            parts.append(conv.Image(part.image_url, f"input[{i}].content[{j}].image_url"))
    return conv.Message(role, tuple(parts), f"input[{i}]", True)

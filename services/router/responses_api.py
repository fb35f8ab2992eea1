"""The OpenAI Responses format's adapter: `POST /v1/responses`, stateless.

``input`` (a string, or message items with text and image parts) and ``instructions`` become
the same ``Conversation`` the other formats make; the answer is written back as a response
object, or its stream of events. kvmesh keeps no responses: ``previous_response_id`` and
``store: true`` are refused with a 400 saying so, as is every field it does not serve.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.router import conversation as conv
from services.router import sse
from services.router.openai_api import (
    NO_PARAMETERS,
    ApiError,
    Usage,
    parse_body,
    refuse_unserved,
    tool_choice,
)
from services.router.toolcalls import calls_of

if TYPE_CHECKING:
    from services.router.generation import Delta, Prepared


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


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


class TextFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def answer(self) -> conv.JsonAnswer | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return conv.JsonAnswer(None, "text.format")
        if self.schema_ is None or self.name is None:
            field = "text.format.schema" if self.schema_ is None else "text.format.name"
            raise ApiError(400, f"{field}: required with type json_schema", param=field)
        return conv.JsonAnswer(self.schema_, "text.format.schema")


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str = Field(min_length=1)
    input: str | list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextOptions | None = None
    # Accepted, as in Chat Completions (openai_api.ChatRequest says why).
    prompt_cache_key: str | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    safety_identifier: str | None = Field(default=None, max_length=256)
    service_tier: Literal["auto", "default"] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None  # a forced choice makes one call; auto, any
    # Defined by OpenAI, not served (yet): refused with a 400 naming them.
    reasoning: dict | None = None
    include: list | None = None
    background: bool | None = None


NOT_SERVED = {
    "reasoning": "reasoning is not served by this model",
    "include": "no extra output is served",
    "background": "background responses are not served (kvmesh keeps no responses)",
}


def conversation(body: bytes) -> conv.Conversation:
    req = parse_body(body, ResponsesRequest)
    assert isinstance(req, ResponsesRequest)
    if req.previous_response_id is not None:
        raise ApiError(
            400,
            "previous_response_id: kvmesh keeps no responses (stateless); send the whole "
            "conversation as input",
            param="previous_response_id",
        )
    if req.store:
        raise ApiError(
            400,
            "store: kvmesh keeps no responses (stateless); leave store unset or false",
            param="store",
        )
    refuse_unserved(req, NOT_SERVED)
    messages: list[conv.Message] = []
    if req.instructions:
        messages.append(conv.Message("system", (conv.Text(req.instructions),), "instructions"))
    if isinstance(req.input, str):
        messages.append(conv.Message("user", (conv.Text(req.input),), "input"))
    else:
        for i, item in enumerate(req.input):
            _add_item(messages, item, i)
    asked = conv.Asked(
        max_tokens=req.max_output_tokens,
        max_field="max_output_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        json=req.text.format.answer() if req.text and req.text.format else None,
    )
    tools = tuple(
        conv.Tool(
            t.name,
            t.description or "",
            t.parameters if t.parameters is not None else NO_PARAMETERS,
            f"tools[{i}].parameters",
        )
        for i, t in enumerate(req.tools or ())
    )
    choice = req.tool_choice
    named = choice.name if isinstance(choice, NamedChoice) else None
    picked = tool_choice(choice if isinstance(choice, str) else None, named)
    return conv.Conversation(
        req.model, asked, tuple(messages), stream=req.stream, tools=tools, tool_choice=picked
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


# -- the answer ------------------------------------------------------------------------------


def usage(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def response(
    resp_id: str, model: str, output: list[dict] | None, finish: str | None, u: Usage | None
) -> dict:
    """The response object (``finish`` None: in progress, as ``response.created`` shows it)."""
    done = finish is not None
    return {
        "id": resp_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": ("incomplete" if finish == "length" else "completed") if done else "in_progress",
        "model": model,
        "output": output or [],
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "error": None,
        "instructions": None,
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": {"type": "text"}},
        "store": False,
        "usage": usage(u) if done and u is not None else None,
    }


def message_item(resp_id: str, text: str, status: str) -> dict:
    return {
        "type": "message",
        "id": f"msg_{resp_id.removeprefix('resp_')}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if text else [],
    }


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": f"fc_{call_id}",
        "call_id": f"call_{call_id}",
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseWriter:
    """The answer as a response object, or its events: response.created, .in_progress; for
    text, .output_item.added (a message), .content_part.added, .output_text.delta…,
    .output_text.done, .content_part.done, .output_item.done; for each tool call,
    .output_item.added (a function_call), .function_call_arguments.delta…, .done,
    .output_item.done; then .completed (or .incomplete)."""

    def __init__(self, p: Prepared, kvmesh: Callable[[], dict]) -> None:
        self.p, self.kvmesh = p, kvmesh
        self.resp_id = f"resp_{p.job.request_id}"
        self.output: list[dict] = []  # the items done
        self.parts: list[str] = []  # the open message item's text
        self.call: dict | None = None  # the open function_call item
        self._seq = itertools.count()

    def _event(self, kind: str, **fields: object) -> bytes:
        return sse.event(kind, {"type": kind, "sequence_number": next(self._seq), **fields})

    def _final(self, output: list[dict], finish: str | None) -> dict:
        body = response(self.resp_id, self.p.job.model, output, finish, self.p.usage)
        return {**body, "kvmesh": self.kvmesh()}

    def whole(self, answer: Delta) -> dict:
        output = [message_item(self.resp_id, answer.text, "completed")] if answer.text else []
        output += [
            call_item(c.id, c.name, c.arguments, "completed") for c in calls_of(answer.calls)
        ]
        if not output:
            output = [message_item(self.resp_id, "", "completed")]
        return self._final(output, answer.finish_reason)

    def start(self) -> list[bytes]:
        started = response(self.resp_id, self.p.job.model, None, None, None)
        return [
            self._event("response.created", response=started),
            self._event("response.in_progress", response=started),
        ]

    @property
    def _where(self) -> dict:
        item_id = f"msg_{self.resp_id.removeprefix('resp_')}"
        return {"item_id": item_id, "output_index": len(self.output), "content_index": 0}

    def _open_message(self) -> list[bytes]:
        self.parts = [""]
        item = message_item(self.resp_id, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": []}
        return [
            self._event("response.output_item.added", output_index=len(self.output), item=item),
            self._event("response.content_part.added", **self._where, part=part),
        ]

    def _close_message(self) -> list[bytes]:
        if not self.parts:
            return []
        text, self.parts = "".join(self.parts), []
        part = {"type": "output_text", "text": text, "annotations": []}
        done = message_item(self.resp_id, text, "completed")
        out = [
            self._event("response.output_text.done", **self._where, text=text),
            self._event("response.content_part.done", **self._where, part=part),
            self._event("response.output_item.done", output_index=len(self.output), item=done),
        ]
        self.output.append(done)
        return out

    def text(self, delta: Delta) -> list[bytes]:
        out = []
        if delta.text:
            if not self.parts:
                out += self._open_message()
            self.parts.append(delta.text)
            out.append(self._event("response.output_text.delta", **self._where, delta=delta.text))
        for e in delta.calls:
            if e.name:
                out += self._close_message()
                self.call = call_item(e.id, e.name, "", "in_progress")
                out.append(
                    self._event(
                        "response.output_item.added", output_index=len(self.output), item=self.call
                    )
                )
            assert self.call is not None
            where = {"item_id": self.call["id"], "output_index": len(self.output)}
            if e.arguments:
                self.call["arguments"] += e.arguments
                out.append(
                    self._event(
                        "response.function_call_arguments.delta", **where, delta=e.arguments
                    )
                )
            if e.done:
                args = self.call["arguments"]
                done = {**self.call, "status": "completed"}
                out += [
                    self._event("response.function_call_arguments.done", **where, arguments=args),
                    self._event("response.output_item.done", **where, item=done),
                ]
                self.output.append(done)
                self.call = None
        return out

    def end(self, last: Delta) -> list[bytes]:
        out = self._close_message()
        if not self.output:  # an empty answer: its (empty) message
            out = [*self._open_message(), *self._close_message()]
        final = self._final(self.output, last.finish_reason)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        return [*out, self._event(kind, response=final)]

    def ping(self) -> bytes:
        return sse.COMMENT_PING

    def error(self, err: ApiError) -> list[bytes]:
        return [self._event("error", code=err.code, message=err.message)]

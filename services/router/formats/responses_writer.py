"""The OpenAI Responses format's writer: the answer as a response object, or its stream of
events. Pure: deltas in, bytes (or the body's dict) out."""

from __future__ import annotations

import itertools
import time

from services.router.errors import ApiError
from services.router.formats import wire
from services.router.request.answer import Delta
from services.router.request.prepare import Prepared, Usage
from services.router.request.toolcalls import calls_of


def usage(u: Usage) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def response(
    resp_id: str,
    model: str,
    output: list[dict] | None,
    finish: str | None,
    u: Usage | None,
    service_tier: str = "default",
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
        "service_tier": service_tier,
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

    def __init__(self, p: Prepared) -> None:
        self.p, self.kvmesh = p, p.kvmesh
        self.resp_id = f"resp_{p.job.request_id}"
        self.output: list[dict] = []  # the items done
        self.parts: list[str] = []  # the open message item's text
        self.call: dict | None = None  # the open function_call item
        self._seq = itertools.count()

    def _event(self, kind: str, **fields: object) -> bytes:
        return wire.event(kind, {"type": kind, "sequence_number": next(self._seq), **fields})

    def _final(self, output: list[dict], finish: str | None) -> dict:
        p = self.p
        body = response(self.resp_id, p.job.model, output, finish, p.usage, p.job.priority)
        return {**body, "kvmesh": self.kvmesh()}

    def whole(self, answers: list[Delta]) -> dict:
        (answer,) = answers  # (one choice: the format has no n)
        output = [message_item(self.resp_id, answer.text, "completed")] if answer.text else []
        output += [
            call_item(c.id, c.name, c.arguments, "completed") for c in calls_of(answer.calls)
        ]
        if not output:
            output = [message_item(self.resp_id, "", "completed")]
        return self._final(output, answer.finish_reason)

    def start(self) -> list[bytes]:
        started = response(self.resp_id, self.p.job.model, None, None, None, self.p.job.priority)
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
        return wire.COMMENT_PING

    def error(self, err: ApiError) -> list[bytes]:
        return [self._event("error", code=err.code, message=err.message)]

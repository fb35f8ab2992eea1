"""The Anthropic Messages format's writer: the answer as Anthropic's message, or its stream of
events; errors in Anthropic's shape. Pure: deltas in, bytes (or the body's dict) out."""

from __future__ import annotations

import json

from services.router.errors import ApiError
from services.router.formats import wire
from services.router.request.answer import Delta
from services.router.request.prepare import Prepared
from services.router.request.toolcalls import calls_of

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


def error_body(err: ApiError) -> dict:
    kind = ERROR_TYPES.get(err.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def stop_reason(finish: str, stop_sequence: str | None, called: bool = False) -> str:
    if finish == "length":
        return "max_tokens"
    if called:
        return "tool_use"
    return "stop_sequence" if stop_sequence else "end_turn"


def usage(
    prompt_tokens: int, cached: int, output: int, block_size: int, tier: str = "default"
) -> dict:
    """Anthropic's counts from kvmesh's one count: tokens read from the cache, tokens this
    request newly stored (its prompt's full blocks not cached before), and the rest; and the
    class it ran at (Anthropic's ``standard`` is kvmesh's default)."""
    stored = max(0, prompt_tokens // block_size * block_size - cached) if block_size else 0
    return {
        "input_tokens": prompt_tokens - cached - stored,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": stored,
        "output_tokens": output,
        "service_tier": "standard" if tier == "default" else tier,
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

    def __init__(self, p: Prepared) -> None:
        self.p, self.kvmesh, self.block_size = p, p.kvmesh, p.block_size
        self.msg_id = f"msg_{p.job.request_id}"
        self.blocks = 0  # content blocks started
        self.open: str | None = None  # the kind of the block open now: "text", "tool_use"
        self.called = False

    def _usage(self) -> dict:
        u = self.p.usage
        return usage(
            u.prompt_tokens,
            u.cached_tokens,
            u.completion_tokens,
            self.block_size,
            self.p.job.priority,
        )

    def whole(self, answers: list[Delta]) -> dict:
        (answer,) = answers  # (one choice: the format has no n)
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
            wire.event("message_start", {"type": "message_start", "message": start}),
            wire.event("ping", {"type": "ping"}),
        ]

    def _open(self, block: dict) -> list[bytes]:
        out = self._close()
        self.open = block["type"]
        body = {"type": "content_block_start", "index": self.blocks, "content_block": block}
        self.blocks += 1
        return [*out, wire.event("content_block_start", body)]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        body = {"type": "content_block_stop", "index": self.blocks - 1}
        return [wire.event("content_block_stop", body)]

    def _delta(self, delta: dict) -> bytes:
        body = {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta}
        return wire.event("content_block_delta", body)

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
            wire.event("message_delta", body),
            wire.event("message_stop", {"type": "message_stop"}),
        ]

    def ping(self) -> bytes:
        return wire.event("ping", {"type": "ping"})

    def error(self, err: ApiError) -> list[bytes]:
        return [wire.event("error", error_body(err))]

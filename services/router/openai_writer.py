"""The OpenAI formats' writer: the answer as a Chat Completions or Completions body, or as
their chunks (``data:`` lines ending with ``[DONE]``)."""

from __future__ import annotations

from collections.abc import Callable

from services.router import sse
from services.router.generation import Delta, Prepared
from services.router.openai_api import ApiError


class OpenAIWriter:
    """The answer as a Chat Completions or Completions body, or as their chunks."""

    def __init__(self, p: Prepared, kvmesh: Callable[[], dict]) -> None:
        self.p, self.kvmesh = p, kvmesh
        self.shape = p.shape
        self.usage_field = p.include_usage  # with include_usage, chunks carry "usage": null

    def whole(self, text: str, last: Delta) -> dict:
        return self.shape.response(text, last.finish_reason or "stop", self.p.usage, self.kvmesh())

    def start(self) -> list[bytes]:
        if not self.shape.chat:
            return []
        return [sse.data(self.shape.chunk("", first=True, with_usage_field=self.usage_field))]

    def text(self, text: str) -> list[bytes]:
        return [sse.data(self.shape.chunk(text, with_usage_field=self.usage_field))]

    def end(self, last: Delta) -> list[bytes]:
        out = [
            sse.data(self.shape.chunk(None, last.finish_reason, with_usage_field=self.usage_field))
        ]
        return out + self._closing()

    def error(self, err: ApiError) -> list[bytes]:
        body = {"error": {"message": err.message, "type": "server_error", "code": err.code}}
        return [sse.data(body), *self._closing()]

    def _closing(self) -> list[bytes]:
        out = []
        if self.p.include_usage:
            out.append(sse.data(self.shape.usage_chunk(self.p.usage, self.kvmesh())))
        return [*out, sse.data("[DONE]")]

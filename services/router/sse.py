"""Server-sent events as bytes: OpenAI's unnamed ``data:`` lines, or named events
(Anthropic's and OpenAI Responses' streams)."""

from __future__ import annotations

import json


def data(obj: dict | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def event(name: str, obj: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


COMMENT_PING = b": ping\n\n"  # a comment line: clients skip it, proxies see traffic

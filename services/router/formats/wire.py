"""What every API format shares on the wire: strict request bodies checked into a 400 that names
the field (and query parameters), the sampling fields a body carries over by name, and
server-sent event framing (OpenAI's unnamed ``data:`` lines, and the named events of
Anthropic's and OpenAI Responses' streams)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields

from pydantic import BaseModel, ConfigDict, ValidationError

from services.router.errors import ApiError
from shared.engine.sampling import SamplingParams


class StrictBody(BaseModel):
    """A request body (or a part of one). Strict: "5" is not a number. A field the API does
    not define is refused (as OpenAI and Anthropic do), so nothing a client sends is silently
    ignored."""

    model_config = ConfigDict(strict=True, extra="forbid")


def parse_body(body: bytes, kind: type[BaseModel]) -> BaseModel:
    """The request body, checked; ApiError(400) names the first bad field."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-after"))
        if first["type"] == "json_invalid":
            raise ApiError(400, f"request body is not valid JSON: {first['msg']}") from None
        if first["type"] == "model_type" and not loc:
            raise ApiError(400, "request body must be a JSON object") from None
        if first["type"] == "extra_forbidden":
            raise ApiError(400, f"{loc}: not a field this API accepts", param=loc) from None
        msg = first["msg"].removeprefix("Value error, ")
        if loc and msg.startswith(loc + ":"):
            msg = msg[len(loc) + 1 :].strip()
        raise ApiError(400, f"{loc or 'body'}: {msg}", param=loc or None) from None


def refuse_unserved(req: BaseModel, not_served: dict[str, str]) -> None:
    """400 naming the first field the format defines that this server does not serve."""
    for name, why in not_served.items():
        if getattr(req, name, None) is not None:
            raise ApiError(400, f"{name}: {why}", param=name)


# Sampling fields a body names as the engine does, but shapes otherwise: each format's
# adapter converts these itself; every other field of the same name is carried over as it is.
CONVERTED = frozenset({"max_tokens", "stop", "logit_bias", "logprobs"})
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


def sampling_of(req: BaseModel, **converted: object) -> SamplingParams:
    """The sampling a checked body asks for: its fields named as ``SamplingParams``'s (those
    it set), with ``converted`` (the fields it shapes its own way)."""
    names = (SAMPLING_FIELDS & type(req).model_fields.keys()) - CONVERTED
    asked = {n: v for n in names if (v := getattr(req, n)) is not None}
    return SamplingParams(**asked, **converted)


def query_int(query: Mapping[str, str], name: str, default: int, most: int) -> int:
    """A query parameter from 1 to ``most``; ApiError(400) naming it otherwise."""
    try:
        value = int(query.get(name, str(default)))
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise ApiError(400, f"{name}: 1 to {most}", param=name)
    return value


def data(obj: dict | str) -> bytes:
    payload = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def event(name: str, obj: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


COMMENT_PING = b": ping\n\n"  # a comment line: clients skip it, proxies see traffic

"""What every API format shares on the wire: strict request bodies checked into a 400 that names
the field (and query parameters), the sampling fields a body carries over by name, and
server-sent event framing (OpenAI's unnamed ``data:`` lines, and the named events of
Anthropic's and OpenAI Responses' streams)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
)

from services.router.errors import ApiError
from shared.messages.sampling import SamplingParams

# OpenAI's service tiers (Chat Completions, Completions, Responses): the request's class
# (shared/messages/generate.py), within its key's ceiling; auto: its key's default.
ServiceTier = Literal["auto", "default", "flex", "priority"]


def _only_false(value: bool) -> bool:
    if value:
        raise ValueError("only false is taken here")
    return value


# A flag of which only false is served (a Literal[False] would take 0, which equals False).
FalseOnly = Annotated[bool, AfterValidator(_only_false), Field(json_schema_extra={"const": False})]


class StrictBody(BaseModel):
    """A request body (or a part of one). Strict: "5" is not a number. A field the API does
    not define is refused (as OpenAI and Anthropic do), so nothing a client sends is silently
    ignored. Only keys go to pydantic's string cache: a body's texts rarely repeat, and the
    cache (process-wide) would keep them."""

    model_config = ConfigDict(strict=True, extra="forbid", cache_strings="keys")


def parse_body(body: bytes, kind: type[BaseModel]) -> BaseModel:
    """The request body, checked; ApiError(400) names the bad field (of a union's errors,
    the one that reached deepest into what was sent), as ``messages[1].content``."""
    try:
        return kind.model_validate_json(body)
    except ValidationError as err:
        errors = err.errors()
        sent = None
        if errors[0]["type"] not in ("json_invalid", "model_type"):
            sent = json.loads(body)
        paths = [_field_path(sent, e) for e in errors]
        # A union's members each fail: the one meant failed on a constraint (not on the
        # value's type), and reached deepest into what was sent.
        deepest = max(
            range(len(errors)),
            key=lambda i: (not _mismatch(errors[i]["type"]), len(paths[i]), -i),
        )
        first, loc = errors[deepest], _named(paths[deepest])
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


NonEmpty = Annotated[str, Field(min_length=1)]


def _integral(value: object) -> object:
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**limits: int) -> Any:  # noqa: ANN401 (a type, for an annotation)
    """An integer as JSON Schema counts them (5.0 is one: it is 5; "5" is not), within
    ``limits`` (ge, le), which /openapi.json states."""
    return Annotated[int, Field(**limits), BeforeValidator(_integral)]


# A field a format defines that kvmesh does not serve: taken when it asks for nothing (null,
# false, "", [] or {}, as clients often send the default), refused with a 400 naming it and
# why otherwise. /openapi.json says exactly that.
NOT_SERVED = "x-kvmesh-not-served"
Unserved = Annotated[
    Any,
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "null"},
                {"const": False},
                {"const": ""},
                {"type": "array", "maxItems": 0},
                {"type": "object", "maxProperties": 0},
            ]
        }
    ),
]


def unserved(why: str) -> Any:  # noqa: ANN401 (a pydantic FieldInfo, as Field returns)
    """The field's default and description for an ``Unserved`` field."""
    return Field(
        default=None,
        description=f"not served: {why} (only an empty value is taken)",
        json_schema_extra={NOT_SERVED: why},
    )


def refuse_unserved(req: BaseModel) -> None:
    """400 naming the first field not served here that asks for something."""
    for name, info in type(req).model_fields.items():
        why = (info.json_schema_extra or {}).get(NOT_SERVED)  # type: ignore[union-attr]
        if why and not _inert(getattr(req, name)):
            raise ApiError(400, f"{name}: {why}", param=name)


def _field_path(sent: object, error: dict) -> list[str | int]:
    """The error's place less pydantic's own steps (a union member's name, a tag): those
    that are not a key or an index of what was sent; but a field that is missing is named,
    as is the field that tells a union's members apart (``role``) when it is wrong."""
    loc, kind = error["loc"], error["type"]
    path: list[str | int] = []
    for step in loc:
        if (
            isinstance(sent, dict)
            and step in sent
            or isinstance(sent, list)
            and isinstance(step, int)
            and 0 <= step < len(sent)
        ):
            sent = sent[step]
        else:
            continue
        path.append(step)
    if kind == "missing" and loc and isinstance(loc[-1], str):
        path.append(loc[-1])
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        path.append(str(error.get("ctx", {}).get("discriminator", "")).strip("'"))
    return path


def _mismatch(kind: str) -> bool:
    """An error that says the value is of another kind (another union member was meant)."""
    return kind.endswith(("_type", "_parsing")) or kind == "literal_error"


def _named(path: list[str | int]) -> str:
    out = ""
    for step in path:
        out += f"[{step}]" if isinstance(step, int) else f".{step}" if out else step
    return out


def _inert(value: object) -> bool:
    return value is None or value is False or (type(value) in (str, list, dict) and not value)


# Sampling fields a body names as the engine does, but shapes otherwise: each format's
# adapter converts these itself; every other field of the same name is carried over as it is.
CONVERTED = frozenset(
    {"max_tokens", "stop", "stop_token_ids", "logit_bias", "logprobs", "prompt_logprobs"}
)
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

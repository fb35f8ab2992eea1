"""GET /openapi.json: the router's HTTP API as it is, built from its route table and the
request models the handlers parse (a route without a description here fails the build, so
the document cannot fall behind the routes)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from services.router.api.dashboard import MAX_LISTED, MAX_SERIES_MINUTES
from services.router.batch.api import MAX_LISTED as MAX_BATCHES_LISTED
from services.router.formats.adapters import LoadAdapter, UnloadAdapter
from services.router.formats.anthropic import CountRequest
from services.router.formats.batches import BatchCreate
from services.router.formats.endpoints import COUNT_TOKENS, ENDPOINTS

# path (or "METHOD path" where a path's methods differ) → (summary, the body's model or
# None, the error statuses it can answer with)
GENERATION_ERRORS = (400, 401, 404, 413, 429, 503, 504)
SUMMARIES = {  # the generation endpoints' (their bodies: the format table's)
    "/v1/chat/completions": "A chat completion, whole or as server-sent events (OpenAI's "
    "Chat Completions)",
    "/v1/completions": "A text completion, whole or as server-sent events (OpenAI's Completions)",
    "/v1/messages": "A message, whole or as Anthropic's stream of events (Anthropic's Messages)",
    "/v1/responses": "A response, whole or as its stream of events (OpenAI's Responses; stateless)",
}

ROUTES: dict[str, tuple[str, type[BaseModel] | None, tuple[int, ...]]] = {
    **{
        path: (SUMMARIES[path], endpoint.body, GENERATION_ERRORS)
        for path, endpoint in ENDPOINTS.items()
    },
    COUNT_TOKENS: (
        "The exact prompt tokens of a Messages request (the same renderer)",
        CountRequest,
        (400, 401, 404, 413),
    ),
    "POST /v1/files": ("Upload a file (multipart: file, purpose=batch)", None, (400, 401, 413)),
    "/v1/files": ("The caller's files (?purpose=)", None, (401,)),
    "GET /v1/files/{file_id}": ("A file's description", None, (401, 404)),
    "DELETE /v1/files/{file_id}": ("Delete a file", None, (401, 404)),
    "/v1/files/{file_id}/content": ("A file's bytes", None, (401, 404)),
    "POST /v1/batches": ("Create a batch from an uploaded file", BatchCreate, (400, 401, 404)),
    "/v1/batches": ("The caller's batches, newest first (?limit=, ?after=)", None, (400, 401)),
    "/v1/batches/{batch_id}": ("A batch: its status, counts and files", None, (401, 404)),
    "/v1/batches/{batch_id}/cancel": ("Cancel a batch", None, (401, 404, 409)),
    "/dashboard": ("The operator's page (HTML; it asks for an admin key)", None, ()),
    "/dashboard/app.js": ("The page's script", None, ()),
    "/dashboard/style.css": ("The page's style", None, ()),
    "/v1/dashboard/mesh": ("Every service by role, and those gone lately", None, (401, 403)),
    "/v1/dashboard/series": ("The mesh's figures minute by minute", None, (400, 401, 403)),
    "/v1/dashboard/requests": ("This router's recent requests", None, (400, 401, 403)),
    "/v1/dashboard/requests/{request_id}": (
        "A recent request with its routing decision and its spans from every service",
        None,
        (401, 403, 404),
    ),
    "/v1/models": ("The models a ready prefill and decode worker both serve", None, (401,)),
    "/v1/stats": (
        "The operator's summary, overall, per traffic class and per tenant",
        None,
        (401, 403),
    ),
    "/v1/plan": (
        "The prefill and decode pools the recent traffic needs for the plan's targets",
        None,
        (401, 403),
    ),
    "/v1/load_lora_adapter": (
        "Serve a LoRA adapter as a model of its own, from every worker of its base model",
        LoadAdapter,
        (400, 401, 403),
    ),
    "/v1/unload_lora_adapter": (
        "Serve a LoRA adapter no more (its requests in progress finish)",
        UnloadAdapter,
        (400, 401, 403, 404),
    ),
    "/health": ("Each role with its services; 503 while a role has none ready", None, ()),
    "/metrics": ("Prometheus metrics", None, ()),
    "/openapi.json": ("This document", None, ()),
}

# Bodies that are not JSON, by route.
UPLOAD = {
    "type": "object",
    "properties": {
        "file": {"type": "string", "format": "binary", "description": "JSON lines"},
        "purpose": {"const": "batch"},
    },
    "required": ["file", "purpose"],
    "additionalProperties": False,
}
OTHER_BODIES = {"POST /v1/files": {"multipart/form-data": {"schema": UPLOAD}}}

# Responses that are not errors though their status says so.
NOT_ERRORS = {"/health": {"503": {"description": "a role has no ready service (this document)"}}}

_LIMIT = {"type": "integer", "minimum": 1}
QUERY: dict[str, list[dict]] = {  # each operation's query parameters, as the handler reads them
    "/v1/files": [{"name": "purpose", "schema": {"type": "string"}}],
    "/v1/batches": [
        {"name": "limit", "schema": {**_LIMIT, "maximum": MAX_BATCHES_LISTED, "default": 20}},
        {"name": "after", "schema": {"type": "string"}},
    ],
    "/v1/dashboard/series": [
        {"name": "minutes", "schema": {**_LIMIT, "maximum": MAX_SERIES_MINUTES}}
    ],
    "/v1/dashboard/requests": [{"name": "limit", "schema": {**_LIMIT, "maximum": MAX_LISTED}}],
}


def operation_id(method: str, path: str) -> str:
    """``get_v1_batches_batch_id`` for GET /v1/batches/{batch_id}."""
    return f"{method.lower()}_" + "_".join(re.findall(r"\w+", path))


def _link(method: str, path: str, **fields: object) -> dict:
    return {"operationId": operation_id(method, path), **fields}


FILE_ID = {"file_id": "$response.body#/id"}
BATCH_ID = {"batch_id": "$response.body#/id"}
# What one operation's answer leads to (OpenAPI links): a client, and a stateful fuzzer, goes
# from an uploaded file to its description, its bytes, a batch of it and its deletion, and
# from a batch to its status and its cancel, and from the recent requests to one's detail.
LINKS = {
    "POST /v1/files": {
        "file": _link("GET", "/v1/files/{file_id}", parameters=FILE_ID),
        "content": _link("GET", "/v1/files/{file_id}/content", parameters=FILE_ID),
        "batch": _link("POST", "/v1/batches", requestBody={"input_file_id": "$response.body#/id"}),
        "delete": _link("DELETE", "/v1/files/{file_id}", parameters=FILE_ID),
    },
    "POST /v1/batches": {
        "batch": _link("GET", "/v1/batches/{batch_id}", parameters=BATCH_ID),
        "cancel": _link("POST", "/v1/batches/{batch_id}/cancel", parameters=BATCH_ID),
    },
    "GET /v1/dashboard/requests": {
        "request": _link(
            "GET",
            "/v1/dashboard/requests/{request_id}",
            parameters={"request_id": "$response.body#/requests/0/id"},
        ),
    },
}


def _parameters(path: str) -> list[dict]:
    """The path's parameters (every ``{name}`` in it) and its query's."""
    found = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in re.findall(r"{(\w+)}", path)
    ]
    return found + [{"in": "query", "required": False, **q} for q in QUERY.get(path, [])]


_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
            "required": ["message", "type"],
        }
    },
    "required": ["error"],
}


def _bodies() -> tuple[dict[type[BaseModel], dict], dict]:
    """Every request body's schema reference, and the schemas they use: built together, so
    two formats' models of one name (each has a ToolDef) are told apart."""
    models = sorted({m for _, m, _ in ROUTES.values() if m is not None}, key=lambda m: m.__name__)
    refs, top = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    return {m: refs[(m, "validation")] for m in models}, top.get("$defs", {})


def _with_examples(schemas: dict, served: list[str]) -> dict:
    """The schemas, each body's ``model`` with the served models as its examples."""
    for schema in schemas.values() if served else ():
        model = schema.get("properties", {}).get("model")
        if model is not None and model.get("type") == "string":
            model["examples"] = served
    return schemas


def document(
    routes: Iterable[web.AbstractRoute], version: str, auth: bool, served: Iterable[str] = ()
) -> dict:
    """``served``: the models the mesh serves, the examples of every body's ``model``."""
    bodies, defs = _bodies()
    schemas: dict = {"Error": _ERROR, **_with_examples(defs, sorted(served))}
    paths: dict = {}
    for route in routes:
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter")
        if route.method == "HEAD" or not path:
            continue
        key = f"{route.method} {path}" if f"{route.method} {path}" in ROUTES else path
        assert key in ROUTES, (
            f"{route.method} {path}: describe it in services/router/api/openapi.py"
        )
        summary, model, errors = ROUTES[key]
        op: dict = {
            "operationId": operation_id(route.method, path),
            "summary": summary,
            "responses": {"200": {"description": "OK"}}
            | NOT_ERRORS.get(path, {})
            | {
                str(code): {
                    "description": "an OpenAI-style error",
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/Error"}}
                    },
                }
                for code in errors
            },
        }
        if links := LINKS.get(f"{route.method} {path}"):
            op["responses"]["200"]["links"] = links
        if parameters := _parameters(path):
            op["parameters"] = parameters
        if model is not None:
            op["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": bodies[model]}},
            }
        elif key in OTHER_BODIES:
            op["requestBody"] = {"required": True, "content": OTHER_BODIES[key]}
        if auth and path.startswith("/v1/"):
            op["security"] = [{"bearer": []}, {"apiKey": []}]
        paths.setdefault(path, {})[route.method.lower()] = op
    components: dict = {"schemas": schemas}
    if auth:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
        }
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvmesh router", "version": version},
        "paths": dict(sorted(paths.items())),
        "components": components,
    }

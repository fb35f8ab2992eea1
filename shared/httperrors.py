"""OpenAI-style error bodies for every HTTP error a kvmesh service returns."""

from __future__ import annotations

from aiohttp import web

# HTTP status → OpenAI's error "type".
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error body: the message, a type from the status, the field and a code."""
    kind = _TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = error_body(status, message, param, code)
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def openai_errors(request: web.Request, handler) -> web.StreamResponse:  # noqa: ANN001
    """Turn aiohttp's plain-text errors (unknown path, wrong method) into OpenAI error bodies."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = f"{request.method} {request.path}: {exc.reason}"
        return error_response(
            exc.status,
            message,
            headers={"Allow": exc.headers.get("Allow", "")} if exc.status == 405 else None,
        )

"""The router's one error type: a request the router refuses or cannot serve.

Raised anywhere along the request path and rendered once, in the caller's format: the HTTP
middleware writes it as the endpoint's API writes errors (OpenAI's or Anthropic's body, with
``Retry-After`` when set), the gRPC interceptor ends the call with its status code, and a
stream already open gets it as its format's error event.
"""

from __future__ import annotations

from shared.telemetry.metrics import REFUSED


class ApiError(Exception):
    """HTTP status, a message for the client, the offending field, an error code, and how
    long to wait before trying again (429, 503)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s


def overloaded(why: str, priority: str = "", where: str = "") -> ApiError:
    """429: too much at once; the client retries shortly. With ``where``: a refusal of a
    request of class ``priority`` counted on /metrics (kvmesh_refused_total)."""
    if where:
        REFUSED.labels(priority, where).inc()
    return ApiError(429, f"{why}; retry shortly", code="overloaded", retry_after_s=1)


def unavailable(why: str, retry_after_s: int | None = None) -> ApiError:
    """503: no worker can serve the request now, or the store it needs cannot be reached."""
    return ApiError(503, why, code="unavailable", retry_after_s=retry_after_s)

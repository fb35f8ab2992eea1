"""Log set-up shared by every process: one line per record, level and logger name first, and
the request id and trace id of the request being handled, when there is one."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from opentelemetry import trace

request_id_var: ContextVar[str] = ContextVar("kvmesh_request_id", default="")


@contextmanager
def request_scope(request_id: str) -> Iterator[None]:
    """Log lines in the block (and in tasks started from it) carry this request id."""
    token = request_id_var.set(request_id)
    try:
        yield
    finally:
        request_id_var.reset(token)


class RequestContext(logging.Filter):
    """Adds ``ctx``: " [request=... trace=...]" for a line logged while a request is handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        parts = []
        rid = request_id_var.get()
        if rid:
            parts.append(f"request={rid}")
        span = trace.get_current_span().get_span_context()
        if span.is_valid:
            parts.append(f"trace={span.trace_id:032x}")
        record.ctx = f" [{' '.join(parts)}]" if parts else ""
        return True


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RequestContext())
    handler.setFormatter(
        logging.Formatter(
            "%(asctime)s.%(msecs)03d %(levelname)-7s %(name)s: %(message)s%(ctx)s",
            datefmt="%H:%M:%S",
        )
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # nats-py and aiohttp are chatty at INFO about things our own logs already say.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)

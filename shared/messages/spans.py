"""A request's spans, asked of every service (the operator page's waterfall)."""

from __future__ import annotations

from pydantic import Field

from shared.messages import Message


class SpansQuery(Message):
    trace_id: str = Field(pattern=r"^[0-9a-f]{32}$")


class SpansReply(Message):
    service_id: str
    spans: list[dict] = Field(default_factory=list)  # shared/telemetry/tracing.span_record's

"""Typed wire messages, one module per link. Never a bare dict between services."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Message(BaseModel):
    """Base of every wire message: immutable, JSON on the wire, tolerant of newer fields.
    Only keys go to pydantic's string cache (process-wide): ids and hashes never repeat."""

    model_config = ConfigDict(frozen=True, extra="ignore", cache_strings="keys")

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, data: bytes):  # -> Self
        return cls.model_validate_json(data)

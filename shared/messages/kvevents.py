"""The KV-block link: workers and cachemeta → the KV event stream → cachemeta; routers ↔
cachemeta lookups."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from shared.messages import Message

# Where a block lives: the shared storage tier, or one worker's host-memory tier.
STORE = "store"
Retention = Literal["chat", "agent"]
RETENTIONS: tuple[str, ...] = get_args(Retention)


def memory_location(service_id: str) -> str:
    return f"mem:{service_id}"


class KvEvent(Message):
    """Blocks stored at, or removed from, one location (in order, on a JetStream stream)."""

    kind: Literal["stored", "removed"]
    location: str
    hashes: list[str]
    sizes: list[int] = Field(default_factory=list, description="bytes, per hash (stored)")
    retention: Retention = "chat"
    at: float = Field(description="unix time of the change")


class LookupRequest(Message):
    hashes: list[str] = Field(description="a prompt's block hashes, in order")


class LookupReply(Message):
    counts: dict[str, int] = Field(
        description="location → how many of the hashes, from the first, it holds"
    )

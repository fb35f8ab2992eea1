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


HASH_CHARS = 32  # a block hash in hex (shared/kvstore/hashing.py)


class LookupRequest(Message):
    """A prompt's block hashes, in order. On the wire as one string of fixed-width hashes: a
    77K-token prompt has 1,200 of them, and one string parses far faster than 1,200."""

    packed: str = Field(pattern=r"^([0-9a-f]{32})*$")

    @classmethod
    def of(cls, hashes: list[str]) -> LookupRequest:
        return cls(packed="".join(hashes))

    @property
    def hashes(self) -> list[str]:
        p = self.packed
        return [p[i : i + HASH_CHARS] for i in range(0, len(p), HASH_CHARS)]


class LookupReply(Message):
    counts: dict[str, int] = Field(
        description="location → how many of the hashes, from the first, it holds"
    )

"""The KV-block link: workers, routers and cachemeta → the KV event stream → cachemeta and
every router (each keeps the block index itself); anyone ↔ cachemeta lookups (tools, tests)."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field

from shared.messages import Message

# Where a block lives: the shared storage tier, or one worker's host-memory tier.
STORE = "store"
Retention = Literal["chat", "agent"]
RETENTIONS: tuple[str, ...] = get_args(Retention)


MEMORY_PREFIX = "mem:"


def memory_location(service_id: str) -> str:
    return f"{MEMORY_PREFIX}{service_id}"


def memory_owner(location: str) -> str:
    """The worker whose memory tier ``location`` is ("" for the storage tier)."""
    return location.removeprefix(MEMORY_PREFIX) if location.startswith(MEMORY_PREFIX) else ""


Kind = Literal["stored", "removed", "touched", "cleared"]


class KvEvent(Message):
    """A change to the block index, on a JetStream stream: blocks stored at or removed from a
    location; blocks used (``touched``, by a router: their TTL and LRU clocks restart,
    wherever they are); every block of a location gone (``cleared``: a worker that stopped, or
    one about to republish what its memory tier holds).

    Each publisher numbers its events from 1 per process (``source``, ``epoch``, ``seq``) and
    says in its heartbeat how many it made: whoever applies the stream can tell a feed that
    lags or stopped."""

    kind: Kind
    location: str = ""
    hashes: list[str] = Field(default_factory=list)
    sizes: list[int] = Field(default_factory=list, description="bytes, per hash (stored)")
    retention: Retention = "chat"
    at: float = Field(description="unix time of the change")
    source: str = Field(default="", description="the publisher's service id")
    epoch: float = Field(default=0.0, description="the publisher's start (unix time)")
    seq: int = Field(default=0, ge=0, description="the publisher's count of its events, this one")


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


class ResyncRequest(Message):
    """To a worker whose KV events did not all come: republish what its memory tier holds."""

    by: str = Field(description="who asks (a router's or cachemeta's id)")
    why: str = ""

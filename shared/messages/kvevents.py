"""The KV-block link: workers, routers and cachemeta → the KV event stream → cachemeta and
every router (each keeps the block index itself); anyone ↔ cachemeta lookups (tools, tests)."""

from __future__ import annotations

import re
from typing import Literal, get_args

from pydantic import Field, model_validator

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
# A block hash in hex (shared/kvstore/hashing.py): kvmesh's XXH3-128, or SGLang's SHA-256 for
# the blocks of SGLang workers (their engine names its storage pages so).
HASH_CHARS = 32
HASH_WIDTHS = (32, 64)


class KvEvent(Message):
    """A change to the block index, on a JetStream stream: blocks stored at or removed from a
    location; blocks used (``touched``, by a router: their TTL and LRU clocks restart,
    wherever they are); every block of a location gone (``cleared``: a worker that stopped, or
    one about to republish what its memory tier holds).

    Each publisher numbers its events from 1 per process (``source``, ``epoch``, ``seq``) and
    says in its heartbeat how many it made: whoever applies the stream can tell a feed that
    lags or stopped."""

    kind: Kind
    location: str = Field(default="", pattern=r"^(store|mem:[A-Za-z0-9_.-]{1,64})?$")
    hashes: list[str] = Field(
        default_factory=list, description="32 hex digits each (64: SGLang's page hashes)"
    )
    sizes: list[int] = Field(default_factory=list, description="bytes, per hash (stored)")
    retention: Retention = "chat"
    pinned_until: float = Field(
        default=0.0,
        ge=0,
        description="(stored) kept until this unix time whatever eviction or its retention "
        "would do: a conversation that said it will continue (0: not pinned)",
    )
    at: float = Field(description="unix time of the change")
    source: str = Field(default="", description="the publisher's service id")
    epoch: float = Field(default=0.0, description="the publisher's start (unix time)")
    seq: int = Field(default=0, ge=0, description="the publisher's count of its events, this one")

    @model_validator(mode="after")
    def _whole(self) -> KvEvent:
        """Every hash a block's, all of one width (the storage tier names files by them);
        one size per hash when sizes are given."""
        widths = {len(h) for h in self.hashes}
        if len(widths) > 1 or widths - set(HASH_WIDTHS) or not _HEX.fullmatch("".join(self.hashes)):
            raise ValueError(
                f"hashes: each must be {HASH_CHARS} lowercase hex digits (or 64 each: SGLang's)"
            )
        if self.sizes and len(self.sizes) != len(self.hashes):
            raise ValueError(f"sizes: {len(self.sizes)} for {len(self.hashes)} hashes")
        if any(size < 0 for size in self.sizes):
            raise ValueError("sizes: a block's bytes cannot be negative")
        if self.kind in ("stored", "removed", "cleared") and not self.location:
            raise ValueError(f"location: a {self.kind} event names one")
        return self


_HEX = re.compile(r"[0-9a-f]*")


class LookupRequest(Message):
    """A prompt's block hashes, in order. On the wire as one string of hashes of one width
    (``width`` hex digits each: 64 for an SGLang model's): a 77K-token prompt has 1,200 of
    them, and one string parses far faster than 1,200."""

    packed: str = Field(pattern=r"^[0-9a-f]*$")
    width: Literal[32, 64] = HASH_CHARS

    @model_validator(mode="after")
    def _whole(self) -> LookupRequest:
        if len(self.packed) % self.width:
            raise ValueError(f"packed: {len(self.packed)} hex digits, not hashes of {self.width}")
        return self

    @classmethod
    def of(cls, hashes: list[str]) -> LookupRequest:
        return cls(packed="".join(hashes), width=len(hashes[0]) if hashes else HASH_CHARS)

    @property
    def hashes(self) -> list[str]:
        p, w = self.packed, self.width
        return [p[i : i + w] for i in range(0, len(p), w)]


class LookupReply(Message):
    counts: dict[str, int] = Field(
        description="location → how many of the hashes, from the first, it holds"
    )


class ResyncRequest(Message):
    """To a worker whose KV events did not all come: republish what its memory tier holds."""

    by: str = Field(description="who asks (a router's or cachemeta's id)")
    why: str = ""

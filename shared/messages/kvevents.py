"""The KV-block link: workers, routers and cachemeta → the KV event stream → cachemeta and
every router (each keeps the block index itself); anyone ↔ cachemeta lookups (tools, tests).

On the stream, a message is a batch of events in MessagePack (``pack_events``): each event's
hashes packed as bytes, its sizes as 32-bit integers, so that a holder reads a 1,000-block
event without a parse per hash (``KvRecord``). ``KvEvent`` is the same event as a checked
model with hex hashes, for the processes that make events one at a time."""

from __future__ import annotations

import re
from typing import Literal, get_args

import msgspec
from pydantic import Field, model_validator

from shared.messages import Message

# Where a block lives: the shared storage tier, or one worker's host-memory tier.
STORE = "store"
MEMORY, STORAGE = "memory", "storage"  # the tiers, as a cached count names them
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
_LOCATION = re.compile(r"(store|mem:[A-Za-z0-9_.-]{1,64})?")
KINDS: tuple[str, ...] = get_args(Kind)


class KvRecord(msgspec.Struct, array_like=True):
    """A KV event as the stream carries it: ``hashes`` packed, ``width`` bytes each (16: kvmesh's
    XXH3-128; 32: SGLang's SHA-256), ``sizes`` as little-endian 32-bit integers, one per hash
    (or none). The other fields as ``KvEvent``'s."""

    kind: str
    location: str
    hashes: bytes
    width: int
    sizes: bytes
    retention: str
    pinned_until: float
    at: float
    source: str
    epoch: float
    seq: int

    def __len__(self) -> int:
        return len(self.hashes) // self.width

    def check(self) -> KvRecord:
        """A record as ``KvEvent`` would take it; ValueError naming the field otherwise."""
        if self.kind not in KINDS:
            raise ValueError(f"kind: {self.kind!r} is not one of {KINDS}")
        if not _LOCATION.fullmatch(self.location):
            raise ValueError(f"location: {self.location[:80]!r} is not store or mem:<worker>")
        if self.kind in ("stored", "removed", "cleared") and not self.location:
            raise ValueError(f"location: a {self.kind} event names one")
        if self.width not in (16, 32) or len(self.hashes) % self.width:
            raise ValueError(f"hashes: {len(self.hashes)} bytes, not hashes of 16 (or 32) bytes")
        if self.sizes and len(self.sizes) != 4 * len(self):
            raise ValueError(f"sizes: {len(self.sizes) // 4} for {len(self)} hashes")
        if self.retention not in RETENTIONS:
            raise ValueError(f"retention: {self.retention!r} is not one of {RETENTIONS}")
        if self.pinned_until < 0 or self.seq < 0:
            raise ValueError("pinned_until and seq: not negative")
        return self

    @classmethod
    def of(cls, event: KvEvent) -> KvRecord:
        width = len(event.hashes[0]) // 2 if event.hashes else HASH_CHARS // 2
        sizes = b"".join(n.to_bytes(4, "little") for n in event.sizes)
        raw = bytes.fromhex("".join(event.hashes))
        return cls(
            event.kind, event.location, raw, width, sizes, event.retention,
            event.pinned_until, event.at, event.source, event.epoch, event.seq,
        )  # fmt: skip

    def hex_hashes(self) -> list[str]:
        w = self.width
        return [self.hashes[i : i + w].hex() for i in range(0, len(self.hashes), w)]

    def size_list(self) -> list[int]:
        s = self.sizes
        return [int.from_bytes(s[i : i + 4], "little") for i in range(0, len(s), 4)]


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(list[KvRecord])


def pack_events(events: list[KvRecord]) -> bytes:
    """Events as one message of the stream."""
    return _ENCODER.encode(events)


def unpack_events(data: bytes) -> list[KvRecord]:
    """A message of the stream's events, each checked; ValueError for a malformed one."""
    try:
        records = _DECODER.decode(data)
    except msgspec.DecodeError as err:
        raise ValueError(f"not a batch of KV events: {err}") from None
    return [r.check() for r in records]


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

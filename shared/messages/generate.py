"""The request path: router → prefill/decode tasks, worker → router token events, cancels.

Tasks are sent with NATS request/reply: the reply (TaskAck) only says the worker accepted the
task into its queue; tokens then arrive as TokenEvents on the router's reply subject, batched.
"""

from __future__ import annotations

import array
import base64
import binascii
import json
import sys
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import (
    Field,
    PrivateAttr,
    ValidatorFunctionWrapHandler,
    field_serializer,
    field_validator,
)

from shared.messages import Message
from shared.messages.kvevents import Retention
from shared.messages.sampling import SamplingParams, TokenLogprobs


class ImageRef(Message):
    """An image in a prompt: its placeholder tokens, whose embeddings the encoder makes."""

    image_hash: str
    start: int = Field(ge=0, description="position of its first placeholder token")
    tokens: int = Field(ge=1)


# A request's class, highest first: OpenAI's service tiers (``priority`` > ``default`` >
# ``flex``), then batch work (services/router/batch/), which takes what the others leave. Every
# queue orders by class first; a bounded one (the router's requests in progress, a worker's
# waiting tasks) lets each class fill only its share of it, so as it fills the lowest class is
# refused first and the highest always finds room.
Priority = Literal["priority", "default", "flex", "batch"]
PRIORITIES: tuple[Priority, ...] = ("priority", "default", "flex", "batch")
RANKS: dict[str, int] = {p: rank for rank, p in enumerate(PRIORITIES)}
QUEUE_SHARE: dict[str, float] = {"priority": 1.0, "default": 0.85, "flex": 0.5, "batch": 0.25}


class Bootstrap(Message):
    """Where a decode engine fetches a request's KV from its prefill engine in SGLang's own
    P/D: the prefill engine's bootstrap server and the request's room there."""

    host: str
    port: int = Field(ge=1, le=65535)
    room: int = Field(ge=0, lt=2**63)


class Handover(Message):
    """A P/D hand-over between workers whose engines own their KV (``services/prefill/
    whole.py``): the prompt's KV is in the storage tier, or (``bootstrap``) the prefill
    engine sends it to the decode engine itself as it computes it; the answer's first tokens
    that the prefill worker sent (none when decode must sample every token itself: see
    ``SamplingParams.continues_as_prompt``). Decode goes on after them, numbering its events
    from there, and leaves the reuse figures to the prefill worker's event."""

    answer_ids: list[int] = Field(default_factory=list)
    bootstrap: Bootstrap | None = None


class GenerateTask(Message):
    """Compute a prompt and stream its answer. Sent to a prefill worker, which hands the KV to
    ``decode_id`` at ``decode_kv_address``; or, for a short uncached prompt, straight to the
    decode worker, which prefills it itself (conditional disaggregation)."""

    request_id: str
    model: str
    # On the wire, packed (int32, little-endian) after the rest's JSON and a NUL byte (in
    # JSON alone, base64): a 77K-token prompt as a JSON list took the router ~5 ms to make and
    # write, and its worker ~4 ms to read.
    token_ids: list[int] = Field(default_factory=list)
    sampling: SamplingParams
    reply_subject: str
    # The router's token link (shared/bus/tokens.py): where it listens, and the key it asks
    # for ("": its events go on reply_subject alone).
    reply_address: str = ""
    reply_key: str = Field(default="", repr=False)  # (not in a task's repr: logs, errors)
    decode_id: str
    decode_kv_address: str = Field(description="host:port of the decode worker's KV server")
    deadline: float = Field(description="unix time after which nobody waits for the answer")
    block_hashes: list[str] = Field(
        default_factory=list, description="hashes of the prompt's full blocks (shared/kvstore)"
    )
    salt: str = Field(default="", description="the tenant salt the hashes were made with")
    handoff_token: str = Field(
        default="", description="what decode_id expects with the KV push (shared/security)"
    )
    retention: Retention = "chat"
    images: list[ImageRef] = Field(
        default_factory=list,
        description="images in the prompt, in order (their embeddings "
        "come from the embeddings stream)",
    )
    priority: Priority = "default"
    # Fair share within a class (start-time fair queueing: services/prefill/queue.py): whose
    # the task is (its tenant's salt) and the weight its key gives that tenant.
    weight: int = Field(default=1, ge=1, le=1000)
    ttft_first_by: float = Field(
        default=0.0, description="unix time its first token is due by, when the client said"
    )
    pinned_until: float = Field(
        default=0.0, ge=0, description="its KV kept in both tiers until then (0: not pinned)"
    )
    handover: Handover | None = Field(
        default=None,
        description="set by a prefill worker whose engine owns its KV, handing the request to "
        "decode_id once the prompt's KV is in the storage tier",
    )
    _packed: bytes = PrivateAttr(b"")  # token_ids packed, when its sender had them so

    @classmethod
    def of(cls, packed: bytes = b"", **fields: Any) -> GenerateTask:
        """A task made by its sender from fields it has checked (the router's own job): not
        validated again here (its worker validates what it reads). ``packed``: the prompt's
        ids as the wire carries them, when the sender has them so."""
        task = cls.model_construct(**fields)
        if len(packed) == 4 * len(task.token_ids):
            task._packed = packed
        return task

    def to_bytes(self) -> bytes:
        head = self.model_dump_json(exclude={"token_ids"}).encode()
        return b"%s\x00%s" % (head, self._packed or pack_ids(self.token_ids))

    @classmethod
    def from_bytes(cls, data: bytes) -> GenerateTask:
        head, nul, packed = data.partition(b"\x00")  # (JSON has no raw NUL byte)
        if not nul:
            return cls.model_validate_json(data)
        if len(packed) % 4:
            raise ValueError(f"token_ids: {len(packed)} bytes is not a whole number of int32")
        ids = unpack_ids(packed).tolist()
        task = cls.model_validate_json(head).model_copy(update={"token_ids": ids})
        task._packed = packed
        return task

    @field_serializer("token_ids", when_used="json")
    def _pack(self, ids: list[int]) -> str:
        packed = self._packed or pack_ids(ids)
        return base64.b64encode(packed).decode("ascii")

    @field_validator("token_ids", mode="wrap")
    @classmethod
    def _unpack(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> list[int]:
        if not isinstance(value, str):
            return handler(value)  # a list (as an older sender wrote it, or in Python)
        try:
            packed = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("token_ids: not base64 of packed int32 ids") from None
        if len(packed) % 4:
            raise ValueError(f"token_ids: {len(packed)} bytes is not a whole number of int32")
        return unpack_ids(packed).tolist()


# A prompt's token ids as the router holds them: int32 in an array, made from their packed
# bytes in one copy (a list of a 77K-token prompt's ids is 2.8 MB of int objects to touch).
TokenIds = array.array
_LITTLE = sys.byteorder == "little"


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids packed as the wire and block hashing read them: int32, little-endian."""
    if _LITTLE and isinstance(ids, array.array) and ids.typecode == "i":
        return ids.tobytes()
    packed = array.array("i", ids)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(packed: bytes) -> TokenIds:
    """Packed ids (``pack_ids``) as an array of int32."""
    ids = array.array("i", packed)
    if not _LITTLE:
        ids.byteswap()
    return ids


class TaskAck(Message):
    accepted: bool
    reason: str = ""  # why not: "busy" (queue full), "unknown model", ...
    queued: int = 0  # tasks ahead of this one
    again: bool = False  # asked again after it was taken (the first ack lost): taken once


# busy: no room now (the router moves it, no fault); unavailable: the worker cannot serve it
# (moved, a fault of the worker's); engine: the engine raised on it (moved; a second worker's
# engine failing on it too fails the request); internal: the request cannot be served.
ErrorCode = Literal["", "busy", "unavailable", "engine", "internal", "cancelled"]


class Logprobs(Message):
    """A token's log-probability, and the most likely tokens' ids and log-probabilities."""

    logprob: float
    top_ids: list[int] = Field(default_factory=list)
    top_logprobs: list[float] = Field(default_factory=list)

    @classmethod
    def of(cls, lp: TokenLogprobs) -> Logprobs:
        return cls(
            logprob=lp.logprob,
            top_ids=[t for t, _ in lp.top],
            top_logprobs=[v for _, v in lp.top],
        )


class TokenEvent(Message):
    """New tokens of a request, in order: ``index`` is the position of the first of them in
    the answer. The last event has ``finish_reason`` (or ``error``)."""

    request_id: str
    index: int
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[Logprobs] | None = None  # one per token, when the request asked for them
    # On the first event, when asked for: the prompt's tokens' (each but the first).
    prompt_logprobs: list[Logprobs] | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_string: str | None = None
    cached_tokens: int | None = None  # on the first event: prompt tokens whose KV was reused
    cached_by_tier: dict[str, int] | None = None  # those tokens by tier: memory, storage
    error: str = ""
    error_code: ErrorCode = ""
    # Where the time went (seconds), on the events that know it: prefill on the first,
    # decode compute on the last.
    prefill_s: float | None = None
    decode_s: float | None = None
    kv_bytes: int | None = None
    kv_transfer_s: float | None = None
    worker_id: str = ""


class TokenEvents(Message):
    """What is sent on a router's reply subject: events of any of its requests, each
    request's in order (one message per decode step for all of them, not one per token)."""

    events: list[TokenEvent]
    sent_ns: int = 0  # when the worker sent it (its clock): the router's transit histogram

    def to_bytes(self) -> bytes:
        # Sent every step: an event's unset fields stay off the wire (a third of the bytes).
        return self.model_dump_json(exclude_defaults=True).encode()

    @staticmethod
    def joined(events: list[bytes], sent_ns: int = 0) -> bytes:
        """The message of events each already JSON (``encoded``, ``PlainTokens.event``)."""
        return b'{"events":[' + b",".join(events) + b'],"sent_ns":%d}' % sent_ns

    @staticmethod
    def encoded(event: TokenEvent) -> bytes:
        """One event as ``to_bytes`` writes it in a message."""
        return event.model_dump_json(exclude_defaults=True).encode()


class PlainTokens:
    """A request's events of one token and nothing else (most of what a decode step sends),
    as JSON made from parts encoded once: building and dumping a model for each costs
    several times more, on the thread that also steps the batch."""

    def __init__(self, request_id: str, worker_id: str) -> None:
        self.head = b'{"request_id":%s,"index":' % json.dumps(request_id).encode()
        self.tail = b',"worker_id":%s}' % json.dumps(worker_id).encode()

    def event(self, index: int, token_id: int) -> bytes:
        return b'%s%d,"token_ids":[%d]%s' % (self.head, index, token_id, self.tail)


class Cancel(Message):
    """The client went away: free the request's sequence wherever it is."""

    request_id: str


class HandoffDone(Message):
    """The end of a KV handoff (prefill → decode, in the last gRPC chunk): the first token,
    sampled by prefill (a seeded answer goes on the same: its randomness is per position),
    and when prefill began sending the KV (unix ns; the transfer's time is measured from it,
    as exact as the two hosts' clocks agree: a KV under a chunk arrives in one message)."""

    first_token: int
    sent_ns: int = 0

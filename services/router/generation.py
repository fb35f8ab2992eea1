"""A request's answer as text: token events from the dispatcher, detokenized, stop strings
cut, usage and timing counted. Shared by the HTTP and the gRPC API."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer

from services.router.cachemiss import Seen
from services.router.conversation import Conversation
from services.router.detokenizer import Detokenizer
from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.encodes import Encodes
from services.router.dispatch.job import Job
from services.router.openai_api import ApiError, Shape, Usage
from services.router.toolcalls import CallEvent
from shared.messages.generate import Logprobs
from shared.model.text import TextModel

EXPLAINED = 4  # candidates listed in a response (all with the header x-kvmesh-explain: all)


@dataclass
class Timing:
    """Where a request's time went, in the workers (ms); the rest is the mesh's."""

    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    kv_bytes: int = 0
    kv_transfer_ms: float = 0.0
    workers: list[str] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    route: dict = field(default_factory=dict)  # the routing decision, with each candidate's terms
    images: list[dict] = field(default_factory=list)  # per image: tokens, cached, encode_ms
    first_token_at: float = 0.0  # perf_counter when the first token came, and the last
    last_token_at: float = 0.0
    explain_all: bool = False  # else only the best EXPLAINED candidates are listed
    cache_miss: dict | None = None  # why the prompt missed the cache (services/router/cachemiss)

    @property
    def engine_ms(self) -> float:
        return self.prefill_ms + self.decode_ms

    def to_dict(self) -> dict:
        return {
            "engine_ms": round(self.engine_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "kv_bytes": self.kv_bytes,
            "kv_transfer_ms": round(self.kv_transfer_ms, 3),
            "workers": self.workers,
            "cached_tokens_by_tier": self.cached_tokens_by_tier,
            "route": self.decision(),
            **({"images": self.images} if self.images else {}),
            **({"cache_miss": self.cache_miss} if self.cache_miss else {}),
        }

    def decision(self, every: bool = False) -> dict:
        """The routing decision with its candidates' terms (the best EXPLAINED of them
        unless ``every`` or the request asked for all)."""
        ranked = self.route.get("candidates")
        if ranked is None:
            return self.route
        shown = ranked if every or self.explain_all else ranked[:EXPLAINED]
        out = {**self.route, "candidates": [{"worker": r.service_id, **r.terms} for r in shown]}
        if len(shown) < len(ranked):
            out["others"] = len(ranked) - len(shown)
        return out


@dataclass
class Prepared:
    """A request checked, tokenized and ready to dispatch: what its answer's stream needs."""

    job: Job
    shape: Shape
    text: TextModel
    stop: list[str]
    stream: bool
    include_usage: bool
    usage: Usage
    timing: Timing = field(default_factory=Timing)
    received_at: float = field(default_factory=time.perf_counter)
    encodes: Encodes | None = None  # the images' encode requests, in flight
    delivered: bool = False  # a stream's last event written (the client has the answer)
    seen: Seen | None = None  # what explains its cache misses, and is remembered after
    tenant: str = ""  # whose request (the key's tenant, or the tenant header with auth off)
    conversation: Conversation | None = None


class Writer(Protocol):
    """How a format writes an answer back: a whole body, or its stream as server-sent events
    (what comes before the first text, each text, the end, an error mid-stream)."""

    def whole(self, answer: Delta) -> dict:
        """The body of the whole answer (all its deltas in one)."""
        ...

    def start(self) -> list[bytes]: ...

    def text(self, delta: Delta) -> list[bytes]: ...

    def end(self, last: Delta) -> list[bytes]: ...

    def ping(self) -> bytes:
        """A keep-alive while the first token is long in coming."""
        ...

    def error(self, err: ApiError) -> list[bytes]: ...


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None  # on the last: "stop" or "length"
    stop_sequence: str | None = None  # on the last, when a stop string ended the answer
    # When asked for: (token id, its log-probabilities) of the tokens this text came from.
    logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)
    calls: list[CallEvent] = field(default_factory=list)  # tool calls' pieces (toolcalls.py)

    @classmethod
    def joined(cls, deltas: list[Delta]) -> Delta:
        """A whole answer as one delta: every text and token, the last one's ending."""
        last = deltas[-1]
        return cls(
            "".join(d.text for d in deltas),
            last.finish_reason,
            last.stop_sequence,
            [lp for d in deltas for lp in d.logprobs],
            [c for d in deltas for c in d.calls],
        )


async def stream_text(
    dispatcher: Dispatcher,
    job: Job,
    tokenizer: Tokenizer,
    stop: list[str],
    usage: Usage,
    timing: Timing,
    encodes: Encodes | None = None,
) -> AsyncIterator[Delta]:
    """Text deltas of the answer; the last has finish_reason. ``usage`` and ``timing`` are
    filled in as events arrive (complete once the last delta is out). With ``encodes``, the
    answer starts only once every image is encoded, and a failed encode ends it."""
    detok = Detokenizer(tokenizer, stop)
    logprobs: list[tuple[int, Logprobs]] = []  # the tokens' not yet sent with a text
    events = dispatcher.generate(job, timing.route)
    if encodes is not None:
        events = encodes.guard(events)
    async for event in events:
        if encodes is not None and not timing.images:
            timing.images = encodes.report()
        if event.cached_tokens is not None:
            usage.cached_tokens = event.cached_tokens
        if event.cached_by_tier is not None:
            timing.cached_tokens_by_tier = event.cached_by_tier
        usage.completion_tokens += len(event.token_ids)
        if event.token_ids:
            timing.last_token_at = time.perf_counter()
            timing.first_token_at = timing.first_token_at or timing.last_token_at
        timing.prefill_ms += (event.prefill_s or 0.0) * 1e3
        timing.decode_ms += (event.decode_s or 0.0) * 1e3
        timing.kv_bytes += event.kv_bytes or 0
        timing.kv_transfer_ms += (event.kv_transfer_s or 0.0) * 1e3
        if event.worker_id and event.worker_id not in timing.workers:
            timing.workers.append(event.worker_id)
        if event.logprobs:
            logprobs += zip(event.token_ids, event.logprobs, strict=True)
        text = detok.add(event.token_ids)
        if detok.stopped:  # leaving the loop cancels the rest of the answer on decode
            yield Delta(text, "stop", detok.stop_hit, logprobs)
            return
        if event.finish_reason == "abort":
            if time.time() >= job.deadline:  # decode stops a request at its deadline
                raise ApiError(504, "request deadline passed", code="timeout")
            raise ApiError(503, "the worker stopped this request", code="aborted")
        if event.finish_reason:
            text += detok.finish()
            finish = "stop" if event.finish_reason == "stop" else "length"
            yield Delta(text, finish, detok.stop_hit or event.stop_string, logprobs)
            return
        if text:
            yield Delta(text, logprobs=logprobs)
            logprobs = []

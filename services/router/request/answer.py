"""A prepared request and its answer: what the request carries from preparation to its last
byte (``Prepared``: the job, the conversation, its usage and timing as they fill in), and the
answer as text deltas (``Answers``): the dispatcher's token events detokenized, stop strings
cut, tool calls parsed out of the text. Shared by every API: a format's writer
(``Writer``) turns the deltas into its bytes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.encodes import Encodes
from services.router.dispatch.job import Job
from services.router.errors import ApiError
from services.router.request.conversation import Conversation
from services.router.request.detokenizer import Detokenizer
from services.router.request.toolcalls import CallEvent, CallParser
from shared.messages.generate import Logprobs, TokenEvent
from shared.model.text import TextModel

EXPLAINED = 4  # candidates listed in a response (all with the header x-kvmesh-explain: all)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


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
    cache_miss: dict | None = None  # why the prompt missed the cache (observe/cachemiss.py)

    def add(self, event: TokenEvent) -> None:
        """What an event says of the workers' time and the tiers' hits."""
        if event.cached_by_tier is not None:
            self.cached_tokens_by_tier = event.cached_by_tier
        if event.token_ids:
            self.last_token_at = time.perf_counter()
            self.first_token_at = self.first_token_at or self.last_token_at
        self.prefill_ms += (event.prefill_s or 0.0) * 1e3
        self.decode_ms += (event.decode_s or 0.0) * 1e3
        self.kv_bytes += event.kv_bytes or 0
        self.kv_transfer_ms += (event.kv_transfer_s or 0.0) * 1e3
        if event.worker_id and event.worker_id not in self.workers:
            self.workers.append(event.worker_id)

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
    conversation: Conversation
    text: TextModel
    usage: Usage
    timing: Timing = field(default_factory=Timing)
    received_at: float = field(default_factory=time.perf_counter)
    encodes: Encodes | None = None  # the images' encode requests, in flight
    block_size: int = 0  # the model's KV block size (0 while no worker has said)
    tenant: str = ""  # whose request (the key's tenant, or the tenant header with auth off)
    delivered: bool = False  # a stream's last event written (the client has the answer)

    def kvmesh(self) -> dict:
        """The `kvmesh` extension of a response: where the time went, and the prompt's cache
        hits and misses as DeepSeek's API names them."""
        return {
            **self.timing.to_dict(),
            "router_ms": round((time.perf_counter() - self.received_at) * 1e3, 3),
            "prompt_cache_hit_tokens": self.usage.cached_tokens,
            "prompt_cache_miss_tokens": self.usage.prompt_tokens - self.usage.cached_tokens,
        }


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


class Answers:
    """Prepared requests' answers as text deltas. ``on_last``: called with the request as its
    last delta goes out (what it says is in that delta's response: a cache-miss explanation)."""

    def __init__(
        self, dispatcher: Dispatcher, on_last: Callable[[Prepared], None] | None = None
    ) -> None:
        self.dispatcher = dispatcher
        self.on_last = on_last

    async def deltas(self, p: Prepared) -> AsyncIterator[Delta]:
        """The answer's deltas; the last has finish_reason. Closing them early cancels the
        request on its workers."""
        inner = self.text(p)
        conv = p.conversation
        calls = None
        if conv.calls_tools:  # forced calls stream as they come
            calls = CallParser(streamed=bool(conv.forced_tools))
        try:
            async for delta in inner:
                if calls is not None:
                    text, events = calls.feed(delta.text)
                    if delta.finish_reason:
                        rest, more = calls.finish()
                        text, events = text + rest, events + more
                    if not (text or events or delta.finish_reason):
                        continue
                    delta = replace(delta, text=text, calls=events)
                if delta.finish_reason and self.on_last is not None:
                    self.on_last(p)
                yield delta
        finally:
            await inner.aclose()

    async def text(self, p: Prepared) -> AsyncIterator[Delta]:
        """Text deltas of the answer; the last has finish_reason. ``p.usage`` and
        ``p.timing`` are filled in as events arrive (complete once the last delta is out).
        With images, the answer starts only once every image is encoded, and a failed encode
        ends it."""
        job, usage, timing, encodes = p.job, p.usage, p.timing, p.encodes
        detok = Detokenizer(p.text.tokenizer, job.sampling.stop)
        logprobs: list[tuple[int, Logprobs]] = []  # the tokens' not yet sent with a text
        events = self.dispatcher.generate(job, timing.route)
        if encodes is not None:
            events = encodes.guard(events)
        async for event in events:
            if encodes is not None and not timing.images:
                timing.images = encodes.report()
            if event.cached_tokens is not None:
                usage.cached_tokens = event.cached_tokens
            timing.add(event)
            usage.completion_tokens += len(event.token_ids)
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

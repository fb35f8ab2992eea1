"""Sending a request to workers and getting its tokens back, with moves and cancellation.

The router picks a prefill and a decode worker (a policy ranks them), sends the GenerateTask
with NATS request/reply (the reply only says "queued" or "busy"), then reads TokenEvents from
its reply subject. When the request's workers fail (no answer to the task, gone from the
registry, an error event, or no token within the progress bounds), the request moves to other
workers, at most ``migration_limit`` times, then fails with 503: before its first token it is
sent again; mid-answer it resumes from the tokens already sent (its prompt plus them, on a
decode worker that loads the blocks the failed one stored as they filled, the same sampler
positions), so the client's stream goes on with no token missing or repeated.
A busy worker is skipped for the next one; when every candidate is busy: 429.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from services.router.breaker import Breakers
from services.router.openai_api import ApiError
from services.router.policies import Ranked, RouteRequest, RoutingPolicy
from services.router.registry import WorkerRecord, WorkerRegistry
from services.router.scoring import DecodeScore, rank_decode
from services.router.tokens import PrefixHashes, Segments
from shared.bus import Bus, BusError, NoResponders, subjects
from shared.kvstore.hashing import block_hashes
from shared.messages.generate import (
    Cancel,
    GenerateTask,
    ImageRef,
    Priority,
    Sampling,
    TaskAck,
    TokenEvent,
    TokenEvents,
)
from shared.messages.kvevents import STORE, LookupReply, LookupRequest, memory_location
from shared.security.handoff import handoff_token
from shared.telemetry.metrics import MOVES
from shared.telemetry.tracing import tracer

log = logging.getLogger(__name__)

NO_RESPONDERS_RETRY_S = 0.1  # between asks of a worker not subscribed at the moment


def route_attributes(policy: str, ranked: list[Ranked]) -> dict:
    """A routing decision as span attributes: the choice, and every candidate's score terms
    in rank order (JSON)."""
    terms = [{"worker": r.service_id, **r.terms} for r in ranked]
    return {
        "policy": policy,
        "chosen": ranked[0].service_id if ranked else "",
        "candidate_count": len(ranked),
        "candidates": json.dumps(terms, separators=(",", ":")),
    }


def resumed_event(event: TokenEvent, offset: int) -> TokenEvent:
    """An event of a resumed request as its client sees it: after the ``offset`` tokens sent
    before the move; the reuse figures stay the first attempt's."""
    return event.model_copy(
        update={"index": event.index + offset, "cached_tokens": None, "cached_by_tier": None}
    )


def continues(event: TokenEvent, more: TokenEvent) -> bool:
    """Whether ``more`` is the very next tokens from the same worker, with nothing that
    must be seen on its own (an error)."""
    return (
        not more.error
        and more.index == event.index + len(event.token_ids)
        and more.worker_id == event.worker_id
        and (event.logprobs is None) == (more.logprobs is None)
    )


def merged(run: list[TokenEvent]) -> TokenEvent:
    """Consecutive events (``continues``) as one: tokens joined, the times summed, the end
    the last's; built once for the run (a stream that fell behind must not pay more per
    token to catch up)."""
    if len(run) == 1:
        return run[0]
    first, last = run[0], run[-1]

    def total(name: str) -> float | None:
        values = [v for e in run if (v := getattr(e, name)) is not None]
        return sum(values) if values else None

    cached = [e for e in run if e.cached_tokens is not None]
    tiers = [e.cached_by_tier for e in run if e.cached_by_tier]
    return TokenEvent(
        request_id=first.request_id,
        index=first.index,
        token_ids=[t for e in run for t in e.token_ids],
        logprobs=None if first.logprobs is None else [lp for e in run for lp in e.logprobs or ()],
        finish_reason=last.finish_reason,
        stop_string=last.stop_string,
        cached_tokens=cached[-1].cached_tokens if cached else None,
        cached_by_tier=tiers[-1] if tiers else None,
        prefill_s=total("prefill_s"),
        decode_s=total("decode_s"),
        kv_bytes=total("kv_bytes"),
        kv_transfer_s=total("kv_transfer_s"),
        worker_id=first.worker_id,
    )


@dataclass(frozen=True)
class Job:
    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: Sampling
    deadline: float  # unix time
    retention: str = "chat"
    salt: str = ""  # the tenant's: part of every block hash
    fingerprint: str = ""  # the model's: part of every block hash
    block_size: int = 0
    block_hashes: list[str] = field(default_factory=list)
    cached_blocks: dict[str, int] = field(default_factory=dict)  # location → leading blocks
    segments: Segments = ()  # what the prompt was tokenized from (reuses earlier hashes)
    images: tuple[ImageRef, ...] = ()  # images in the prompt (their placeholders' positions)
    priority: Priority = "online"


@dataclass(frozen=True)
class DispatchLimits:
    ack_timeout_s: float  # a worker must queue (or refuse) a task within this
    local_prefill_max_tokens: int  # uncached prompt at most this: the decode worker prefills it
    liveness_check_s: float = 0.25  # how often a waiting request checks its workers still live
    lookup_timeout_s: float = 0.25  # cachemeta must answer a lookup within this
    migration_limit: int = 3  # moves to other workers when a request's workers fail
    first_token_timeout_s: float = 120.0  # no first token within this: its workers failed
    token_timeout_s: float = 30.0  # no next token within this: its decode worker failed
    max_starting: int = 32  # requests looking up their cache or sending their task at once


@dataclass
class Outstanding:
    """What this router has sent to each worker and not yet seen finish: fresher than the
    worker's last heartbeat (which is up to an interval old)."""

    requests: dict[str, int] = field(default_factory=dict)

    def add(self, service_id: str) -> None:
        self.requests[service_id] = self.requests.get(service_id, 0) + 1

    def done(self, service_id: str) -> None:
        left = self.requests.get(service_id, 0) - 1
        if left > 0:
            self.requests[service_id] = left
        else:
            self.requests.pop(service_id, None)

    def __getitem__(self, service_id: str) -> int:
        return self.requests.get(service_id, 0)


@dataclass
class Attempt:
    """One try of a request: the workers it went to, and the routing decision."""

    workers: tuple[str, ...] = ()
    prefill: str = ""  # the prefill worker the policy chose ("" when decode prefills)
    decode: str = ""
    route: RouteRequest | None = None
    decision: dict = field(default_factory=dict)  # what the router says about its choice
    prefilled: bool = False


@dataclass
class Waiting:
    """An attempt's token events on their way to its reader, and what the watchdog needs to
    tell that they stopped coming (then it puts the reason in, to be raised)."""

    job: Job
    attempt: Attempt
    items: deque[TokenEvent | Exception] = field(default_factory=deque)
    wakeup: asyncio.Future[None] | None = None  # the reader's, while nothing is there
    heard_at: float = field(default_factory=time.monotonic)  # the task went, or an event came
    started: bool = False  # an event came
    told: bool = False  # the watchdog gave up on it

    def put(self, item: TokenEvent | Exception) -> None:
        self.items.append(item)
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)

    async def get(self) -> TokenEvent | Exception:
        """The next item (an asyncio.Queue, less its bookkeeping: this is once per token)."""
        while not self.items:
            self.wakeup = asyncio.get_running_loop().create_future()
            await self.wakeup
        return self.items.popleft()


class _Failed(Exception):
    """This attempt failed: the workers named are not tried again for this request, and
    (unless it was no fault of theirs: busy) their circuit breakers count it."""

    def __init__(self, reason: str, *service_ids: str, fault: bool = True) -> None:
        super().__init__(reason)
        self.service_ids = service_ids
        self.fault = fault


class Dispatcher:
    def __init__(
        self,
        bus: Bus,
        router_id: str,
        registry: WorkerRegistry,
        policy: RoutingPolicy,
        limits: DispatchLimits,
        handoff_secret: bytes,
        breakers: Breakers | None = None,
    ) -> None:
        self.bus = bus
        self.breakers = breakers or Breakers()
        self.handoff_secret = handoff_secret
        self.router_id = router_id
        self.registry = registry
        self.policy = policy
        self.limits = limits
        self.outstanding = Outstanding()
        self.hash_cache = PrefixHashes()
        self._waiting: dict[str, Waiting] = {}  # by request id (the attempt's)
        # A burst of requests takes turns to start: the replies of those already asking
        # (cachemeta's, the workers' acks) are not left waiting behind a thousand others.
        self._starting = asyncio.Semaphore(limits.max_starting)
        self._watchdog: asyncio.Task | None = None  # (held: the loop keeps only weak refs)

    async def start(self) -> None:
        await self.bus.subscribe(subjects.replies(self.router_id), TokenEvents, self._on_events)
        self.bus.on_reconnect.append(self._reconnected)
        self._watchdog = asyncio.create_task(self._watch())

    def _reconnected(self) -> None:
        """Token events published while this router was away from NATS are lost (its
        subscription was gone from the cluster): every answer in flight moves on from the
        tokens it sent (no fault of its workers)."""
        for rid, waiting in self._waiting.items():
            waiting.put(
                TokenEvent(
                    request_id=rid,
                    index=-1,
                    error="this router's connection to NATS was lost meanwhile",
                    error_code="unavailable",
                )
            )

    async def _on_events(self, message: TokenEvents) -> None:
        waiting, now = self._waiting, time.monotonic()
        for event in message.events:
            w = waiting.get(event.request_id)
            if w is not None:
                w.heard_at, w.started = now, True
                w.put(event)

    async def _watch(self) -> None:
        """Every liveness_check_s, each answer being waited for is checked (one timer for
        all, not one per token): the reason is put in its events when its deadline passed,
        a worker of its attempt left the registry, or no event came within the progress
        bound (a frozen worker is given up on, not waited for until the deadline)."""
        while True:
            await asyncio.sleep(self.limits.liveness_check_s)
            now, wall = time.monotonic(), time.time()
            for w in list(self._waiting.values()):
                try:
                    reason = None if w.told else self._given_up(w, now, wall)
                except Exception:  # never the end of the watchdog: answers would hang
                    log.exception("checking %s", w.job.request_id)
                    continue
                if reason is not None:
                    w.told = True
                    w.put(reason)

    def _given_up(self, w: Waiting, now: float, wall: float) -> Exception | None:
        """Why an answer is no longer waited for (None while it may still come)."""
        if wall >= w.job.deadline:
            return ApiError(504, "request deadline passed", code="timeout")
        attempt, limits = w.attempt, self.limits
        gone = [s for s in attempt.workers if not self._alive(s)]
        if gone:
            return _Failed(f"worker {gone[0]} went away", *gone)
        bound = limits.token_timeout_s if w.started else limits.first_token_timeout_s
        if now - w.heard_at < bound:
            return None
        blamed = (attempt.decode,) if w.started else attempt.workers
        which = "next" if w.started else "first"
        return _Failed(f"no {which} token within {bound:g} s from {', '.join(blamed)}", *blamed)

    def check_servable(self, model: str) -> None:
        """503 unless a ready prefill and a ready decode worker serve the model, and one of
        each is not skipped by its circuit breaker."""
        for role in ("prefill", "decode"):
            if self._candidates(role, model, set()):
                continue
            if self._candidates(role, model, set(), breakers=False):
                why = f"every {role} worker serving {model!r} is failing (breakers open)"
            else:
                why = f"no live {role} worker serves {model!r}"
            raise ApiError(503, f"{why}; retry later", code="unavailable")

    def _candidates(
        self, role: str, model: str, excluded: set[str], breakers: bool = True
    ) -> list[WorkerRecord]:
        return [
            w
            for w in self.registry.ready(role)
            if model in w.heartbeat.models
            and w.service_id not in excluded
            and (not breakers or self.breakers.allows(w.service_id))
        ]

    async def generate(self, job: Job, decision: dict | None = None) -> AsyncIterator[TokenEvent]:
        """The request's token events in order, ending with the one that has finish_reason.
        ``decision`` (when given) is filled with the routing decision and its terms.

        Leaving early (the client went away, a stop string) cancels the request on its workers.
        """
        async with self._starting:
            job = await self._with_cache_plan(job)
        wire = job
        excluded: set[str] = set()
        sent: list[int] = []  # answer tokens yielded so far
        failures: list[str] = []
        for move in range(self.limits.migration_limit + 1):
            attempt_ = Attempt()
            waiting = self._waiting[wire.request_id] = Waiting(wire, attempt_)
            finished = False
            # Not the current span across the yields below (the consumer may step this
            # generator from other tasks): current only while the task is sent.
            span = tracer.start_span(
                "generate",
                kind=SpanKind.CLIENT,
                attributes={
                    "attempt": move + 1,
                    "resumed_tokens": len(sent),
                    "prompt_tokens": len(wire.prompt_ids),
                },
            )
            try:
                with trace.use_span(span, end_on_exit=False):
                    try:
                        async with self._starting:
                            await self._send(wire, excluded, attempt_)  # in outstanding
                    except ApiError as err:
                        if failures:  # no worker left to move to: say why it had to move
                            err.message += f" (after: {'; '.join(failures)})"
                        raise
                span.set_attributes(
                    {
                        "workers": list(attempt_.workers),
                        "chosen": str(attempt_.decision.get("chosen", "")),
                    }
                )
                if decision is not None and not sent:
                    decision.clear()
                    decision.update(attempt_.decision)
                resumed_after = len(sent)  # tokens sent before this attempt
                async for event in self._events(waiting):
                    if not attempt_.prefilled and event.worker_id == attempt_.prefill:
                        self._prefilled(attempt_, event, len(wire.prompt_ids))
                    if resumed_after:  # a resumed answer: its events continue the first's
                        if event.cached_tokens is not None:
                            span.set_attribute("reused_tokens", event.cached_tokens)
                        event = resumed_event(event, resumed_after)
                    sent.extend(event.token_ids)
                    if event.finish_reason:
                        finished = True
                        for w in attempt_.workers:
                            self.breakers.success(w)
                    yield event
                    if finished:
                        return
            except _Failed as failure:
                span.set_status(StatusCode.ERROR, str(failure))
                failures.append(str(failure))
                excluded.update(failure.service_ids)
                for w in failure.service_ids if failure.fault else ():
                    self.breakers.fault(w, str(failure))
                if move == self.limits.migration_limit:
                    raise ApiError(
                        503,
                        f"request failed after {move} moves: {'; '.join(failures)}",
                        code="unavailable",
                    ) from None
                log.warning(
                    "%s: %s; %s on other workers",
                    job.request_id,
                    failure,
                    f"resuming after {len(sent)} tokens" if sent else "retrying",
                )
                MOVES.labels("resumed" if sent else "retried").inc()
            finally:
                span.end()
                for w in attempt_.workers:
                    self.outstanding.done(w)
                if attempt_.prefill and not attempt_.prefilled:  # failed or cancelled first
                    self._prefilled(attempt_, None, len(wire.prompt_ids))
                self._waiting.pop(wire.request_id, None)
                if not finished:
                    with contextlib.suppress(Exception):
                        await self.bus.publish(subjects.CANCEL, Cancel(request_id=wire.request_id))
            # The next move has an id of its own: a worker that wakes up late with this one
            # (and is told to cancel it) can never mix its tokens into the answer.
            wire = await self._resumed(job, sent, move + 1)

    async def _resumed(self, job: Job, sent: list[int], move: int) -> Job:
        """The request again, for its ``move``-th move: its prompt plus the answer tokens
        already sent, the answer's remaining length, the sampler at the next position."""
        if not sent:
            return replace(job, request_id=f"{job.request_id}-retry{move}")
        sampling = job.sampling.model_copy(
            update={
                "max_tokens": job.sampling.max_tokens - len(sent),
                "answer_offset": job.sampling.answer_offset + len(sent),
            }
        )
        resumed = replace(
            job,
            request_id=f"{job.request_id}-resume{move}",
            prompt_ids=[*job.prompt_ids, *sent],
            sampling=sampling,
            segments=(),
            block_hashes=[],
            cached_blocks={},
        )
        return await self._with_cache_plan(resumed)

    def _prefilled(self, attempt: Attempt, first: TokenEvent | None, n_prompt: int) -> None:
        """The prefill worker is done with the request: the policy learns what it took."""
        attempt.prefilled = True
        assert attempt.route is not None
        now = time.monotonic()
        if first is None or first.cached_tokens is None:
            self.policy.prefilled(attempt.prefill, attempt.route, now)
            return
        uncached = n_prompt - first.cached_tokens
        loaded = (first.cached_by_tier or {}).get("storage", 0)
        self.policy.prefilled(
            attempt.prefill, attempt.route, now, uncached, loaded, first.prefill_s or 0.0
        )

    def block_size(self, model: str) -> int:
        """The KV block size of the workers serving the model (0 when none says)."""
        for role in ("prefill", "decode"):
            for w in self._candidates(role, model, set()):
                if w.heartbeat.load.kv_block_size:
                    return w.heartbeat.load.kv_block_size
        return 0

    async def lookup(self, hashes: list[str]) -> dict[str, int]:
        """Per location, the leading blocks it holds (cachemeta); {} when it cannot say."""
        if not hashes:
            return {}
        with tracer.start_as_current_span(
            "cachemeta.lookup", kind=SpanKind.CLIENT, attributes={"blocks": len(hashes)}
        ) as span:
            try:
                reply = await self.bus.request(
                    subjects.CACHEMETA_LOOKUP,
                    LookupRequest.of(hashes),
                    LookupReply,
                    self.limits.lookup_timeout_s,
                )
            except BusError as err:
                log.warning("cache lookup failed (routing as if nothing is cached): %s", err)
                span.set_status(StatusCode.ERROR, str(err))
                return {}
            span.set_attribute("held", json.dumps(reply.counts, sort_keys=True))
        return reply.counts

    def prompt_hashes(self, job: Job) -> tuple[int, list[str]]:
        """The block size of the job's model (0 while no worker of it is known) and the
        hashes of the prompt's full blocks."""
        bs = self.block_size(job.model)
        if not bs:
            return 0, []
        if job.segments:
            return bs, self.hash_cache.hashes(job.segments, bs, job.fingerprint, job.salt)
        return bs, block_hashes(job.prompt_ids, bs, job.fingerprint, job.salt, images=job.images)

    async def _with_cache_plan(self, job: Job) -> Job:
        """The prompt's block hashes, and which locations hold how many of them."""
        bs, hashes = self.prompt_hashes(job)
        if not bs:
            return job
        counts = await self.lookup(hashes)
        return replace(job, block_size=bs, block_hashes=hashes, cached_blocks=counts)

    def _rank_decode(self, job: Job, excluded: set[str]) -> list[WorkerRecord]:
        """Decode workers with KV room, those with room for the whole answer first."""
        records = {w.service_id: w for w in self._candidates("decode", job.model, excluded)}
        bs = max(1, job.block_size or 64)
        needed = -(-(len(job.prompt_ids) + job.sampling.max_tokens) // bs)
        scores = []
        for w in records.values():
            load = w.heartbeat.load
            active = max(self.outstanding[w.service_id], load.inflight)
            scores.append(
                DecodeScore(w.service_id, load.kv_blocks_total - load.kv_blocks_used, active)
            )
        return [records[s.service_id] for s in rank_decode(scores, needed)]

    async def _send(self, job: Job, excluded: set[str], attempt: Attempt) -> None:
        """Queue the task on the best worker that takes it; fills ``attempt`` (its workers are
        counted in ``outstanding`` until the caller says they are done)."""
        decodes = self._rank_decode(job, excluded)
        if not decodes:
            self.check_servable(job.model)
            raise ApiError(503, "no decode worker has room for this request", code="unavailable")
        # What the decode worker could load itself: the storage tier, or its own memory.
        near = (STORE, memory_location(decodes[0].service_id))
        cached_blocks = max(job.cached_blocks.get(loc, 0) for loc in near)
        uncached = len(job.prompt_ids) - cached_blocks * job.block_size
        local = uncached <= self.limits.local_prefill_max_tokens
        route = RouteRequest(
            job.request_id,
            len(job.prompt_ids),
            job.block_size,
            job.block_hashes,
            job.cached_blocks,
            time.monotonic(),
        )
        with tracer.start_as_current_span("route") as span:
            if local:
                plan = [(d, d) for d in decodes]
                attempt.decision = {"prefill": "on decode", "uncached_tokens": uncached}
                span.set_attributes({"prefill": "on decode", "uncached_tokens": uncached})
            else:
                records = {
                    w.service_id: w for w in self._candidates("prefill", job.model, excluded)
                }
                for sid, w in records.items():
                    self.policy.reported(sid, w.heartbeat.load.queued_tokens)
                if not records:
                    self.check_servable(job.model)
                    raise ApiError(
                        503, "every prefill worker failed this request", code="unavailable"
                    )
                ranked = self.policy.rank(route, sorted(records))
                plan = [(records[r.service_id], decodes[0]) for r in ranked]
                attempt.decision = {
                    "policy": self.policy.name,
                    "candidates": ranked,  # terms are built when the decision is shown
                }
                if span.is_recording():  # the terms are built only for a recorded trace
                    span.set_attributes(route_attributes(self.policy.name, ranked))
            span.set_attribute("decode", decodes[0].service_id)
        busy = 0
        for worker, decode in plan:
            task = GenerateTask(
                request_id=job.request_id,
                model=job.model,
                token_ids=job.prompt_ids,
                sampling=job.sampling,
                reply_subject=subjects.replies(self.router_id),
                decode_id=decode.service_id,
                decode_kv_address=decode.heartbeat.addresses.get("kv", ""),
                deadline=job.deadline,
                block_hashes=job.block_hashes,
                salt=job.salt,
                handoff_token=handoff_token(
                    self.handoff_secret, job.request_id, decode.service_id, job.deadline
                ),
                retention=job.retention,
                images=list(job.images),
                priority=job.priority,
            )
            role = worker.heartbeat.role
            involved = tuple(dict.fromkeys((worker.service_id, decode.service_id)))
            # Counted from now: requests routed meanwhile see this one (before its ack).
            for w in involved:
                self.outstanding.add(w)
                self.breakers.trying(w)
            if role == "prefill":
                self.policy.dispatched(worker.service_id, route)
            try:
                ack = await self._ask(subjects.tasks(role, worker.service_id), task)
            except BusError as err:
                for w in involved:
                    self.outstanding.done(w)
                if role == "prefill":
                    self.policy.prefilled(worker.service_id, route, time.monotonic())
                raise _Failed(
                    f"{role} {worker.service_id} did not answer: {err}", worker.service_id
                ) from None
            if ack.accepted:
                attempt.workers, attempt.decode = involved, decode.service_id
                attempt.decision["chosen"] = worker.service_id
                attempt.decision["decode"] = decode.service_id
                if role == "prefill":
                    attempt.prefill, attempt.route = worker.service_id, route
                return
            for w in involved:
                self.outstanding.done(w)
            if role == "prefill":
                self.policy.prefilled(worker.service_id, route, time.monotonic())
            if ack.reason != "busy":
                raise ApiError(503, f"{role} worker refused: {ack.reason}", code="unavailable")
            busy += 1
        raise ApiError(
            429, f"all {busy} workers are busy; retry shortly", code="overloaded", retry_after_s=1
        )

    async def _ask(self, subject: str, task: GenerateTask) -> TaskAck:
        """The worker's ack within the ack timeout. Nobody subscribed is asked again within
        it: a worker whose NATS node was lost is reconnecting (a dead one is not, and is
        given up on when the timeout ends)."""
        deadline = time.monotonic() + self.limits.ack_timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return await self.bus.request(subject, task, TaskAck, max(0.05, left))
            except NoResponders:
                if left <= NO_RESPONDERS_RETRY_S:
                    raise
                await asyncio.sleep(NO_RESPONDERS_RETRY_S)

    async def _events(self, waiting: Waiting) -> AsyncIterator[TokenEvent]:
        """Events in answer order (prefill and decode publish on separate connections)."""
        items = waiting.items
        next_index = 0
        early: dict[int, TokenEvent] = {}
        held: list[TokenEvent | Exception] = []  # taken while catching up, not yet seen
        while True:
            if next_index in early:
                event = early.pop(next_index)
            else:
                item = held.pop() if held else await waiting.get()
                if isinstance(item, Exception):  # the watchdog's: the attempt failed
                    raise item
                event = item
                if event.error:
                    if event.error_code in ("busy", "unavailable"):
                        raise _Failed(
                            event.error,
                            *([event.worker_id] if event.worker_id else []),
                            fault=event.error_code == "unavailable",
                        )
                    if event.worker_id:
                        self.breakers.fault(event.worker_id, event.error)
                    raise ApiError(500, f"worker error: {event.error}", code="internal")
                if event.index > next_index:
                    early[event.index] = event
                    continue
                if event.index < next_index:  # a duplicate
                    continue
            next_index += len(event.token_ids)
            # Events already here that continue this one go out with it: a stream that fell
            # behind catches up in one chunk and one write, not one per token.
            run = [event]
            while not run[-1].finish_reason and items and next_index not in early:
                more = items.popleft()
                if isinstance(more, Exception) or not continues(run[-1], more):
                    held.append(more)  # (an error, a gap, another worker's: on its own next)
                    break
                run.append(more)
                next_index += len(more.token_ids)
            event = merged(run)
            yield event
            if event.finish_reason:
                return

    def _alive(self, service_id: str) -> bool:
        record = self.registry.get(service_id)
        return record is not None and record.heartbeat.status != "stopped"

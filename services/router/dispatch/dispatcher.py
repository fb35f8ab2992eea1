"""Sending a request to workers and getting its tokens back, with moves and cancellation.

``Dispatcher.generate`` is the whole stage on one screen: the cache plan (``plan.py``), then
per attempt the routing decision and the task sent (``send.py``), the token events streamed
back (``stream.py``), and on a failure the move to other workers (``Moves``). Leaving early
(the client went away, a stop string) cancels the request on its workers.

When a request's workers fail (no answer to the task, gone from the registry, an error event,
or no token within the progress bounds), the request moves to other workers, at most
``migration_limit`` times, then fails with 503. Before its first token it is sent again;
mid-answer it resumes from the tokens already sent: its prompt plus them, on a decode worker
that loads the blocks the failed one stored as they filled, with the sampler at the next
position, so the client's stream goes on with no token missing or repeated. Each move has a
request id of its own: a worker that wakes up late with an earlier one (and is told to cancel
it) can never mix its tokens into the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode

from services.router.dispatch.job import Attempt, Failed, Job
from services.router.dispatch.moves import Moves, Waiting
from services.router.dispatch.plan import BlockLookup, CachePlanner
from services.router.dispatch.send import Direct, InFlight, NoDirect, Sender
from services.router.dispatch.stream import Replies
from services.router.dispatch.workers import Breakers, WorkerRecord, WorkerRegistry
from services.router.errors import ApiError, overloaded, unavailable
from services.router.routing.route import (
    DecodeScore,
    PrefillWorkerState,
    Ranked,
    Route,
    RouteRequest,
    RoutingPolicy,
    route,
)
from services.router.settings import DispatchSettings
from shared.bus import Bus
from shared.messages.generate import RANKS, TokenEvent
from shared.telemetry.tracing import mark_span, tracer

log = logging.getLogger(__name__)


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


def decode_score(w: WorkerRecord, inflight: int, adapter: str = "") -> DecodeScore:
    """A decode worker as routing sees it, from its heartbeat and what this router sent it
    (``adapter``: the request's LoRA adapter, whether it holds it resident)."""
    load = w.heartbeat.load
    return DecodeScore(
        w.service_id,
        load.kv_blocks_total - load.kv_blocks_used,
        max(inflight, load.inflight),
        w.heartbeat.whole,
        load.queued_tokens,
        w.heartbeat.pd_only,
        load.kv_blocks_used * load.kv_block_size,
        not adapter or adapter in load.adapters,
    )


def waiting(workers: list[WorkerRecord], sent: Mapping[str, PrefillWorkerState]) -> int:
    """Requests waiting at ``workers`` behind the one each computes: as this router counts
    the prompts it ``sent`` them and has not seen prefilled, or as each says it queues."""
    total = 0
    for w in workers:
        state = sent.get(w.service_id)
        total += max(state.inflight - 1 if state else 0, w.heartbeat.load.queued)
    return total


def check_fits(job: Job, decoders: list[WorkerRecord]) -> None:
    """400 when no decode worker's KV pool could ever hold the prompt and its answer
    (busy ones free up; one too small never does)."""
    pools = [w.heartbeat.load.kv_blocks_total * w.heartbeat.load.kv_block_size for w in decoders]
    largest = max(pools, default=0)
    need = len(job.prompt_ids) + job.sampling.max_tokens
    if largest and need > largest:
        raise ApiError(
            400,
            f"the prompt ({len(job.prompt_ids)} tokens) and max_tokens "
            f"({job.sampling.max_tokens}) need {need} tokens of KV; the largest decode "
            f"worker holds {largest}: shorten the prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )


def check_due(job: Job, chosen: Route) -> None:
    """429 at once, saying the estimate, when the policy's best estimate of the first
    token's time is past what the client asked for (x-kvmesh-ttft-deadline-ms): better
    told now than kept waiting to miss it. (A policy with no estimate never refuses.)"""
    candidates = chosen.decision.get("candidates") if chosen.ranked else None
    estimate = candidates[0].terms.get("ttft_s") if candidates else None
    left_s = job.ttft_first_by - time.time()
    if estimate is not None and estimate > left_s:
        raise overloaded(
            f"the first token is estimated in {estimate * 1e3:.0f} ms, past the deadline "
            f"asked for (x-kvmesh-ttft-deadline-ms: {max(0.0, left_s) * 1e3:.0f} ms left)",
            job.priority,
            "deadline",
        )


CACHED_POLL_S = 0.005  # how often ``cached`` looks at the index again


@contextlib.contextmanager
def traced(attempt: Attempt, moves: Moves) -> Iterator[Span]:
    """The attempt's span. Not the current span across the yields of ``generate`` (its reader
    may step it from other tasks): current only while the task is sent."""
    span = tracer.start_span(
        "generate",
        kind=SpanKind.CLIENT,
        attributes={
            "attempt": moves.move + 1,
            "resumed_tokens": moves.offset,
            "prompt_tokens": len(attempt.job.prompt_ids),
        },
    )
    try:
        yield span
    finally:
        span.end()


class Dispatcher:
    def __init__(
        self,
        bus: Bus,
        router_id: str,
        registry: WorkerRegistry,
        breakers: Breakers,
        kv: BlockLookup,
        policy: RoutingPolicy,
        settings: DispatchSettings,
        secrets_dir: Path,
        direct: Direct | None = None,
        links_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.bus = bus
        self.registry = registry
        direct = direct or NoDirect()
        self.breakers = breakers
        self.policy = policy
        self.settings = settings
        self.plans = CachePlanner(kv, settings.prefix_prompts, settings.prefix_bytes)
        self.inflight = InFlight(policy, breakers)
        self.replies = Replies(bus, router_id, registry, breakers, settings, direct, links_tls)
        self.sender = Sender(
            *(bus, router_id, registry, self.inflight, settings, secrets_dir, direct),
            self.replies.tokens,
        )
        # A burst of requests takes turns to start: the replies of those already asking
        # (the workers' acks) are not left waiting behind a thousand others.
        self._starting = asyncio.Semaphore(settings.max_starting)
        self.resumes_waiting = Waiting()  # answers half sent, waiting for a worker

    async def start(self, host: str = "127.0.0.1", advertised_host: str = "127.0.0.1") -> None:
        """``host``: where the workers' token links connect, ``advertised_host`` what they are
        told (the router's own addresses)."""
        await self.replies.start(host, advertised_host)

    async def stop(self) -> None:
        await self.replies.stop()

    async def generate(self, job: Job, decision: dict | None = None) -> AsyncIterator[TokenEvent]:
        """The request's token events in order, ending with the one that has finish_reason.
        ``decision`` (when given) is filled with the routing decision and its terms."""
        async with self._starting:
            job = await self.plan(job)
        moves = Moves(job, self.settings.migration_limit)
        while True:
            attempt = moves.attempt()
            with traced(attempt, moves) as span, self.inflight.held(attempt):
                async with self.replies.expecting(attempt) as waiting:
                    try:
                        await self._send(attempt, moves, span)
                        waiting.heard_at = max(waiting.heard_at, time.monotonic())  # (sent)
                        if decision is not None and not moves.sent:
                            decision.clear()
                            decision.update(attempt.decision)
                        async for event in self.replies.events(waiting):
                            yield self._seen(attempt, moves, event, span)
                            if attempt.finished:
                                moves.answered(self.breakers)
                                return
                    except Failed as failure:
                        span.set_status(StatusCode.ERROR, str(failure))
                        moves.failed(failure, self.breakers)  # (ApiError: no move is left)
            job = moves.next_job()
            if moves.needs_plan:
                moves.job = await self.plan(job)

    async def plan(self, job: Job) -> Job:
        """The job with its cache plan: block hashes, and where this router's index says
        they are."""
        return await self.plans.planned(job, *self.kv_format(job.model))

    async def _send(self, attempt: Attempt, moves: Moves, span: Span) -> None:
        """Route the attempt and queue its task (the span current meanwhile)."""
        async with self._starting:
            with trace.use_span(span, end_on_exit=False):
                try:
                    chosen, req = await self._route_resuming(attempt.job, moves)
                    mark_span("routed", span)
                    await self.sender.send(attempt, chosen, req)
                    mark_span("acked", span)
                except ApiError as err:
                    raise moves.unservable(err) from None
        chosen_id = str(attempt.decision.get("chosen", ""))
        span.set_attributes({"workers": list(attempt.workers), "chosen": chosen_id})

    async def _route_resuming(self, job: Job, moves: Moves) -> tuple[Route, RouteRequest]:
        """The routing decision; mid-answer, with no worker for the rest now (each gone or
        full), it waits up to ``resume_wait_s`` for one (a client cannot retry half an answer),
        then trying again those given up on for silence once heard from (``Moves.left_out``)."""
        deadline = time.monotonic() + (self.settings.resume_wait_s if moves.sent else 0.0)
        try:
            return self._route(job, moves.left_out(self.registry))
        except ApiError as err:
            if err.status not in (429, 503) or time.monotonic() >= deadline:
                raise
        with self.resumes_waiting.one():
            while True:
                await asyncio.sleep(self.settings.liveness_check_s)
                try:
                    return self._route(job, moves.left_out(self.registry, heard=True))
                except ApiError as err:
                    if err.status not in (429, 503) or time.monotonic() >= deadline:
                        raise

    def _route(self, job: Job, excluded: set[str]) -> tuple[Route, RouteRequest]:
        """The routing decision over the workers not left out (503 when there is none)."""
        decoders = self.candidates("decode", job.model, excluded)
        check_fits(job, decoders)
        # Workers pair with their own kind: engines that own their KV hand a request over
        # through the storage tier (or, SGLang's in its own P/D, engine to engine: prefill
        # workers with a bootstrap server pair with decode workers that take only that), the
        # others over gRPC.
        whole = any(w.heartbeat.whole for w in decoders)
        peered = any(w.heartbeat.pd_only for w in decoders)
        adapter = job.sampling.adapter
        decodes = [
            decode_score(w, self.inflight[w.service_id], adapter)
            for w in decoders
            if w.heartbeat.whole == whole
        ]
        prefillers = [
            w
            for w in self.candidates("prefill", job.model, excluded)
            if w.heartbeat.whole == whole and ("bootstrap" in w.heartbeat.addresses) == peered
        ]
        prefills = {w.service_id: w.heartbeat.load.queued_tokens for w in prefillers}
        for w in prefillers if adapter else ():  # (where adapters are: their heartbeats)
            load = w.heartbeat.load
            self.policy.resident(w.service_id, load.adapters, load.adapter_load_s)
        req = RouteRequest(
            job.request_id,
            len(job.prompt_ids),
            job.block_size,
            job.block_hashes,
            job.cached_blocks,
            time.monotonic(),
            min(job.sampling.max_tokens, job.expected_tokens or job.sampling.max_tokens),
            adapter,
        )
        # A candidate whose prompt a decode worker holds (``near``) computes under a block
        # there, sharing the rest, whatever the bound on prompts prefilled on decode.
        local_max = self.settings.local_prefill_max_tokens
        if job.near:
            local_max = max(local_max, job.block_size)
        with tracer.start_as_current_span("route") as span:
            chosen = route(self.policy, req, prefills, decodes, local_max)
            if not chosen.pairs:
                self.check_servable(job.model)
                if not decodes:  # each one tried failed it
                    raise unavailable("every decode worker failed this request")
                if not chosen.decision:  # (full now: the client retries shortly)
                    why = "no decode worker has room for this request"
                    raise overloaded(why, job.priority, "decode")
                raise unavailable("every prefill worker failed this request")
            if job.ttft_first_by:
                check_due(job, chosen)
            if not chosen.ranked:
                span.set_attributes(chosen.decision)
            elif span.is_recording():  # the terms are built only for a recorded trace
                span.set_attributes(
                    route_attributes(self.policy.name, chosen.decision["candidates"])
                )
            span.set_attribute("decode", chosen.pairs[0][1])
        return chosen, req

    def _seen(self, attempt: Attempt, moves: Moves, event: TokenEvent, span: Span) -> TokenEvent:
        """An event of the attempt's, as the answer goes on with it."""
        if not attempt.prefilled and attempt.prefill and event.worker_id == attempt.prefill:
            self.inflight.prefilled(attempt, event)
        if moves.offset and event.cached_tokens is not None:
            span.set_attribute("reused_tokens", event.cached_tokens)
        if event.finish_reason:
            attempt.finished = True
            for w in attempt.workers:
                self.breakers.success(w)
        return moves.continued(event)

    # -- who can serve a model -------------------------------------------------------------

    def check_servable(self, model: str) -> None:
        """503 unless a ready prefill and a ready decode worker serve the model, and one of
        each is not skipped by its circuit breaker (a decode worker that takes whole requests
        needs no prefill worker)."""
        decoders = self.candidates("decode", model, set())
        whole = any(w.heartbeat.whole and not w.heartbeat.pd_only for w in decoders)
        for role in ("decode",) if whole else ("decode", "prefill"):
            if self.candidates(role, model, set()):
                continue
            if self.candidates(role, model, set(), breakers=False):
                why = f"every {role} worker serving {model!r} is failing (breakers open)"
            else:
                why = f"no live {role} worker serves {model!r}"
            raise unavailable(f"{why}; retry later")

    def queues_full(self, model: str) -> bool:
        """The workers that would prefill for ``model`` have requests waiting: on average one
        behind each one computing (the mesh has no spare room)."""
        workers = self.candidates("prefill", model, set())
        workers = workers or self.candidates("decode", model, set())
        return bool(workers) and waiting(workers, self.policy.workers) >= len(workers)

    def check_spare(self, model: str, priority: str) -> None:
        """429 for a flex or batch request while the mesh's queues are full: the lower
        classes take its spare room, never its queues, where they would slow the higher
        classes down."""
        if RANKS[priority] >= RANKS["flex"] and self.queues_full(model):
            why = f"no spare room for the {priority} class: requests wait already"
            raise overloaded(why, priority, "spare")

    def candidates(
        self, role: str, model: str, excluded: set[str], breakers: bool = True
    ) -> list[WorkerRecord]:
        return [
            w
            for w in self.registry.ready(role)
            if model in w.heartbeat.models
            and w.service_id not in excluded
            and (not breakers or self.breakers.allows(w.service_id))
        ]

    def kv_format(self, model: str) -> tuple[int, str]:
        """The KV block size of the workers serving the model and how their blocks are named
        (their engine's hash scheme: shared/kvstore/hashing.py), as their heartbeats say;
        (0, "") while none says (nothing is hashed then)."""
        for role in ("prefill", "decode"):
            for w in self.candidates(role, model, set()):
                if w.heartbeat.load.kv_block_size:
                    return w.heartbeat.load.kv_block_size, w.heartbeat.load.kv_hash
        return 0, ""

    async def cached(self, job: Job, timeout_s: float) -> int:
        """Wait (``timeout_s`` at most) until one place holds the prompt's reusable blocks."""
        size, hashes = self.prompt_hashes(job)
        wanted = min(len(hashes), (len(job.prompt_ids) - 1) // size) if size else 0
        deadline = time.monotonic() + timeout_s
        while (held := max(self.plans.lookup(hashes[:wanted]).values(), default=0)) < wanted:
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(CACHED_POLL_S)
        return held

    def prompt_hashes(self, job: Job) -> tuple[int, list[str]]:
        """The block size of the job's model (0 while no worker of it is known) and the
        hashes of the prompt's full blocks (from the cache of recent prompts' hashes)."""
        bs, scheme = self.kv_format(job.model)
        return bs, self.plans.hashes(job, bs, scheme)

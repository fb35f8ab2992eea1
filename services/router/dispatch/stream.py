"""An answer's token events on their way back: from this router's reply subject to the
answer's reader, in answer order, and merged when the reader fell behind; and the watchdog that
gives up on an answer whose workers stopped answering.

Prefill and decode publish on separate connections, so events can arrive out of order: each
carries its index in the answer, and the reader releases them in order (a duplicate is
dropped). Events already queued that continue the one being released go out with it: a stream
that fell behind catches up in one chunk and one write, not one per token. An error event ends
the attempt (busy or unavailable: it moves; else the request fails). The watchdog checks every
answer being waited for on one timer (not one per token): its deadline, its workers still in
the registry, and the progress bounds (a frozen worker is given up on, not waited for until
the deadline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from secrets import token_hex

from services.router.dispatch.job import Attempt, Failed
from services.router.dispatch.send import Direct
from services.router.dispatch.workers import Breakers, WorkerRegistry
from services.router.errors import ApiError
from services.router.settings import DispatchSettings
from shared.bus import Bus, subjects
from shared.bus.tokens import TokenServer
from shared.messages.generate import Cancel, TokenEvent, TokenEvents
from shared.telemetry.metrics import TOKEN_MESSAGES, TOKEN_TRANSIT

log = logging.getLogger(__name__)


@dataclass
class Waiting:
    """An attempt's token events on their way to its reader, and what the watchdog needs to
    tell that they stopped coming (then it puts the reason in, to be raised)."""

    attempt: Attempt
    items: deque[TokenEvent | Exception] = field(default_factory=deque)
    wakeup: asyncio.Future[None] | None = None  # the reader's, while nothing is there
    heard_at: float = field(default_factory=time.monotonic)  # the task went, or an event came
    started: bool = False  # an event came
    decoding: bool = False  # an event came from its decode worker: prefill is done with it
    told: bool = False  # the watchdog gave up on it

    def owed(self) -> tuple[str, ...]:
        """The workers the answer still waits on: its decode worker, and its prefill worker
        until decode has taken over (the KV handed over, decode's first event here)."""
        attempt = self.attempt
        if self.decoding:
            return tuple(w for w in attempt.workers if w != attempt.prefill)
        return attempt.workers

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
        prompt_logprobs=next((e.prompt_logprobs for e in run if e.prompt_logprobs), None),
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


def failure_of(event: TokenEvent, breakers: Breakers) -> Exception:
    """What an error event means: the attempt moves (the worker is busy; unavailable: a fault
    of its own; its engine raised on it), or the request fails (a fault of the worker's,
    counted)."""
    code = event.error_code
    if code in ("busy", "unavailable", "engine"):
        workers = [event.worker_id] if event.worker_id else []
        return Failed(event.error, *workers, fault=code != "busy", engine=code == "engine")
    if event.worker_id:
        breakers.fault(event.worker_id, event.error)
    return ApiError(500, f"worker error: {event.error}", code="internal")


class Replies:
    """Every answer this router waits for, by the request id its attempt went out with."""

    def __init__(
        self,
        bus: Bus,
        router_id: str,
        registry: WorkerRegistry,
        breakers: Breakers,
        settings: DispatchSettings,
        direct: Direct,
        links_tls: ssl.SSLContext | None = None,
    ) -> None:
        self.bus = bus
        # The workers' token links (shared/bus/tokens.py), under a key new at each start.
        self.tokens: TokenServer | None = None
        if settings.token_links:
            self.tokens = TokenServer(token_hex(16), links_tls, self._on_link, self._link_lost)
        self.direct = direct
        self.router_id = router_id
        self.registry = registry
        self.breakers = breakers
        self.settings = settings
        self.waiting: dict[str, Waiting] = {}
        self._watchdog: asyncio.Task | None = None  # (held: the loop keeps only weak refs)

    async def start(self, host: str, advertised_host: str) -> None:
        await self.bus.subscribe(subjects.replies(self.router_id), TokenEvents, self._on_events)
        self.bus.on_reconnect.append(self._reconnected)
        self._watchdog = asyncio.create_task(self._watch())
        if self.tokens is not None:
            await self.tokens.start(host, self.settings.token_port, advertised_host)

    async def stop(self) -> None:
        if self.tokens is not None:
            await self.tokens.stop()
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)

    async def _on_events(self, message: TokenEvents) -> None:
        self._received(message, "nats")

    def _on_link(self, payload: bytes) -> None:
        self._received(TokenEvents.from_bytes(payload), "link")

    def _received(self, message: TokenEvents, path: str) -> None:
        TOKEN_MESSAGES.labels(path).inc()
        if message.sent_ns:
            TOKEN_TRANSIT.observe(max(0, time.time_ns() - message.sent_ns) / 1e9)
        self.deliver(message.events)

    def _link_lost(self, worker: str) -> None:
        """Events the worker wrote to its token link as it broke may be lost: the answers in
        flight here that still wait on it (``Waiting.owed``) move on from the tokens they
        sent (no fault of the worker's: the link may have broken between). A prefill worker
        that stops when its prompts are handed over moves nothing."""
        for rid, waiting in self.waiting.items():
            if worker in waiting.owed() and not waiting.attempt.finished:
                waiting.put(
                    TokenEvent(
                        request_id=rid,
                        index=-1,
                        error=f"{worker}'s token link to this router was lost",
                        error_code="unavailable",
                    )
                )

    def deliver(self, events: list[TokenEvent]) -> None:
        """Token events of answers this router waits for (those of others are dropped)."""
        waiting, now = self.waiting, time.monotonic()
        for event in events:
            w = waiting.get(event.request_id)
            if w is not None:
                w.heard_at, w.started = now, True
                w.decoding = w.decoding or event.worker_id == w.attempt.decode
                w.put(event)

    def _reconnected(self) -> None:
        """Token events published while this router was away from NATS are lost (its
        subscription was gone from the cluster): every answer in flight moves on from the
        tokens it sent (no fault of its workers)."""
        for rid, waiting in self.waiting.items():
            waiting.put(
                TokenEvent(
                    request_id=rid,
                    index=-1,
                    error="this router's connection to NATS was lost meanwhile",
                    error_code="unavailable",
                )
            )

    @contextlib.asynccontextmanager
    async def expecting(self, attempt: Attempt) -> AsyncIterator[Waiting]:
        """The attempt's events, from before its task is sent; when the attempt ends
        unfinished (it failed, or its reader left), its workers are told to cancel it."""
        rid = attempt.job.request_id
        waiting = self.waiting[rid] = Waiting(attempt)
        try:
            yield waiting
        finally:
            self.waiting.pop(rid, None)
            if not attempt.finished and self.direct.owns(attempt.decode):
                self.direct.cancel(rid)
            elif not attempt.finished:
                with contextlib.suppress(Exception):
                    await self.bus.publish(subjects.CANCEL, Cancel(request_id=rid))

    async def events(self, waiting: Waiting) -> AsyncIterator[TokenEvent]:
        """The attempt's events in answer order, each run that arrived together as one."""
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
                if item.error:
                    raise failure_of(item, self.breakers)
                if item.index > next_index:
                    early[item.index] = item
                    continue
                if item.index < next_index and (item.token_ids or item.finish_reason):
                    continue  # a duplicate (one with no tokens only brings figures: it goes on)
                event = item
            next_index += len(event.token_ids)
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

    # -- the watchdog ---------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.settings.liveness_check_s)
            now, wall = time.monotonic(), time.time()
            for w in list(self.waiting.values()):
                try:
                    reason = None if w.told else self.given_up(w, now, wall)
                except Exception:  # never the end of the watchdog: answers would hang
                    log.exception("checking %s", w.attempt.job.request_id)
                    continue
                if reason is not None:
                    w.told = True
                    w.put(reason)

    def given_up(self, w: Waiting, now: float, wall: float) -> Exception | None:
        """Why an answer is no longer waited for (None while it may still come)."""
        attempt, s = w.attempt, self.settings
        if wall >= attempt.job.deadline:
            return ApiError(504, "request deadline passed", code="timeout")
        if not attempt.workers:  # not sent yet (a move waiting for a worker)
            return None
        gone = [worker for worker in w.owed() if not self.registry.alive(worker)]
        if gone:
            return Failed(f"worker {gone[0]} went away", *gone, silent=True)
        bound = s.token_timeout_s if w.started else s.first_token_timeout_s
        if now - w.heard_at < bound:
            return None
        blamed = (attempt.decode,) if w.started else attempt.workers
        which = "next" if w.started else "first"
        why = f"no {which} token within {bound:g} s from {', '.join(blamed)}"
        return Failed(why, *blamed, silent=True)

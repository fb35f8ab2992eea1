"""Sending one attempt: the routing decision's pairs asked in turn until a worker queues the
task, and what this router has in flight at each worker.

The task goes with NATS request/reply; the reply only says "queued" or "busy" (tokens come
later, on this router's reply subject). A busy worker is skipped for the next pair; when every
pair is busy: 429. The task is asked again until acked within the ack timeout (``Bus.ask``):
an ask or its ack lost with a NATS node, or a worker reconnecting to another node, costs a
resend, not the request; the worker takes a task sent twice once (``shared.worker.Tasks``).
A dead worker is given up on when the ack timeout ends.

Servers kvmesh did not start are reached by the router itself, not over NATS (``Direct``:
``services/router/upstream/``): the task is their call, the ack their answer to it.

What is in flight is counted from the moment a task is sent (requests routed meanwhile see it)
and undone when the worker refuses it or the attempt ends, however it ends: ``InFlight.held``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from services.router.dispatch.job import Attempt, Failed, Job
from services.router.dispatch.workers import Breakers, WorkerRegistry
from services.router.errors import ApiError, overloaded
from services.router.routing.route import Route, RouteRequest, RoutingPolicy
from services.router.settings import DispatchSettings
from shared.bus import Bus, BusError, subjects
from shared.bus.tokens import TokenServer
from shared.messages.generate import GenerateTask, TaskAck, TokenEvent, pack_ids
from shared.security.handoff import HANDOFF_SECRET, handoff_token
from shared.security.secret import load_or_create


class Direct(Protocol):
    """Workers this router calls itself rather than over NATS (servers it did not start)."""

    def owns(self, worker: str) -> bool: ...

    async def ask(self, attempt: Attempt, worker: str) -> TaskAck:
        """Start the attempt on ``worker``; its ack (BusError when it does not answer)."""
        ...

    def cancel(self, request_id: str) -> None:
        """The attempt ended unfinished: stop it there."""
        ...


class NoDirect:
    """A router with no such workers."""

    def owns(self, worker: str) -> bool:
        return False

    async def ask(self, attempt: Attempt, worker: str) -> TaskAck:
        raise AssertionError(f"{worker} is not called directly")

    def cancel(self, request_id: str) -> None:
        pass


class InFlight:
    """What this router has sent to each worker and not yet seen finish: fresher than the
    worker's last heartbeat (which is up to an interval old). The routing policy is told as
    well: a prefill worker's queue holds the request until it is prefilled (or fails)."""

    def __init__(self, policy: RoutingPolicy, breakers: Breakers) -> None:
        self.policy = policy
        self.breakers = breakers
        self.requests: dict[str, int] = {}

    def __getitem__(self, service_id: str) -> int:
        return self.requests.get(service_id, 0)

    def take(
        self, attempt: Attempt, worker: str, decode: str, route: RouteRequest, ranked: bool
    ) -> None:
        """The attempt's task is on its way to ``worker`` (a prefill worker, or ``decode``
        itself when it prefills); ``ranked``: the policy chose it, and follows it."""
        attempt.workers = tuple(dict.fromkeys((worker, decode)))
        attempt.decode, attempt.route = decode, route
        for w in attempt.workers:
            self.requests[w] = self.requests.get(w, 0) + 1
            self.breakers.trying(w)
        if ranked:
            attempt.prefill = worker
            self.policy.dispatched(worker, route)

    def put_back(self, attempt: Attempt) -> None:
        """The attempt's workers no longer hold it (refused, failed, or it ended)."""
        for w in attempt.workers:
            left = self.requests.get(w, 0) - 1
            if left > 0:
                self.requests[w] = left
            else:
                self.requests.pop(w, None)
        if attempt.prefill and not attempt.prefilled:
            self.prefilled(attempt, None)
        attempt.workers, attempt.prefill, attempt.prefilled = (), "", False

    def prefilled(self, attempt: Attempt, first: TokenEvent | None) -> None:
        """The prefill worker is done with the request: the policy learns what it took (from
        its first event; nothing when it failed first)."""
        attempt.prefilled = True
        assert attempt.route is not None
        now = time.monotonic()
        if first is None or first.cached_tokens is None:
            self.policy.prefilled(attempt.prefill, attempt.route, now)
            return
        uncached = len(attempt.job.prompt_ids) - first.cached_tokens
        loaded = (first.cached_by_tier or {}).get("storage", 0)
        prefill_s = first.prefill_s or 0.0
        self.policy.prefilled(attempt.prefill, attempt.route, now, uncached, loaded, prefill_s)

    @contextlib.contextmanager
    def held(self, attempt: Attempt) -> Iterator[Attempt]:
        """Whatever the attempt took is given back when it ends, however it ends."""
        try:
            yield attempt
        finally:
            self.put_back(attempt)


class Sender:
    def __init__(
        self,
        bus: Bus,
        router_id: str,
        registry: WorkerRegistry,
        inflight: InFlight,
        settings: DispatchSettings,
        secrets_dir: Path,
        direct: Direct,
        tokens: TokenServer | None = None,
    ) -> None:
        self.bus = bus
        self.direct = direct
        self.reply_subject = subjects.replies(router_id)
        self.tokens = tokens
        self.registry = registry
        self.inflight = inflight
        self.settings = settings
        # The mesh's: a decode worker admits a handed-off prompt only with the token it makes.
        self.handoff_secret = load_or_create(secrets_dir, HANDOFF_SECRET)

    async def send(self, attempt: Attempt, route: Route, req: RouteRequest) -> None:
        """Queue the attempt's task on the first pair that takes it; fills ``attempt`` (its
        workers stay counted in flight until ``InFlight.put_back``)."""
        role = "decode" if route.on_decode else "prefill"
        busy = 0
        for worker, decode in route.pairs:
            self.inflight.take(attempt, worker, decode, req, route.ranked)
            try:
                if self.direct.owns(worker):
                    ack = await self.direct.ask(attempt, worker)
                else:
                    ack = await self.bus.ask(
                        subjects.tasks(role, worker),
                        self._task(attempt, decode),
                        TaskAck,
                        self.settings.ack_timeout_s,
                        # (asked again while the worker may answer: one whose connection
                        # closed, a process that ended, is not waited on for the whole bound)
                        nobody_again=lambda worker=worker: self.registry.alive(worker),
                    )
            except BusError as err:
                self.inflight.put_back(attempt)
                why = f"{role} {worker} did not answer: {err}"
                raise Failed(why, worker, silent=True) from None
            if ack.accepted:
                attempt.decision = {**route.decision, "chosen": worker, "decode": decode}
                return
            self.inflight.put_back(attempt)
            if ack.reason != "busy":
                raise ApiError(503, f"{role} worker refused: {ack.reason}", code="unavailable")
            busy += 1
        raise overloaded(f"all {busy} workers are busy", attempt.job.priority, "workers")

    def _task(self, attempt: Attempt, decode_id: str) -> GenerateTask:
        job = attempt.job
        decode = self.registry.get(decode_id)
        tokens = self.tokens
        return generate_task(
            job,
            reply_subject=self.reply_subject,
            decode_id=decode_id,
            decode_kv_address=decode.heartbeat.addresses.get("kv", "") if decode else "",
            handoff=handoff_token(self.handoff_secret, job.request_id, decode_id, job.deadline),
            reply_address=tokens.address if tokens is not None else "",
            reply_key=tokens.key if tokens is not None and tokens.address else "",
        )


def generate_task(
    job: Job,
    reply_subject: str,
    decode_id: str,
    decode_kv_address: str,
    handoff: str,
    reply_address: str = "",
    reply_key: str = "",
) -> GenerateTask:
    """The task a worker is sent for ``job``: made from what the router checked, not checked
    again (its prompt's ids packed as they are held: one copy)."""
    return GenerateTask.of(
        pack_ids(job.prompt_ids),
        request_id=job.request_id,
        model=job.model,
        token_ids=job.prompt_ids,
        sampling=job.sampling,
        reply_subject=reply_subject,
        reply_address=reply_address,
        reply_key=reply_key,
        decode_id=decode_id,
        decode_kv_address=decode_kv_address,
        deadline=job.deadline,
        block_hashes=job.block_hashes,
        salt=job.salt,
        handoff_token=handoff,
        retention=job.retention,
        images=list(job.images),
        priority=job.priority,
        weight=job.weight,
        ttft_first_by=job.ttft_first_by,
        pinned_until=job.pinned_until,
    )

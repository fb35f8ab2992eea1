"""A request across its attempts (``Moves``): the answer tokens sent so far, the workers given
up on and why, and the job each move sends (``dispatcher.py`` runs the attempts)."""

from __future__ import annotations

import array
import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import replace

from services.router.dispatch.job import Attempt, Failed, Job
from services.router.dispatch.workers import Breakers, WorkerRegistry
from services.router.errors import ApiError, overloaded
from shared.messages.generate import TokenEvent
from shared.telemetry.metrics import MOVES, RESUMES_WAITING

log = logging.getLogger("services.router.dispatch.dispatcher")


def resumed_event(event: TokenEvent, offset: int) -> TokenEvent:
    """An event of a resumed request as its client sees it: after the ``offset`` tokens sent
    before the move; the reuse figures stay the first attempt's."""
    return event.model_copy(
        update={"index": event.index + offset, "cached_tokens": None, "cached_by_tier": None}
    )


POISON_WORKERS = 2  # engines failing on one request before it is failed, not moved again


class Moves:
    """A request across its attempts: the answer tokens sent so far, the workers given up on,
    why each move happened, and the job the next attempt sends."""

    def __init__(self, job: Job, limit: int) -> None:
        self.first = job
        self.job = job  # the next attempt's
        self.limit = limit
        self.move = 0
        self.sent: list[int] = []  # answer tokens the client has
        self.offset = 0  # of them, those sent before the current attempt
        # worker → when it was given up on (monotonic), and whether for its silence
        self.excluded: dict[str, tuple[float, bool]] = {}
        self.failures: list[str] = []
        self.faults = 0  # of the failures, those that were a worker's fault (not busy)
        # Engines that raised on it, not yet counted by their breakers: the worker's fault if
        # the request is then answered elsewhere, the request's if another engine fails too.
        self.engine_failures: list[Failed] = []

    def attempt(self) -> Attempt:
        self.offset = len(self.sent)
        return Attempt(self.job)

    def continued(self, event: TokenEvent) -> TokenEvent:
        """An attempt's event as the client's answer goes on with it."""
        if self.offset:
            event = resumed_event(event, self.offset)
        self.sent.extend(event.token_ids)
        return event

    def failed(self, failure: Failed, breakers: Breakers) -> None:
        """An attempt failed: its workers are left out from now on, their breakers count it
        if it was their fault (an engine's failure: see ``answered``); ApiError(503) when no
        move is left, ApiError(500) when a second engine failed on it."""
        self.failures.append(str(failure))
        self.faults += failure.fault
        for w in failure.service_ids if failure.fault and not failure.engine else ():
            breakers.fault(w, str(failure))
        if failure.engine:
            self.engine_failures.append(failure)
            broken = {w for f in self.engine_failures for w in f.service_ids}
            if len(broken) >= POISON_WORKERS:
                raise ApiError(
                    500,
                    f"the engine failed on this request on {len(broken)} workers, so it is "
                    f"not tried again (its input, not the workers): "
                    f"{'; '.join(str(f) for f in self.engine_failures)}",
                    code="engine_error",
                )
        given_up = (time.monotonic(), failure.silent)
        self.excluded.update(dict.fromkeys(failure.service_ids, given_up))
        if self.move == self.limit:
            raise ApiError(
                503,
                f"request failed after {self.move} moves: {'; '.join(self.failures)}",
                code="unavailable",
            )
        log.warning(
            "%s: %s; %s on other workers",
            self.first.request_id,
            failure,
            f"resuming after {len(self.sent)} tokens" if self.sent else "retrying",
        )
        MOVES.labels("resumed" if self.sent else "retried").inc()

    def answered(self, breakers: Breakers) -> None:
        """The request was answered: the engines that raised on it on the way failed on their
        own account, and their breakers count it now."""
        for failure in self.engine_failures:
            for w in failure.service_ids:
                breakers.fault(w, str(failure))

    def left_out(self, registry: WorkerRegistry, heard: bool = False) -> set[str]:
        """The workers given up on, but for those registered again since (dropped, then back:
        a worker whose NATS node was lost reconnects to another within seconds) and, with
        ``heard``, those given up on for their silence that have sent a heartbeat since (their
        NATS link works again: a task or tokens lost with a NATS node were no fault of theirs)."""
        out = set()
        for sid, (at, silent) in self.excluded.items():
            record = registry.get(sid)
            back = record is not None and record.first_seen_at > at
            heard_since = heard and silent and record is not None and record.seen_at > at
            if not (back or heard_since):
                out.add(sid)
        return out

    def unservable(self, err: ApiError) -> ApiError:
        """No worker is left to move to: the error says why the request had to move (429
        when every worker tried was only busy: the client retries shortly)."""
        if not self.failures:
            return err
        if err.status == 503 and not self.faults:
            err = overloaded(err.message.removesuffix("; retry later"))
        err.message += f" (after: {'; '.join(self.failures)})"
        return err

    def next_job(self) -> Job:
        """The request again, for its next move: sent again as it was, or (mid-answer) its
        prompt plus the answer tokens already sent, the answer's remaining length, the
        sampler at the next position; its cache plan is made again (``needs_plan``)."""
        self.move += 1
        job, sent = self.first, self.sent
        if not sent:
            self.job = replace(job, request_id=f"{job.request_id}-retry{self.move}")
            return self.job
        sampling = job.sampling.resumed(len(sent))
        prompt_ids = array.array("i", job.prompt_ids)  # (one copy, the answer so far after it)
        prompt_ids.extend(sent)
        self.job = replace(
            job,
            request_id=f"{job.request_id}-resume{self.move}",
            prompt_ids=prompt_ids,
            sampling=sampling,
            segments=(),
            block_hashes=[],
            cached_blocks={},
            ttft_first_by=0.0,  # (its first token is out: no deadline for it to miss)
        )
        return self.job

    @property
    def needs_plan(self) -> bool:
        """The next job's prompt is not the first's: its blocks are looked up again."""
        return bool(self.sent)


class Waiting:
    """Answers half sent whose workers are gone, waiting for one to carry on (``count``, and
    kvmesh_resumes_waiting across the router's)."""

    def __init__(self) -> None:
        self.count = 0

    @contextlib.contextmanager
    def one(self) -> Iterator[None]:
        self.count += 1
        RESUMES_WAITING.inc()
        try:
            yield
        finally:
            self.count -= 1
            RESUMES_WAITING.dec()

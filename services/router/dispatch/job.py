"""A request as dispatch sees it: the job, each attempt at it, why an attempt failed, and the
moves that carry the request over failures.

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

import logging
from dataclasses import dataclass, field, replace

from services.router.errors import ApiError
from services.router.routing.route import RouteRequest
from shared.engine.sampling import SamplingParams
from shared.messages.generate import ImageRef, Priority, TokenEvent
from shared.telemetry.metrics import MOVES

log = logging.getLogger(__name__)

# What a prompt was tokenized from: (text, its ids packed as block hashing reads them), in
# prompt order (services/router/request/render.py makes them; a next turn's hashes reuse them).
Segments = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class Job:
    """What a request asks of the workers (the prompt's tokens, how to sample the answer) and
    its cache plan (the block hashes, and per location the leading blocks held there)."""

    request_id: str
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
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


@dataclass
class Attempt:
    """One try of a request: the job as it went on the wire, the workers that took it, and
    the routing decision."""

    job: Job
    workers: tuple[str, ...] = ()
    prefill: str = ""  # the prefill worker the policy chose ("" when decode prefills)
    decode: str = ""
    route: RouteRequest | None = None
    decision: dict = field(default_factory=dict)  # what the router says about its choice
    prefilled: bool = False  # the prefill worker is done with it (the policy was told)
    finished: bool = False  # its last event came (nothing to cancel)


class Failed(Exception):
    """This attempt failed: the workers named are not tried again for this request, and
    (unless it was no fault of theirs: busy) their circuit breakers count it."""

    def __init__(self, reason: str, *service_ids: str, fault: bool = True) -> None:
        super().__init__(reason)
        self.service_ids = service_ids
        self.fault = fault


def resumed_event(event: TokenEvent, offset: int) -> TokenEvent:
    """An event of a resumed request as its client sees it: after the ``offset`` tokens sent
    before the move; the reuse figures stay the first attempt's."""
    return event.model_copy(
        update={"index": event.index + offset, "cached_tokens": None, "cached_by_tier": None}
    )


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
        self.excluded: set[str] = set()
        self.failures: list[str] = []

    def attempt(self) -> Attempt:
        self.offset = len(self.sent)
        return Attempt(self.job)

    def continued(self, event: TokenEvent) -> TokenEvent:
        """An attempt's event as the client's answer goes on with it."""
        if self.offset:
            event = resumed_event(event, self.offset)
        self.sent.extend(event.token_ids)
        return event

    def failed(self, failure: Failed) -> None:
        """An attempt failed: its workers are left out from now on; ApiError(503) when no
        move is left."""
        self.failures.append(str(failure))
        self.excluded.update(failure.service_ids)
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

    def unservable(self, err: ApiError) -> ApiError:
        """No worker is left to move to: the error says why the request had to move."""
        if self.failures:
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
        sampling = replace(
            job.sampling,
            max_tokens=job.sampling.max_tokens - len(sent),
            answer_offset=job.sampling.answer_offset + len(sent),
        )
        self.job = replace(
            job,
            request_id=f"{job.request_id}-resume{self.move}",
            prompt_ids=[*job.prompt_ids, *sent],
            sampling=sampling,
            segments=(),
            block_hashes=[],
            cached_blocks={},
        )
        return self.job

    @property
    def needs_plan(self) -> bool:
        """The next job's prompt is not the first's: its blocks are looked up again."""
        return bool(self.sent)

"""A request as dispatch sees it: the job, each attempt at it, and why an attempt failed (the
moves that carry a request over failures are the dispatcher's: ``dispatcher.Moves``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.router.routing.route import RouteRequest
from shared.messages.generate import ImageRef, Priority, TokenIds
from shared.messages.sampling import SamplingParams

# What a prompt was tokenized from: (text, its ids packed as block hashing reads them), in
# prompt order (services/router/request/render.py makes them; a next turn's hashes reuse them).
Segments = tuple[tuple[str, bytes], ...]


@dataclass(frozen=True)
class Job:
    """What a request asks of the workers (the prompt's tokens, how to sample the answer) and
    its cache plan (the block hashes, and per location the leading blocks held there)."""

    request_id: str
    model: str
    prompt_ids: TokenIds  # (a list in tests that make jobs by hand)
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
    priority: Priority = "default"
    weight: int = 1  # its tenant's weight in the class's fair share (its key's)
    ttft_first_by: float = 0.0  # unix time the client wants the first token by (0: none)
    pinned_until: float = 0.0  # its KV kept in the tiers until then (tenancy/pins.py)
    # The answer's length the client expects (an agent's hint; 0: none): decode workers are
    # ranked by room for that much (each still holds room for max_tokens).
    expected_tokens: int = 0
    # A decode worker holding the prompt's KV in a sequence of its own (the first candidate
    # of the same prompt: ``n``): its full blocks count as in that worker's memory, where
    # they are shared rather than copied.
    near: str = ""


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
    (unless it was no fault of theirs: busy) their circuit breakers count it. ``silent``:
    they were not heard from (gone, no answer to the task, no token in time), not that they
    said they failed. ``engine``: their engine raised on it (the request's fault, if another
    engine fails on it too: then it is not tried again, and no breaker counts it)."""

    def __init__(
        self,
        reason: str,
        *service_ids: str,
        fault: bool = True,
        silent: bool = False,
        engine: bool = False,
    ) -> None:
        super().__init__(reason)
        self.service_ids = service_ids
        self.fault = fault
        self.silent = silent
        self.engine = engine

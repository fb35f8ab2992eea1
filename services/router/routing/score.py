"""A request scored on each prefill worker (the TTFT model's terms, ``ttft.py``), and the
scores ranked: the overload guard, what the estimate cannot tell apart decided by load, ties.
Pure and synchronous."""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field

from services.router.routing.estimate import Shape
from services.router.routing.ttft import PrefillWorkerState

TIE_S = 1e-6  # estimated costs closer than this, or than this share of the best, are a tie
TIE_SHARE = 1e-4
# Costs closer than the estimate's recent error × UNSURE_Z (at most UNSURE_MAX of the best)
# are not told apart by the estimate: load decides between them (``rank_prefill``).
UNSURE_Z = 1.0
UNSURE_MAX = 0.25
# A prompt nothing favors is balanced by tokens in flight: counts within this share of the
# least are alike, and between them requests of a like size go together (``balance_cold``).
SIZE_BAND = 0.25


@dataclass(slots=True)
class StoreView:
    """When a prompt's leading blocks can be loaded from the storage tier: ``stored`` of them
    now, then one more at each time in ``ready_at`` (non-decreasing: requests in flight are
    computing them, and each will be stored when its request is prefilled)."""

    stored: int
    ready_at: list[float] = field(default_factory=list)

    def by(self, t: float) -> int:
        return self.stored + bisect_right(self.ready_at, t)


@dataclass(slots=True)
class PrefillScore:
    service_id: str
    memory_tokens: int  # free: in its memory tier, or brought there by requests ahead
    storage_tokens: int  # loaded from the storage tier
    uncached_tokens: int  # computed
    queue_s: float
    compute_s: float
    load_s: float
    cost_s: float = 0.0  # what the choice costs everyone (set by ``rank_prefill``)
    ahead_s: float = 0.0  # the work counted ahead (``queue_s`` before the queue's factor)
    sharing: float = 0.0  # the share of the pool loading now
    error: float = 0.0  # the worker's estimate's recent error (relative)
    decoding: int = 0  # sequences the worker decodes meanwhile, and their context (its own;
    decoding_tokens: int = 0  # its shape has the pool's share: ``Pool.decodes``)
    chunk: int = 0  # the pool's pass budget
    joins: bool = False  # it would join the pass queued last there
    given: Shape | None = None  # (the shape it was scored from)
    by_load: bool = False  # within the estimate's error of the best: placed by load
    by_tokens: bool = False  # nothing cached favors a worker: placed by tokens in flight

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.compute_s + self.load_s

    @property
    def work_s(self) -> float:
        """What this request adds to the worker's queue."""
        return self.compute_s + self.load_s

    @property
    def shape(self) -> Shape:
        if self.given is not None:
            return self.given
        return Shape(
            self.uncached_tokens,
            self.storage_tokens,
            self.memory_tokens,
            self.sharing,
            self.decoding,
            self.decoding_tokens,
            self.chunk,
        )

    def explain(self) -> dict:
        return {
            "memory_tokens": self.memory_tokens,
            "storage_tokens": self.storage_tokens,
            "uncached_tokens": self.uncached_tokens,
            "queue_s": round(self.queue_s, 6),
            "compute_s": round(self.compute_s, 6),
            "load_s": round(self.load_s, 6),
            "ttft_s": round(self.ttft_s, 6),
            "cost_s": round(self.cost_s, 6),
            "estimate_error": round(self.error, 4),
            **({"decoding": self.decoding} if self.decoding else {}),
            **({"joins_pass": True} if self.joins else {}),
            **({"ranked_by_load": True} if self.by_load else {}),
            **({"ranked_by_tokens": True} if self.by_tokens else {}),
        }


def score_prefill(
    worker: PrefillWorkerState,
    n_prompt: int,
    hashes: list[str],
    block_size: int,
    memory_blocks: int,
    store: StoreView | int,
    now: float = 0.0,
    look_ahead: bool = True,
    known: dict | None = None,
    adapter_s: float = 0.0,
) -> PrefillScore:
    """``memory_blocks``: leading blocks in this worker's memory tier (the index); ``store``:
    leading blocks in the storage tier, now or (a ``StoreView``) as they will be. Without
    ``look_ahead`` only what the tiers hold now counts. ``known``: what one decision has
    estimated so far (most workers hold none of the prompt, and are estimated alike).
    ``adapter_s``: the wait for its LoRA adapter to load there (not resident)."""
    ahead = worker.ahead_s(now)
    estimate = worker.estimate
    wait = estimate.wait_s(ahead)
    if isinstance(store, int):
        store = StoreView(store)
    limit = max(0, (n_prompt - 1) // block_size)  # a prompt keeps one token to compute
    if look_ahead:
        free = min(limit, max(memory_blocks, worker.pending_prefix(hashes)))
        in_store = store.by(now + wait) if store.ready_at else store.stored
    else:
        free, in_store = min(limit, memory_blocks), store.stored
    stored = min(limit, max(free, in_store)) - free
    decodes = known.get(None) if known is not None else None  # (the pool's: alike for all)
    if decodes is None:
        decodes = worker.pool.decodes()
        if known is not None:
            known[None] = decodes
    decoding, decoding_tokens = decodes
    key = (free, stored, decoding, decoding_tokens, estimate.alike)
    seen = known.get(key) if known is not None else None
    if seen is None:
        uncached = n_prompt - (free + stored) * block_size
        shape = Shape(uncached, stored * block_size, free * block_size, worker.pool.sharing)
        shape.decoding, shape.decoding_tokens = decoding, decoding_tokens
        shape.chunk = worker.pool.batch_tokens
        seen = (shape, *estimate.parts(shape))
        if known is not None:
            known[key] = seen
    shape, compute_s, load_s = seen
    joins = worker.joins(shape.uncached)
    if joins:
        compute_s = max(0.0, compute_s - estimate.pass_s(shape))
    return PrefillScore(
        *(worker.service_id, shape.memory, shape.loaded, shape.uncached, wait, compute_s),
        *(load_s + adapter_s, 0.0, ahead, shape.sharing, estimate.error.recent, worker.decoding),
        *(worker.decoding_tokens, shape.chunk, joins, shape),
    )


def waiting_per_worker(states: list[PrefillWorkerState]) -> float:
    """Requests queued behind the one each worker is computing, on average over the pool."""
    return sum(max(0, w.inflight - 1) for w in states) / max(1, len(states))


def rank_prefill(
    scores: list[PrefillScore],
    workers: dict[str, PrefillWorkerState],
    guard: bool = True,
    salt: str = "",
    unsure: float = 0.0,
) -> list[PrefillScore]:
    """The scores best first, by cost: the estimated TTFT, plus (the overload guard) the
    work the choice adds beyond the least any candidate would add, × the requests waiting
    per worker. While no queue builds the weight is 0 and the lowest TTFT wins. Once requests
    wait, each of them, and whoever queues behind them, waits for that extra work too: then
    saving work (a worker that holds the prefix in memory, or will) shortens every queue,
    and is worth a slightly longer wait now. The work is valued at the pool's mean rates (it
    should tell cached from uncached, not a worker measured a little faster from a slower
    one: that difference is in the TTFT term already): the pool's estimate.

    Costs within ``unsure`` (a share) of the best are not told apart by the estimate (it is
    that far off, lately): among them the fewest uncached tokens, this request's and those in
    flight there, go first, as the best balancers count load, with nothing an estimate can
    get wrong. Costs within ``TIE_S`` or ``TIE_SHARE`` of each other are a tie as well. Equal
    counts go to the worker that holds the most of the prompt (blocks kept together), then to
    the one whose memory tier has been given the least (new conversations spread over the
    tiers), then by ``salt`` (a router's own order of its workers: routers with the same view
    do not all pick the same one). Sets ``cost_s``."""
    if not scores:
        return scores
    states = [workers[s.service_id] for s in scores]
    weight = waiting_per_worker(states) if guard else 0.0
    if weight:
        pool = states[0].pool.estimate
        alike: dict[int, float] = {}  # (workers alike share their shape: valued once)
        added = [
            alike.get(id(s.shape)) or alike.setdefault(id(s.shape), pool.service_s(s.shape))
            for s in scores
        ]
        least = min(added)
        for s, a in zip(scores, added, strict=True):
            s.cost_s = s.ttft_s + weight * (a - least)
    else:
        for s in scores:
            s.cost_s = s.ttft_s

    def tie_order(s: PrefillScore) -> tuple:
        w = workers[s.service_id]
        return (-s.memory_tokens, w.blocks_routed, w.tie_key(salt), s.service_id)

    def balance(s: PrefillScore) -> tuple:
        return (to_compute(s, workers), *tie_order(s))

    ordered = sorted(scores, key=_cost)  # (stable: the candidates' order past the best)
    best = ordered[0].cost_s
    edge = best + max(TIE_S, (TIE_SHARE + unsure) * best)
    near = 1
    while near < len(ordered) and ordered[near].cost_s <= edge:
        near += 1
    if unsure and near > 1:
        for s in ordered[:near]:
            s.by_load = True
    return sorted(ordered[:near], key=balance if unsure else tie_order) + ordered[near:]


def _cost(s: PrefillScore) -> float:
    return s.cost_s


def to_compute(s: PrefillScore, workers: dict[str, PrefillWorkerState]) -> int:
    """Uncached tokens at the worker once the request is there: its own and those queued."""
    return s.uncached_tokens + workers[s.service_id].tokens_queued


def cold(scores: list[PrefillScore]) -> bool:
    """No worker holds any of the prompt, in its memory tier or the storage tier (nor will,
    by requests ahead): nothing cached favors one. (A prompt in the storage tier is not: its
    load's share of the tier's bandwidth, and the waits, still tell workers apart.)"""
    return all(s.memory_tokens == 0 and s.storage_tokens == 0 for s in scores)


def balance_cold(
    scores: list[PrefillScore],
    workers: dict[str, PrefillWorkerState],
    salt: str = "",
    band: float = SIZE_BAND,
) -> list[PrefillScore]:
    """A prompt nothing cached favors (``cold``) is placed as the best balancers place it,
    by tokens to compute, its own and those in flight there: counted, nothing estimated, so
    nothing to get wrong (ranked by the estimate, a trace of mixed sizes sharing nothing lost
    its p99 by up to 80% to the balancers). Counts within ``band`` of the least are alike, and
    between those the prompt goes where the requests in flight are of its own size
    (``like_size``): short prompts queue with short ones and long with long, so that a short
    one seldom waits behind a long one (size-interval routing; where prompt sizes vary as on
    Azure's traces, means 5-15% lower at the balancers' tail). Equal counts go to the worker
    whose memory tier has been given the least (new conversations spread over the tiers),
    then by the router's own order."""
    tokens = {s.service_id: to_compute(s, workers) for s in scores}
    edge = min(tokens.values()) * (1 + band)

    def key(s: PrefillScore) -> tuple:
        w, n = workers[s.service_id], tokens[s.service_id]
        alike = n <= edge
        size = like_size(s.uncached_tokens, w) if alike else 0.0
        return (not alike, size, n, w.blocks_routed, w.tie_key(salt))

    for s in scores:
        s.cost_s, s.by_tokens = s.ttft_s, True
    return sorted(scores, key=key)


def like_size(uncached: int, worker: PrefillWorkerState) -> float:
    """How unlike a prompt of ``uncached`` tokens to compute is to the requests in flight at
    ``worker``: |ln| of its ratio to their mean, to a tenth (an idle worker is like any)."""
    if not worker.inflight:
        return 0.0
    mean = max(1.0, worker.uncached_inflight / worker.inflight)
    return round(abs(math.log(max(1, uncached) / mean)), 1)

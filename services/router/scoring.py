"""Estimated time to first token per prefill worker, and the decode pick. Pure and synchronous:
the live router and `kvmesh sim` call the same code.

For a prefill candidate:

    ttft ≈ queue wait + uncached tokens / compute rate + storage-tier hit tokens / load rate

Blocks already in the worker's memory tier are free, and so are blocks that requests queued or
running on it will bring there (look-ahead: the new request waits behind them anyway, and that
wait is already in the queue term). Rates are moving averages of what each worker reports,
starting from settings. Bounded load keeps any worker under ``c ×`` the mean in-flight work, so
one shared system prompt cannot pile everything onto one worker. Every score keeps its terms,
so each decision can be explained.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Ewma:
    """An exponentially weighted moving average, starting from a prior."""

    value: float
    weight: float = 0.2  # of each new observation
    observed: int = 0

    def observe(self, x: float) -> None:
        if x > 0:
            self.value += self.weight * (x - self.value)
            self.observed += 1


@dataclass(frozen=True)
class CostDefaults:
    """Starting rates, until workers report their own (tokens per second)."""

    prefill_tok_s: float = 400.0  # uncached tokens computed (a CPU worker; GPUs: ~60K)
    load_tok_s: float = 20_000.0  # cached tokens loaded from the storage tier
    transfer_tok_s: float = 20_000.0  # KV moved to decode
    bounded_load_c: float = 1.5  # no worker above c × the mean in-flight work ...
    bounded_load_slack_s: float = 1.0  # ... and this far above it
    # Weight of the work a choice adds for the requests that queue after it, per request now
    # in flight on a worker of the pool (see ``rank_prefill``); chosen with `kvmesh sim` on the
    # Mooncake trace (bench/routing.py: 15 to 25 all do as well).
    externality: float = 20.0


@dataclass
class PrefillWorkerState:
    """What the router believes of one prefill worker."""

    service_id: str
    prefill_tok_s: Ewma
    load_tok_s: Ewma
    queued_s: float = 0.0  # estimated work of requests sent to it, not yet first-tokened
    reported_tokens: int = 0  # uncached tokens queued there, from its last heartbeat
    blocks_routed: int = 0  # blocks of all requests sent to it (how full its cache runs)
    inflight: int = 0
    pending: Counter[str] = field(default_factory=Counter)  # block → requests bringing it

    @classmethod
    def fresh(cls, service_id: str, d: CostDefaults) -> PrefillWorkerState:
        return cls(service_id, Ewma(d.prefill_tok_s), Ewma(d.load_tok_s))

    @property
    def queue_wait_s(self) -> float:
        """Work ahead of a new request: what this router sent, or what the worker says it has
        queued when that is more (other routers send it work too)."""
        return max(self.queued_s, self.reported_tokens / self.prefill_tok_s.value)

    def pending_prefix(self, hashes: list[str]) -> int:
        """Leading blocks of ``hashes`` that requests queued or running here will bring."""
        n, pending = 0, self.pending
        if pending:
            for h in hashes:
                if not pending.get(h):
                    break
                n += 1
        return n

    # -- the router's bookkeeping ----------------------------------------------------------

    def dispatched(self, hashes: list[str], work_s: float) -> None:
        self.inflight += 1
        self.queued_s += work_s
        self.pending.update(hashes)
        self.blocks_routed += len(hashes)

    def prefilled(
        self,
        hashes: list[str],
        estimate_s: float,
        uncached_tokens: int = 0,
        loaded_tokens: int = 0,
        prefill_s: float = 0.0,
        load_s: float = 0.0,
    ) -> None:
        """A request's prompt is computed here: it leaves the queue (``estimate_s``: its work
        as estimated at dispatch), its blocks are in the memory tier now (cachemeta
        says so from here on), and the rates it showed are learned."""
        self.inflight = max(0, self.inflight - 1)
        self.queued_s = max(0.0, self.queued_s - estimate_s)
        self.pending.subtract(hashes)
        self.pending = +self.pending  # drop counts at zero
        if prefill_s > 0 and uncached_tokens:
            self.prefill_tok_s.observe(uncached_tokens / prefill_s)
        if load_s > 0 and loaded_tokens:
            self.load_tok_s.observe(loaded_tokens / load_s)


@dataclass(slots=True)
class PrefillScore:
    service_id: str
    memory_tokens: int  # free: in its memory tier, or brought there by requests ahead
    storage_tokens: int  # loaded from the storage tier
    uncached_tokens: int  # computed
    queue_s: float
    compute_s: float
    load_s: float
    over_bound: bool = False  # left out by bounded load (set by ``bounded``)
    cost_s: float = 0.0  # what the choice costs everyone (set by ``rank_prefill``)

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.compute_s + self.load_s

    @property
    def work_s(self) -> float:
        """What this request adds to the worker's queue."""
        return self.compute_s + self.load_s

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
            "over_bound": self.over_bound,
        }


def score_prefill(
    worker: PrefillWorkerState,
    n_prompt: int,
    hashes: list[str],
    block_size: int,
    memory_blocks: int,
    store_blocks: int,
) -> PrefillScore:
    """``memory_blocks``: leading blocks in this worker's memory tier (cachemeta);
    ``store_blocks``: leading blocks in the storage tier."""
    limit = max(0, (n_prompt - 1) // block_size)  # a prompt keeps one token to compute
    free = min(limit, max(memory_blocks, worker.pending_prefix(hashes)))
    stored = min(limit, max(free, store_blocks)) - free
    uncached = n_prompt - (free + stored) * block_size
    rate = worker.prefill_tok_s.value
    return PrefillScore(
        service_id=worker.service_id,
        memory_tokens=free * block_size,
        storage_tokens=stored * block_size,
        uncached_tokens=uncached,
        queue_s=worker.queue_wait_s,
        compute_s=uncached / rate,
        load_s=stored * block_size / worker.load_tok_s.value,
    )


def bounded(
    scores: list[PrefillScore], work: dict[str, float], c: float, slack_s: float = 0.0
) -> list[PrefillScore]:
    """Marks ``over_bound`` on the scores where taking the request would put a worker above
    c × the mean in-flight work and more than ``slack_s`` above the mean (``work``: service
    id → its in-flight work, seconds), and returns them. The slack lets a few turns of one
    conversation queue together on the worker that will hold their prefix."""
    if not scores:
        return scores
    total = sum(work.get(s.service_id, 0.0) for s in scores)
    for s in scores:
        mean_after = (total + s.work_s) / len(scores)
        mine_after = work.get(s.service_id, 0.0) + s.work_s
        s.over_bound = mine_after > c * mean_after and mine_after - mean_after > slack_s
    return scores


def rank_prefill(
    scores: list[PrefillScore], workers: dict[str, PrefillWorkerState], d: CostDefaults
) -> list[PrefillScore]:
    """The scores best first. Workers over the bound go last; the rest by cost: estimated
    TTFT plus a weight × the work the choice adds, valued at the pool's mean rates (it should
    tell cached from uncached, not a worker measured a little faster from a slower one: that
    difference is in the TTFT term already, and weighted it would starve the other).

    The work added delays every request that queues behind it. How many will is unknown, but
    it grows with the queues: as many as wait now, by Little's law, at a steady arrival rate.
    So the weight is ``d.externality × (1 + the pool's mean in-flight requests per worker)``:
    an idle pool mostly weighs the request's own TTFT and spreads load, a busy one saves work
    (a worker that holds the prefix, or will) even at a longer wait.

    Ties (nothing cached anywhere, all idle: a new conversation) go to the worker whose memory
    tier has been given the least, so conversations spread over the tiers. Sets ``over_bound``
    and ``cost_s``."""
    if not scores:
        return scores
    states = [workers[s.service_id] for s in scores]
    bounded(
        scores,
        {w.service_id: w.queue_wait_s for w in states},
        d.bounded_load_c,
        d.bounded_load_slack_s,
    )
    pool_prefill = sum(w.prefill_tok_s.value for w in states) / len(states)
    pool_load = sum(w.load_tok_s.value for w in states) / len(states)
    weight = d.externality * (1 + sum(w.inflight for w in states) / len(states))
    for s in scores:
        added = s.uncached_tokens / pool_prefill + s.storage_tokens / pool_load
        s.cost_s = s.ttft_s + weight * added
    return sorted(
        scores,
        key=lambda s: (
            s.over_bound,
            round(s.cost_s, 9),
            workers[s.service_id].blocks_routed,
            s.service_id,
        ),
    )


@dataclass(frozen=True)
class DecodeScore:
    service_id: str
    headroom_blocks: int  # free KV blocks now
    active: int  # sequences decoding

    @property
    def fits(self) -> bool:
        return self.headroom_blocks > 0


def rank_decode(scores: list[DecodeScore], needed_blocks: int) -> list[DecodeScore]:
    """Workers with any KV room: those with room for the whole answer first; within each
    group the fewest active sequences, then the most headroom."""
    room = [s for s in scores if s.headroom_blocks > 0]
    return sorted(
        room,
        key=lambda s: (
            s.headroom_blocks < needed_blocks,
            s.active,
            -s.headroom_blocks,
            s.service_id,
        ),
    )


def choose_decode(scores: list[DecodeScore], needed_blocks: int) -> DecodeScore | None:
    """The best worker with room for the whole answer; None when none has room."""
    ranked = rank_decode(scores, needed_blocks)
    return ranked[0] if ranked and ranked[0].headroom_blocks >= needed_blocks else None

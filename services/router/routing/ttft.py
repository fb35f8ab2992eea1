"""The TTFT model: estimated time to first token per prefill worker. Pure and synchronous: the
live router and `kvmesh sim` call the same code.

For a prefill candidate:

    ttft ≈ wait + compute (uncached tokens) + load (storage-tier tokens)

The compute and load times are the worker's estimate (``estimate.py``: fixed rates, or terms
fitted to what the worker reports). The wait is the work sent to the worker and not yet done:
the estimates of its requests in flight, less what the oldest has done since it began (a
worker takes its queue in order), times what the pool's waits showed of such estimates.
Blocks already in the worker's memory tier are free, and so are blocks that requests ahead of
it there will bring (they wait behind them anyway). Blocks another worker is computing now count
as in the storage tier if they will be there by the time this request would start (look-ahead:
the next turn of a conversation, sent while the last is still being computed, neither
recomputes the shared history nor waits for it where a shorter queue is). Every score keeps
its terms, and each estimate its error, so each decision can be explained.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from services.router.routing.estimate import Fitted, Rates, Shape


class Scored(Protocol):
    """What a request's score on a worker (``score.PrefillScore``) tells its bookkeeping."""

    @property
    def uncached_tokens(self) -> int: ...
    @property
    def storage_tokens(self) -> int: ...
    @property
    def ttft_s(self) -> float: ...
    @property
    def ahead_s(self) -> float: ...
    @property
    def shape(self) -> Shape: ...


ADAPTER_LOAD_S = 0.05  # a LoRA adapter's load, until a worker reports its own


@dataclass(frozen=True)
class CostDefaults:
    """Starting rates, until workers report their own (tokens per second)."""

    prefill_tok_s: float = 400.0  # uncached tokens computed (a CPU worker; GPUs: ~60K)
    load_tok_s: float = 20_000.0  # cached tokens loaded from the storage tier
    transfer_tok_s: float = 20_000.0  # KV moved to decode
    # Uncached tokens a worker computes in one pass over the requests queued together (0: a
    # request a pass): requests waiting when a pass begins are done when it ends.
    batch_tokens: int = 0

    def estimate(self, fitted: bool, pool: Rates | None = None) -> Rates:
        kind = Fitted if fitted else Rates
        return kind(self.prefill_tok_s, self.load_tok_s, pool)  # type: ignore[arg-type]


@dataclass
class Pool:
    """What the router believes of a pool: its estimate (the workers' start from it), how
    many of its workers are loading from the storage tier now (their oldest request loads),
    and (workers that also decode) the answers they decode, all together."""

    estimate: Rates
    workers: int = 0
    loading: int = 0
    batch_tokens: int = 0  # (CostDefaults.batch_tokens)
    decoding: int = 0  # sequences its workers decode, summed...
    decoding_tokens: int = 0  # ...and their context

    def decodes(self) -> tuple[int, int]:
        """A worker's share of the answers decoded in the pool, and of their context: what a
        request is scored with. Each worker's own count is a snapshot that every answer moves
        (and the next prompt's own answer joins it); a choice between workers made on it
        chased the snapshot and lost the tail in the aggregated world. So decoding sets the
        estimate's level, for every worker alike, and the queues and caches the choice."""
        n = max(1, self.workers)
        return round(self.decoding / n), round(self.decoding_tokens / n)

    @classmethod
    def fresh(cls, d: CostDefaults, fitted: bool) -> Pool:
        return cls(d.estimate(fitted), batch_tokens=d.batch_tokens)

    @property
    def sharing(self) -> float:
        """The share of the pool loading now."""
        return self.loading / max(1, self.workers)


@dataclass(slots=True)
class Sent:
    """A request in flight at a worker, with what was estimated when it was sent."""

    work_s: float  # its time there
    uncached: int = 0  # its tokens to compute
    ttft_s: float = 0.0
    ahead_s: float = 0.0  # the work counted ahead of it (before the queue's factor)
    at: float = 0.0  # when it was sent
    loads: bool = False  # it loads from the storage tier
    sharing: float = 0.0  # the pool's share loading when it began
    decoding: int = 0  # sequences the worker was decoding when it was sent...
    decoding_tokens: int = 0  # ...and their context
    shape: Shape | None = None  # as estimated when it was sent
    batch: Batch | None = None  # the others in the pass it ran in, when it shared one


class Batch:
    """Requests the router counted in one pass: each reports the whole pass, which is learned
    once (from the first report), with the others' tokens as estimated when they were sent."""

    __slots__ = ("members", "learned")

    def __init__(self, members: list[Sent]) -> None:
        self.members = members
        self.learned = False

    def others(self, sent: Sent) -> tuple[Shape, ...] | None:
        """The others' shapes, the first time; None after (already learned)."""
        if self.learned:
            return None
        self.learned = True
        return tuple(m.shape for m in self.members if m is not sent and m.shape is not None)


@dataclass
class PrefillWorkerState:
    """What the router believes of one prefill worker."""

    service_id: str
    estimate: Rates
    pool: Pool
    work: dict[str, Sent] = field(default_factory=dict)  # in flight, oldest first
    queued_s: float = 0.0  # their work's sum
    head_s: float = 0.0  # the work of the pass running: the oldest's, and any batched with it
    head_since: float = 0.0  # when the oldest in flight began, as far as the router knows
    reported_tokens: int = 0  # uncached tokens queued there, from its last heartbeat
    # (a worker that also decodes) the sequences it decodes, and their context, as last told
    decoding: int = 0
    decoding_tokens: int = 0
    blocks_routed: int = 0  # blocks of all requests sent to it (how full its cache runs)
    uncached_inflight: int = 0  # tokens to compute of the requests in flight
    tie: bytes | None = None  # (tie_key)
    tail_room: int = 0  # uncached tokens the pass queued last (not begun) can still take
    pending: Counter[str] = field(default_factory=Counter)  # block → requests bringing it
    # LoRA adapters: those it holds resident (its heartbeats, and requests that loaded one
    # since), those requests in flight there bring, and what a load takes there.
    adapters: frozenset[str] = frozenset()
    adapters_coming: Counter[str] = field(default_factory=Counter)
    adapter_load_s: float = ADAPTER_LOAD_S

    @classmethod
    def fresh(
        cls, service_id: str, d: CostDefaults, pool: Pool | None = None, fitted: bool = False
    ) -> PrefillWorkerState:
        pool = pool or Pool.fresh(d, fitted)
        pool.workers += 1
        return cls(service_id, d.estimate(fitted, pool.estimate), pool)

    @property
    def inflight(self) -> int:
        return len(self.work)

    @property
    def tokens_queued(self) -> int:
        """Uncached tokens to compute there: of the requests this router sent, or what the
        worker says it has queued when that is more (other routers send it work too)."""
        return max(self.uncached_inflight, self.reported_tokens)

    def ahead_s(self, now: float) -> float:
        """Work ahead of a request arriving at ``now``: what this router sent, less what the
        oldest has done since it began; or what the worker says it has queued when that is
        more (other routers send it work too)."""
        ahead = self.queued_s
        if ahead:  # (the pass running is done at most)
            ahead -= min(self.head_s, max(0.0, now - self.head_since))
        if self.reported_tokens:
            return max(ahead, self.reported_tokens / self.estimate.tok_s)
        return ahead

    def wait_s(self, now: float) -> float:
        """How long a request arriving at ``now`` waits (the estimate's factor on the work
        ahead)."""
        return self.estimate.wait_s(self.ahead_s(now))

    def adapter_s(self, adapter: str) -> float:
        """What a request of ``adapter`` waits here for it to load (0 when resident, or
        brought by a request ahead)."""
        if not adapter or adapter in self.adapters or self.adapters_coming[adapter]:
            return 0.0
        return self.adapter_load_s

    def tie_key(self, salt: str) -> bytes:
        """Its place in the order of a router's ties (``salt``: the router's id)."""
        if self.tie is None:
            self.tie = salted(salt, self.service_id) if salt else b""
        return self.tie

    def joins(self, uncached: int) -> bool:
        """A request of these uncached tokens sent now would join the pass queued last (it
        shares that pass's fixed cost, and the answers decoded in it)."""
        return 0 < uncached <= self.tail_room

    def pending_prefix(self, hashes: list[str]) -> int:
        """Leading blocks of ``hashes`` that requests queued or running here will bring."""
        n, pending = 0, self.pending
        if pending:
            for h in hashes:
                if h not in pending:
                    break
                n += 1
        return n

    # -- the router's bookkeeping ----------------------------------------------------------

    def dispatched(
        self,
        request_id: str,
        hashes: list[str],
        work_s: float,
        now: float,
        score: Scored | None = None,
    ) -> None:
        sent = Sent(work_s, at=now, decoding=self.decoding, decoding_tokens=self.decoding_tokens)
        if score is not None:
            sent.uncached, sent.shape = score.uncached_tokens, score.shape
            sent.ttft_s, sent.ahead_s = score.ttft_s, score.ahead_s
            sent.loads = score.storage_tokens > 0
        self.work[request_id] = sent
        chunk = self.pool.batch_tokens
        if len(self.work) == 1:  # idle: it begins now
            self.tail_room = 0
            self._begins(sent, now)
        elif self.joins(sent.uncached):
            self.tail_room -= sent.uncached
        elif chunk:  # a pass of its own, after the others
            self.tail_room = max(0, chunk - sent.uncached)
        self.queued_s += work_s
        self.uncached_inflight += sent.uncached
        self.pending.update(hashes)
        self.blocks_routed += len(hashes)

    def _begins(self, sent: Sent, now: float) -> None:
        """The oldest request in flight begins, in one pass with those waiting behind it while
        their uncached tokens fit the pool's ``batch_tokens`` (as the worker batches)."""
        self.head_since, self.head_s = now, sent.work_s
        budget = self.pool.batch_tokens - sent.uncached
        batch = [sent]
        if budget > 0 and len(self.work) > 1:
            for other in itertools.islice(self.work.values(), 1, None):
                if other.uncached > budget:
                    break
                self.head_s += other.work_s
                budget -= other.uncached
                batch.append(other)
        if len(batch) > 1:  # each will report the whole pass: it is learned once, as a pass
            shared = Batch(batch)
            for m in batch:
                m.batch = shared
        if len(batch) == len(self.work):  # the pass queued last is the one running now
            self.tail_room = 0
        sent.sharing = self.pool.sharing
        self.pool.loading += sent.loads

    def prefilled(
        self,
        request_id: str,
        hashes: list[str],
        now: float,
        uncached_tokens: int = 0,
        loaded_tokens: int = 0,
        prefill_s: float = 0.0,
        load_s: float = 0.0,
        n_prompt: int = 0,
    ) -> None:
        """A request's prompt is computed here (or it failed): it leaves the queue, the next
        one begins, its blocks are in the memory tier now (the index says so from here on),
        and what it took is learned: ``prefill_s`` computing (all of it, when the worker does
        not tell loading apart), ``load_s`` loading, of ``n_prompt`` tokens. A request that ran
        in one pass with others reports the whole pass: the estimate learns its share."""
        work = self.work
        if request_id not in work:
            return
        was_head = next(iter(work)) == request_id
        sent = work.pop(request_id)
        self.queued_s = max(0.0, self.queued_s - sent.work_s)
        self.uncached_inflight -= sent.uncached
        if was_head:
            self.pool.loading -= sent.loads
        if not work:
            self.queued_s = self.head_s = 0.0  # no rounding left behind
        elif was_head:  # the next one begins
            self._begins(next(iter(work.values())), now)
        pending = self.pending
        for h in hashes:
            left = pending[h] - 1
            if left > 0:
                pending[h] = left
            else:
                del pending[h]
        if prefill_s + load_s <= 0:
            return  # it failed: nothing measured
        memory = max(0, n_prompt - uncached_tokens - loaded_tokens)
        shape = Shape(
            uncached_tokens,
            loaded_tokens,
            memory,
            sent.sharing,
            sent.decoding,
            sent.decoding_tokens,
            self.pool.batch_tokens,
        )
        others = sent.batch.others(sent) if sent.batch else ()
        self.estimate.observe(shape, prefill_s, load_s, others)
        if sent.ttft_s:
            ttft = now - sent.at
            self.estimate.error.add(sent.ttft_s, ttft)
            self.pool.estimate.error.add(sent.ttft_s, ttft)
            self.estimate.waited(sent.ahead_s, max(0.0, ttft - prefill_s - load_s))

    def decodes(self, sequences: int, tokens: int) -> None:
        """What it decodes now (its heartbeat), in its pool's sums."""
        self.pool.decoding += sequences - self.decoding
        self.pool.decoding_tokens += tokens - self.decoding_tokens
        self.decoding, self.decoding_tokens = sequences, tokens

    def forgotten(self) -> None:
        """The worker left the pool."""
        self.decodes(0, 0)
        self.pool.workers -= 1
        self.estimate.leave()
        if self.work:
            self.pool.loading -= next(iter(self.work.values())).loads

    def check_integrity(self) -> None:
        assert abs(self.queued_s - sum(s.work_s for s in self.work.values())) < 1e-6, (
            "queued work drifted"
        )
        head = next(iter(self.work.values()), None)
        if not self.pool.batch_tokens:
            assert self.head_s == (head.work_s if head else 0.0), "the head is not the oldest"
        assert all(n > 0 for n in self.pending.values()), "a pending block with no request"
        assert self.uncached_inflight == sum(s.uncached for s in self.work.values())
        assert self.work or not self.pending, "pending blocks with nothing in flight"


def salted(salt: str, service_id: str) -> bytes:
    """A worker's place in a router's own order of its ties."""
    return hashlib.blake2b(f"{salt}/{service_id}".encode(), digest_size=8).digest()

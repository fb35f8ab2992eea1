"""The routing decision: which workers a request goes to, best first. Pure and synchronous:
the live router and `kvmesh sim` drive the same code.

``route`` is the whole stage on one screen. Decode workers are ranked by KV room and load
(``rank_decode``). When the prompt's uncached part is short enough (what the best decode worker
could load itself, from its own memory tier or the storage tier, leaves at most
``local_max_tokens`` to compute), the decode worker prefills it: no KV moves. Otherwise a
routing policy (``policies.py``, picked by name) ranks the prefill workers, and each is paired
with the best decode worker. Decode workers whose engine owns its KV (vLLM) with no prefill
worker beside them take every request, ranked by the policy as prefill workers are. Dispatch
tries the pairs in order (a busy worker is skipped for the next) and tells the policy what
became of the request (``dispatched``, ``prefilled``).

A policy sees the request (its block hashes and, per location, the leading blocks the block
index says it holds) and the candidate workers; it keeps whatever per-worker state it needs.
``rank`` returns every candidate best first, each with the terms that placed it there, so a
decision can always be explained.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from services.router.routing.score import PrefillScore, StoreView, score_prefill
from services.router.routing.ttft import CostDefaults, Pool, PrefillWorkerState
from shared.messages.kvevents import STORE, memory_location

DEFAULTS = CostDefaults()


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    n_prompt: int
    block_size: int
    hashes: list[str] = field(default_factory=list)  # the prompt's full blocks
    counts: dict[str, int] = field(default_factory=dict)  # location → leading blocks held
    at: float = 0.0  # when it is routed (the router's monotonic clock, or simulated time)
    answer_tokens: int = 0  # the most it may generate (the KV a decode worker must hold)
    adapter: str = ""  # the LoRA adapter computing it ("": the base model)

    def memory_blocks(self, service_id: str) -> int:
        return self.counts.get(memory_location(service_id), 0)

    @property
    def store_blocks(self) -> int:
        return self.counts.get(STORE, 0)


class Ranked:
    """A candidate's place, with the terms that put it there: a dict, or a function that
    makes one (most decisions are never shown, so most terms are never built)."""

    __slots__ = ("service_id", "_terms")

    def __init__(self, service_id: str, terms: dict | Callable[[], dict]) -> None:
        self.service_id = service_id
        self._terms = terms

    @property
    def terms(self) -> dict:
        if callable(self._terms):
            self._terms = self._terms()
        return self._terms

    def __repr__(self) -> str:
        return f"Ranked({self.service_id!r})"


class RoutingPolicy(ABC):
    name: ClassVar[str]
    fitted: ClassVar[bool] = False  # the service-time estimate: fitted terms, or plain rates
    # A worker lacking a request's LoRA adapter loads it first: counted in its estimate.
    knows_adapters: ClassVar[bool] = False

    def __init__(self, defaults: CostDefaults = DEFAULTS, salt: str = "") -> None:
        self.defaults = defaults
        self.salt = salt  # orders ties its own way (a router's id: routers do not herd)
        self.pool = Pool.fresh(defaults, self.fitted)
        self.workers: dict[str, PrefillWorkerState] = {}
        # The scores of the request ranked last (its dispatch counts what was decided).
        self.scored: tuple[str, dict[str, PrefillScore]] = ("", {})
        # Blocks that requests in flight are computing: block → (when it is expected in the
        # storage tier, the request that will bring it there first).
        self.computing: dict[str, tuple[float, str]] = {}

    def state(self, service_id: str) -> PrefillWorkerState:
        w = self.workers.get(service_id)
        if w is None:
            w = PrefillWorkerState.fresh(service_id, self.defaults, self.pool, self.fitted)
            self.workers[service_id] = w
        return w

    def pool_prior(self, states: list[PrefillWorkerState]) -> None:
        """Plain rates: workers not yet measured are assumed as fast as the measured ones (a
        pessimistic default would keep them from ever being tried), and the pool's are the
        candidates' mean. (A fitted estimate follows its pool's by itself.)"""
        if self.fitted or not states:
            return
        for attr in ("prefill_tok_s", "load_tok_s"):
            rates = [getattr(w.estimate, attr) for w in states]
            seen = [r.value for r in rates if r.observed]
            if seen and len(seen) < len(rates):
                mean = sum(seen) / len(seen)
                for r in rates:
                    if not r.observed:
                        r.value = mean
            getattr(self.pool.estimate, attr).value = sum(r.value for r in rates) / len(rates)

    @abstractmethod
    def rank(self, req: RouteRequest, candidates: list[str]) -> list[Ranked]:
        """All candidates, best first."""

    def store_view(self, req: RouteRequest) -> StoreView:
        """The prompt's leading blocks in the storage tier now, and when each following one
        that a request in flight is computing will be there."""
        ready: list[float] = []
        if self.computing:
            t = 0.0
            for h in req.hashes[req.store_blocks :]:
                c = self.computing.get(h)
                if c is None:
                    break
                t = max(t, c[0])
                ready.append(t)
        return StoreView(req.store_blocks, ready)

    def score(
        self, req: RouteRequest, service_id: str, view: StoreView | None = None
    ) -> PrefillScore:
        """The TTFT model's terms for the request on this worker."""
        w = self.state(service_id)
        return score_prefill(
            w,
            req.n_prompt,
            req.hashes,
            req.block_size,
            req.memory_blocks(service_id),
            self.store_view(req) if view is None else view,
            req.at,
            adapter_s=w.adapter_s(req.adapter) if self.knows_adapters else 0.0,
        )

    # -- what happened to a routed request (every policy tracks in-flight work) --------------

    def dispatched(self, service_id: str, req: RouteRequest) -> None:
        rid, scores = self.scored
        s = scores.get(service_id) if rid == req.request_id else None
        s = s or self.score(req, service_id)
        w = self.state(service_id)
        w.dispatched(req.request_id, req.hashes, s.work_s, req.at, s)
        if req.adapter:  # (resident there by the time the requests after it begin)
            w.adapters_coming[req.adapter] += 1
        stored_at = req.at + s.ttft_s
        for h in req.hashes[req.store_blocks :]:
            c = self.computing.get(h)
            if c is None or c[0] > stored_at:
                self.computing[h] = (stored_at, req.request_id)

    def prefilled(
        self,
        service_id: str,
        req: RouteRequest,
        now: float,
        uncached_tokens: int = 0,
        loaded_tokens: int = 0,
        prefill_s: float = 0.0,
        load_s: float = 0.0,
    ) -> None:
        """Its first token came (or it failed): the prefill worker is done with it, and says
        what it took (``PrefillWorkerState.prefilled``)."""
        w = self.state(service_id)
        if req.adapter and w.adapters_coming[req.adapter] > 0:
            w.adapters_coming[req.adapter] -= 1
            w.adapters |= {req.adapter}  # (loaded there now, as far as the router knows)
        w.prefilled(
            req.request_id,
            req.hashes,
            now,
            uncached_tokens,
            loaded_tokens,
            prefill_s,
            load_s,
            req.n_prompt,
        )
        computing = self.computing
        for h in req.hashes[req.store_blocks :]:
            c = computing.get(h)
            if c is not None and c[1] == req.request_id:
                del computing[h]

    def reported(
        self, service_id: str, queued_tokens: int, active: int = 0, active_tokens: int = 0
    ) -> None:
        """The worker's own count of what waits there (heartbeats); and, for a worker that
        also decodes, the sequences it holds (``active``, those it is prefilling among them)
        and the tokens of KV they hold: those past their first token decode in the steps that
        will compute the next prompt."""
        w = self.state(service_id)
        w.reported_tokens = queued_tokens
        decoding = max(0, active - w.inflight)
        w.decodes(decoding, active_tokens if decoding else 0)

    def resident(self, service_id: str, adapters: list[str], load_s: float) -> None:
        """The LoRA adapters the worker holds resident, and what loading one took there on
        average (its heartbeats)."""
        w = self.state(service_id)
        w.adapters = frozenset(adapters)
        w.adapter_load_s = load_s or w.adapter_load_s

    def forget(self, service_id: str) -> None:
        w = self.workers.pop(service_id, None)
        if w is not None:
            w.forgotten()


# -- decode ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeScore:
    service_id: str
    headroom_blocks: int  # free KV blocks now
    active: int  # sequences decoding (the router's count of what it sent, or the worker's)
    whole: bool = False  # it takes whole requests (an engine that owns its KV: vLLM)
    queued_tokens: int = 0  # (whole) prompt tokens its last heartbeat says wait there
    pd_only: bool = False  # (whole) it decodes only what a prefill engine hands it (SGLang P/D)
    used_tokens: int = 0  # (whole) tokens of KV its sequences hold
    has_adapter: bool = True  # it holds the request's LoRA adapter resident (or none is asked)


def rank_decode(scores: list[DecodeScore], needed_blocks: int) -> list[DecodeScore]:
    """Workers with any KV room: those with room for the whole answer first; within each
    group the fewest active sequences, then those holding the request's LoRA adapter, then
    the most headroom."""
    room = [s for s in scores if s.headroom_blocks > 0]
    return sorted(
        room,
        key=lambda s: (
            s.headroom_blocks < needed_blocks,
            s.active,
            not s.has_adapter,
            -s.headroom_blocks,
            s.service_id,
        ),
    )


def uncached_on(req: RouteRequest, decode_id: str) -> int:
    """Prompt tokens a decode worker would compute itself: those neither in its own memory
    tier nor in the storage tier."""
    near = (STORE, memory_location(decode_id))
    return req.n_prompt - max(req.counts.get(loc, 0) for loc in near) * req.block_size


# -- the decision -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """Where to send a request: (the worker that takes the task, the decode worker) pairs,
    best first; and what to say about the choice."""

    pairs: list[tuple[str, str]]
    decision: dict
    on_decode: bool = False  # the decode worker prefills (the task goes to decode)
    ranked: bool = False  # the policy ranked who prefills (it follows the request)


def route(
    policy: RoutingPolicy,
    req: RouteRequest,
    prefills: dict[str, int],
    decodes: list[DecodeScore],
    local_max_tokens: int,
) -> Route:
    """The pairs to try for ``req``. ``prefills``: the prefill candidates, each with the
    uncached tokens its last heartbeat says wait there; ``decodes``: the decode candidates.
    No pair when no decode worker has room, or no prefill worker is left for a long prompt.

    Decode workers whose engine owns its KV (``whole``: vLLM) prefill, decode and keep their
    KV themselves: with no prefill worker for the model, every request is theirs (aggregated),
    and the policy ranks them as it ranks prefill workers, by what their caches hold and
    what waits there. Those that decode only what a prefill engine hands them (``pd_only``:
    SGLang's own P/D) never prefill a request themselves."""
    bs = max(1, req.block_size or 64)
    ranked = rank_decode(decodes, -(-(req.n_prompt + req.answer_tokens) // bs))
    if not ranked:
        return Route([], {})
    decode = ranked[0].service_id
    alone = [d for d in ranked if not d.pd_only]  # (those that can prefill a request too)
    if alone and not alone[0].whole:
        # Of those with room for the answer, the one that computes least of the prompt first
        # (its memory holds more: a next turn's answer it decoded, another candidate's
        # prompt), the ranking's order between equals.
        needed = -(-(req.n_prompt + req.answer_tokens) // bs)
        nearest = min(
            alone, key=lambda d: (d.headroom_blocks < needed, uncached_on(req, d.service_id))
        )
        alone.remove(nearest)
        alone.insert(0, nearest)
    uncached = uncached_on(req, alone[0].service_id) if alone else req.n_prompt
    if alone and alone[0].whole and not prefills:
        for d in alone:
            policy.reported(d.service_id, d.queued_tokens, d.active, d.used_tokens)
        chosen = policy.rank(req, [d.service_id for d in alone])
        decision = {"policy": policy.name, "candidates": chosen, "prefill": "on decode (whole)"}
        return Route([(r.service_id, r.service_id) for r in chosen], decision, True, True)
    if alone and uncached <= local_max_tokens:
        pairs = [(d.service_id, d.service_id) for d in alone]
        return Route(pairs, {"prefill": "on decode", "uncached_tokens": uncached}, True)
    for service_id, queued in prefills.items():
        policy.reported(service_id, queued)
    chosen = policy.rank(req, sorted(prefills)) if prefills else []
    # (the candidates' terms are built only when the decision is shown: Ranked)
    decision = {"policy": policy.name, "candidates": chosen}
    return Route([(r.service_id, decode) for r in chosen], decision, ranked=True)

"""The routing policies, by name (setting KVMESH_ROUTER_ROUTING_POLICY): which prefill worker
computes a request. Ours (``ttft``: the lowest estimated time to first token, looking ahead,
with an overload guard), and the others' for comparison: Mooncake's Conductor, SGLang's
cache-aware router, NVIDIA Dynamo's KV router cost, llm-d's scorer mix, round robin and least
loaded.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict

from services.router.routing.route import DEFAULTS, Ranked, RouteRequest, RoutingPolicy
from services.router.routing.score import (
    SIZE_BAND,
    UNSURE_MAX,
    UNSURE_Z,
    StoreView,
    balance_cold,
    cold,
    rank_prefill,
    score_prefill,
)
from services.router.routing.ttft import CostDefaults


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, defaults: CostDefaults = DEFAULTS, salt: str = "") -> None:
        super().__init__(defaults, salt)
        self._turn = itertools.count()

    def rank(self, req: RouteRequest, candidates: list[str]) -> list[Ranked]:
        ordered = sorted(candidates)
        start = next(self._turn) % len(ordered) if ordered else 0
        return [Ranked(s, {"turn": i}) for i, s in enumerate(ordered[start:] + ordered[:start])]


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def rank(self, req: RouteRequest, candidates: list[str]) -> list[Ranked]:
        states = sorted(
            (self.state(s) for s in candidates),
            key=lambda w: (w.inflight, w.queued_s, w.service_id),
        )
        return [
            Ranked(w.service_id, {"inflight": w.inflight, "queued_s": w.queued_s}) for w in states
        ]


class Mooncake(RoutingPolicy):
    """Mooncake's Conductor idea, the reference: the lowest estimated TTFT (wait, compute,
    load) from what the tiers hold now; no look-ahead, no overload guard."""

    name = "mooncake"
    look_ahead = False
    guard = False
    balances_cold = False  # a prompt nothing cached favors: by tokens in flight, not estimate

    def rank(self, req: RouteRequest, candidates: list[str]) -> list[Ranked]:
        states = {s: self.state(s) for s in candidates}
        self.pool_prior(list(states.values()))
        view = self.store_view(req) if self.look_ahead else StoreView(req.store_blocks)
        known: dict = {}
        scores = [
            score_prefill(
                w,
                req.n_prompt,
                req.hashes,
                req.block_size,
                req.memory_blocks(s),
                view,
                req.at,
                self.look_ahead,
                known,
                w.adapter_s(req.adapter) if self.knows_adapters else 0.0,
            )
            for s, w in states.items()
        ]
        # (a cold prompt of an adapter some workers lack is placed by cost, its load in it)
        alike = not (self.knows_adapters and req.adapter) or len({s.load_s for s in scores}) < 2
        if self.balances_cold and len(scores) > 1 and alike and cold(scores):
            ranked = balance_cold(scores, states, self.salt, self.size_band())
        else:
            ranked = rank_prefill(scores, states, self.guard, self.salt, self.unsure())
        self.scored = (req.request_id, {x.service_id: x for x in ranked})
        return [Ranked(x.service_id, x.explain) for x in ranked]

    def unsure(self) -> float:
        """How far apart (a share) two estimates must be to be told apart: 0, the estimate
        taken at its word (Mooncake's)."""
        return 0.0


class Ttft(Mooncake):
    """Ours: the lowest estimated TTFT, from terms fitted to what the workers report
    (estimate.py), looking ahead at blocks requests in flight will bring, with the overload
    guard once queues build (ttft.py)."""

    name = "ttft"
    look_ahead = True
    guard = True
    fitted = True
    balances_cold = True
    knows_adapters = True

    def size_band(self) -> float:
        """Token counts this close (a share) place a cold prompt by its size (``balance_cold``):
        not on workers that also decode, whose answers' KV reads would gather with the long
        prompts and slow their every pass (on the aggregated grid, a p99 up to 45% over the
        balancers'), so there by tokens alone."""
        return 0.0 if self.pool.decoding else SIZE_BAND

    def unsure(self) -> float:
        """The pool's estimate's recent error (× ``UNSURE_Z``, at most ``UNSURE_MAX``):
        workers whose estimates differ by less are ranked by the load they hold."""
        return min(UNSURE_MAX, UNSURE_Z * self.pool.estimate.error.recent)


class SglangCacheAware(RoutingPolicy):
    """SGLang's router, `cache_aware` policy (sgl-router; defaults from its documentation:
    cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5). It keeps an
    approximate prefix tree per worker of what it routed there, not what the worker holds;
    here over block hashes instead of characters, bounded like its `max_tree_size`.
    Imbalanced (both thresholds exceeded) → the least loaded worker; else, if the best prefix
    match covers more than cache_threshold of the prompt → that worker; else → the worker
    with the smallest tree (the most free cache). Load = requests in flight."""

    name = "sglang"
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5
    max_tree_blocks = 1 << 20

    def __init__(self, defaults: CostDefaults = DEFAULTS, salt: str = "") -> None:
        super().__init__(defaults, salt)
        self.trees: dict[str, OrderedDict[str, None]] = {}

    def _tree(self, s: str) -> OrderedDict[str, None]:
        return self.trees.setdefault(s, OrderedDict())

    def rank(self, req: RouteRequest, candidates: list[str]) -> list[Ranked]:
        loads = {s: self.state(s).inflight for s in candidates}
        hi, lo = max(loads.values()), min(loads.values())
        imbalanced = hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold
        head = req.hashes[0] if req.hashes else None
        match = {s: self._match(s, req.hashes) if head in self._tree(s) else 0 for s in candidates}
        n = max(1, len(req.hashes))
        if imbalanced:
            key = lambda s: (loads[s], s)  # noqa: E731
            why = "imbalanced: least load"
        elif max(match.values()) / n > self.cache_threshold:
            key = lambda s: (-match[s], loads[s], s)  # noqa: E731
            why = "prefix match"
        else:
            key = lambda s: (len(self._tree(s)), s)  # noqa: E731
            why = "low match: smallest tree"
        return [
            Ranked(s, {"rule": why, "match_blocks": match[s], "load": loads[s]})
            for s in sorted(candidates, key=key)
        ]

    def _match(self, s: str, hashes: list[str]) -> int:
        tree = self._tree(s)
        n = 0
        for h in hashes:
            if h not in tree:
                break
            n += 1
        return n

    def dispatched(self, service_id: str, req: RouteRequest) -> None:
        super().dispatched(service_id, req)
        tree = self._tree(service_id)
        for h in req.hashes:
            tree[h] = None
            tree.move_to_end(h)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)


class DynamoKv(RoutingPolicy):
    """NVIDIA Dynamo's KV router cost (its router design docs): for each worker,
    cost = kv_overlap_score_weight × potential prefill blocks + potential active blocks,
    prefill blocks = prompt blocks not overlapping what the worker's KV events say it holds,
    active blocks = blocks of requests in flight there plus this request's; the lowest cost
    wins (router temperature 0). Default weight 1.0. Overlap comes from the worker's own
    cache only (its memory tier): Dynamo has no shared tier in the cost."""

    name = "dynamo"
    kv_overlap_score_weight = 1.0

    def __init__(self, defaults: CostDefaults = DEFAULTS, salt: str = "") -> None:
        super().__init__(defaults, salt)
        self.active_blocks: dict[str, int] = {}

    def rank(self, req: RouteRequest, candidates: list[str]) -> list[Ranked]:
        bs = max(1, req.block_size)
        blocks = -(-req.n_prompt // bs)
        costs = {}
        for s in candidates:
            prefill = blocks - min(blocks, req.memory_blocks(s))
            active = self.active_blocks.get(s, 0) + blocks
            costs[s] = (self.kv_overlap_score_weight * prefill + active, prefill, active)
        return [
            Ranked(
                s,
                {"cost": costs[s][0], "prefill_blocks": costs[s][1], "active_blocks": costs[s][2]},
            )
            for s in sorted(candidates, key=lambda s: (costs[s][0], s))
        ]

    def dispatched(self, service_id: str, req: RouteRequest) -> None:
        super().dispatched(service_id, req)
        blocks = -(-req.n_prompt // max(1, req.block_size))
        self.active_blocks[service_id] = self.active_blocks.get(service_id, 0) + blocks

    def prefilled(self, service_id: str, req: RouteRequest, now: float, *args: float) -> None:
        super().prefilled(service_id, req, now, *args)  # type: ignore[arg-type]
        blocks = -(-req.n_prompt // max(1, req.block_size))
        self.active_blocks[service_id] = max(0, self.active_blocks.get(service_id, 0) - blocks)


class LlmdScorers(RoutingPolicy):
    """llm-d's inference scheduler, its default scorer mix (the "intelligent inference
    scheduling" path): each worker scored in [0, 1] by three scorers, weighted, the highest
    sum wins (max-score picker).

    - queue (weight 2): requests waiting there, min-max normalized over the candidates
      (1: the shortest queue; all 1 when they are equal);
    - KV-cache utilization (2): 1 − the share of its KV cache the requests in flight hold;
    - prefix cache (3): the share of the prompt's blocks its own cache holds (the precise
      scorer, from KV events: here the index's memory tier for the worker).

    A worker's KV capacity is not something the router is told: ``kv_capacity_tokens``, an
    80 GB card's room for KV after a large model's weights, order of magnitude."""

    name = "llmd"
    weights = {"queue": 2.0, "kv_utilization": 2.0, "prefix": 3.0}
    kv_capacity_tokens = 500_000

    def __init__(self, defaults: CostDefaults = DEFAULTS, salt: str = "") -> None:
        super().__init__(defaults, salt)
        self.active_tokens: dict[str, int] = {}  # prompt tokens of requests in flight there

    def rank(self, req: RouteRequest, candidates: list[str]) -> list[Ranked]:
        waiting = {s: max(0, self.state(s).inflight - 1) for s in candidates}
        lo, hi = min(waiting.values()), max(waiting.values())
        blocks = max(1, len(req.hashes))
        scores = {}
        for s in candidates:
            parts = {
                "queue": 1.0 if hi == lo else (hi - waiting[s]) / (hi - lo),
                "kv_utilization": 1.0
                - min(1.0, self.active_tokens.get(s, 0) / self.kv_capacity_tokens),
                "prefix": min(blocks, req.memory_blocks(s)) / blocks,
            }
            total = sum(self.weights[k] * v for k, v in parts.items())
            scores[s] = (total, parts)
        return [
            Ranked(s, {"score": round(scores[s][0], 4), **scores[s][1]})
            for s in sorted(candidates, key=lambda s: (-scores[s][0], s))
        ]

    def dispatched(self, service_id: str, req: RouteRequest) -> None:
        super().dispatched(service_id, req)
        self.active_tokens[service_id] = self.active_tokens.get(service_id, 0) + req.n_prompt

    def prefilled(self, service_id: str, req: RouteRequest, now: float, *args: float) -> None:
        super().prefilled(service_id, req, now, *args)  # type: ignore[arg-type]
        left = self.active_tokens.get(service_id, 0) - req.n_prompt
        self.active_tokens[service_id] = max(0, left)


POLICIES: dict[str, type[RoutingPolicy]] = {
    p.name: p
    for p in (RoundRobin, LeastLoaded, Ttft, Mooncake, SglangCacheAware, DynamoKv, LlmdScorers)
}

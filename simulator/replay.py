"""`kvmesh sim`: replay a trace through the real routing policies and block index, against
simulated workers.

Cost model, per card (defaults from DeepInfer's published figures): by default the router's
own estimate (``PolicyWorld``): prefill computes uncached tokens at 60K tok/s and loads cached
tokens from the storage tier at 1.5M tok/s (hits in the worker's own memory tier are free);
``SimConfig.world`` replays in a world that is not the estimate (``simulator/world.py``: an
engine profile, varying compute, a shared storage bandwidth, memory copies, batches, decode
steps reading their sequences' KV). A decode card makes 14K tok/s shared by its sequences,
each at most 1/min_tpot. Each prefill worker takes its queue in arrival order, a request a
pass (in a profiled world short ones share a pass). Every prefill worker has a memory tier (LRU, in
blocks); the storage tier has a capacity (LRU) and a retention (TTL after last use, by class).
Stores and evictions become KV events applied to the BlockIndex (shared/kvindex), which answers the
router's lookups, as in the live mesh.
"""

from __future__ import annotations

import heapq
import statistics
import sys
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from services.router.routing.policies import POLICIES
from services.router.routing.route import RouteRequest
from services.router.routing.ttft import CostDefaults
from shared.kvindex.index import BlockIndex
from shared.messages.kvevents import STORE, KvEvent, memory_location
from shared.search import percentile
from simulator.traces import TraceRequest
from simulator.world import Part, PolicyWorld, ProfiledWorld, World, WorldSettings

UNBOUNDED = 10**12  # blocks: a tier that never evicts
BUSY_SHARE = 0.9  # of a trace's reference work: the busy window holds this much
UTIL_BASES = ("busy", "span")


@dataclass(frozen=True)
class SimConfig:
    prefill: int = 8
    decode: int = 8
    prefill_tok_s: float = 60_000.0
    load_tok_s: float = 1_500_000.0
    decode_tok_s: float = 14_000.0
    min_tpot_s: float = 0.02
    memory_blocks: int = 2_000  # per prefill worker, in trace blocks
    store_blocks: int = UNBOUNDED  # the storage tier's capacity, in trace blocks
    ttl_s: tuple[tuple[str, float], ...] = (("chat", 7 * 86400.0), ("agent", 3 * 86400.0))
    speed: float = 1.0  # arrival times are divided by this
    # What the router knows of the storage tier: "exact" (its index follows the tier's
    # events), "none" (only the workers' memory tiers: the prefill worker finds the rest).
    storage_answer: str = "exact"
    world: WorldSettings | None = None  # None: the policy's own estimate (simulator/world.py)
    # LoRA adapters (requests of a trace that has them): each prefill worker holds this many
    # resident, least recently used out, and loads another in ``adapter_load_s`` before the
    # pass that needs it; ``adapter_blind``: the router is not told a request's adapter (its
    # blocks are still the adapter's own: only where adapters are resident is unknown to it).
    max_loras: int = 4
    adapter_load_s: float = 0.05
    adapter_blind: bool = False

    def make_world(self) -> World:
        if self.world is None:
            return PolicyWorld(
                self.prefill_tok_s, self.load_tok_s, self.decode_tok_s, self.min_tpot_s
            )
        return ProfiledWorld(self.world, workers=self.prefill)


@dataclass
class SimResult:
    policy: str
    ttft_of: dict[int, float] = field(default_factory=dict)  # by the request's index
    tpot_s: list[float] = field(default_factory=list)
    input_tokens: int = 0
    memory_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    busy_s: dict[str, float] = field(default_factory=dict)  # per prefill worker
    first_arrival: float = 0.0
    last_done: float = 0.0
    output_tokens: int = 0
    adapter_loads: int = 0
    estimate_mape: float = 0.0  # the policy's TTFT estimates against the replay's TTFTs
    estimate_terms: dict = field(default_factory=dict)  # what the pool's estimate learned

    @property
    def ttft_s(self) -> list[float]:
        """Each request's TTFT, in the order they were prefilled."""
        return list(self.ttft_of.values())

    def summary(self, n_prefill: int) -> dict:
        ttft = sorted(self.ttft_s)
        busy = list(self.busy_s.values()) or [0.0]
        span = max(1e-9, self.last_done - self.first_arrival)
        mean_busy = statistics.fmean(busy)
        return {
            "hit_ratio": (self.memory_hit_tokens + self.storage_hit_tokens)
            / max(1, self.input_tokens),
            "memory_hit_ratio": self.memory_hit_tokens / max(1, self.input_tokens),
            "storage_hit_ratio": self.storage_hit_tokens / max(1, self.input_tokens),
            "ttft_mean_s": statistics.fmean(ttft) if ttft else 0.0,
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "tpot_mean_s": statistics.fmean(self.tpot_s) if self.tpot_s else 0.0,
            "tpot_p99_s": percentile(sorted(self.tpot_s), 99),
            "load_max_over_mean": max(busy) / mean_busy if mean_busy else 0.0,
            "utilization": sum(busy) / (n_prefill * span),
            "throughput_tok_s": (self.input_tokens + self.output_tokens) / span,
            "output_tok_s": self.output_tokens / span,
            "requests": len(ttft),
            "adapter_loads": self.adapter_loads,
            "estimate_mape": self.estimate_mape,
            "estimate_terms": self.estimate_terms,
        }


class _Lru:
    """Block hashes kept within a capacity, least recently used out first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[str, float] = OrderedDict()  # hash → last use
        self.ordered = capacity < UNBOUNDED  # nothing is ever evicted past it: no order kept

    def leading(self, hashes: list[str], now: float, ttl: float = float("inf")) -> int:
        n = 0
        for h in hashes:
            used = self.blocks.get(h)
            if used is None or now - used > ttl:
                break
            n += 1
        return n

    def put(self, hashes: list[str], now: float) -> tuple[list[str], list[str]]:
        """Marks the blocks used now; returns those new here, and those evicted for them."""
        blocks = self.blocks
        if not self.ordered:
            new = [h for h in hashes if h not in blocks]
            blocks.update(dict.fromkeys(hashes, now))
            return new, []
        new, move = [], blocks.move_to_end
        for h in reversed(hashes):  # a prefix's head ends up the most recent
            if h in blocks:
                blocks[h] = now
                move(h)
            else:
                blocks[h] = now  # a new key goes last: the most recent
                new.append(h)
        new.reverse()
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return new, evicted


def infinite_cache_tokens(requests: list[TraceRequest], block_size: int) -> list[int]:
    """Per request, its prompt tokens whose leading blocks appeared in an earlier request:
    what an infinite cache would hold for it."""
    seen: set[str] = set()
    cached = []
    for r in requests:
        n = 0
        for h in r.hashes:
            if h not in seen:
                break
            n += 1
        cached.append(min(r.n_in, n * block_size))
        seen.update(r.hashes)
    return cached


def infinite_cache_hit_ratio(requests: list[TraceRequest], block_size: int) -> float:
    """The share of prompt tokens an infinite cache holds: the best any router and cache
    could do."""
    hit = sum(infinite_cache_tokens(requests, block_size))
    return hit / max(1, sum(r.n_in for r in requests))


def request_work_s(requests: list[TraceRequest], block_size: int, cfg: SimConfig) -> list[float]:
    """Each request's prefill time with an infinite cache: every block computed once, the
    first time it is seen, and loaded from the storage tier after (the reference work), in
    the config's world (each load alone: none shares the tier's bandwidth)."""
    world = cfg.make_world()
    cached = infinite_cache_tokens(requests, block_size)
    return [
        world.service("reference", 0, c, r.n_in - c, now=i * 1e9).total_s
        for i, (r, c) in enumerate(zip(requests, cached, strict=True))
    ]


def prefill_work_s(requests: list[TraceRequest], block_size: int, cfg: SimConfig) -> float:
    """Prefill time of the whole trace with an infinite cache."""
    return sum(request_work_s(requests, block_size, cfg))


def busy_window(
    requests: list[TraceRequest], work: list[float], share: float = BUSY_SHARE
) -> tuple[int, int]:
    """The shortest run of requests (by arrival time, first and last index) holding
    ``share`` of the work."""
    need = share * sum(work)
    best, i, held = (0, len(requests) - 1), 0, 0.0
    for j, w in enumerate(work):
        held += w
        while held - work[i] >= need:
            held -= work[i]
            i += 1
        if held >= need and requests[j].t - requests[i].t < (
            requests[best[1]].t - requests[best[0]].t
        ):
            best = (i, j)
    return best


def speed_for_utilization(
    requests: list[TraceRequest],
    block_size: int,
    cfg: SimConfig,
    target: float,
    basis: str = "busy",
) -> float:
    """The speed at which the prefill pool would be ``target`` busy with the reference work
    (infinite cache): over the busy window (the shortest stretch of the trace that holds 90%
    of that work), or with basis "span" over the trace's whole span. Load ÷ (pool size ×
    window ÷ speed) = target. A window with no length (one instant) falls back to the span;
    a trace with no span replays at speed 1."""
    work = request_work_s(requests, block_size, cfg)
    first, last = 0, len(requests) - 1
    if basis == "busy":
        first, last = busy_window(requests, work)
        if requests[last].t <= requests[first].t:
            first, last = 0, len(requests) - 1
    span = requests[last].t - requests[first].t
    amount = sum(work[first : last + 1])
    if span <= 0 or amount <= 0:
        return 1.0
    return target * cfg.prefill * span / amount


def simulate(
    requests: list[TraceRequest],
    block_size: int,
    cfg: SimConfig,
    policy_name: str,
    progress: Callable[[int, int], None] | None = None,
    earlier: list[TraceRequest] = (),  # type: ignore[assignment]
) -> SimResult:
    """The trace replayed; ``earlier``: requests before it (negative times), whose blocks the
    storage tier holds when it begins (a mesh running for a while, not a cold one)."""
    ttl = dict(cfg.ttl_s)
    world = cfg.make_world()
    costs = CostDefaults(
        prefill_tok_s=cfg.prefill_tok_s,
        load_tok_s=cfg.load_tok_s,
        batch_tokens=world.batch_tokens,  # (how the workers batch: the router is told)
    )
    policy = POLICIES[policy_name](costs)
    index = BlockIndex(ttl, lru=False)  # (a router's: the simulator evicts itself)
    prefills = [f"p{i}" for i in range(cfg.prefill)]
    memory = {p: _Lru(cfg.memory_blocks) for p in prefills}
    store = _Lru(cfg.store_blocks)
    queues: dict[str, deque] = {p: deque() for p in prefills}
    running = dict.fromkeys(prefills, 0)  # requests in the worker's pass now (0: it is idle)
    resident: dict[str, OrderedDict[str, None]] = {p: OrderedDict() for p in prefills}
    # Decode workers: a pool of their own, or (aggregated) the prefill workers themselves.
    decoders = prefills if world.aggregated else [f"d{k}" for k in range(cfg.decode)]
    decode_active = dict.fromkeys(decoders, 0)
    decode_tokens = dict.fromkeys(decoders, 0)  # the context its sequences hold together
    result = SimResult(policy_name, busy_s=dict.fromkeys(prefills, 0.0))
    result.first_arrival = requests[0].t / cfg.speed if requests else 0.0

    events: list[tuple[float, int, str, object]] = []
    seq = 0

    def push(t: float, kind: str, data: object) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    for i, r in enumerate(requests):
        push(r.t / cfg.speed, "arrive", i)

    def emit(kind: str, location: str, hashes: list[str], now: float, retention: str) -> None:
        if hashes:  # built from the simulator's own values: no validation needed
            index.apply(
                KvEvent.model_construct(
                    kind=kind,
                    location=location,
                    hashes=hashes,
                    sizes=[],
                    at=now,
                    retention=retention,
                )
            )

    for r in earlier:
        at = r.t / cfg.speed
        new, evicted = store.put(r.hashes, at)
        emit("removed", STORE, evicted, at, r.retention)
        emit("stored", STORE, new, at, r.retention)

    def start(p: str, now: float) -> None:
        """The worker takes its next request, and those queued behind it while their uncached
        tokens fit the world's pass (a prefill worker batches short prompts)."""
        batch, budget, queue = [], world.batch_tokens, queues[p]
        while queue:
            i, route, arrived = queue[0]
            r = requests[i]
            mem = memory[p].leading(r.hashes, now)
            stored = store.leading(r.hashes[mem:], now, ttl[r.retention])
            hit_tokens = min(r.n_in, (mem + stored) * block_size)
            mem_tokens = min(hit_tokens, mem * block_size)
            part = Part(mem_tokens, hit_tokens - mem_tokens, r.n_in - hit_tokens)
            if batch and part.uncached > budget:
                break
            queue.popleft()
            batch.append((i, route, arrived, part))
            budget -= part.uncached
            if budget <= 0:
                break
        took, services = world.batch(p, [b[3] for b in batch], now)
        loads = 0  # (the adapters its pass needs and lacks, loaded before it)
        for i, *_ in batch:
            adapter = requests[i].adapter
            if adapter and adapter not in resident[p]:
                loads += 1
                resident[p][adapter] = None
                if len(resident[p]) > cfg.max_loras:
                    resident[p].popitem(last=False)
            if adapter:
                resident[p].move_to_end(adapter)
        if loads:
            took += loads * cfg.adapter_load_s
            result.adapter_loads += loads
            extra = loads * cfg.adapter_load_s
            services = [replace(sv, compute_s=sv.compute_s + extra) for sv in services]
        if world.aggregated and decode_active[p]:  # each pass steps its answers too
            uncached = sum(b[3].uncached for b in batch)
            passes = -(-max(1, uncached) // world.batch_tokens) if world.batch_tokens else 1
            extra = passes * world.decode_step_s(decode_active[p], decode_tokens[p])
            took += extra
            services = [replace(sv, compute_s=sv.compute_s + extra) for sv in services]
        result.busy_s[p] += took
        running[p] = len(batch)
        for (i, route, arrived, part), service in zip(batch, services, strict=True):
            push(now + took, "prefilled", (p, i, route, arrived, part, service))

    done = 0
    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "arrive":
            i = data  # type: ignore[assignment]
            r = requests[i]
            counts = index.lookup(r.hashes, now)  # the blocks found are used now
            if cfg.storage_answer == "none":
                counts.pop(STORE, None)
            adapter = "" if cfg.adapter_blind else r.adapter
            route = RouteRequest(str(i), r.n_in, block_size, r.hashes, counts, now, 0, adapter)
            if adapter:  # (what their heartbeats say)
                for p in prefills:
                    policy.resident(p, list(resident[p]), cfg.adapter_load_s)
            if world.aggregated:  # (what their heartbeats say: the answers they decode)
                for p in prefills:
                    held = decode_active[p] + policy.state(p).inflight
                    policy.reported(p, 0, held, decode_tokens[p])
            chosen = policy.rank(route, prefills)[0].service_id
            policy.dispatched(chosen, route)
            queues[chosen].append((i, route, now))
            if not running[chosen]:  # (an idle worker's queue is empty until now)
                start(chosen, now)
        elif kind == "prefilled":
            p, i, route, arrived, part, service = data  # type: ignore[misc]
            mem_tokens, loaded, uncached = part.memory, part.loaded, part.uncached
            r = requests[i]
            running[p] -= 1
            ttft = now - arrived + world.overhead_s + world.overhead_s_per_token * r.n_in
            result.ttft_of[i] = ttft
            result.input_tokens += r.n_in
            result.memory_hit_tokens += mem_tokens
            result.storage_hit_tokens += loaded
            # The prompt's blocks are now in this worker's memory tier and in the storage tier:
            # new ones stored (KV events, as workers send them).
            for location, tier in ((memory_location(p), memory[p]), (STORE, store)):
                new, evicted = tier.put(r.hashes, now)
                emit("removed", location, evicted, now, r.retention)
                emit("stored", location, new, now, r.retention)
            # (what the worker reports: the world's times, not the estimate's)
            compute_s = service.compute_s + service.copy_s  # (a memory hit's copy: not a load)
            policy.prefilled(p, route, now, uncached, loaded, compute_s, service.load_s)
            d = p if world.aggregated else min(decoders, key=decode_active.__getitem__)
            decode_active[d] += 1
            decode_tokens[d] += r.n_in + r.n_out
            tpot = world.tpot_s(decode_active[d], decode_tokens[d])
            result.tpot_s.append(tpot)
            result.output_tokens += r.n_out
            push(now + r.n_out * tpot, "decoded", (d, r.n_in + r.n_out))
            if queues[p] and not running[p]:
                start(p, now)
            result.last_done = max(result.last_done, now)
            done += 1
            if progress and done % 200 == 0:
                progress(done, len(requests))
        else:
            d, tokens = data  # type: ignore[misc]
            decode_active[d] -= 1
            decode_tokens[d] -= tokens
    if progress:
        progress(len(requests), len(requests))
    result.estimate_mape = policy.pool.estimate.error.mape
    result.estimate_terms = policy.pool.estimate.terms()
    return result


def progress_bar(label: str) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(1, total)
        end = "\n" if done >= total else ""
        print(
            f"\r{label:<14} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}",
            end=end,
            file=sys.stderr,
            flush=True,
        )

    return show

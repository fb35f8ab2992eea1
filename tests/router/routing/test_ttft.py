"""The TTFT score: each term, the wait as it drains, look-ahead, the overload guard, rates
learned."""

from __future__ import annotations

import itertools

import pytest

from services.router.routing.policies import POLICIES
from services.router.routing.route import RouteRequest
from services.router.routing.score import PrefillScore, rank_prefill, score_prefill
from services.router.routing.ttft import CostDefaults, PrefillWorkerState

D = CostDefaults(prefill_tok_s=1000.0, load_tok_s=10_000.0)
BS = 64
HASHES = [f"h{i}" for i in range(10)]  # a 640-token prefix


_ids = itertools.count()


def queue(w: PrefillWorkerState, *work_s: float, now: float = 0.0) -> PrefillWorkerState:
    """Requests of these estimates sent to the worker at ``now``."""
    for x in work_s:
        w.dispatched(f"q{next(_ids)}", [], x, now)
    return w


def worker(name: str = "p0", queued_s: float = 0.0) -> PrefillWorkerState:
    w = PrefillWorkerState.fresh(name, D)
    return queue(w, queued_s) if queued_s else w


def choice(scores: list[PrefillScore], *workers: PrefillWorkerState) -> str:
    """Where the ttft policy sends the request (the same ranking it uses)."""
    return rank_prefill(scores, {w.service_id: w for w in workers})[0].service_id


def test_terms_memory_free_storage_loaded_rest_computed() -> None:
    s = score_prefill(worker(queued_s=0.5), 700, HASHES, BS, memory_blocks=4, store=8)
    assert (s.memory_tokens, s.storage_tokens, s.uncached_tokens) == (256, 256, 188)
    assert s.queue_s == pytest.approx(0.5)  # 500 queued tokens at 1000 tok/s
    assert s.compute_s == pytest.approx(0.188)
    assert s.load_s == pytest.approx(256 / 10_000)
    assert s.ttft_s == pytest.approx(0.5 + 0.188 + 0.0256)
    assert set(s.explain()) >= {"queue_s", "compute_s", "load_s", "ttft_s", "memory_tokens"}


def test_a_prompt_keeps_one_token_to_compute() -> None:
    s = score_prefill(worker(), 640, HASHES, BS, memory_blocks=10, store=10)
    assert s.uncached_tokens == 64 and s.memory_tokens == 576


def test_memory_hit_beats_storage_hit_beats_cold() -> None:
    hot = score_prefill(worker("hot"), 700, HASHES, BS, memory_blocks=10, store=10)
    warm = score_prefill(worker("warm"), 700, HASHES, BS, memory_blocks=0, store=10)
    cold = score_prefill(worker("cold"), 700, HASHES, BS, memory_blocks=0, store=0)
    assert hot.ttft_s < warm.ttft_s < cold.ttft_s
    assert choice([cold, warm, hot], *(worker(n) for n in ("hot", "warm", "cold"))) == "hot"


def test_a_busy_worker_loses_its_cache_advantage() -> None:
    hot, warm = worker("hot", queued_s=5.0), worker("warm")
    busy_hot = score_prefill(hot, 700, HASHES, BS, 10, 10)
    idle_warm = score_prefill(warm, 700, HASHES, BS, 0, 10)
    assert busy_hot.ttft_s > idle_warm.ttft_s
    assert choice([busy_hot, idle_warm], hot, warm) == "warm"


def test_the_wait_drains_as_the_worker_computes() -> None:
    """A worker takes its queue in order: the oldest request's work shrinks as time passes
    (never below nothing), and the next one begins when the oldest is prefilled."""
    w = PrefillWorkerState.fresh("p0", D)
    w.dispatched("a", [], 1.0, now=10.0)
    w.dispatched("b", [], 2.0, now=10.2)
    assert w.wait_s(10.0) == pytest.approx(3.0)
    assert w.wait_s(10.5) == pytest.approx(2.5)
    assert w.wait_s(13.0) == pytest.approx(2.0)  # "a" overran its estimate: "b" waits whole
    w.prefilled("a", [], now=11.2)
    assert w.wait_s(11.2) == pytest.approx(2.0)
    assert w.wait_s(12.2) == pytest.approx(1.0)
    w.prefilled("b", [], now=13.0)
    assert w.wait_s(13.0) == 0 and w.inflight == 0
    w.check_integrity()


def test_the_overload_guard_saves_work_only_once_queues_build() -> None:
    """'hot' holds the prefix in memory but has 0.2 s more queued than 'warm', which would
    load it from the storage tier (64 ms more work). While nothing waits behind the request
    each worker is computing, the lower TTFT decides; once requests wait everywhere, the
    64 ms that each of them would wait too decides."""

    def pick(waiting: int) -> str:
        hot = queue(worker("hot"), 3.2, *[0.0] * waiting)
        warm = queue(worker("warm"), 3.0, *[0.0] * waiting)
        scores = [score_prefill(w, 700, HASHES, BS, m, 10) for w, m in ((hot, 10), (warm, 0))]
        return choice(scores, hot, warm)

    assert pick(waiting=0) == "warm"
    assert pick(waiting=8) == "hot"


def test_look_ahead_counts_blocks_a_queued_request_will_bring() -> None:
    """Turn 2 arrives while turn 1 is still queued on p0: nothing is in any tier yet, but p0
    is about to hold the shared prefix."""
    p0, p1 = worker("p0"), worker("p1")
    p0.dispatched("turn1", HASHES[:8], work_s=0.1, now=0.0)
    s0 = score_prefill(p0, 700, HASHES, BS, memory_blocks=0, store=0)
    s1 = score_prefill(p1, 700, HASHES, BS, memory_blocks=0, store=0)
    assert s0.memory_tokens == 8 * BS and s1.memory_tokens == 0
    assert choice([s0, s1], p0, p1) == "p0"
    p0.prefilled("turn1", HASHES[:8], now=0.1)
    assert p0.pending_prefix(HASHES) == 0 and not p0.pending and p0.queued_s == 0


def test_look_ahead_sees_blocks_another_worker_will_have_stored() -> None:
    """Turn 1 is being computed on p0, which has 2 s more queued behind it; turn 2 comes.
    p1 has 1 s of its own queue: by the time turn 2 would start there, turn 1's blocks are
    in the storage tier, so p1 loads them instead of recomputing them. Mooncake's plain
    estimate, from what the tiers hold now, has p1 compute everything."""
    turn1 = RouteRequest("t1", 8 * BS, BS, HASHES[:8], {}, at=0.0)
    turn2 = RouteRequest("t2", 700, BS, HASHES, {}, at=0.05)
    for name in ("ttft", "mooncake"):
        policy = POLICIES[name](D)
        policy.dispatched("p0", turn1)  # 0.512 s of compute, stored at 0.512
        queue(policy.state("p0"), 2.0)
        queue(policy.state("p1"), 1.0)
        ranked = policy.rank(turn2, ["p0", "p1"])
        p1 = next(r.terms for r in ranked if r.service_id == "p1")
        if name == "ttft":
            assert ranked[0].service_id == "p1"
            assert p1["storage_tokens"] == 8 * BS and p1["uncached_tokens"] == 700 - 8 * BS
        else:
            assert p1["storage_tokens"] == 0 and p1["uncached_tokens"] == 700
        policy.prefilled("p0", turn1, now=0.512)
        assert not policy.computing  # turn 1's blocks are stored: nothing left to expect


def test_rates_are_learned_from_what_workers_report() -> None:
    w = worker()
    for i in range(30):
        w.dispatched(f"r{i}", HASHES, 2.0, now=float(i))
        w.prefilled(
            f"r{i}",
            HASHES,
            now=i + 1.1,
            uncached_tokens=2000,
            loaded_tokens=6400,
            prefill_s=1.0,
            load_s=0.1,
        )
    assert w.estimate.prefill_tok_s.value == pytest.approx(2000, rel=0.01)
    assert w.estimate.load_tok_s.value == pytest.approx(64_000, rel=0.01)
    assert w.queued_s == 0 and w.inflight == 0 and not w.pending


def test_work_other_routers_sent_counts_through_heartbeats() -> None:
    """This router sent p0 nothing, but p0 says 3000 uncached tokens wait there."""
    p0, p1 = worker("p0"), worker("p1")
    p0.reported_tokens = 3000
    s0 = score_prefill(p0, 700, HASHES, BS, memory_blocks=0, store=0)
    s1 = score_prefill(p1, 700, HASHES, BS, memory_blocks=0, store=0)
    assert s0.queue_s == pytest.approx(3.0) and s1.queue_s == 0
    assert choice([s0, s1], p0, p1) == "p1"
    queue(p0, 5.0)  # its own view, when larger, wins
    assert score_prefill(p0, 700, HASHES, BS, 0, 0).queue_s == pytest.approx(5.0)

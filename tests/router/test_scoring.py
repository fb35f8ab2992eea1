"""The TTFT score: each term, look-ahead, bounded load, rates learned, the decode pick."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.router.scoring import (
    CostDefaults,
    DecodeScore,
    PrefillScore,
    PrefillWorkerState,
    bounded,
    choose_decode,
    rank_prefill,
    score_prefill,
)

D = CostDefaults(prefill_tok_s=1000.0, load_tok_s=10_000.0)
BS = 64
HASHES = [f"h{i}" for i in range(10)]  # a 640-token prefix


def worker(name: str = "p0", queued_s: float = 0.0) -> PrefillWorkerState:
    w = PrefillWorkerState.fresh(name, D)
    w.queued_s = queued_s
    return w


def choice(scores: list[PrefillScore], *workers: PrefillWorkerState, d: CostDefaults = D) -> str:
    """Where the ttft policy sends the request (the same ranking it uses)."""
    return rank_prefill(scores, {w.service_id: w for w in workers}, d)[0].service_id


def test_terms_memory_free_storage_loaded_rest_computed() -> None:
    s = score_prefill(worker(queued_s=0.5), 700, HASHES, BS, memory_blocks=4, store_blocks=8)
    assert (s.memory_tokens, s.storage_tokens, s.uncached_tokens) == (256, 256, 188)
    assert s.queue_s == pytest.approx(0.5)  # 500 queued tokens at 1000 tok/s
    assert s.compute_s == pytest.approx(0.188)
    assert s.load_s == pytest.approx(256 / 10_000)
    assert s.ttft_s == pytest.approx(0.5 + 0.188 + 0.0256)
    assert set(s.explain()) >= {"queue_s", "compute_s", "load_s", "ttft_s", "memory_tokens"}


def test_a_prompt_keeps_one_token_to_compute() -> None:
    s = score_prefill(worker(), 640, HASHES, BS, memory_blocks=10, store_blocks=10)
    assert s.uncached_tokens == 64 and s.memory_tokens == 576


def test_memory_hit_beats_storage_hit_beats_cold() -> None:
    hot = score_prefill(worker("hot"), 700, HASHES, BS, memory_blocks=10, store_blocks=10)
    warm = score_prefill(worker("warm"), 700, HASHES, BS, memory_blocks=0, store_blocks=10)
    cold = score_prefill(worker("cold"), 700, HASHES, BS, memory_blocks=0, store_blocks=0)
    assert hot.ttft_s < warm.ttft_s < cold.ttft_s
    assert choice([cold, warm, hot], *(worker(n) for n in ("hot", "warm", "cold"))) == "hot"


def test_a_busy_worker_loses_its_cache_advantage() -> None:
    hot, warm = worker("hot", queued_s=5.0), worker("warm")
    busy_hot = score_prefill(hot, 700, HASHES, BS, 10, 10)
    idle_warm = score_prefill(warm, 700, HASHES, BS, 0, 10)
    assert busy_hot.ttft_s > idle_warm.ttft_s
    assert choice([busy_hot, idle_warm], hot, warm) == "warm"


def test_a_busy_pool_weighs_the_work_saved_more_than_the_wait() -> None:
    """'hot' holds the prefix in memory but has 4 s more queued than 'warm', which would load
    it from the storage tier (64 ms more work). With few requests in flight the wait decides;
    with many queued everywhere, the 64 ms that every later request would wait decides."""

    def pick(inflight: int) -> str:
        hot, warm = worker("hot", queued_s=7.0), worker("warm", queued_s=3.0)
        hot.inflight, warm.inflight = inflight + 1, inflight
        scores = [score_prefill(w, 700, HASHES, BS, m, 10) for w, m in ((hot, 10), (warm, 0))]
        return choice(scores, hot, warm)

    assert pick(inflight=0) == "warm"
    assert pick(inflight=8) == "hot"


def test_look_ahead_counts_blocks_a_queued_request_will_bring() -> None:
    """Turn 2 arrives while turn 1 is still queued on p0: nothing is in any tier yet, but p0
    is about to hold the shared prefix."""
    p0, p1 = worker("p0"), worker("p1")
    p0.dispatched(HASHES[:8], work_s=0.1)  # turn 1: its own work queued
    s0 = score_prefill(p0, 700, HASHES, BS, memory_blocks=0, store_blocks=0)
    s1 = score_prefill(p1, 700, HASHES, BS, memory_blocks=0, store_blocks=0)
    assert s0.memory_tokens == 8 * BS and s1.memory_tokens == 0
    assert choice([s0, s1], p0, p1) == "p0"
    p0.prefilled(HASHES[:8], estimate_s=0.1)
    assert p0.pending_prefix(HASHES) == 0 and not p0.pending and p0.queued_s == 0


def test_bounded_load_keeps_a_hot_prefix_from_piling_on_one_worker() -> None:
    """Everyone shares a system prompt cached on p0; p0 already carries all the work."""
    p0, p1 = worker("p0", queued_s=0.3), worker("p1")
    scores = [
        score_prefill(p0, 700, HASHES, BS, memory_blocks=10, store_blocks=0),
        score_prefill(p1, 700, HASHES, BS, memory_blocks=0, store_blocks=0),
    ]
    unbounded = replace(D, bounded_load_c=1e9)
    assert choice(scores, p0, p1, d=unbounded) == "p0"  # its cache wins
    limited = bounded(scores, {"p0": 0.3, "p1": 0.0}, c=1.5)
    assert [s.over_bound for s in limited] == [True, False]
    no_slack = replace(D, bounded_load_slack_s=0.0)
    assert choice(scores, p0, p1, d=no_slack) == "p1"
    # With the work spread, p0 is within the bound and its cache wins again.
    p1.queued_s = 0.3
    assert choice(scores, p0, p1, d=no_slack) == "p0"


def test_rates_are_learned_from_what_workers_report() -> None:
    w = worker()
    for _ in range(30):
        w.dispatched(HASHES, 2000)
        w.prefilled(
            HASHES, 2000, uncached_tokens=2000, loaded_tokens=6400, prefill_s=1.0, load_s=0.1
        )
    assert w.prefill_tok_s.value == pytest.approx(2000, rel=0.01)
    assert w.load_tok_s.value == pytest.approx(64_000, rel=0.01)
    assert w.queued_s == 0 and w.inflight == 0 and not w.pending


def test_decode_pick_needs_room_then_prefers_fewer_active() -> None:
    scores = [DecodeScore("d0", 100, 5), DecodeScore("d1", 100, 2), DecodeScore("d2", 3, 0)]
    assert choose_decode(scores, needed_blocks=10).service_id == "d1"
    assert choose_decode(scores, needed_blocks=2).service_id == "d2"
    assert choose_decode(scores, needed_blocks=500) is None


def test_work_other_routers_sent_counts_through_heartbeats() -> None:
    """This router sent p0 nothing, but p0 says 3000 uncached tokens wait there."""
    p0, p1 = worker("p0"), worker("p1")
    p0.reported_tokens = 3000
    s0 = score_prefill(p0, 700, HASHES, BS, memory_blocks=0, store_blocks=0)
    s1 = score_prefill(p1, 700, HASHES, BS, memory_blocks=0, store_blocks=0)
    assert s0.queue_s == pytest.approx(3.0) and s1.queue_s == 0
    assert choice([s0, s1], p0, p1) == "p1"
    p0.queued_s = 5.0  # its own view, when larger, wins
    assert score_prefill(p0, 700, HASHES, BS, 0, 0).queue_s == pytest.approx(5.0)

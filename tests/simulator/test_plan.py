"""The capacity planner (simulator/plan.py) and the described workloads it plans for
(simulator/synthetic.py)."""

from __future__ import annotations

import statistics

import pytest

from simulator.plan import Planner, Targets
from simulator.replay import SimConfig, infinite_cache_tokens, simulate
from simulator.synthetic import Workload, generate
from simulator.world import WorldSettings

SMALL = Workload(rate=6.0, requests=300, input_mean=8192, output_mean=200, reuse=0.9)
TARGETS = Targets(ttft_p50_s=0.15, ttft_p99_s=1.0, tpot_p99_s=0.025)


def planner(w: Workload, targets: Targets = TARGETS, max_workers: int = 64) -> Planner:
    requests, earlier = generate(w)
    cfg = SimConfig(world=WorldSettings.named("profiled"))
    return Planner(requests, w.block_size, cfg, targets, earlier, max_workers=max_workers)


@pytest.mark.parametrize(
    "w",
    [
        Workload(requests=4000, input_mean=77_000, output_mean=1000, reuse=0.96, rate=20),
        Workload(requests=3000, input_mean=4096, output_mean=300, reuse=0.5, think_s=5),
    ],
    ids=["agent", "chat"],
)
def test_a_described_workload_has_the_mean_input_and_reuse_it_was_given(w: Workload) -> None:
    requests, earlier = generate(w)
    assert len(requests) == w.requests and earlier
    assert statistics.fmean(r.n_in for r in requests) == pytest.approx(w.input_mean, rel=0.06)
    assert statistics.fmean(r.n_out for r in requests) == pytest.approx(w.output_mean, rel=0.1)
    span = requests[-1].t - requests[0].t
    assert len(requests) / span == pytest.approx(w.rate, rel=0.15)
    # Reuse as an infinite cache holding the earlier turns sees it: less a partial block a turn.
    hits = infinite_cache_tokens(earlier + requests, w.block_size)[len(earlier) :]
    hit = sum(hits) / sum(r.n_in for r in requests)
    partial = w.block_size / 2 / w.input_mean
    assert hit == pytest.approx(w.reuse - partial, abs=0.04)


def test_the_search_finds_what_an_exhaustive_sweep_finds() -> None:
    search = planner(SMALL)
    plan = search.plan()
    assert plan.feasible
    sweep = planner(SMALL)
    assert (plan.prefill, plan.decode) == sweep.sweep(range(1, 9), range(1, 9))
    assert len(search.trials) < 12 < len(sweep.trials) == 64
    # The plan meets every target, and one worker fewer of either kind misses one.
    assert TARGETS.met(plan.summary, ("ttft_p50_s", "ttft_p99_s", "tpot_p99_s"))
    assert all(0 <= m < 1 for m in plan.margin.values())


def test_more_traffic_never_needs_fewer_workers() -> None:
    plans = [
        planner(Workload(**{**SMALL.__dict__, "rate": rate})).plan() for rate in (3, 6, 12, 24)
    ]
    assert all(p.feasible for p in plans)
    for fewer, more in zip(plans, plans[1:], strict=False):
        assert more.prefill >= fewer.prefill and more.decode >= fewer.decode
    assert plans[-1].prefill > plans[0].prefill and plans[-1].decode > plans[0].decode


def test_a_target_no_pool_can_meet_is_reported_with_what_more_workers_reach() -> None:
    """A TTFT p99 below the longest prompts' own compute: more workers stop helping, and the
    search stops there rather than trying every pool to the bound."""
    search = planner(SMALL, Targets(ttft_p99_s=0.01), max_workers=512)
    plan = search.plan()
    assert plan.prefill is None and not plan.feasible
    assert len(search.trials) < 10
    assert plan.summary["ttft_p99_s"] > 0.01


def test_earlier_turns_warm_the_storage_tier() -> None:
    """A described workload starts in the steady state: the turns before it are in the storage
    tier, so its first turns hit as its later ones do."""
    requests, earlier = generate(SMALL)
    cfg = SimConfig(prefill=4, decode=2, world=WorldSettings.named("profiled"))
    cold = simulate(requests, SMALL.block_size, cfg, "ttft").summary(4)
    warm = simulate(requests, SMALL.block_size, cfg, "ttft", None, earlier).summary(4)
    assert warm["hit_ratio"] > cold["hit_ratio"] + 0.1
    assert warm["storage_hit_ratio"] > cold["storage_hit_ratio"]

"""The fitted service-time estimate (services/router/routing/estimate.py): it keeps the
configured rates until reports say otherwise, learns the terms a worker shows (a pass's fixed
cost, attention over the context, slower loads while others load), follows a worker whose
speed changes mid-run, keeps no negative term, and reports its error."""

from __future__ import annotations

import random

import pytest

from services.router.routing.estimate import PRIOR, Fitted, Rates, Shape
from services.router.routing.policies import POLICIES
from services.router.routing.route import RouteRequest
from services.router.routing.ttft import CostDefaults, PrefillWorkerState

RATES = (1000.0, 10_000.0)  # configured: uncached and loaded tokens a second


def truth(r: Shape, slow: float = 1.0) -> float:
    """A worker unlike the configured rates: a 3 ms pass, 500 tok/s, attention doubling a
    token's cost at 4K context, loads at 5K tok/s slowed by others loading, copies at 50K."""
    compute = 0.003 + r.uncached / 500 * (1 + (r.memory + r.loaded + r.uncached / 2) / 4096)
    load = r.loaded / 5000 * (1 + 2 * r.sharing)
    return slow * compute + load + r.memory / 50_000


def shapes(n: int, seed: int = 0) -> list[Shape]:
    rng = random.Random(seed)
    return [
        Shape(
            rng.choice((1, 16, 64, 256, 1024, 2048)),
            rng.choice((0, 0, 512, 2048, 4096)),
            rng.choice((0, 0, 256, 1024)),
            rng.choice((0.0, 0.25, 0.5, 1.0)),
        )
        for _ in range(n)
    ]


def pool_and_worker() -> tuple[Fitted, Fitted]:
    pool = Fitted(*RATES)
    return pool, Fitted(*RATES, pool=pool)


def mape(estimate: Rates, cases: list[Shape], slow: float = 1.0) -> float:
    return sum(abs(estimate.service_s(r) / truth(r, slow) - 1) for r in cases) / len(cases)


def test_with_no_report_it_is_the_configured_rates_to_the_bit() -> None:
    pool, worker = pool_and_worker()
    r = Shape(700, 1280, 256)
    assert worker.beta == PRIOR
    assert worker.compute_s(r) == 700 / 1000.0
    assert worker.load_s(r) == 1280 / 10_000.0
    assert worker.service_s(r) == Rates(*RATES).service_s(r)
    assert worker.wait_s(3.0) == 3.0


def test_it_learns_the_terms_a_worker_shows() -> None:
    pool, worker = pool_and_worker()
    plain = Rates(*RATES)
    for r in shapes(300):
        t = truth(r)
        worker.observe(
            r, t - r.loaded / 5000 * (1 + 2 * r.sharing), r.loaded / 5000 * (1 + 2 * r.sharing)
        )
        plain.observe(
            r, t - r.loaded / 5000 * (1 + 2 * r.sharing), r.loaded / 5000 * (1 + 2 * r.sharing)
        )
    held_out = shapes(200, seed=1)
    assert mape(worker, held_out) < 0.05
    assert mape(plain, held_out) > 3 * mape(worker, held_out)
    terms = worker.terms()
    assert all(v >= 0 for v in terms.values())
    assert terms["pass"] > 1.5  # a 3 ms pass in 1 ms units
    assert terms["attention"] > 0.5  # the context costs
    assert terms["loaded_shared"] > 0.5  # loads slow while others load
    # a longer context makes a token dearer; a shared tier makes a load slower
    assert worker.compute_s(Shape(512, 0, 4096)) > 1.5 * worker.compute_s(Shape(512))
    assert worker.load_s(Shape(1, 4096, 0, 1.0)) > 2 * worker.load_s(Shape(1, 4096, 0, 0.0))


def test_it_follows_a_worker_whose_speed_changes_mid_run() -> None:
    pool, worker = pool_and_worker()
    cases = shapes(600, seed=2)
    for i, r in enumerate(cases):
        slow = 1.0 if i < 300 else 2.0  # its compute halves in speed at report 300
        worker.observe(r, truth(r, slow), 0.0)
        if i == 299:
            assert mape(worker, shapes(100, seed=3)) < 0.06
        if i == 400:  # 100 reports after the change: most of the way there
            assert mape(worker, shapes(100, seed=3), slow=2.0) < 0.15
    assert mape(worker, shapes(100, seed=3), slow=2.0) < 0.08


def test_a_worker_not_heard_from_is_its_measured_peers_mean() -> None:
    pool = Fitted(*RATES)
    a, b, new = (Fitted(*RATES, pool=pool) for _ in range(3))
    for r in shapes(100):
        a.observe(r, truth(r), 0.0)
        b.observe(r, truth(r, slow=2.0), 0.0)
    r = Shape(1024, 0, 512)
    assert a.service_s(r) < new.service_s(r) < b.service_s(r)
    assert new.service_s(r) == pytest.approx((a.service_s(r) + b.service_s(r)) / 2)
    b.leave()
    assert new.service_s(r) == pytest.approx(a.service_s(r))


def test_the_queues_factor_and_the_error_come_from_what_requests_waited() -> None:
    policy = POLICIES["ttft"](CostDefaults(*RATES))
    assert policy.fitted and not POLICIES["mooncake"].fitted
    t = 0.0
    for i in range(200):  # two at a time: the second waits half what was counted
        first = RouteRequest(f"a{i}", 1000, 64, [f"a{i}"], {}, t)
        second = RouteRequest(f"b{i}", 1000, 64, [f"b{i}"], {}, t)
        policy.dispatched("p0", first)
        policy.dispatched("p0", second)
        policy.prefilled("p0", first, t + 1.0, 1000, 0, 1.0)
        policy.prefilled("p0", second, t + 1.5, 1000, 0, 1.0)  # waited 0.5 s behind ~1 s
        t += 10.0
    w = policy.workers["p0"]
    assert isinstance(w, PrefillWorkerState)
    assert policy.pool.estimate.terms()["queue"] == pytest.approx(0.5, abs=0.05)
    assert w.wait_s(t) == 0.0
    error = policy.pool.estimate.error
    assert error.n == 400 and w.estimate.error.n == 400
    assert error.recent < 0.01 and error.recent < error.mape  # wronger at first (the waits)
    best = policy.rank(RouteRequest("x", 1000, 64, [], {}, t), ["p0", "p1"])[0]
    assert "estimate_error" in best.terms


def test_the_last_measured_worker_leaving_leaves_the_pools_fit() -> None:
    pool = Fitted(*RATES)
    only, new = Fitted(*RATES, pool=pool), Fitted(*RATES, pool=pool)
    for r in shapes(50):
        only.observe(r, truth(r), 0.0)
    r = Shape(1024, 2048, 512)
    only.leave()
    # no peer left: the pool's own fit, which still holds what the worker showed
    assert new.factors == (1.0, 1.0) and new.service_s(r) == pool.service_s(r)
    assert mape(new, shapes(100, seed=3)) < 0.05

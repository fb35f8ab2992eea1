"""The router's recommendation (services/router/observe/capacity.py) on traffic whose right
pools are known."""

from __future__ import annotations

import pytest

from services.router.observe.capacity import (
    Answered,
    Capacity,
    PlanTargets,
    concurrency,
    fit_line,
    replay,
)
from services.router.routing.estimate import Rates

RATES = Rates(prefill_tok_s=1000.0, load_tok_s=10_000.0)  # 500 uncached tokens: 0.5 s


def capacity(ready: dict[str, int], targets: PlanTargets, bounds=(1, 64)) -> Capacity:  # noqa: ANN001
    return Capacity(300.0, targets, bounds, lambda: RATES, lambda role: ready[role])


def steady(n: int, every_s: float, workers: int, tpot_s: float = 0.02) -> list[Answered]:
    """``n`` requests of 0.5 s of prefill each, ``every_s`` apart, as ``workers`` prefill
    workers served them (their TTFT: their wait there plus the 0.5 s), each answered with 20
    tokens at ``tpot_s``."""
    arrivals = [100.0 + i * every_s for i in range(n)]
    waits = replay(arrivals, [0.5] * n, workers)
    return [
        Answered(at, w + 0.5, 19 * tpot_s, uncached=500, loaded=0, memory=0, output=20)
        for at, w in zip(arrivals, waits, strict=True)
    ]


def test_one_worker_swamped_needs_as_many_as_its_work_takes() -> None:
    """A request every 0.1 s, each 0.5 s of one worker's time: one worker falls further and
    further behind; five keep up with no wait; four would not."""
    cap = capacity({"prefill": 1, "decode": 4}, PlanTargets(1.0, 1.0, 1.0))
    for a in steady(200, 0.1, workers=1):
        cap.answered.append(a)
    plan = cap.plan(now=110.0)
    assert plan["current"] == {"prefill": 1, "decode": 4}
    assert plan["recommended"]["prefill"] == 5
    assert plan["predicted"]["ttft_p99_s"] == pytest.approx(0.5)
    # The same traffic seen from five workers: the same answer.
    cap5 = capacity({"prefill": 5, "decode": 4}, PlanTargets(1.0, 1.0, 1.0))
    for a in steady(200, 0.1, workers=5):
        cap5.answered.append(a)
    assert cap5.plan(now=110.0)["recommended"]["prefill"] == 5


def test_an_idle_pool_is_told_to_shrink_to_the_fewest() -> None:
    cap = capacity({"prefill": 6, "decode": 6}, PlanTargets(1.0, 2.0, 0.1), bounds=(1, 64))
    for a in steady(20, 2.0, workers=6):
        cap.answered.append(a)
    plan = cap.plan(now=140.0)
    assert plan["recommended"] == {"prefill": 1, "decode": 1}
    empty = capacity({"prefill": 3, "decode": 3}, PlanTargets(1.0, 2.0, 0.1), bounds=(2, 8))
    assert empty.plan()["recommended"] == {"prefill": 2, "decode": 2}


def test_old_requests_leave_the_window() -> None:
    cap = capacity({"prefill": 1, "decode": 1}, PlanTargets(1.0, 1.0, 1.0))
    for a in steady(100, 0.1, workers=1):
        cap.answered.append(a)
    assert cap.plan(now=110.0)["requests"] == 100
    assert cap.plan(now=100.0 + 300.0 + 5.0)["requests"] == 50  # (the first 5 s are gone)


def test_decode_is_sized_by_how_tpot_grows_with_the_sequences_a_worker_holds() -> None:
    """Each request's time per token is 10 ms plus 5 ms per sequence on its worker (of two);
    every answer takes 2 s, at a request every 0.1 s and then every 0.04 s. A 40 ms target
    needs as many workers as bring a worker's sequences down to 6."""
    ready = {"prefill": 8, "decode": 2}
    arrivals = [100.0 + i * 0.1 for i in range(150)] + [115.0 + i * 0.04 for i in range(375)]
    timed = [Answered(at, 0.1, 2.0, 10, 0, 0, 101) for at in arrivals]
    answered = []
    for a, n in zip(timed, concurrency(timed), strict=True):
        tpot = 0.010 + 0.005 * n / 2
        output = 1 + round(2.0 / tpot)
        answered.append(Answered(a.arrived, 0.1, (output - 1) * tpot, 10, 0, 0, output))
    cap = capacity(ready, PlanTargets(1.0, 1.0, 0.040))
    cap.answered.extend(answered)
    plan = cap.plan(now=130.0)
    assert plan["fitted"]["tpot_base_s"] == pytest.approx(0.010, abs=3e-3)
    assert plan["fitted"]["tpot_per_sequence_s"] == pytest.approx(0.005, rel=0.15)
    # The window's mean TPOT on d workers, by the same line, meets 40 ms first at:
    seqs = concurrency(answered)
    expected = next(
        d for d in range(1, 64) if sum(0.010 + 0.005 * n / d for n in seqs) / len(seqs) <= 0.040
    )
    assert abs(plan["recommended"]["decode"] - expected) <= 1 and expected > 2
    assert plan["predicted"]["tpot_mean_s"] <= 0.040


def test_the_line_fit_never_has_more_sequences_speed_a_worker_up() -> None:
    assert fit_line([(1, 3.0), (2, 2.0), (3, 1.0)]) == (2.0, 0.0)
    assert fit_line([(1, 1.0), (2, 2.0), (3, 3.0)]) == pytest.approx((0.0, 1.0))

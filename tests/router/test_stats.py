"""The operator's statistics: extrapolated while young, a rolling day after, per class."""

from __future__ import annotations

import pytest

from services.router.stats import DAY_S, RollingStats

T0 = 1_800_000_000.0


def test_a_young_router_extrapolates_to_a_day() -> None:
    stats = RollingStats(T0)
    stats.tick(T0, 4)
    stats.record(T0 + 10, "chat", 1000, 900, 50, 0.2, 1.0)
    stats.record(T0 + 20, "agent", 3000, 2900, 10, 0.4, 0.0)
    stats.tick(T0 + 3600, 4)  # four workers for an hour
    r = stats.report(T0 + 3600)
    assert r["extrapolated"] and r["window_s"] == 3600 and r["worker_hours"] == pytest.approx(4)
    o = r["overall"]
    assert o["requests"] == 2 and o["tokens_per_day"] == round(4060 * 24)
    assert o["input_tokens_per_request"] == 2000
    assert o["input_cache_hit_ratio"] == pytest.approx(3800 / 4000)
    assert o["ttft_mean_s"] == pytest.approx(0.3)
    assert o["generation_tok_s_per_request"] == pytest.approx(49.0)  # one token: no speed
    assert o["requests_per_worker_hour"] == pytest.approx(0.5)
    assert r["by_class"]["agent"]["input_cache_hit_ratio"] == pytest.approx(2900 / 3000)
    assert r["by_class"]["chat"]["tokens_per_worker_hour"] == pytest.approx(1050 / 4)


def test_a_day_later_old_minutes_are_gone() -> None:
    stats = RollingStats(T0)
    stats.record(T0, "chat", 100, 0, 1, 0.1, 0.0)
    stats.record(T0 + DAY_S - 120, "chat", 200, 0, 1, 0.1, 0.0)
    r = stats.report(T0 + DAY_S + 30)
    assert not r["extrapolated"] and r["window_s"] == DAY_S
    assert r["overall"]["requests"] == 1 and r["overall"]["input_tokens"] == 200
    assert stats.report(T0 + 3 * DAY_S)["overall"]["requests"] == 0

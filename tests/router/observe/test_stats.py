"""The operator's statistics: extrapolated while young, a rolling day after, per class."""

from __future__ import annotations

import pytest

from services.router.observe.stats import DAY_S, TENANTS_PER_MINUTE, RollingStats

T0 = 1_800_000_000.0


def test_a_young_router_extrapolates_to_a_day() -> None:
    stats = RollingStats("r0", T0)
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
    stats = RollingStats("r0", T0)
    stats.record(T0, "chat", 100, 0, 1, 0.1, 0.0)
    stats.record(T0 + DAY_S - 120, "chat", 200, 0, 1, 0.1, 0.0)
    r = stats.report(T0 + DAY_S + 30)
    assert not r["extrapolated"] and r["window_s"] == DAY_S
    assert r["overall"]["requests"] == 1 and r["overall"]["input_tokens"] == 200
    assert stats.report(T0 + 3 * DAY_S)["overall"]["requests"] == 0


def test_every_router_reports_the_whole_mesh() -> None:
    """Router a's minutes reach b (as over the stream): b reports both routers' requests,
    and the workers both of them counted once."""
    a, b = RollingStats("a", T0), RollingStats("b", T0 + 60)
    for r in (a, b):
        r.tick(T0 + 60, 4)
    a.record(T0 + 70, "chat", 1000, 500, 20, 0.2, 1.0)
    a.record(T0 + 80, "chat", 1000, 900, 20, 0.4, 1.0)
    b.record(T0 + 90, "agent", 2000, 1000, 5, 0.6, 1.0)
    for r in (a, b):
        r.tick(T0 + 60 + 3600, 4)
    for m in a.to_share():
        b.merge(m, replaying=False)
    assert a.to_share() == []  # nothing changed since
    report = b.report(T0 + 3660)
    assert report["routers"] == 2 and report["window_s"] == 3660  # since a started
    assert report["worker_hours"] == pytest.approx(4)  # not 8: both saw the same workers
    assert report["overall"]["requests"] == 3 and report["overall"]["input_tokens"] == 4000
    assert report["by_class"]["chat"]["input_cache_hit_ratio"] == pytest.approx(0.7)
    a.record(T0 + 3660, "chat", 500, 0, 1, 0.1, 0.0)  # a minute a shares again
    for m in a.to_share():
        b.merge(m, replaying=False)
    assert b.report(T0 + 3670)["by_class"]["chat"]["requests"] == 3  # replaced, not added


def test_a_restarted_router_finds_its_earlier_minutes() -> None:
    before = RollingStats("a", T0)
    before.record(T0 + 5, "chat", 100, 0, 3, 0.1, 1.0)
    before.record(T0 + 10, "chat", 100, 50, 3, 0.1, 1.0)
    stored = before.to_share()
    after = RollingStats("a", T0 + 30)  # restarted within the same minute
    after.record(T0 + 40, "chat", 100, 90, 3, 0.1, 1.0)
    for m in stored:
        after.merge(m, replaying=True)
    report = after.report(T0 + 50)
    assert report["overall"]["requests"] == 3 and report["window_s"] == 50
    (shared,) = after.to_share()  # the minute again, with all three
    assert shared.by_class["chat"].requests == 3 and shared.by_class["chat"].cached_tokens == 140
    after.merge(shared, replaying=False)  # its own echo, once caught up: ignored
    assert after.report(T0 + 50)["overall"]["requests"] == 3


def test_each_tenant_has_its_hit_ratio_across_routers_and_a_bounded_count() -> None:
    a, b = RollingStats("a", T0), RollingStats("b", T0)
    a.record(T0 + 10, "chat", 1000, 900, 5, 0.1, 0.0, tenant="acme")
    b.record(T0 + 20, "agent", 3000, 1500, 5, 0.1, 0.0, tenant="acme")
    b.record(T0 + 30, "chat", 500, 0, 5, 0.1, 0.0, tenant="")
    for m in a.to_share():
        b.merge(m, replaying=False)
    tenants = b.report(T0 + 60)["by_tenant"]
    assert list(tenants) == ["acme", "(none)"]  # busiest first
    assert tenants["acme"]["requests"] == 2
    assert tenants["acme"]["input_cache_hit_ratio"] == pytest.approx(2400 / 4000)
    assert tenants["(none)"]["input_cache_hit_ratio"] == 0
    many = RollingStats("c", T0)
    for i in range(TENANTS_PER_MINUTE + 10):  # one minute: the first 64 by name, then "other"
        many.record(T0 + 1, "chat", 100, 50, 1, 0.1, 0.0, tenant=f"t{i}")
    report = many.report(T0 + 60)["by_tenant"]
    assert len(report) == TENANTS_PER_MINUTE + 1 and report["(other)"]["requests"] == 10


def test_each_class_and_tenant_has_its_ttft_and_refusals_across_routers() -> None:
    """By service class (highest first) and by tenant: TTFT percentiles and requests refused
    for load, summed over the routers; a refusal before the body was read is unclassed."""
    a, b = RollingStats("a", T0), RollingStats("b", T0)
    for _ in range(10):
        a.record(T0 + 1, "chat", 100, 0, 2, 0.05, 0.1, tenant="light", priority="priority")
        b.record(T0 + 2, "chat", 100, 0, 2, 2.0, 0.1, tenant="heavy", priority="flex")
    a.status(T0 + 3, 429, "flex", "heavy")
    b.status(T0 + 3, 429, "flex", "heavy")
    b.status(T0 + 4, 429)  # (refused at admission: no class yet)
    b.status(T0 + 5, 200, "priority", "light")
    for m in a.to_share():
        b.merge(m, replaying=False)
    report = b.report(T0 + 60)
    classes = report["by_priority"]
    assert list(classes) == ["priority", "flex", "(unknown)"]
    assert classes["priority"]["requests"] == 10 and classes["priority"]["refused"] == 0
    assert classes["priority"]["ttft_p99_ms"] <= 0.05e3 * 1.3
    assert classes["flex"]["ttft_p50_ms"] >= 2.0e3 and classes["flex"]["refused"] == 2
    assert classes["(unknown)"] == {**classes["(unknown)"], "requests": 0, "refused": 1}
    tenants = report["by_tenant"]
    assert tenants["heavy"]["refused"] == 2 and tenants["light"]["refused"] == 0
    assert tenants["light"]["ttft_p50_ms"] <= 0.05e3 * 1.3

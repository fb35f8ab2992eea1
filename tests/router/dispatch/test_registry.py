"""The router's registry: registration, expiry after missed beats, stop notices, integrity."""

from __future__ import annotations

import pytest

from services.router.dispatch.workers import LoopLag, WorkerRegistry
from shared.messages.heartbeat import ROLES, Heartbeat


def beat(service_id: str, role: str = "prefill", interval_s: float = 1.0, **kw) -> Heartbeat:
    return Heartbeat(
        service_id=service_id,
        role=role,
        version="test",
        interval_s=interval_s,
        started_at=0.0,
        sent_at=0.0,
        **kw,
    )


def full_registry(now: float = 0.0) -> WorkerRegistry:
    reg = WorkerRegistry()
    for role in ROLES:
        reg.observe(beat(f"{role}-0", role), now)
    return reg


def test_registers_once_and_refreshes() -> None:
    reg = WorkerRegistry()
    assert reg.observe(beat("p0"), now=0.0) is True
    assert reg.observe(beat("p0"), now=1.0) is False
    assert [r.service_id for r in reg.workers("prefill")] == ["p0"]
    assert reg.get("p0").first_seen_at == 0.0
    assert reg.get("p0").seen_at == 1.0
    reg.check_integrity()


def test_a_process_restarted_under_a_known_id_registers_anew() -> None:
    """Restarted before its old process was dropped: another process, registered afresh (its
    circuit breaker starts closed, its first-seen time is now)."""
    reg = WorkerRegistry()
    reg.observe(beat("p0"), now=0.0)
    assert reg.observe(Heartbeat(**{**beat("p0").model_dump(), "started_at": 5.0}), 6.0)
    assert reg.get("p0").first_seen_at == 6.0
    reg.check_integrity()


@pytest.mark.parametrize("interval_s", [0.2, 1.0, 5.0])
@pytest.mark.parametrize("missed", [1, 3])
def test_expires_after_missed_beats(interval_s: float, missed: int) -> None:
    reg = WorkerRegistry(missed_beats=missed)
    reg.observe(beat("p0", interval_s=interval_s), now=10.0)
    assert reg.expire(now=10.0 + missed * interval_s * 0.99) == []
    dropped = reg.expire(now=10.0 + missed * interval_s * 1.01)
    assert [r.service_id for r in dropped] == ["p0"]
    assert len(reg) == 0
    reg.check_integrity()


def test_a_router_running_behind_gives_beats_as_long_again() -> None:
    """Beats wait in a lagging router's queue as its timers do: that long is not held
    against the workers."""
    reg = WorkerRegistry(missed_beats=3)
    reg.observe(beat("p0", interval_s=1.0), now=0.0)
    assert reg.expire(now=4.5, grace_s=2.0) == []
    assert [r.service_id for r in reg.expire(now=5.5, grace_s=2.0)] == ["p0"]


def test_the_lag_is_the_worst_of_the_last_few_wakeups() -> None:
    lag = LoopLag(kept=3)
    assert lag.seconds == 0.0
    for late in (0.01, 1.5, -0.2, 0.02):  # (early counts as on time)
        lag.observe(late)
    assert lag.seconds == 1.5
    for _ in range(3):
        lag.observe(0.001)
    assert lag.seconds == 0.001


def test_each_worker_expires_by_its_own_interval() -> None:
    reg = WorkerRegistry()
    reg.observe(beat("fast", interval_s=0.5), now=0.0)
    reg.observe(beat("slow", interval_s=2.0), now=0.0)
    assert [r.service_id for r in reg.expire(now=2.0)] == ["fast"]
    assert [r.service_id for r in reg.workers()] == ["slow"]


def test_stopped_beat_removes_at_once_and_draining_is_not_ready() -> None:
    reg = full_registry()
    reg.observe(beat("decode-0", "decode", status="draining"), now=0.5)
    assert reg.missing_roles() == ["decode"]
    assert [r.service_id for r in reg.workers("decode")] == ["decode-0"]
    reg.observe(beat("decode-0", "decode", status="stopped"), now=0.6)
    assert reg.workers("decode") == []
    reg.check_integrity()


def test_missing_roles() -> None:
    reg = full_registry()
    assert reg.missing_roles() == []
    reg.remove("encoder-0")
    assert reg.missing_roles() == ["encoder"]
    assert WorkerRegistry().missing_roles() == list(ROLES)


def test_id_reused_by_another_role_moves() -> None:
    reg = WorkerRegistry()
    reg.observe(beat("w", "prefill"), now=0.0)
    assert reg.observe(beat("w", "decode"), now=1.0) is True
    assert reg.workers("prefill") == []
    assert [r.service_id for r in reg.workers("decode")] == ["w"]
    reg.check_integrity()


def test_entries_report_age_by_router_clock() -> None:
    reg = WorkerRegistry()
    reg.observe(beat("p0", addresses={"http": "http://h:1"}), now=100.0)
    (entry,) = reg.entries(now=100.75)
    assert entry.age_s == 0.75
    assert entry.addresses == {"http": "http://h:1"}


def test_integrity_check_catches_a_corrupt_index() -> None:
    reg = full_registry()
    reg._by_role["decode"].add("ghost")
    with pytest.raises(AssertionError, match="disagree"):
        reg.check_integrity()

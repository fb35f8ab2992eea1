"""The operator page's recent requests: the newest kept, within their count and their bytes
(a routing decision's terms over many workers can make one request's record large)."""

from __future__ import annotations

from services.router.observe.recorder import RecentRequests


def record(rid: str, workers: int) -> dict:
    candidates = [
        {"worker": f"decode-{w}", "ttft_s": 0.1234, "memory_tokens": 64} for w in range(workers)
    ]
    return {"id": rid, "status": 200, "route": {"candidates": candidates}}


def test_the_newest_are_kept_within_the_count() -> None:
    recent = RecentRequests(size=3)
    for i in range(5):
        recent.add(record(f"r{i}", 1))
    assert [r["id"] for r in recent.latest(10)] == ["r4", "r3", "r2"]
    assert recent.get("r1") is None and recent.get("r4")["status"] == 200


def test_large_records_are_dropped_oldest_first_to_stay_within_the_bytes() -> None:
    recent = RecentRequests(size=200, max_bytes=40_000)
    for i in range(60):  # ~8 KB each: terms on 128 workers
        recent.add(record(f"big{i}", 128))
    assert 0 < recent.bytes <= 40_000 and 1 < len(recent.latest(200)) < 10
    assert recent.get("big0") is None and recent.get("big59") is not None
    for i in range(100):  # small ones: the count grows back, the bytes stay within
        recent.add(record(f"small{i}", 1))
    assert all(recent.get(f"small{i}") for i in range(100)) and recent.bytes <= 40_000
    # A reused id: the newer record answers for it, and dropping the older keeps it.
    recent.add(record("small99", 2))
    for i in range(3):
        recent.add(record(f"after{i}", 1))
    assert len(recent.get("small99")["route"]["candidates"]) == 2

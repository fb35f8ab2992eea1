"""What a response says about where its time went and how it was routed."""

from __future__ import annotations

from services.router.request.prepare import EXPLAINED, Timing
from services.router.routing.route import Ranked


def route(n: int) -> dict:
    ranked = [Ranked(f"p{i}", lambda i=i: {"cost_s": float(i)}) for i in range(n)]
    return {"policy": "ttft", "chosen": "p0", "candidates": ranked}


def test_a_response_lists_the_best_candidates_and_counts_the_rest() -> None:
    t = Timing(route=route(64))
    out = t.to_dict()["route"]
    assert [c["worker"] for c in out["candidates"]] == [f"p{i}" for i in range(EXPLAINED)]
    assert [c["cost_s"] for c in out["candidates"]] == [float(i) for i in range(EXPLAINED)]
    assert out["others"] == 64 - EXPLAINED and out["chosen"] == "p0"


def test_all_candidates_when_asked() -> None:
    out = Timing(route=route(64), explain_all=True).to_dict()["route"]
    assert len(out["candidates"]) == 64 and "others" not in out


def test_engine_time_is_prefill_plus_decode() -> None:
    t = Timing(prefill_ms=12.5, decode_ms=30.0)
    assert t.engine_ms == 42.5 and t.to_dict()["engine_ms"] == 42.5

"""Routing policies in the simulator on small traces where the right choice is known."""

from __future__ import annotations

import pytest

from services.router.policies import POLICIES
from simulator.replay import SimConfig, infinite_cache_hit_ratio, simulate
from simulator.traces import TraceRequest


def conversation_trace() -> list[TraceRequest]:
    """Two long conversations; each turn extends the last and comes 50 ms after it, while the
    turn before is still being prefilled (60K tok/s: a 20K-token turn takes 0.33 s)."""
    out = []
    for turn in range(6):
        for conv in ("a", "b"):
            blocks = [f"{conv}{i}" for i in range(40 + 2 * turn)]
            out.append(
                TraceRequest(
                    turn * 0.05 + (0.01 if conv == "b" else 0), len(blocks) * 512, 10, blocks
                )
            )
    return out


def test_look_ahead_keeps_overlapping_turns_together() -> None:
    trace = conversation_trace()
    cfg = SimConfig(prefill=4, decode=2, memory_blocks=1000)
    runs = {p: simulate(trace, 512, cfg, p).summary(4) for p in POLICIES}
    ttft = runs["ttft"]
    # Every later turn finds its conversation in the memory tier of the worker it goes to.
    assert ttft["memory_hit_ratio"] > 0.75
    for other in ("round_robin", "least_loaded", "dynamo"):
        assert ttft["memory_hit_ratio"] > runs[other]["memory_hit_ratio"], other
        assert ttft["ttft_mean_s"] < runs[other]["ttft_mean_s"], other
    assert ttft["hit_ratio"] == pytest.approx(infinite_cache_hit_ratio(trace, 512))


def test_bounded_load_spreads_a_shared_prompt() -> None:
    """Every request shares one long system prompt; without a bound it would all go to the
    worker that holds it."""
    trace = [
        TraceRequest(
            i * 0.01,
            40 * 512,
            10,
            [f"sys{j}" for j in range(30)] + [f"u{i}.{j}" for j in range(10)],
        )
        for i in range(200)
    ]
    cfg = SimConfig(prefill=4, decode=4, memory_blocks=10_000)
    s = simulate(trace, 512, cfg, "ttft").summary(4)
    assert s["load_max_over_mean"] < 1.6

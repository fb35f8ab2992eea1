"""Routing policies in the simulator on small traces where the right choice is known."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.agent_trace import agent_trace
from services.router.routing.policies import POLICIES
from simulator.replay import (
    SimConfig,
    busy_window,
    infinite_cache_hit_ratio,
    request_work_s,
    simulate,
    speed_for_utilization,
)
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


def test_a_shared_prompt_spreads_over_the_pool() -> None:
    """Every request shares one long system prompt: the worker that holds it in memory saves
    its load from the storage tier, but not at the cost of a queue."""
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


def unique_requests(times: list[float], tokens: int = 6_000) -> list[TraceRequest]:
    blocks = tokens // 512
    return [
        TraceRequest(t, tokens, 10, [f"r{i}b{j}" for j in range(blocks)])
        for i, t in enumerate(times)
    ]


def test_load_is_measured_over_the_busy_window() -> None:
    """A quiet hour (20 requests) and a busy minute (400): 80% load means 80% over the busy
    minute, not over the hour, where the same speed would be heavy overload."""
    quiet = [i * 180.0 for i in range(20)]
    busy = [4000 + i * 0.15 for i in range(400)]
    trace = unique_requests(sorted(quiet + busy))
    cfg = SimConfig(prefill=4, decode=4)
    work = request_work_s(trace, 512, cfg)
    first, last = busy_window(trace, work)
    assert trace[first].t >= 3420 and trace[last].t <= 4060  # the busy minute, and at most
    held = sum(work[first : last + 1])  # one quiet request on either side of it
    assert held >= 0.9 * sum(work)
    by_window = speed_for_utilization(trace, 512, cfg, 0.8)
    by_span = speed_for_utilization(trace, 512, cfg, 0.8, basis="span")
    assert by_window < by_span / 10
    # At the window's speed the pool is about 80% busy during the busy minute.
    run = replace(cfg, speed=by_window)
    s = simulate(trace[first : last + 1], 512, run, "ttft").summary(4)
    assert 0.7 < s["utilization"] < 0.9


def test_the_span_basis_when_the_work_is_even() -> None:
    trace = unique_requests([i * 0.5 for i in range(200)])
    cfg = SimConfig(prefill=2, decode=2)
    busy = speed_for_utilization(trace, 512, cfg, 0.5)
    span = speed_for_utilization(trace, 512, cfg, 0.5, basis="span")
    assert busy == pytest.approx(span, rel=0.15)
    assert speed_for_utilization(trace[:1], 512, cfg, 0.5) == 1.0  # no span: as recorded


def agent_cell(load: float) -> dict[str, dict]:
    """Every policy on 40 agent sessions (970 turns), 4 prefill workers at this load."""
    trace = agent_trace(40)
    unique = len({h for r in trace for h in r.hashes})
    cfg = SimConfig(prefill=4, decode=4, memory_blocks=int(unique * 0.3 / 4))
    cfg = replace(cfg, speed=speed_for_utilization(trace, 512, cfg, load))
    return {p: simulate(trace, 512, cfg, p).summary(4) for p in POLICIES}


def test_near_full_load_ttft_leads_every_policy_on_agent_sessions() -> None:
    """Turns of a session overlap (the next one comes before the last is computed) and queues
    build: look-ahead and the overload guard are what the plain estimate lacks."""
    runs = agent_cell(0.95)
    ttft = runs.pop("ttft")
    for name, other in runs.items():
        assert ttft["ttft_mean_s"] < 0.9 * other["ttft_mean_s"], name
        assert ttft["ttft_p99_s"] < 0.95 * other["ttft_p99_s"], name


def test_at_half_load_ttft_is_the_plain_estimate() -> None:
    """No queue builds: the guard stays off and ttft routes as Mooncake's plain minimum."""
    runs = agent_cell(0.5)
    assert runs["ttft"]["ttft_mean_s"] == pytest.approx(runs["mooncake"]["ttft_mean_s"], rel=0.02)
    assert runs["ttft"]["ttft_mean_s"] <= min(s["ttft_mean_s"] for s in runs.values())


def test_a_router_without_the_storage_tier_still_gets_its_prefixes_from_it() -> None:
    """A router that follows only its workers' memory tiers (the storage tier's answer left to
    the prefill worker) routes the same trace: every turn still loads its conversation's
    prefix, from memory or from the storage tier, as much as with the tier known."""
    trace = conversation_trace()
    cfg = SimConfig(prefill=4, decode=2, memory_blocks=60)  # (a conversation's turns spill)
    known = simulate(trace, 512, cfg, "ttft").summary(4)
    unknown = simulate(trace, 512, replace(cfg, storage_answer="none"), "ttft").summary(4)
    assert unknown["hit_ratio"] == pytest.approx(known["hit_ratio"])
    assert unknown["hit_ratio"] == pytest.approx(infinite_cache_hit_ratio(trace, 512))
    assert unknown["ttft_mean_s"] < 1.25 * known["ttft_mean_s"]

"""Routing policies rank every candidate, with the terms behind each rank."""

from __future__ import annotations

import pytest

from services.router.routing.policies import POLICIES
from services.router.routing.route import RouteRequest


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_ranks_every_candidate_with_its_reasons(name: str) -> None:
    policy = POLICIES[name]()
    req = RouteRequest("r", 700, 64, [f"h{i}" for i in range(10)], {"mem:p1": 10, "store": 10})
    ranked = policy.rank(req, ["p0", "p1", "p2"])
    assert sorted(r.service_id for r in ranked) == ["p0", "p1", "p2"]
    assert all(r.terms for r in ranked)
    if name in ("ttft", "dynamo", "llmd"):  # cache-aware from cachemeta: p1 holds the prefix
        assert ranked[0].service_id == "p1"


def test_llmds_scorers_weigh_the_prefix_against_the_queue() -> None:
    """llm-d's mix: prefix 3, queue 2, KV utilization 2, each in [0, 1]."""
    policy = POLICIES["llmd"]()
    hashes = [f"h{i}" for i in range(10)]
    whole = RouteRequest("a", 700, 64, hashes, {"mem:p1": 10})
    best = policy.rank(whole, ["p0", "p1"])[0]
    assert best.service_id == "p1" and best.terms["prefix"] == 1.0
    assert best.terms["score"] == pytest.approx(2 + 2 + 3)  # nothing queued anywhere
    for i in range(3):  # p1 gets a queue: 2 waiting behind the one it runs
        policy.dispatched("p1", RouteRequest(f"q{i}", 1000, 64, [f"q{i}"]))
    partial = RouteRequest("b", 700, 64, hashes, {"mem:p1": 3})  # 30% of the prompt there
    ranked = policy.rank(partial, ["p0", "p1"])
    assert [r.service_id for r in ranked] == ["p0", "p1"]
    assert ranked[1].terms["queue"] == 0.0 and ranked[1].terms["kv_utilization"] < 1.0
    # the whole prefix is still worth more than the queue
    assert policy.rank(whole, ["p0", "p1"])[0].service_id == "p1"

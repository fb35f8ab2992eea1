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
    if name in ("ttft", "dynamo"):  # cache-aware from cachemeta: p1 holds the prefix
        assert ranked[0].service_id == "p1"

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
    if name in ("ttft", "mooncake", "dynamo", "llmd"):  # from the index: p1 holds the prefix
        assert ranked[0].service_id == "p1"


HASHES = [f"h{i}" for i in range(10)]


def ask(rid: str, n_prompt: int = 700, counts: dict | None = None) -> RouteRequest:
    return RouteRequest(rid, n_prompt, 64, list(HASHES), counts or {})


def order(policy, req: RouteRequest, candidates=("p0", "p1", "p2")) -> list[str]:  # noqa: ANN001
    return [r.service_id for r in policy.rank(req, list(candidates))]


def test_round_robin_takes_turns() -> None:
    policy = POLICIES["round_robin"]()
    turns = [order(policy, ask(f"r{i}"))[0] for i in range(4)]
    assert turns == ["p0", "p1", "p2", "p0"]


def test_least_loaded_puts_the_fewest_in_flight_first() -> None:
    policy = POLICIES["least_loaded"]()
    for i, worker in enumerate(["p0", "p0", "p1"]):
        policy.dispatched(worker, ask(f"q{i}"))
    assert order(policy, ask("r")) == ["p2", "p1", "p0"]
    policy.prefilled("p0", ask("q0"), 0.0)
    policy.prefilled("p0", ask("q1"), 0.0)
    assert order(policy, ask("r")) == ["p0", "p2", "p1"]  # (ties by name)


def test_sglang_follows_its_own_tree_not_the_index_then_balances() -> None:
    """SGLang's router knows only what it sent where: p2 was sent this prefix, so p2 comes
    first though the index says p1 holds it; a prompt it never sent goes to the smallest tree;
    past both imbalance thresholds, the least loaded wins whatever it matches."""
    policy = POLICIES["sglang"]()
    policy.dispatched("p2", ask("first"))
    assert order(policy, ask("again", counts={"mem:p1": 10}))[0] == "p2"
    fresh = RouteRequest("fresh", 700, 64, [f"x{i}" for i in range(10)], {})
    assert order(policy, fresh)[:2] == ["p0", "p1"]  # empty trees, by name; p2's holds 10
    for i in range(100):  # p2 far busier than the others: imbalanced
        policy.dispatched("p2", RouteRequest(f"b{i}", 64, 64, [f"b{i}"], {}))
    assert order(policy, ask("again"))[-1] == "p2"


def test_dynamo_weighs_the_overlap_against_the_blocks_in_flight() -> None:
    """cost = prompt blocks not held + blocks in flight and this one's: p1 holds the prefix
    and wins; given three prompts' worth in flight, p1 costs more than computing elsewhere."""
    policy = POLICIES["dynamo"]()
    held = ask("r", counts={"mem:p1": 10})
    ranked = policy.rank(held, ["p0", "p1"])
    assert [r.service_id for r in ranked] == ["p1", "p0"]
    assert ranked[0].terms["cost"] == 1 + 11  # 1 block of 11 to compute, 11 active
    for i in range(3):
        policy.dispatched("p1", ask(f"q{i}"))
    assert order(policy, held, ("p0", "p1")) == ["p0", "p1"]


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

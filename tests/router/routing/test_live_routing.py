"""The live router with two prefill workers: a repeated long conversation goes where the
TTFT cost model says, and the response explains the choice."""

from __future__ import annotations

import pytest

from tests.procs import wait_until
from tests.stack import Stack


@pytest.fixture(scope="module")
def stack(stacks) -> Stack:
    return stacks(
        ("cachemeta-0", "router-0", "prefill-0", "prefill-1", "decode-0"),
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
    )


def test_a_repeated_conversation_goes_where_its_prefix_is(stack: Stack) -> None:
    client = stack.client()
    turn1 = [(i * 7919) % 40000 + 100 for i in range(600)]  # 9 full blocks of 64

    def ask(ids: list[int]):
        r = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
        return r, r.model_extra["kvmesh"]

    _, first = ask(turn1)
    route = first["route"]
    assert route["policy"] == "ttft" and len(route["candidates"]) == 2
    assert {"queue_s", "compute_s", "load_s", "ttft_s", "memory_tokens"} <= set(
        route["candidates"][0]
    )
    home = route["chosen"]
    # Once its blocks are indexed in that worker's memory tier, the next turn goes there.
    turn2 = turn1 + [(i * 104729) % 40000 + 100 for i in range(100)]

    hashes = stack.hashes(turn1)
    wait_until(
        lambda: (stack.lookup(hashes) or {}).get(f"mem:{home}") == len(hashes),
        30,
        what="turn 1 indexed in its worker's memory tier",
    )
    resp, timing = ask(turn2)
    assert timing["route"]["chosen"] == home
    by_worker = {c["worker"]: c for c in timing["route"]["candidates"]}
    other = next(w for w in by_worker if w != home)
    assert by_worker[home]["memory_tokens"] >= 512 and by_worker[other]["memory_tokens"] == 0
    assert by_worker[home]["ttft_s"] <= by_worker[other]["ttft_s"]
    assert resp.usage.prompt_tokens_details.cached_tokens >= 512


def test_every_candidate_is_explained_on_request(stack: Stack) -> None:
    r = stack.client().completions.create(
        model="tiny", prompt=[5] * 100, max_tokens=1, extra_headers={"x-kvmesh-explain": "all"}
    )
    route = r.model_extra["kvmesh"]["route"]
    assert {c["worker"] for c in route["candidates"]} == {"prefill-0", "prefill-1"}
    assert "others" not in route


def test_the_estimates_error_is_on_metrics_and_in_the_explanation(stack: Stack) -> None:
    """Each prefilled request's estimated TTFT is checked against the measured one: the
    router's /metrics carry the error per worker and for the pool, and what the pool's
    estimate learned; each candidate in a response says its worker's recent error."""
    from tests.procs import metrics

    client = stack.client()
    before = metrics(stack.url).get(("kvmesh_router_ttft_estimates_total", (("scope", "pool"),)))
    for i in range(4):
        prompt = [(i * 7927 + j * 31) % 40000 + 100 for j in range(300)]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    candidates = r.model_extra["kvmesh"]["route"]["candidates"]
    assert all(c["estimate_error"] >= 0 for c in candidates)
    assert any(c["estimate_error"] > 0 for c in candidates)  # a worker measured by now
    m = metrics(stack.url)
    pool = m[("kvmesh_router_ttft_estimates_total", (("scope", "pool"),))]
    assert pool >= (before or 0) + 4
    per_worker = sum(
        m.get(("kvmesh_router_ttft_estimates_total", (("scope", w),)), 0)
        for w in ("prefill-0", "prefill-1")
    )
    assert per_worker == pool
    for window in ("all", "recent"):
        assert m[("kvmesh_router_ttft_estimate_error", (("scope", "pool"), ("window", window)))] > 0
    # the fitted terms: computing uncached tokens costs something
    assert m[("kvmesh_router_ttft_estimate_term", (("term", "uncached"),))] > 0
    assert ("kvmesh_router_ttft_estimate_term", (("term", "queue"),)) in m

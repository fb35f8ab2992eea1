"""Routing with LoRA adapters in mind: a request goes where its adapter is resident (or is
being brought by a request ahead) unless waiting there costs more than the load; a policy that
ignores adapters does not; decode workers holding it go first between equals; and in the
simulator, on a trace whose conversations each use one of 32 adapters, the default policy is
ahead of itself blind to adapters, and of round robin, on mean and p99 TTFT."""

from __future__ import annotations

import json
from dataclasses import replace

from services.router.routing.policies import POLICIES
from services.router.routing.route import DecodeScore, RouteRequest, rank_decode
from simulator.replay import SimConfig, simulate, speed_for_utilization
from simulator.synthetic import Workload, generate


def request(rid: str, adapter: str, hashes: list[str] | None = None, counts=None) -> RouteRequest:  # noqa: ANN001
    return RouteRequest(rid, 2048, 64, hashes or [], counts or {}, 0.0, 16, adapter)


def test_a_request_goes_where_its_adapter_is_unless_waiting_there_costs_more() -> None:
    policy = POLICIES["ttft"]()
    policy.resident("p0", [], 0.5)
    policy.resident("p1", ["sql"], 0.5)
    assert policy.rank(request("r0", "sql"), ["p0", "p1"])[0].service_id == "p1"
    # where it is not resident, its load is in the estimate the decision shows
    terms = {r.service_id: r.terms for r in policy.rank(request("r1", "sql"), ["p0", "p1"])}
    assert terms["p0"]["load_s"] >= 0.5 > terms["p1"]["load_s"]
    # ... and a request of the base model sees no difference
    assert policy.rank(request("r2", ""), ["p0", "p1"])[0].terms["load_s"] < 0.5
    # A worker busy for longer than the load: the request loads its adapter elsewhere.
    for k in range(6):
        policy.dispatched("p1", request(f"busy{k}", "", [f"b{k}{i}" for i in range(32)]))
    assert policy.rank(request("r3", "sql"), ["p0", "p1"])[0].service_id == "p0"


def test_an_adapter_a_request_ahead_brings_counts_as_resident() -> None:
    policy = POLICIES["ttft"]()
    for w in ("p0", "p1"):
        policy.resident(w, [], 0.5)
    first = request("r0", "sql")
    chosen = policy.rank(first, ["p0", "p1"])[0].service_id
    policy.dispatched(chosen, first)
    # A next request of it waits for no load there (the first brings it), only elsewhere.
    terms = {r.service_id: r.terms for r in policy.rank(request("r1", "sql"), ["p0", "p1"])}
    other = ({"p0", "p1"} - {chosen}).pop()
    assert terms[chosen]["load_s"] == 0 and terms[other]["load_s"] >= 0.5
    policy.prefilled(chosen, first, 1.0, 2048, 0, 0.5)
    assert "sql" in policy.state(chosen).adapters  # (loaded there, as far as it knows)


def test_a_policy_blind_to_adapters_does_not_see_them() -> None:
    policy = POLICIES["mooncake"]()
    policy.resident("p0", [], 0.5)
    policy.resident("p1", ["sql"], 0.5)
    terms = [r.terms for r in policy.rank(request("r0", "sql"), ["p0", "p1"])]
    assert all(t["load_s"] < 0.5 for t in terms)


def test_decode_workers_holding_the_adapter_go_first_between_equals() -> None:
    scores = [DecodeScore("d0", 100, 1, has_adapter=False), DecodeScore("d1", 100, 1)]
    assert [s.service_id for s in rank_decode(scores, 4)] == ["d1", "d0"]
    # (load first: fewer sequences decoding wins over the adapter)
    scores = [DecodeScore("d0", 100, 0, has_adapter=False), DecodeScore("d1", 100, 3)]
    assert rank_decode(scores, 4)[0].service_id == "d0"


def test_in_the_simulator_knowing_adapters_is_ahead_of_not_knowing_them() -> None:
    workload = Workload(
        rate=4.0, requests=600, input_mean=4096, output_mean=128, reuse=0.9, systems=4,
        block_size=512, seed=3, adapters=32,
    )  # fmt: skip
    requests, earlier = generate(workload)
    assert len({r.adapter for r in requests}) > 8
    # (an adapter's blocks are its own: two adapters never share one)
    by_block: dict[str, set[str]] = {}
    for r in requests:
        for h in r.hashes:
            by_block.setdefault(h, set()).add(r.adapter)
    assert all(len(a) == 1 for a in by_block.values())
    cfg = SimConfig(prefill=4, decode=4, memory_blocks=400, max_loras=2, adapter_load_s=0.02)
    cfg = replace(cfg, speed=speed_for_utilization(requests, 512, cfg, 0.7))
    results = {
        name: simulate(requests, 512, replace(cfg, adapter_blind=blind), policy, None, earlier)
        for name, policy, blind in (
            ("aware", "ttft", False),
            ("blind", "ttft", True),
            ("round_robin", "round_robin", False),
        )
    }
    summary = {name: r.summary(4) for name, r in results.items()}
    aware = summary["aware"]
    for other in ("blind", "round_robin"):
        assert aware["ttft_mean_s"] < summary[other]["ttft_mean_s"], (other, summary)
        assert aware["ttft_p99_s"] < summary[other]["ttft_p99_s"], (other, summary)
        assert aware["adapter_loads"] < summary[other]["adapter_loads"]


def test_a_trace_line_names_its_adapter_and_its_blocks_are_the_adapters(tmp_path) -> None:  # noqa: ANN001
    from simulator.traces import read_trace

    lines = [
        {"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 1024, "output_length": 8, "hash_ids": [1, 2],
         "adapter": "sql"},
    ]  # fmt: skip
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines))
    base, sql = read_trace(path)[0]
    assert (base.adapter, sql.adapter) == ("", "sql")
    assert not set(base.hashes) & set(sql.hashes)

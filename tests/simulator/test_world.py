"""The simulated worlds (simulator/world.py): the policy's own estimate, kept exactly, and one
built from an engine profile, where loads running at once share the storage tier's bandwidth,
a longer context costs more per token, a memory hit costs a copy and compute varies."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from simulator.replay import SimConfig, simulate
from simulator.traces import TraceRequest
from simulator.world import GB, Part, PolicyWorld, ProfiledWorld, WorldSettings
from tests.simulator.test_profile import measured

BYTES = 70_272  # per token (the default: DeepSeek-V3's latent)


def world(**settings) -> ProfiledWorld:
    defaults = dict(profile="", variation=0.0, store_gb_s_per_worker=10.0, link_gb_s=25.0)
    return ProfiledWorld(WorldSettings(**{**defaults, **settings}), measured())


def test_the_policys_world_is_its_formula_to_the_bit() -> None:
    s = PolicyWorld(60_000.0, 1_500_000.0).service("p0", 640, 3000, 1234, 0.0)
    assert s.total_s == 1234 / 60_000.0 + 3000 / 1_500_000.0
    assert s.copy_s == 0.0  # memory hits are free in it
    one = [TraceRequest(0.0, 1000, 4, [f"b{i}" for i in range(15)])]
    result = simulate(one, 64, SimConfig(prefill=2, decode=1), "ttft")
    assert result.ttft_s == [1000 / 60_000.0]


def test_two_loads_at_once_share_the_storage_tiers_bandwidth() -> None:
    w = world()
    alone = w.service("p0", 0, 10_000, 0, now=0.0).load_s
    assert alone == pytest.approx(10_000 * BYTES / (10 * GB))  # the tier's 10 GB/s, all its
    w = world()
    first = w.service("p0", 0, 10_000, 0, now=0.0).load_s
    second = w.service("p1", 0, 10_000, 0, now=0.0).load_s  # while the first runs
    assert first == pytest.approx(alone) and second == pytest.approx(2 * alone)
    later = w.service("p2", 0, 10_000, 0, now=10.0).load_s  # both done by then
    assert later == pytest.approx(alone)
    # A worker's link caps it, whatever the tier could give.
    wide = world(store_gb_s_per_worker=1000.0)
    assert wide.service("p0", 0, 10_000, 0, 0.0).load_s == pytest.approx(10_000 * BYTES / (25 * GB))


def test_a_longer_context_costs_more_per_token_and_a_memory_hit_a_copy() -> None:
    w = world()
    none = w.service("p0", 0, 0, 512, 0.0)
    after = w.service("p0", 4096, 0, 512, 0.0)
    assert after.compute_s > none.compute_s
    assert after.copy_s == pytest.approx(4096 * BYTES / (64 * GB)) and none.copy_s == 0.0
    # scaled to the card's rate: 1024 tokens with nothing cached at 60K tok/s
    assert w.service("p0", 0, 0, 1024, 0.0).compute_s == pytest.approx(1024 / 60_000)


def test_compute_varies_around_the_profile_by_its_spread() -> None:
    w = world(variation=0.1, seed=3)
    times = [w.service("p0", 0, 0, 1024, 0.0).compute_s for _ in range(2000)]
    median = statistics.median(times)
    assert median == pytest.approx(1024 / 60_000, rel=0.03)
    spread = statistics.median(abs(t / median - 1) for t in times)
    assert spread == pytest.approx(0.1, rel=0.15)
    again = world(variation=0.1, seed=3)
    assert [again.service("p0", 0, 0, 1024, 0.0).compute_s for _ in range(5)] == times[:5]


def test_a_trace_replays_in_a_profiled_world_from_its_files(tmp_path: Path) -> None:
    (tmp_path / "profile.json").write_text(measured().to_json())
    (tmp_path / "world.json").write_text(json.dumps({"profile": "profile.json", "seed": 1}))
    settings = WorldSettings.read(tmp_path / "world.json")
    trace = [
        TraceRequest(i * 0.001, 4096, 4, [f"s{j}" for j in range(48)] + [f"u{i}"])
        for i in range(40)
    ]
    cfg = SimConfig(prefill=2, decode=2)
    policy_world = simulate(trace, 64, cfg, "ttft").summary(2)
    profiled = simulate(trace, 64, replace(cfg, world=settings), "ttft").summary(2)
    assert profiled["requests"] == policy_world["requests"] == 40
    assert profiled["ttft_mean_s"] != policy_world["ttft_mean_s"]


def test_a_bad_world_file_is_named_with_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "world.json"
    path.write_text(json.dumps({"profile": "p.json", "store_gbs": 1}))
    with pytest.raises(ValueError, match=r"world.json: unknown fields \['store_gbs'\]"):
        WorldSettings.read(path)
    path.write_text("[1]")
    with pytest.raises(ValueError, match="world.json: a JSON object with at least 'profile'"):
        WorldSettings.read(path)


def test_the_reference_work_that_sets_the_load_is_the_worlds(tmp_path: Path) -> None:
    """--target-util sizes the load from the work in the world replayed, not the estimate."""
    from simulator.replay import request_work_s

    (tmp_path / "profile.json").write_text(measured().to_json())
    settings = WorldSettings(profile=str(tmp_path / "profile.json"), variation=0.0)
    trace = [TraceRequest(0.0, 2048, 4, [f"b{i}" for i in range(32)])]
    work = request_work_s(trace, 64, SimConfig(world=settings))
    assert work == [ProfiledWorld(settings).service("p", 0, 0, 2048, 0.0).total_s]
    assert request_work_s(trace, 64, SimConfig()) == [2048 / 60_000.0]


def test_the_tier_of_a_larger_pool_is_larger() -> None:
    """The storage bandwidth is given per worker: a pool of 4 shares four workers' worth."""
    four = ProfiledWorld(
        WorldSettings(profile="", variation=0.0, store_gb_s_per_worker=10.0), measured(), 4
    )
    times = [four.service(f"p{i}", 0, 10_000, 0, now=0.0).load_s for i in range(4)]
    # 40 GB/s in all: the first load alone gets its link's 25 GB/s, the second half the tier,
    # the fourth a quarter
    gb_s = [10_000 * BYTES / t / GB for t in times]
    assert gb_s == pytest.approx([25.0, 20.0, 40 / 3, 10.0])


def test_short_prompts_queued_together_share_a_pass(tmp_path: Path) -> None:
    w = world()
    shared = w.profile.shared_pass_s()
    # measured(): 1 prompt 0.08 s, 4 in 0.2 s, 8 in 0.35 s (before scaling): each prompt past
    # the first saves what the pass's fixed part costs
    (_, one), (_, four), (_, eight) = w.profile.batch
    assert shared == pytest.approx(((4 * one - four) / 3 + (8 * one - eight) / 7) / 2)
    parts = [Part(0, 0, 64)] * 4
    took, services = w.batch("p0", parts, 0.0)
    alone = w.service("p0", 0, 0, 64, 0.0).compute_s
    assert took == pytest.approx(4 * alone - 3 * shared)
    assert alone < took < 4 * alone
    assert all(s.compute_s == took for s in services)  # all done when the pass is
    # In a replay, short prompts arriving at once on one worker: the first starts alone, the
    # four queued behind it share the next pass.
    trace = [TraceRequest(0.0, 64, 4, [f"r{i}"]) for i in range(5)]
    (tmp_path / "profile.json").write_text(measured().to_json())
    settings = replace(w.settings, profile=str(tmp_path / "profile.json"))
    result = simulate(trace, 64, SimConfig(prefill=1, decode=1, world=settings), "round_robin")
    assert len(set(result.ttft_s[1:])) == 1 and result.ttft_s[-1] < 5 * alone
    single = replace(settings, batch_tokens=0)
    one_by_one = simulate(trace, 64, SimConfig(prefill=1, decode=1, world=single), "round_robin")
    assert max(one_by_one.ttft_s) > max(result.ttft_s)


def test_decode_steps_slow_with_the_kv_they_read() -> None:
    w = world()
    few = w.tpot_s(4, 4 * 1000)
    assert w.tpot_s(4, 4 * 100_000) > few  # the same sequences, longer: each step reads more
    assert w.tpot_s(400, 400 * 1000) > few  # more of them
    assert PolicyWorld(60_000.0, 1_500_000.0).tpot_s(4, 4 * 100_000) == 0.02  # (not there)


def test_a_long_prompt_is_computed_in_chunks_each_after_the_last() -> None:
    """Past a pass's budget a prompt is chunked (as SGLang and vLLM prefill), each chunk after
    the context before it: twice the tokens cost more than twice the time."""
    w = world(batch_tokens=2048)
    one = w.compute_s(0, 2048)
    assert one == pytest.approx(w.profile.prefill_s(0, 2048))
    two = w.compute_s(0, 4096)
    assert two == pytest.approx(one + w.profile.prefill_s(2048, 2048))
    assert two > 2 * one
    # a prompt wholly cached still computes its last token (for its logits)
    assert w.service("p0", 0, 4096, 0, 0.0).compute_s > 0


def test_an_aggregated_worker_is_slowed_by_what_it_decodes_and_the_estimate_learns_it(
    tmp_path: Path,
) -> None:
    """Whole-request workers: every pass of a prompt steps the answers the worker decodes.
    Halfway, some answers grow long (the decode load rises, unevenly); the default's fit
    learns what decoding costs a pass, its estimate stays close, and it routes ahead of round
    robin, which does not see the answers a worker is still decoding."""
    import random

    rng = random.Random(5)
    trace, t = [], 0.0
    for i in range(600):
        t += rng.expovariate(3.0)
        answer = 8 if i < 200 or rng.random() < 0.7 else 1500
        trace.append(TraceRequest(t, 2048, answer, [f"r{i}b{j}" for j in range(32)]))
    (tmp_path / "profile.json").write_text(measured().to_json())
    settings = WorldSettings(
        profile=str(tmp_path / "profile.json"),
        variation=0.05,
        batch_tokens=1024,
        hbm_gb_s=40.0,
        aggregated=True,
    )
    w = ProfiledWorld(settings)
    # a pass on a worker decoding 20 answers of 3K tokens together is longer by their step
    assert w.decode_step_s(20, 60_000) == pytest.approx(20 / 14_000 + 60_000 * BYTES / 40e9)
    cfg = SimConfig(prefill=2, decode=2, world=settings)
    runs = {p: simulate(trace, 64, cfg, p).summary(2) for p in ("ttft", "round_robin")}
    ours = runs["ttft"]
    terms = ours["estimate_terms"]
    assert terms["decoding"] + terms["decoding_context"] > 0.05, terms
    assert ours["estimate_mape"] < 0.25
    assert ours["ttft_mean_s"] < 0.95 * runs["round_robin"]["ttft_mean_s"]
    assert ours["ttft_p99_s"] < 0.8 * runs["round_robin"]["ttft_p99_s"]

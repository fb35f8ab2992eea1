"""The simulator predicts the live mesh (simulator/validate.py), loosely, at a small size: a
few sessions replayed on real processes (2 prefill workers, the tiny model) and simulated in
the world of those workers (their engine's profile and KV rates, measured here, and the
mesh's own overhead), for two policies. The figure is bench/sim_vs_live.py's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench.sim_vs_live import measure_overhead, replay_live
from simulator.measure import KvRates, kv_rates, profile_engine
from simulator.profile import EngineProfile
from simulator.validate import (
    compare,
    sessions,
    simulated,
    world_of,
)
from tests.stack import Stack

REQUESTS = sessions(n=3, turns=3, system_tokens=1024, turn_tokens=256, gap_s=0.3, stagger_s=0.1)
LONGEST = max(len(r.ids) for r in REQUESTS)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, KvRates]:
    profile = profile_engine(
        "tiny", 1, (0, LONGEST // 4, LONGEST // 2), (64, 256, LONGEST // 2), (1, 2), runs=2
    )
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    path.write_text(profile.to_json())
    return path, kv_rates("tiny", 1, tokens=1024)


@pytest.mark.parametrize("policy", ["ttft", "round_robin"])
def test_the_simulated_ttfts_follow_the_live_ones(
    stacks, world: tuple[Path, KvRates], policy: str
) -> None:
    stack: Stack = stacks(
        ("cachemeta-0", "router-0", "prefill-0", "prefill-1", "decode-0"),
        own_nats=True,
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
        KVMESH_ROUTER_ROUTING_POLICY=policy,
        KVMESH_PREFILL_KV_CACHE_TOKENS="16384",
        KVMESH_DECODE_KV_CACHE_TOKENS="16384",
    )
    profile_path, kv = world
    profile = EngineProfile.read(profile_path)
    overhead = measure_overhead(stack.url, "tiny", profile, (64, LONGEST // 2), each=3)
    live = asyncio.run(replay_live(stack.url, "tiny", REQUESTS))
    settings = world_of(profile_path, kv, batch_tokens=0, overhead=overhead)
    sim = simulated(REQUESTS, settings, policy, workers=2)
    c = compare(live, sim)
    # Loose: this machine's two cores run the router, the workers and this test at once.
    assert c["per_request_error"] < 0.6, c
    assert abs(c["mean_error"]) < 0.5, c
    assert all(s > 0 for s in sim) and len(sim) == len(live) == len(REQUESTS)

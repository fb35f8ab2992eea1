"""Does the simulator predict the live mesh? A small trace of sessions (a system prompt they all
share, then each turn its history and new tokens) is replayed on a live mesh, real processes,
at its own times, and simulated in the world of those same workers: their engine's measured
profile unscaled, the KV rates and bytes per token measured on the same engine, the workers'
pass budget, and the mesh's own time outside the workers (measured on it). Each request's
TTFT, the mean and the p99 are compared (``compare``).

``bench/sim_vs_live.py`` drives the live mesh and reports the error for two policies;
``tests/simulator/test_live_vs_sim.py`` checks it loosely at a small size.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from shared.kvstore.hashing import block_hashes
from shared.search import percentile
from simulator.measure import BLOCK, KvRates
from simulator.profile import EngineProfile
from simulator.replay import UNBOUNDED, SimConfig, simulate
from simulator.traces import TraceRequest
from simulator.world import WorldSettings


@dataclass(frozen=True)
class LiveRequest:
    t: float  # seconds after the first
    ids: list[int]  # the prompt's tokens
    n_out: int


def sessions(
    n: int,
    turns: int,
    system_tokens: int,
    turn_tokens: int,
    gap_s: float,
    stagger_s: float,
    seed: int = 0,
    n_out: int = 2,
) -> list[LiveRequest]:
    """``n`` sessions, each starting ``stagger_s`` after the last, sending a turn every
    ``gap_s``: the shared system prompt, the turns before, then ``turn_tokens`` new tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(100, 40000) for _ in range(system_tokens)]
    out = []
    for s in range(n):
        history = list(system)
        for k in range(turns):
            history += [rng.randrange(100, 40000) for _ in range(turn_tokens)]
            out.append(LiveRequest(s * stagger_s + k * gap_s, list(history), n_out))
    return sorted(out, key=lambda r: r.t)


def as_trace(requests: list[LiveRequest], block: int = BLOCK) -> list[TraceRequest]:
    """The same requests as the simulator reads them (their blocks' hashes)."""
    return [
        TraceRequest(r.t, len(r.ids), r.n_out, block_hashes(r.ids, block, "validate"))
        for r in requests
    ]


def world_of(
    profile: Path,
    kv: KvRates,
    batch_tokens: int,
    overhead: tuple[float, float],
    variation: float = -1.0,
) -> WorldSettings:
    """The live workers' world: the profile at its own rate, the engine's KV figures (the
    storage tier's bandwidth never shared: one machine's page cache), their pass budget."""
    own = EngineProfile.read(profile)
    return WorldSettings(
        profile=str(profile),
        prefill_tok_s=own.tok_s(0, 1024),  # (scaled by 1: as measured)
        variation=variation,
        kv_bytes_per_token=kv.bytes_per_token,
        store_gb_s_per_worker=kv.storage_gb_s,
        link_gb_s=kv.storage_gb_s,
        memory_gb_s=kv.memory_gb_s,
        batch_tokens=batch_tokens,
        overhead_s=overhead[0],
        overhead_s_per_token=overhead[1],
    )


def simulated(
    requests: list[LiveRequest],
    world: WorldSettings,
    policy: str,
    workers: int,
    prefill_tok_s: float = 400.0,
    load_tok_s: float = 20_000.0,
    memory_blocks: int = UNBOUNDED,
) -> list[float]:
    """Each request's TTFT in the simulated world, in the requests' order. The router's
    estimate starts where the live router's does (its settings' defaults)."""
    cfg = SimConfig(
        prefill=workers,
        decode=1,
        memory_blocks=memory_blocks,
        world=world,
        prefill_tok_s=prefill_tok_s,
        load_tok_s=load_tok_s,
    )
    result = simulate(as_trace(requests), BLOCK, cfg, policy)
    return [result.ttft_of[i] for i in range(len(requests))]


def compare(live: list[float], sim: list[float]) -> dict:
    """The simulation's error against the live mesh: per request (mean of |sim − live| ÷ live),
    and of the mean and the p99 TTFT."""
    per = [abs(s - x) / x for s, x in zip(sim, live, strict=True)]
    live_mean, sim_mean = statistics.fmean(live), statistics.fmean(sim)
    live_p99, sim_p99 = percentile(sorted(live), 99), percentile(sorted(sim), 99)
    return {
        "requests": len(live),
        "live_mean_s": live_mean,
        "sim_mean_s": sim_mean,
        "live_p99_s": live_p99,
        "sim_p99_s": sim_p99,
        "per_request_error": statistics.fmean(per),
        "mean_error": (sim_mean - live_mean) / live_mean,
        "p99_error": (sim_p99 - live_p99) / live_p99,
    }


def overhead(alone: dict[int, list[float]], profile: EngineProfile) -> tuple[float, float]:
    """The mesh's time outside the engine's compute, per request and per prompt token: new
    prompts of two lengths sent alone (live TTFTs by length), less what the profile says
    their compute takes, through the two points."""
    (short, a), (long, b) = sorted(
        (n, max(0.0, statistics.median(ts) - profile.prefill_s(0, n))) for n, ts in alone.items()
    )
    per_token = max(0.0, (b - a) / (long - short))
    return max(0.0, a - per_token * short), per_token

"""The agent-like trace: sessions of tool-call turns, each re-sending its history."""

from __future__ import annotations

import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from bench.agent_trace import agent_trace
from simulator.replay import infinite_cache_hit_ratio
from simulator.traces import MOONCAKE_BLOCK, read_trace
from tests.procs import REPO


def sessions(trace: list) -> dict[str, list]:
    by = defaultdict(list)
    for r in trace:
        own = next(h for h in r.hashes if h.startswith("s"))  # "s<session>b<j>" or "...t<turn>"
        by[own.replace("t", "b").split("b")[0]].append(r)
    return by


def test_long_inputs_mostly_reused_turns_seconds_apart() -> None:
    trace = agent_trace(60, seed=3)
    assert 50_000 <= statistics.fmean(r.n_in for r in trace) <= 100_000
    assert infinite_cache_hit_ratio(trace, MOONCAKE_BLOCK) >= 0.9
    assert all(r.retention == "agent" for r in trace)
    by = sessions(trace)
    assert len(by) == 60
    for turns in by.values():
        assert 8 <= len(turns) <= 40
        for a, b in zip(turns, turns[1:], strict=False):
            assert 1.0 <= b.t - a.t <= 8.0  # the call decoded, the tool run
            assert b.n_in > a.n_in + a.n_out  # the call and the tool's result joined
            full = a.n_in // MOONCAKE_BLOCK
            assert b.hashes[:full] == a.hashes[:full]  # every full block reused


def test_seeded() -> None:
    assert agent_trace(20, seed=1) == agent_trace(20, seed=1)
    assert agent_trace(20, seed=1) != agent_trace(20, seed=2)


def test_written_in_mooncakes_format(tmp_path: Path) -> None:
    out = tmp_path / "agent.jsonl"
    run = subprocess.run(
        [sys.executable, "bench/agent_trace.py", "--sessions", "20", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    back, block = read_trace(out)
    trace = agent_trace(20)
    assert len(back) == len(trace) and block == MOONCAKE_BLOCK
    assert [r.n_in for r in back] == [r.n_in for r in trace]
    assert infinite_cache_hit_ratio(back, block) == infinite_cache_hit_ratio(trace, block)

"""Routing policies in the simulator on small traces where the right choice is known."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.router.policies import POLICIES, RouteRequest
from services.router.simulator import SimConfig, infinite_cache_hit_ratio, simulate
from services.router.traces import TraceRequest
from tests.procs import REPO


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


def test_bounded_load_spreads_a_shared_prompt() -> None:
    """Every request shares one long system prompt; without a bound it would all go to the
    worker that holds it."""
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


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_policy_ranks_every_candidate_with_its_reasons(name: str) -> None:
    policy = POLICIES[name]()
    req = RouteRequest("r", 700, 64, [f"h{i}" for i in range(10)], {"mem:p1": 10, "store": 10})
    ranked = policy.rank(req, ["p0", "p1", "p2"])
    assert sorted(r.service_id for r in ranked) == ["p0", "p1", "p2"]
    assert all(r.terms for r in ranked)
    if name in ("ttft", "dynamo"):  # cache-aware from cachemeta: p1 holds the prefix
        assert ranked[0].service_id == "p1"


def test_sim_cli_prints_a_table_a_png_and_one_json_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "timestamp": i * 20,
            "input_length": 2048,
            "output_length": 8,
            "hash_ids": [i % 5, 100 + i % 5, 200 + i, 300 + i],
        }
        for i in range(300)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    png = tmp_path / "cdf.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "shared.cli.main",
            "sim",
            "--trace",
            str(trace),
            "--prefill",
            "2",
            "--decode",
            "2",
            "--policy",
            "all",
            "--target-util",
            "0.7",
            "--png",
            str(png),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert set(POLICIES) <= set(out) and "infinite_cache_hit_ratio" in out and out["speed"] > 0
    assert out["ttft"]["hit_ratio"] <= out["infinite_cache_hit_ratio"] + 1e-9
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "300/300" in run.stderr  # progress shown


def test_sim_cli_names_the_bad_argument(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", "sim", "--trace", str(tmp_path / "nope.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--trace" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", "sim", "--trace", "x", "--policy", "magic"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--policy" in run.stderr

"""`kvmesh sim`: a table, a PNG and one JSON line; bad arguments named."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from services.router.routing.policies import POLICIES
from tests.procs import REPO


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
            "kvmesh",
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
        [sys.executable, "-m", "kvmesh", "sim", "--trace", str(tmp_path / "nope.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--trace" in run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "kvmesh", "sim", "--trace", "x", "--policy", "magic"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2 and "--policy" in run.stderr


def sim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvmesh", "sim", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_target_util_is_over_the_busy_window_unless_asked_for_the_span(tmp_path: Path) -> None:
    """Ten quiet minutes, then 300 requests in a minute."""
    trace = tmp_path / "bunched.jsonl"
    times = [i * 60_000 for i in range(10)] + [600_000 + i * 200 for i in range(300)]
    lines = [
        {
            "timestamp": t,
            "input_length": 4096,
            "output_length": 8,
            "hash_ids": [4 * i + j for j in range(8)],
        }
        for i, t in enumerate(times)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    common = ("--trace", str(trace), "--prefill", "2", "--decode", "2", "--target-util", "0.8")
    speeds = {}
    for basis in ("busy", "span"):
        run = sim(*common, "--util-basis", basis)
        assert run.returncode == 0, run.stderr
        speeds[basis] = json.loads(run.stdout.strip().splitlines()[-1])["speed"]
    assert speeds["busy"] < speeds["span"] / 5  # the busy minute is not diluted by the quiet
    run = sim(*common, "--util-basis", "day")
    assert run.returncode == 2 and "--util-basis" in run.stderr
    assert "busy window" in sim("--help").stdout


def test_sim_in_a_world_from_a_profile_and_in_the_policys_own(tmp_path: Path) -> None:
    from tests.simulator.test_profile import measured

    trace = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": i * 20, "input_length": 2048, "output_length": 8, "hash_ids": [i % 3, i]}
        for i in range(100)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines))
    (tmp_path / "profile.json").write_text(measured().to_json())
    (tmp_path / "world.json").write_text(json.dumps({"profile": "profile.json"}))
    base = ["--trace", str(trace), "--prefill", "2", "--decode", "2", "--policy", "ttft"]

    def figures(*more: str) -> dict:
        run = sim(*base, *more)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout.strip().splitlines()[-1])["ttft"]

    default, policy = figures(), figures("--world", "policy")
    assert default == policy  # today's world, kept exactly
    profiled = figures("--world", str(tmp_path / "world.json"))
    assert profiled["ttft_mean_s"] != default["ttft_mean_s"]
    assert profiled["estimate_terms"]["uncached"] > 0  # what ttft's estimate learned there
    # the committed world, by name: the torch engine's profile at a card's rate
    named = figures("--world", "profiled")
    assert named["ttft_mean_s"] not in (default["ttft_mean_s"], profiled["ttft_mean_s"])
    run = sim(*base, "--world", str(tmp_path / "nope.json"))
    assert run.returncode == 2 and "--world" in run.stderr and "nope.json" in run.stderr


def test_sim_replays_a_trace_whose_lines_name_adapters(tmp_path: Path) -> None:
    rng = random.Random(0)
    trace = tmp_path / "trace.jsonl"
    lines = [
        {
            "timestamp": i * 20,
            "input_length": 2048,
            "output_length": 8,
            "hash_ids": [4 * i + k for k in range(4)],  # (nothing shared: adapters decide)
            "adapter": f"lora{rng.randrange(8)}",
        }
        for i in range(200)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines))

    def sim(*extra: str) -> dict:
        run = subprocess.run(
            [sys.executable, "-m", "kvmesh", "sim", "--trace", str(trace), "--prefill", "4"]
            + ["--policy", "ttft,round_robin", "--target-util", "0.6", "--max-loras", "2"]
            + list(extra),
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout.strip().splitlines()[-1])

    aware, blind = sim(), sim("--adapter-blind")
    # 8 adapters over 4 workers holding 2 each: the default keeps each where it is resident
    assert aware["ttft"]["adapter_loads"] < aware["round_robin"]["adapter_loads"]
    assert aware["ttft"]["adapter_loads"] < blind["ttft"]["adapter_loads"]
    assert aware["ttft"]["ttft_mean_s"] < blind["ttft"]["ttft_mean_s"]

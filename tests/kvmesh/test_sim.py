"""`kvmesh sim`: a table, a PNG and one JSON line; bad arguments named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from services.router.policies import POLICIES
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

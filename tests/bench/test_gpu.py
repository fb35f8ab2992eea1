"""bench/gpu.py's dry run on this machine's CPU (a tiny shape): every part of the GPU run
(the engine alone, the mesh's turns from each tier, bench/e2e.py beside the Rust anchor) runs
and reports, so the script the lent GPU machine runs cannot rot between the sessions that
have one."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.procs import REPO


def test_the_gpu_script_runs_dry_on_the_cpu(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "bench/gpu.py", "--device", "cpu", "--shape", "tiny"]
        + ["--out", str(tmp_path), "--e2e-requests", "1", "--e2e-rounds", "5"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["errors"] == {}, figures["errors"]
    assert figures["greedy_bf16_equal"] and figures["greedy_fp32_equal"]
    assert figures["prefill_1024_uncached_tok_s"] > 0 and figures["decode_b4_tok_s"] > 0
    run = json.loads((tmp_path / "gpu.json").read_text())
    mesh = run["mesh"]
    assert mesh["cold"]["memory_tokens"] == 0 and mesh["cold"]["storage_tokens"] == 0
    assert mesh["memory"]["memory_tokens"] >= 960  # (the next turn: its prefix from memory)
    assert mesh["storage"]["storage_tokens"] >= 960  # (evicted from memory: from storage)
    assert figures["fake_overhead_p50_ms_1"] > 0
    # The anchor's added latency is a difference of two medians of ~1 ms: measured, but on a
    # loaded machine it can come out below zero.
    assert isinstance(figures["anchor_overhead_p50_ms"], float)
    table = (tmp_path / "gpu.txt").read_text()
    assert "96% cached ms" in table and "mesh turn" in table and "targets:" in table

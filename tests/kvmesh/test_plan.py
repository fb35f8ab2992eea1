"""`kvmesh plan`: a plan as a table, a plot and one JSON line; what-ifs move it; bad flags
named."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvmesh.main import main

DESCRIBED = ["--rate", "6", "--requests", "300", "--input-mean", "8192", "--output-mean", "200"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def plan(capsys: pytest.CaptureFixture[str]):  # noqa: ANN201
    """`kvmesh plan ARGS` as the command line runs it (in this process: it only computes)."""

    def run(*args: str) -> Run:
        code = main(["plan", *args])
        out = capsys.readouterr()
        return Run(code, out.out, out.err)

    return run


def test_a_plan_is_a_table_a_plot_and_one_json_line(plan, tmp_path: Path) -> None:  # noqa: ANN001
    png = tmp_path / "plan.png"
    run = plan(*DESCRIBED, "--ttft-p99", "1", "--tpot-p99", "0.025", "--png", str(png))
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["feasible"] and out["prefill"] >= 1 and out["decode"] >= 1
    assert out["ttft_p99_s"] <= 1 and out["tpot_p99_s"] <= 0.025
    assert 0 <= out["margin"]["ttft_p99_s"] < 1
    assert out["hit_ratio"] == pytest.approx(out["memory_hit_ratio"] + out["storage_hit_ratio"])
    assert f"plan: {out['prefill']} prefill + {out['decode']} decode workers" in run.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slower_cards_need_more_workers(plan) -> None:  # noqa: ANN001
    def workers(*what_if: str) -> tuple[int, int]:
        run = plan(*DESCRIBED, "--ttft-p99", "1", "--tpot-p99", "0.025", *what_if)
        out = json.loads(run.stdout.strip().splitlines()[-1])
        return out["prefill"], out["decode"]

    base = workers()
    slow_prefill = workers("--prefill-tok-s", "20000")
    slow_decode = workers("--decode-tok-s", "500")  # (its sequences share less)
    assert slow_prefill[0] > base[0] and slow_decode[1] > base[1]


def test_a_target_no_pool_meets_exits_1_saying_what_more_workers_reach(plan) -> None:  # noqa: ANN001
    run = plan(*DESCRIBED, "--ttft-p99", "0.001")
    assert run.returncode == 1
    assert "no prefill pool meets the targets" in run.stdout and "target 0.001 s" in run.stdout
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["feasible"] is False and out["prefill"] is None and out["decode"] is None
    # Its figures are the largest prefill pool's, named; no decode pool was sized, so no
    # decode figure is given.
    assert out["at"]["prefill"] >= 1 and out["at"]["decode"] is None
    assert out["ttft_p99_s"] > 0.001
    assert not {"tpot_mean_s", "tpot_p99_s", "decode_utilization"} & set(out)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--ttft-p99", "1"], "--trace FILE, or --rate"),
        ([*DESCRIBED], "at least one of --ttft-mean"),
        ([*DESCRIBED, "--ttft-p99", "-1"], "above 0 seconds"),
        ([*DESCRIBED, "--ttft-p99", "1", "--retention", "chat=soon"], "--retention"),
        ([*DESCRIBED, "--ttft-p99", "1", "--retention", "video=1d"], "not a class"),
        ([*DESCRIBED, "--ttft-p99", "1", "--reuse", "1.2"], "--reuse: in [0, 1)"),
        ([*DESCRIBED, "--ttft-p99", "1", "--output-mean", "9000"], "--output-mean"),
        ([*DESCRIBED, "--ttft-p99", "1", "--world", "policy", "--store-gb-s", "5"], "profiled"),
        (["--trace", "/nonexistent.jsonl", "--ttft-p99", "1"], "no such file"),
        (["--trace", "t.jsonl", "--ttft-p99", "1", "--block-size", "64"], "--block-size"),
        ([*DESCRIBED, "--ttft-p99", "1", "--policy", "fastest"], "--policy: unknown"),
    ],
)
def test_bad_flags_are_named(plan, args: list[str], named: str) -> None:  # noqa: ANN001
    run = plan(*args)
    assert run.returncode == 2 and named in run.stderr, run.stderr

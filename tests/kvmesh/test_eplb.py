"""`kvmesh eplb plan`: a load file in, a placement and its predicted balance out; its own
placement given back as --current is kept (no moves); bad arguments get a message naming them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvmesh.main import main
from shared.eplb.placement import Placement
from shared.eplb.stats import write_load
from tests.procs import REPO


@pytest.fixture
def load_file(tmp_path: Path) -> Path:
    """400 steps of 2 layers × 32 experts, Zipf-popular, in the .npz form the engine writes."""
    rng = np.random.default_rng(0)
    share = (1.0 + np.stack([rng.permutation(32) for _ in range(2)])) ** -1.1
    share /= share.sum(-1, keepdims=True)
    path = tmp_path / "load.npz"
    write_load(path, rng.poisson(share * 4000, (400, 2, 32)))
    return path


def plan(load: Path, *extra: str) -> list[str]:
    return [
        "eplb", "plan", "--load", str(load), "--experts", "32", "--cards", "4", "--slots", "40",
        "--window-steps", "100", "--replan-steps", "200", *extra,
    ]  # fmt: skip


def test_a_plan_from_a_load_file_prints_every_card_and_beats_contiguous(
    load_file: Path, tmp_path: Path
) -> None:
    out = tmp_path / "placement.json"
    result = subprocess.run(
        [sys.executable, "-m", "kvmesh", *plan(load_file, "--out", str(out))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert sum(line.startswith("  card ") for line in text.splitlines()) == 2 * 4
    assert "layer 1:" in text
    predicted = float(text.split("this plan")[1].split()[0])
    contiguous = float(text.split("contiguous")[1].split()[0])
    assert predicted < contiguous and predicted < 1.1
    placement = Placement.from_json(json.loads(out.read_text()))
    assert placement.slot_expert.shape == (2, 40) and (placement.replicas() >= 1).all()


def test_the_current_placement_planned_again_moves_nothing(
    load_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "placement.json"
    assert main(plan(load_file, "--out", str(out), "--json")) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["taken"] and first["moves"] > 0 and first["predicted"] <= first["greedy"] + 0.02
    assert main(plan(load_file, "--current", str(out), "--json")) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["current"] == pytest.approx(first["predicted"])
    assert again["moves"] == 0 or not again["taken"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--experts", "30"], "--experts 30 does not match the load file's 32 experts"),
        (["--slots", "42"], "--slots: at least the 32 experts and a multiple of --cards 4"),
        (["--slots", "16"], "--slots: at least the 32 experts"),
    ],
)
def test_bad_arguments_are_refused_naming_them(
    load_file: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = plan(load_file)
    for flag, value in zip(args[::2], args[1::2], strict=True):
        argv[argv.index(flag) + 1] = value
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_a_load_file_that_is_not_one_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "load.json"
    bad.write_text('{"counts": [1, 2]}')
    assert main(plan(bad)) == 2
    assert "--load:" in capsys.readouterr().err

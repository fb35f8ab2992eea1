"""A start in seconds: a model's converted weights and speculation's cost curve are built once
per machine and state dir, then found: a second load reads no checkpoint and measures
nothing, two workers starting at once build the weights once, and a damaged cache is rebuilt."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.engine.interface import EngineOptions
from shared.engine.torch import loader
from shared.engine.torch.engine import TorchEngine
from shared.model.catalog import ModelSource
from tests.checkpoints import hf_checkpoint
from tests.procs import REPO


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ckpt") / "hf"
    hf_checkpoint(path, "qwen2")
    return path


def test_a_second_load_maps_the_cached_weights_and_reads_no_checkpoint(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = ModelSource("mine", "hf", checkpoint)
    first = loader.load_model(source, tmp_path)
    (cached,) = (tmp_path / "cache").glob("weights-*.safetensors")
    assert first.config.fingerprint in cached.name

    def unread(*args: object) -> None:
        raise AssertionError("the checkpoint was read again")

    monkeypatch.setattr(loader, "read_safetensors", unread)
    second = loader.load_model(source, tmp_path)
    assert second.config == first.config
    for name, w in first.weights.items():
        torch.testing.assert_close(second.weights[name], w, rtol=0, atol=0)
    # Damaged (a new file in its place: the loaded weights map the old one, which stays
    # whole, as every writer here replaces files, never rewrites them): rebuilt, not trusted.
    damaged = cached.with_name("damaged")
    damaged.write_bytes(b"not a safetensors file")
    damaged.replace(cached)
    monkeypatch.undo()
    third = loader.load_model(source, tmp_path)
    torch.testing.assert_close(third.weights["tok_emb"], first.weights["tok_emb"])


BUILD = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, format="%(message)s")
from shared.engine.torch.loader import load_model
from shared.model.catalog import ModelSource
model = load_model(ModelSource("mine", "hf", Path(sys.argv[1])), Path(sys.argv[2]))
print("loaded", model.config.fingerprint)
"""


def test_two_workers_starting_at_once_build_the_cache_once(
    checkpoint: Path, tmp_path: Path
) -> None:
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD, str(checkpoint), str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    built = sum("weights cached in" in out for out in outs)
    assert built == 1, outs
    assert len({out.split("loaded ")[1].split()[0] for out in outs}) == 1


def test_speculations_cost_curve_is_measured_once_per_machine_and_model(
    checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = ModelSource("mine", "hf", checkpoint)
    options = EngineOptions(block_size=8, kv_cache_tokens=1024, speculative="adaptive")
    first = TorchEngine.load(source, tmp_path, options)
    first.start()
    (costs,) = (tmp_path / "cache").glob("costs-*.json")
    second = TorchEngine.load(source, tmp_path, options)
    second._measure_costs = lambda: (_ for _ in ()).throw(AssertionError("measured again"))
    with caplog.at_level(logging.INFO):
        second.start()
    assert "measured before" in caplog.text
    assert second._base_cost.seconds == first._base_cost.seconds
    bigger = EngineOptions(block_size=8, kv_cache_tokens=2048, speculative="adaptive")
    other = TorchEngine.load(source, tmp_path, bigger)
    other.start()  # another pool: its own curve
    assert len(list((tmp_path / "cache").glob("costs-*.json"))) == 2 and costs.is_file()

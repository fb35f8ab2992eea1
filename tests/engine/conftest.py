"""Engine fixtures: the real model is loaded once per session (it takes seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.interface import EngineOptions
from shared.engine.torch.engine import TorchEngine
from shared.engine.torch.loader import LoadedModel, load_model

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def engine_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-state")


@pytest.fixture(scope="session")
def real_model(engine_state_dir: Path) -> LoadedModel:
    return load_model("smollm2-135m-instruct", engine_state_dir)


@pytest.fixture(scope="session")
def tiny_models(engine_state_dir: Path) -> dict[str, LoadedModel]:
    return {name: load_model(name, engine_state_dir) for name in ("tiny", "tiny-swa", "tiny-moe")}


def make_engine(model: LoadedModel, **options) -> TorchEngine:
    defaults = dict(block_size=8, kv_cache_tokens=8192, prefill_chunk=32)
    engine = TorchEngine(model, EngineOptions(**{**defaults, **options}))
    engine.start()
    return engine

"""Engine backends by name. A worker's setting (``KVMESH_<WORKER>_ENGINE``) picks one; its
module is imported only then, so a backend whose packages are not installed (SGLang, on a
machine without a GPU) costs nothing until it is chosen."""

from __future__ import annotations

import importlib
from pathlib import Path

from shared.engine.interface import Engine, EngineOptions
from shared.model.catalog import ModelSource

# name → "module:class" of an Engine subclass
ENGINES: dict[str, str] = {
    "torch": "shared.engine.torch.engine:TorchEngine",
    # benchmarks of the mesh only: real prefill, decode a paced fixed token (see its module)
    "fake-paced": "shared.engine.fake:PacedFakeEngine",
}


def engine_class(name: str) -> type[Engine]:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; one of {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    found = getattr(importlib.import_module(module), cls)
    assert issubclass(found, Engine), f"{ENGINES[name]} is not an Engine"
    return found


def load_engine(name: str, model: ModelSource, state_dir: Path, options: EngineOptions) -> Engine:
    """Build backend ``name`` serving ``model`` (loads its weights: seconds)."""
    return engine_class(name).load(model, state_dir, options)

"""Engine backends by name. A worker's setting (``KVMESH_<WORKER>_ENGINE``) picks one; its
module is imported only then, so a backend whose packages are not installed (SGLang, on a
machine without a GPU) costs nothing until it is chosen."""

from __future__ import annotations

import importlib
from pathlib import Path

from shared.engine.interface import Engine, EngineOptions, OwningEngine
from shared.model.catalog import ModelSource

# name → "module:class" of an Engine subclass
ENGINES: dict[str, str] = {
    "torch": "shared.engine.torch.engine:TorchEngine",
    # benchmarks of the mesh only: real prefill, decode a paced fixed token (see its module)
    "fake-paced": "shared.engine.fake:PacedFakeEngine",
    # engines that own their KV (OwningEngine): vLLM, from the vllm extra; SGLang, on a GPU
    # machine with sglang installed
    "vllm": "shared.engine.vllm.engine:VllmEngine",
    "sglang": "shared.engine.sglang.engine:SglangEngine",
}
OWNING = frozenset({"vllm", "sglang"})  # the OwningEngine backends (known before importing)
# Engines whose answers are not the model's: a worker runs one only when told it is a
# benchmark (KVMESH_BENCH_ENGINES).
BENCH_ONLY = frozenset({"fake-paced"})


def engine_class(name: str) -> type[Engine] | type[OwningEngine]:
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; one of {', '.join(ENGINES)}")
    module, _, cls = ENGINES[name].partition(":")
    found = getattr(importlib.import_module(module), cls)
    kind = OwningEngine if name in OWNING else Engine
    assert issubclass(found, kind), f"{ENGINES[name]} is not an {kind.__name__}"
    return found


def load_engine(name: str, model: ModelSource, state_dir: Path, options: EngineOptions) -> Engine:
    """Build step-engine backend ``name`` serving ``model`` (loads its weights: seconds)."""
    cls = engine_class(name)
    assert issubclass(cls, Engine), f"{name} owns its KV: load_owning_engine"
    return cls.load(model, state_dir, options)


def load_owning_engine(
    name: str, model: ModelSource, state_dir: Path, options: EngineOptions
) -> OwningEngine:
    """Build backend ``name``, an engine that owns its KV (started later, on the loop)."""
    cls = engine_class(name)
    assert issubclass(cls, OwningEngine), f"{name} is a step engine: load_engine"
    return cls.load(model, state_dir, options)

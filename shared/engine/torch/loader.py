"""Models with their weights, by the catalog's source: the bundled SmolLM2 and GGUF files by
path (dequantized), Hugging Face checkpoints (safetensors), or a tiny seeded config. The text
side (config, tokenizer, template) is ``shared/model``'s.

A model's weights are read and converted (dequantized, fused into the layout the model
computes with) once per machine: the result is cached under the state dir as one safetensors
file named by the model's fingerprint (its config and its weights' identity), which later
starts map into memory in milliseconds, and which every worker of the machine shares in the
page cache. Two workers starting at once build it once (a lock); a damaged file is rebuilt.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors.torch import load_file, save_file

from shared.engine.torch.weights import Weights, random_weights, read_gguf, read_safetensors
from shared.files import locked, replacing
from shared.model import hf
from shared.model.catalog import ModelSource, resolve
from shared.model.config import ModelConfig
from shared.model.gguf import find_gguf
from shared.model.text import NO_MODELS, TextModel, text_of

log = logging.getLogger(__name__)


@dataclass
class LoadedModel(TextModel):
    weights: Weights


def load_model(
    model: str | ModelSource,
    state_dir: Path,
    seed: int = 0,
    models: Mapping[str, str | Path] = NO_MODELS,
) -> LoadedModel:
    """Load a model by name (resolved in ``models`` and the built-ins) or by its source;
    logs progress, as it can take seconds."""
    source = model if isinstance(model, ModelSource) else resolve(model, models)
    started = time.monotonic()
    text = text_of(source, state_dir, seed)
    config = text.config
    if source.kind == "tiny":
        weights = random_weights(config, seed)
    else:
        weights = cached(state_dir / "cache", config.fingerprint, lambda: _read(source, config))
    log.info(
        "loaded %s in %.1f s (fingerprint %s)",
        source.name,
        time.monotonic() - started,
        config.fingerprint,
    )
    return LoadedModel(config, text.tokenizer, text.chat_template, weights)


def _read(source: ModelSource, config: ModelConfig) -> Weights:
    if source.kind == "hf":
        log.info("loading %s: reading its safetensors (once per machine)", source.name)
        return read_safetensors(hf.weight_files(source), config)
    path = find_gguf() if source.kind == "bundled" else source.path
    assert path is not None
    log.info("loading %s: reading and dequantizing %s (once per machine)", source.name, path.name)
    return read_gguf(path, config)


def cached(cache_dir: Path, fingerprint: str, build: Callable[[], Weights]) -> Weights:
    """The weights of the model with ``fingerprint`` from this machine's cache (mapped into
    memory, not read), built by ``build`` and stored there the first time."""
    path = cache_dir / f"weights-{fingerprint}.safetensors"
    if (found := _mapped(path)) is not None:
        return found
    with locked(path.with_suffix(".lock")):
        if (found := _mapped(path)) is not None:  # (built meanwhile by another worker)
            return found
        weights = build()
        with replacing(path) as tmp:
            save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp))
        log.info("weights cached in %s", path)
    return _mapped(path) or weights


def _mapped(path: Path) -> Weights | None:
    if not path.is_file():
        return None
    try:
        return load_file(str(path))
    except Exception as err:  # noqa: BLE001 (a damaged cache is rebuilt, never trusted)
        log.warning("rebuilding the weights cache %s: %s", path, err)
        path.unlink(missing_ok=True)
        return None

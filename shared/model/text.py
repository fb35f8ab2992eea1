"""Models by name, as the router sees them: configuration, tokenizer and chat template.

The real model's come from its GGUF file and are cached under the state dir (the file is read
once per machine; later starts read a few small files). The tiny configs share the real
tokenizer's vocabulary, so text goes in and out as for the real model.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from shared.files import write_atomically
from shared.model.config import TINY_CONFIGS, ModelConfig
from shared.model.gguf import REAL_MODEL, find_gguf, read_gguf_config, read_metadata
from shared.model.tokenizer import ChatTemplate, load_tokenizer

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


def _cache_key() -> str:
    stat = find_gguf().stat()
    return f"{stat.st_size}-{stat.st_mtime_ns}"


def text_assets(
    state_dir: Path, meta: dict[str, Any] | None = None
) -> tuple[Tokenizer, ChatTemplate]:
    """The real model's tokenizer and chat template, from the cache when possible.

    ``meta`` is the GGUF metadata when the caller has already read the file; otherwise the
    file is opened only if the cache lacks something.
    """
    key = _cache_key()
    cache = state_dir / "cache"
    template_file = cache / f"chat_template-{key}.jinja"
    tok_file = cache / f"tokenizer-{key}.json"
    if meta is None and not (template_file.is_file() and tok_file.is_file()):
        meta = read_metadata(find_gguf(), "tokenizer.")
    if not template_file.is_file():
        assert meta is not None
        write_atomically(template_file, meta["tokenizer.chat_template"])
    tokenizer = load_tokenizer(meta or {}, cache, key)
    return tokenizer, ChatTemplate(template_file.read_text())


def tiny_config(name: str, seed: int) -> ModelConfig:
    return ModelConfig(**{**TINY_CONFIGS[name].__dict__, "weights_id": f"seed:{seed}"})


def config_file(state_dir: Path) -> Path:
    """Where the real model's configuration is cached (written by whoever reads it first)."""
    return state_dir / "cache" / f"config-{_cache_key()}.json"


def load_config(name: str, state_dir: Path, seed: int = 0) -> ModelConfig:
    """A model's configuration by name (see MODEL_NAMES); raises UnknownModel."""
    if name == REAL_MODEL:
        path = config_file(state_dir)
        if not path.is_file():  # first start: a worker's load writes it too
            log.info("reading %s's configuration from the GGUF file", name)
            write_atomically(path, read_gguf_config(find_gguf()).to_json())
        return ModelConfig.from_json(path.read_text())
    if name in TINY_CONFIGS:
        return tiny_config(name, seed)
    raise UnknownModel(f"unknown model {name!r}; known: {', '.join(MODEL_NAMES)}")


def load_text_model(name: str, state_dir: Path, seed: int = 0) -> TextModel:
    """A model's config, tokenizer and template without its weights: fast once cached."""
    return TextModel(load_config(name, state_dir, seed), *text_assets(state_dir))

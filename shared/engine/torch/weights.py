"""Model weights: the real SmolLM2 from its GGUF file (dequantized to fp32), or seeded random.

Weights are kept in the layout the model computes with: the query, key and value projections
fused into one ``wqkv`` matrix and gate+up into one ``w13`` (fewer, larger matrix products).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from shared.model.config import ModelConfig
from shared.model.gguf import config_from_meta

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


@dataclass
class GGUFModel:
    config: ModelConfig
    weights: Weights
    metadata: dict[str, Any]  # GGUF key → value (tokenizer vocabulary, chat template, ...)


def _unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation, back to the half-split RoPE layout HF uses."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: Path) -> GGUFModel:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    started = time.monotonic()
    reader = GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
    config = config_from_meta(meta, path)
    raw: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        raw[t.name] = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    w: Weights = {
        "tok_emb": torch.from_numpy(raw["token_embd.weight"].copy()),
        "norm": torch.from_numpy(raw["output_norm.weight"].copy()),
    }
    if "output.weight" in raw:
        w["lm_head"] = torch.from_numpy(raw["output.weight"].copy())
        config = replace(config, tie_embeddings=False)
    for i in range(config.n_layers):
        p = f"blk.{i}."
        q = _unpermute_rope(raw[p + "attn_q.weight"], config.n_heads)
        k = _unpermute_rope(raw[p + "attn_k.weight"], config.n_kv_heads)
        v = raw[p + "attn_v.weight"]
        w[f"layers.{i}.wqkv"] = torch.from_numpy(np.concatenate([q, k, v]))
        w[f"layers.{i}.wo"] = torch.from_numpy(raw[p + "attn_output.weight"].copy())
        w[f"layers.{i}.w13"] = torch.from_numpy(
            np.concatenate([raw[p + "ffn_gate.weight"], raw[p + "ffn_up.weight"]])
        )
        w[f"layers.{i}.w2"] = torch.from_numpy(raw[p + "ffn_down.weight"].copy())
        w[f"layers.{i}.attn_norm"] = torch.from_numpy(raw[p + "attn_norm.weight"].copy())
        w[f"layers.{i}.ffn_norm"] = torch.from_numpy(raw[p + "ffn_norm.weight"].copy())
    log.info("read %s in %.1f s", path.name, time.monotonic() - started)
    return GGUFModel(config, w, meta)


def random_weights(config: ModelConfig, seed: int = 0) -> Weights:
    """Seeded random weights with the scale of a trained model (so activations stay sane)."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float | None = None) -> torch.Tensor:
        std = scale if scale is not None else shape[-1] ** -0.5
        return torch.randn(*shape, generator=g) * std

    d, hd = config.dim, config.head_dim
    qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * hd
    w: Weights = {"tok_emb": rand(config.vocab_size, d, scale=1.0), "norm": 1 + rand(d, scale=0.1)}
    if not config.tie_embeddings:
        w["lm_head"] = rand(config.vocab_size, d, scale=1.0)
    for i in range(config.n_layers):
        p = f"layers.{i}."
        w[p + "wqkv"] = rand(qkv_rows, d)
        w[p + "wo"] = rand(d, config.n_heads * hd)
        w[p + "attn_norm"] = 1 + rand(d, scale=0.1)
        w[p + "ffn_norm"] = 1 + rand(d, scale=0.1)
        if config.is_moe(i):
            moe = config.moe
            assert moe is not None
            w[p + "router"] = rand(moe.n_experts, d)
            w[p + "experts_w13"] = rand(moe.n_experts, 2 * moe.expert_ffn_dim, d)
            w[p + "experts_w2"] = rand(moe.n_experts, d, moe.expert_ffn_dim)
            if moe.shared_expert:
                w[p + "w13"] = rand(2 * moe.expert_ffn_dim, d)
                w[p + "w2"] = rand(d, moe.expert_ffn_dim)
        else:
            w[p + "w13"] = rand(2 * config.ffn_dim, d)
            w[p + "w2"] = rand(d, config.ffn_dim)
    return w

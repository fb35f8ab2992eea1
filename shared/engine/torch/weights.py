"""Model weights: from a GGUF file (dequantized to fp32), from a Hugging Face checkpoint's
safetensors, or seeded random (the tiny test models).

Weights are kept in the layout the model computes with: the query, key and value projections
fused into one ``wqkv`` matrix (and their biases into ``bqkv``) and gate+up into one ``w13``
(fewer, larger matrix products). Both file formats are read through the Hugging Face names, so
one mapping (``fused``) makes the layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from shared.model.config import ModelConfig
from shared.model.gguf import hf_name, unpermute_rope

log = logging.getLogger(__name__)

Weights = dict[str, torch.Tensor]


def fused(config: ModelConfig, tensor: Callable[[str], torch.Tensor | None]) -> Weights:
    """The model's weights in its computing layout, from ``tensor`` (a layer's part by its
    Hugging Face name, ``None`` where the checkpoint has none)."""

    def need(name: str) -> torch.Tensor:
        t = tensor(name)
        if t is None:
            raise ValueError(f"the checkpoint has no tensor {name}")
        return t

    w: Weights = {"tok_emb": need("model.embed_tokens.weight"), "norm": need("model.norm.weight")}
    if not config.tie_embeddings:
        w["lm_head"] = need("lm_head.weight")
    for i in range(config.n_layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        att = hf + "self_attn."
        w[p + "wqkv"] = torch.cat([need(f"{att}{x}_proj.weight") for x in "qkv"])
        if config.qkv_bias:
            w[p + "bqkv"] = torch.cat([need(f"{att}{x}_proj.bias") for x in "qkv"])
        if config.qk_norm:
            w[p + "q_norm"], w[p + "k_norm"] = (
                need(att + "q_norm.weight"),
                need(att + "k_norm.weight"),
            )
        w[p + "wo"] = need(att + "o_proj.weight")
        w[p + "w13"] = torch.cat(
            [need(hf + "mlp.gate_proj.weight"), need(hf + "mlp.up_proj.weight")]
        )
        w[p + "w2"] = need(hf + "mlp.down_proj.weight")
        w[p + "attn_norm"] = need(hf + "input_layernorm.weight")
        w[p + "ffn_norm"] = need(hf + "post_attention_layernorm.weight")
    return w


def read_gguf(path: Path, config: ModelConfig) -> Weights:
    """A GGUF file's weights, dequantized to fp32 (the file's q and k rows back in the
    half-split rope layout where llama.cpp permuted them: its ``llama`` architecture)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from shared.model.gguf import reader

    started = time.monotonic()
    raw: dict[str, torch.Tensor] = {}
    for t in reader(path).tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        x = dequantize(t.data, GGMLQuantizationType(t.tensor_type)).astype(np.float32, copy=False)
        if config.arch in ("llama", "mistral") and name.endswith(
            ("q_proj.weight", "k_proj.weight")
        ):
            heads = config.n_heads if "q_proj" in name else config.n_kv_heads
            x = unpermute_rope(x, heads)
        if not x.flags.writeable:  # (an F32 tensor is a view of the file's map)
            x = x.copy()
        raw[name] = torch.from_numpy(np.ascontiguousarray(x))
    w = fused(config, raw.get)
    log.info("read %s in %.1f s", path.name, time.monotonic() - started)
    return w


def read_safetensors(files: list[Path], config: ModelConfig) -> Weights:
    """A Hugging Face checkpoint's weights (every shard), in fp32."""
    from safetensors import safe_open

    started = time.monotonic()
    raw: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                raw[name] = f.get_tensor(name).float()
    w = fused(config, raw.get)
    log.info("read %d safetensors files in %.1f s", len(files), time.monotonic() - started)
    return w


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
        if config.qkv_bias:
            w[p + "bqkv"] = rand(qkv_rows, scale=0.1)
        if config.qk_norm:
            w[p + "q_norm"], w[p + "k_norm"] = 1 + rand(hd, scale=0.1), 1 + rand(hd, scale=0.1)
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

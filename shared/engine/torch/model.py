"""The Llama-family decoder, computing over a paged KV cache.

Shapes: N tokens in a forward pass (all sequences' new tokens, concatenated), D model dim,
H query heads, G kv heads, E head dim, S cache slots (n_blocks × block_size). A token's KV lives
in one slot: slot = block_id × block_size + offset in block.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from shared.engine.torch.project import project
from shared.engine.torch.weights import Weights
from shared.model.config import ModelConfig

if TYPE_CHECKING:
    from shared.engine.torch.lora import LoraPass


@dataclass
class Segment:
    """One sequence's part of a forward pass: its ``q_len`` new tokens at rows
    [q_start, q_start + q_len) see the ``ctx_len`` tokens whose KV slots are ``slots``
    (the new tokens are the last ``q_len`` of them)."""

    q_start: int
    q_len: int
    slots: torch.Tensor  # [ctx_len] int64

    @property
    def ctx_len(self) -> int:
        return self.slots.numel()


class KVCache:
    """K and V for every layer and slot: [layers, S, G, E] each, zero-filled (never NaN), on
    the engine's device."""

    def __init__(
        self,
        config: ModelConfig,
        n_slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (config.n_layers, n_slots, config.n_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """RoPE's per-pair frequencies [E/2], scaled as the checkpoint says (``RopeScaling``:
    transformers' ``linear`` and ``llama3``, or the divisors a GGUF file carries)."""
    e = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, e, 2, dtype=torch.float64) / e))
    s = config.rope_scaling
    if s is None:
        return inv_freq
    if s.kind == "linear":
        return inv_freq / s.factor
    if s.kind == "factors":
        return inv_freq / torch.tensor(s.factors, dtype=torch.float64)
    assert s.kind == "llama3", s.kind
    # Wavelengths longer than the trained context's share are slowed by the factor, shorter
    # ones kept, and those between blended smoothly.
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_context / s.low_freq_factor
    high_wavelen = s.original_context / s.high_freq_factor
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_context / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_context, E], in the half-split layout (HF's rotate_half)."""
    inv_freq = inverse_frequencies(config)
    angles = torch.outer(torch.arange(config.max_context, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, E]; cos, sin: [N, 1, E]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Transformer:
    """Forward passes over the paged cache. Weights are plain tensors on one device (the
    model computes where its embedding lives); no autograd."""

    def __init__(self, config: ModelConfig, weights: Weights) -> None:
        self.config = config
        self.w = weights
        self.device = weights["tok_emb"].device
        # Tied embeddings: the output head is the embedding matrix itself, not a copy.
        self.lm_head = weights["tok_emb"] if config.tie_embeddings else weights["lm_head"]
        # (at the weights' dtype, as transformers applies them: a bf16 model rotates in bf16)
        dtype = weights["tok_emb"].dtype
        self.cos, self.sin = (t.to(self.device, dtype) for t in _rope_tables(config))
        n_moe = len(config.moe.layers) if config.moe else 0
        n_experts = config.moe.n_experts if config.moe else 0
        # Tokens routed to each expert in the last forward pass: [MoE layers, experts].
        self.expert_counts = torch.zeros(n_moe, n_experts, dtype=torch.int64, device=self.device)
        self._turn = 0  # which replica of an expert takes its first token, rotating per pass
        self.place(np.tile(np.arange(n_experts), (n_moe, 1)))

    def place(self, slot_expert: np.ndarray) -> None:
        """Follow a placement: ``slot_expert`` [MoE layers, slots] names each slot's expert
        (``shared/eplb/placement.py``); an expert's tokens are split evenly between its slots.
        ``slot_counts`` [MoE layers, slots] then says what each slot computed in the last pass.
        """
        layers, slots = slot_expert.shape
        n_experts = self.expert_counts.shape[1]
        replicas = [[np.flatnonzero(row == e) for e in range(n_experts)] for row in slot_expert]
        widest = max((len(r) for row in replicas for r in row), default=1)
        table = torch.zeros(layers, n_experts, widest, dtype=torch.int64)
        for layer, row in enumerate(replicas):
            for e, where in enumerate(row):
                assert len(where), f"expert {e} of MoE layer {layer} has no slot"
                table[layer, e, : len(where)] = torch.from_numpy(where)
        self._replica_slots = table.to(self.device)  # [layers, experts, widest]: their slots
        self._replicas = (
            torch.tensor([[len(r) for r in row] for row in replicas])
            .reshape(layers, n_experts)
            .to(self.device)
        )
        self.slot_counts = torch.zeros(layers, slots, dtype=torch.int64, device=self.device)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # (one fused kernel there, not five)
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.norm_eps)
            return weight * normed.to(x.dtype)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        return weight * x32.to(x.dtype)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token embeddings [N, D]."""
        return self.w["tok_emb"][tokens.to(self.device)]

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        segments: list[Segment],
        cache: KVCache,
        embeds: torch.Tensor | None = None,
        lora: LoraPass | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [N, D]. Writes the new tokens' KV to the cache.

        ``embeds`` ([N, D]) replaces the token embeddings where given (image placeholders);
        ``lora``: the rows' adapters (``shared/engine/torch/lora.py``), when any row has one.
        The inputs may be on the host: they are moved to the model's device once, here.
        """
        dev = self.device
        if dev.type != "cpu":
            tokens, positions = tokens.to(dev, non_blocking=True), positions.to(dev)
            segments = [Segment(s.q_start, s.q_len, s.slots.to(dev)) for s in segments]
            embeds = embeds.to(dev) if embeds is not None else None
        x = embeds if embeds is not None else self.w["tok_emb"][tokens]
        new_slots = torch.cat([s.slots[s.ctx_len - s.q_len :] for s in segments])
        if self.expert_counts.numel():
            self.expert_counts.zero_()
            self.slot_counts.zero_()
            self._turn += 1
        return self._layers(
            x,
            positions,
            new_slots,
            cache,
            lambda i, q: self._attention(i, q, segments, cache),
            lora,
        )

    @torch.inference_mode()
    def decode(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        new_slots: torch.Tensor,
        context: torch.Tensor,
        lens: torch.Tensor,
        cache: KVCache,
    ) -> torch.Tensor:
        """One new token for each of B sequences, every input on the model's device and of
        fixed shape (what a CUDA graph replays: no host sync, nothing sized by the values):
        ``tokens``, ``positions``, ``new_slots`` [B]; ``context`` [B, L] each sequence's
        slots, padded past ``lens`` [B] (the new token's included). Hidden states [B, D]."""
        assert not self.expert_counts.numel(), "a MoE pass is sized by its routing: forward()"
        x = self.w["tok_emb"][tokens]
        k_pos = torch.arange(context.shape[1], device=context.device).unsqueeze(0)
        valid = k_pos < lens.unsqueeze(1)  # [B, L]

        def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
            window = self.config.window(layer)
            mask = valid & (k_pos >= (lens - window).unsqueeze(1)) if window else valid
            return _padded(q, cache.k[layer][context], cache.v[layer][context], mask)

        return self._layers(x, positions, new_slots, cache, attend)

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        new_slots: torch.Tensor,
        cache: KVCache,
        attend: Callable[[int, torch.Tensor], torch.Tensor],
        lora: LoraPass | None = None,
    ) -> torch.Tensor:
        """The decoder's layers over ``x`` [N, D] at ``positions``, the new tokens' KV written
        to ``new_slots``; ``attend(layer, q)`` their attention ([N, H, E])."""
        c = self.config
        cos, sin = self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)
        q_dim, heads = c.n_heads * c.head_dim, c.n_heads + c.n_kv_heads
        for i in range(c.n_layers):
            p = f"layers.{i}."
            h = self._norm(x, self.w[p + "attn_norm"])
            qkv = self._linear(h, i, "wqkv", lora)
            if c.qkv_bias:
                qkv = qkv + self.w[p + "bqkv"]
            v = qkv[:, q_dim + c.kv_dim :].view(-1, c.n_kv_heads, c.head_dim)
            if c.qk_norm:  # each head's queries and keys normed (over E) before the rotation
                q = self._norm(qkv[:, :q_dim].view(-1, c.n_heads, c.head_dim), self.w[p + "q_norm"])
                k = qkv[:, q_dim : q_dim + c.kv_dim].view(-1, c.n_kv_heads, c.head_dim)
                q, k = _rotate(q, cos, sin), _rotate(self._norm(k, self.w[p + "k_norm"]), cos, sin)
            else:  # (queries and keys rotated in one pass: fewer kernels)
                qk = _rotate(qkv[:, : q_dim + c.kv_dim].view(-1, heads, c.head_dim), cos, sin)
                q, k = qk[:, : c.n_heads], qk[:, c.n_heads :]
            cache.k[i].index_copy_(0, new_slots, k.to(cache.k.dtype))
            cache.v[i].index_copy_(0, new_slots, v.to(cache.v.dtype))
            x = x + self._linear(attend(i, q).reshape(-1, q_dim), i, "wo", lora)
            h = self._norm(x, self.w[p + "ffn_norm"])
            x = x + (self._moe(i, h) if c.is_moe(i) else self._mlp(h, i, lora))
        return self._norm(x, self.w["norm"])

    def _linear(
        self, x: torch.Tensor, layer: int, name: str, lora: LoraPass | None
    ) -> torch.Tensor:
        """x times the layer's weight ``name`` transposed, plus what the rows' adapters add."""
        w = self.w[f"layers.{layer}.{name}"]
        return project(x, w) if lora is None else lora.project(layer, name, x, w)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return project(hidden, self.lm_head).float()

    def _mlp(self, h: torch.Tensor, layer: int, lora: LoraPass | None = None) -> torch.Tensor:
        gate, up = self._linear(h, layer, "w13", lora).chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, layer, "w2", lora)

    def _moe(self, layer: int, h: torch.Tensor) -> torch.Tensor:
        """Top-k routed experts (softmax gate, renormalized over the k) plus a shared expert.

        Each (token, choice) is dispatched to one slot holding its expert, an expert's tokens
        dealt round the expert's replicas in turn (so they split evenly). In one process the
        replicas of an expert share its weights, so its tokens are computed in one call, in
        token order, whatever the split: the numbers do not depend on the placement, only the
        slot counts (each card's work) do."""
        moe = self.config.moe
        assert moe is not None
        p = f"layers.{layer}."
        m = moe.layers.index(layer)
        probs = F.softmax(F.linear(h, self.w[p + "router"]).float(), dim=-1)
        weights, chosen = probs.topk(moe.top_k, dim=-1)  # [N, k]
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        flat = chosen.flatten()  # [N·k]: token t's j-th choice at t·k + j
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens in order
        counts = torch.bincount(flat, minlength=moe.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        grouped = flat[order]
        rank = (
            torch.arange(len(flat), device=h.device) - starts[grouped]
        )  # the i-th token of its expert
        replica = (rank + self._turn) % self._replicas[m, grouped]
        slot = self._replica_slots[m, grouped, replica]
        self.expert_counts[m] = counts
        self.slot_counts[m] = torch.bincount(slot, minlength=self.slot_counts.shape[1])
        w13, w2 = self.w[p + "experts_w13"], self.w[p + "experts_w2"]
        ys = torch.empty(len(flat), h.shape[-1], dtype=h.dtype, device=h.device)
        for e in counts.nonzero().flatten().tolist():
            where = order[starts[e] : starts[e] + counts[e]]  # flat positions, token order
            gate, up = F.linear(h[where // moe.top_k], w13[e]).chunk(2, dim=-1)
            ys[where] = F.linear(F.silu(gate) * up, w2[e])
        out = (ys.view(-1, moe.top_k, h.shape[-1]) * weights.unsqueeze(-1)).sum(1)
        if moe.shared_expert:
            out = out + self._mlp(h, layer)
        return out

    def _attention(
        self, layer: int, q: torch.Tensor, segments: list[Segment], cache: KVCache
    ) -> torch.Tensor:
        """Causal attention of each segment's new tokens over its context. Returns [N, H, E]."""
        window = self.config.window(layer)
        singles = [s for s in segments if s.q_len == 1]
        if len(singles) > 1 and len(singles) == len(segments):
            return self._decode_attention(layer, q, segments, cache, window)
        out = torch.empty_like(q)
        if len(singles) > 1:  # decoding sequences beside verifying ones: those in one call
            rows = torch.tensor([s.q_start for s in singles], device=q.device)
            out[rows] = self._decode_attention(layer, q[rows], singles, cache, window)
            segments = [s for s in segments if s.q_len > 1]
        for s in segments:
            first_q = s.ctx_len - s.q_len  # absolute position of the first new token
            # A windowed layer never looks further back than the window: those keys are not
            # even gathered (and need not exist, so an imported prefix can skip them).
            k_start = max(0, first_q - window + 1) if window else 0
            slots = s.slots[k_start:]
            k = cache.k[layer][slots].to(q.dtype).transpose(0, 1)  # [G, keys, E]
            v = cache.v[layer][slots].to(q.dtype).transpose(0, 1)
            qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [H, q_len, E]
            if q.is_cuda and not window:
                o = _causal(qs, k, v)
            else:
                dev = q.device
                q_pos = torch.arange(first_q, s.ctx_len, device=dev).unsqueeze(1)
                k_pos = torch.arange(k_start, s.ctx_len, device=dev).unsqueeze(0)
                mask = k_pos <= q_pos
                if window:
                    mask &= k_pos > q_pos - window
                o = F.scaled_dot_product_attention(
                    qs.unsqueeze(0),
                    k.unsqueeze(0),
                    v.unsqueeze(0),
                    attn_mask=mask,
                    enable_gqa=True,
                )[0]
            out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
        return out

    def _decode_attention(
        self, layer: int, q: torch.Tensor, segments: list[Segment], cache: KVCache, window: int
    ) -> torch.Tensor:
        """One new token per sequence: gather every context padded to the longest, one call."""
        lens = torch.tensor([s.ctx_len for s in segments], device=q.device)
        slots = torch.nn.utils.rnn.pad_sequence([s.slots for s in segments], batch_first=True)
        k_pos = torch.arange(slots.shape[1], device=q.device).unsqueeze(0)
        mask = k_pos < lens.unsqueeze(1)  # [B, L]; the new token is the last of each context
        if window:
            mask &= k_pos >= (lens - window).unsqueeze(1)
        return _padded(q, cache.k[layer][slots], cache.v[layer][slots], mask)


def _padded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query per sequence over its padded context: q [B, H, E], k and v [B, L, G, E] (as
    gathered from the cache), mask [B, L] → [B, H, E]."""
    k, v = k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2)  # [B, G, L, E]
    if q.is_cuda:  # a group's query heads as its queries: one fused kernel, nothing repeated
        b, h, e = q.shape
        o = F.scaled_dot_product_attention(
            q.view(b, k.shape[1], h // k.shape[1], e), k, v, attn_mask=mask[:, None, None, :]
        )  # [B, G, H/G, E]
        return o.reshape(b, h, e)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], enable_gqa=True
    )  # [B, H, 1, E]
    return o.squeeze(2)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions of a context over all of it, on a GPU:
    q [H, q_len, E], k and v [G, keys, E] → [H, q_len, E]. The mask is never built: a whole
    prompt is the fused kernels' own causal case (flash attention, grouped heads as they
    are), and new tokens after a cached prefix are the bottom-right-aligned causal case
    (``causal_lower_right``: the memory-efficient kernel, its heads repeated to the queries')."""
    from torch.nn.attention.bias import causal_lower_right

    q_len, keys = q.shape[1], k.shape[1]
    if q_len == keys:
        return F.scaled_dot_product_attention(
            q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=True
        )[0]
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)
    return F.scaled_dot_product_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=causal_lower_right(q_len, keys)
    )[0]

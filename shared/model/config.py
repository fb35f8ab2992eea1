"""Model configurations: a Llama-family decoder as a checkpoint describes it (a GGUF file's
metadata, a Hugging Face ``config.json``), and seeded tiny ones for tests.

The family's members differ in a few switches, all here: biases on the query, key and value
projections (Qwen2), RMSNorm of each head's queries and keys (Qwen3), sliding-window attention
(Mistral), the rope frequencies scaled for long contexts (Llama 3.1's rope_type "llama3", or
linear), an explicit head dimension, tied or separate output embeddings.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts with top-k gating on ``layers``; an optional always-on shared expert."""

    n_experts: int
    top_k: int
    expert_ffn_dim: int
    layers: tuple[int, ...]
    shared_expert: bool = True


ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # what the torch engine computes


@dataclass(frozen=True)
class RopeScaling:
    """How rope frequencies are scaled for contexts past the trained one: ``linear`` (every
    position divided by ``factor``), ``llama3`` (Llama 3.1: low frequencies divided by
    ``factor``, high ones kept, a smooth blend between, by wavelength against
    ``original_context``), or ``factors`` (one divisor per frequency, as Llama 3.1's GGUF
    files carry them)."""

    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192
    factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder: RMSNorm, RoPE, grouped-query attention, SwiGLU (or MoE)."""

    name: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_context: int = 8192
    tie_embeddings: bool = True
    # Sliding-window attention: these layers see only the last `sliding_window` tokens.
    sliding_window: int = 0
    swa_layers: tuple[int, ...] = ()
    moe: MoEConfig | None = None
    bos_id: int = 1
    eos_ids: tuple[int, ...] = (2,)
    arch: str = "llama"  # one of ARCHITECTURES (the checkpoint's family)
    qkv_bias: bool = False  # the q, k and v projections have biases (Qwen2)
    qk_norm: bool = False  # each head's queries and keys are RMS-normed (Qwen3)
    rope_scaling: RopeScaling | None = None
    # Where the weights come from (a GGUF file's digest, or "seed:N"): part of the fingerprint.
    weights_id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        assert self.arch in ARCHITECTURES, self.arch
        assert self.n_heads % self.n_kv_heads == 0, "query heads must group over kv heads"
        assert all(0 <= i < self.n_layers for i in self.swa_layers)
        assert not self.swa_layers or self.sliding_window > 0

    @cached_property  # (read for every block hashed)
    def fingerprint(self) -> str:
        """Identifies the model's KV: same fingerprint, interchangeable KV blocks."""
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        d = json.loads(text)
        moe, scaling = d.pop("moe"), d.pop("rope_scaling", None)
        for key in ("swa_layers", "eos_ids"):
            d[key] = tuple(d[key])
        if moe:
            moe = MoEConfig(**{**moe, "layers": tuple(moe["layers"])})
        if scaling:
            scaling = RopeScaling(**{**scaling, "factors": tuple(scaling["factors"])})
        return cls(**d, moe=moe, rope_scaling=scaling)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def kv_bytes_per_token(self, itemsize: int = 4) -> int:
        """K and V of one token in every layer, at ``itemsize`` bytes a value."""
        return 2 * self.n_layers * self.kv_dim * itemsize

    def window(self, layer: int) -> int:
        """The layer's attention window in tokens; 0 means the whole context."""
        return self.sliding_window if layer in self.swa_layers else 0

    def is_moe(self, layer: int) -> bool:
        return self.moe is not None and layer in self.moe.layers


# Tiny configs share the real tokenizer's vocabulary, so text goes in and out as for the real
# model; their weights are random (seeded), so what they say is noise but deterministic.
_TINY = dict(
    vocab_size=49152,
    dim=64,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    rope_theta=10000.0,
    max_context=4096,
    bos_id=1,
    eos_ids=(2,),
    tie_embeddings=False,
)

TINY_CONFIGS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(name="tiny", **_TINY),
    "tiny-swa": ModelConfig(name="tiny-swa", sliding_window=24, swa_layers=(0, 2), **_TINY),
    "tiny-moe": ModelConfig(
        name="tiny-moe",
        moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=64, layers=(1, 3)),
        **_TINY,
    ),
}

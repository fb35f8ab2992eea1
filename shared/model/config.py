"""Model configurations: the real SmolLM2 (read from its GGUF) and seeded tiny ones for tests."""

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
    # Where the weights come from (a GGUF file's digest, or "seed:N"): part of the fingerprint.
    weights_id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
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
        moe = d.pop("moe")
        for key in ("swa_layers", "eos_ids"):
            d[key] = tuple(d[key])
        if moe:
            moe = MoEConfig(**{**moe, "layers": tuple(moe["layers"])})
        return cls(**d, moe=moe)

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

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

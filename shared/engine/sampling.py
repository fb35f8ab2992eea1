"""Per-request sampling: greedy, temperature, top-k, top-p, seed, stop tokens and strings."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 (no limit) or more"),
            ("stop", len(self.stop) <= 4 and all(self.stop), "at most 4 non-empty strings"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule} (got {getattr(self, name)!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """One token id from fp32 logits [V]."""
    if params.greedy:
        return int(logits.argmax())
    logits = logits / params.temperature
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))

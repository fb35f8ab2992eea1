"""A sequence's state in the engine: its tokens, its blocks, and why it finished."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shared.engine.interface import FinishReason
from shared.engine.torch.speculate import Acceptance, NgramIndex
from shared.messages.sampling import SamplingParams, TokenLogprobs
from shared.model.grammar import Matcher


@dataclass
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    block_table: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    n_cached: int = 0  # leading tokens whose KV is in the cache
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    last_logits: torch.Tensor | None = None  # of the prompt's last token, [V] fp32
    matcher: Matcher | None = None  # where the answer is in its grammar, when it has one
    ngrams: NgramIndex | None = None  # its tokens' n-grams, for drafts (speculation on)
    acceptance: Acceptance = field(default_factory=Acceptance)
    drafted: int = 0  # drafted tokens verified, and accepted, over its answer
    accepted: int = 0
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # (when asked for)
    adapter_slot: int = -1  # the slot of the LoRA adapter computing it (-1: none)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def slots(self, block_size: int, n: int) -> torch.Tensor:
        """Cache slots of the first n tokens, [n] int64."""
        table = torch.tensor(self.block_table, dtype=torch.int64)
        pos = torch.arange(n)
        return table[pos // block_size] * block_size + pos % block_size

"""Sampling a token from logits, with a sequence's parameters; its log-probabilities.

Logit bias and presence/frequency penalties (OpenAI's definitions) and the repetition penalty
(vLLM's and Hugging Face's) change the logits first; temperature, min-p, top-k and top-p then
shape the distribution drawn from (``distribution``). Log-probabilities are
the model's own (log-softmax of the unchanged logits), as vLLM reports them by default.

A seeded answer's randomness is a function of (seed, position in the answer) alone: each
token draws from a generator seeded with both, so an answer continued elsewhere (handed off
after prefill, or resumed on another worker after a failure) gives the same tokens with no
sampler state carried over.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.messages.sampling import SamplingParams, TokenLogprobs

_MASK = (1 << 64) - 1
FLOAT32_MAX = torch.finfo(torch.float32).max


def position_seed(seed: int, position: int) -> int:
    """A 63-bit seed for one position of a seeded answer (SplitMix64 of both)."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def adjusted(
    logits: torch.Tensor, params: SamplingParams, answer: list[int], seen: Sequence[int] = ()
) -> torch.Tensor:
    """The logits with the request's bias, then its penalties (vLLM's order); ``answer``: its
    tokens so far; ``seen``: the prompt's and the answer's (for the repetition penalty)."""
    if params.logit_bias:
        logits = logits.clone()
        ids, bias = zip(*params.logit_bias, strict=True)
        logits[torch.tensor(ids)] += torch.tensor(bias, dtype=logits.dtype)
    if params.repetition_penalty != 1.0 and seen:
        ids = torch.tensor(sorted(set(seen)), dtype=torch.long)
        ids = ids[ids < logits.numel()]
        picked = logits[ids]
        penalty = params.repetition_penalty
        logits = logits.clone()
        logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    if params.penalized and answer:
        counts = torch.bincount(torch.tensor(answer), minlength=logits.numel())[: logits.numel()]
        counts = counts.to(logits.dtype)
        logits = (
            logits
            - counts * params.frequency_penalty
            - (counts > 0).to(logits.dtype) * params.presence_penalty
        )
    return logits


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """The model's log-probability of ``token`` and of its ``top`` most likely tokens."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = logp.topk(top)
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(float(logp[token]), best)


def held_back(logits: torch.Tensor, ids: Sequence[int]) -> torch.Tensor:
    """The logits with tokens ``ids`` never drawn (an answer's stop tokens before its least
    length)."""
    ids = [t for t in ids if 0 <= t < logits.numel()]
    return logits.index_fill(0, torch.tensor(ids, dtype=torch.long), float("-inf"))


def sample(
    logits: torch.Tensor,
    params: SamplingParams,
    position: int,
    answer: Sequence[int] = (),
    seen: Sequence[int] = (),
) -> int:
    """One token id from fp32 logits [V], as answer token ``position`` (0: the first);
    ``answer``: the tokens before it (for the penalties), ``seen``: the prompt's and the
    answer's (for the repetition penalty)."""
    if params.reshaped:
        logits = adjusted(logits, params, list(answer), seen)
    if params.greedy:
        return int(logits.argmax())
    probs = distribution(logits, params)
    generator = None
    if params.seed is not None:
        generator = torch.Generator().manual_seed(position_seed(params.seed, position))
    return int(torch.multinomial(probs, 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The probabilities a token is drawn with, from the (adjusted) logits: scaled by the
    temperature; then no token less likely than ``min_p`` × the likeliest's probability, none
    outside the ``top_k`` likeliest, none outside the smallest set whose mass reaches
    ``top_p`` (renormalized: vLLM's order)."""
    # (A temperature or a repetition penalty near 0 can scale logits past float32's range:
    # the likeliest stay the likeliest, none becomes NaN.)
    logits = torch.nan_to_num(logits / params.temperature, nan=-torch.inf, posinf=FLOAT32_MAX)
    if params.min_p:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_k:
        kth = logits.topk(min(params.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        outside[0] = False  # (a top_p too small for fp32 compares as 0: the best stays)
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs /= probs.sum()
    return probs

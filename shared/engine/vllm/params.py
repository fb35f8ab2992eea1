"""kvmesh's sampling parameters as vLLM's ``SamplingParams`` fields, as plain values: what an
engine in this process builds vLLM's object from (``engine.vllm_params``) and what a router
sends a vLLM server over HTTP (``services/router/upstream/protocols.py``). Only fields away from
vLLM's defaults are named; vLLM's own package is not needed to make them."""

from __future__ import annotations

from shared.messages.sampling import SamplingParams
from shared.model.grammar import lark_of


def sampling_fields(p: SamplingParams) -> dict:
    """The fields (``logit_bias`` keyed by token id as text, as JSON carries it; a grammar as
    ``structured_outputs: {"grammar": Lark}``, which vLLM's guidance backend reads)."""
    out: dict = {"max_tokens": p.max_tokens, "temperature": p.temperature, "top_p": p.top_p}
    optional = {
        "top_k": p.top_k or None,
        "seed": p.seed,
        "stop_token_ids": list(p.stop_token_ids) or None,
        "stop": list(p.stop) or None,
        "ignore_eos": p.ignore_eos or None,
        "min_tokens": p.min_tokens or None,
        "min_p": p.min_p or None,
        "repetition_penalty": p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        "logit_bias": {str(t): b for t, b in p.logit_bias} or None,
        "presence_penalty": p.presence_penalty or None,
        "frequency_penalty": p.frequency_penalty or None,
        "logprobs": p.logprobs,
        "prompt_logprobs": p.prompt_logprobs,
    }
    out.update({k: v for k, v in optional.items() if v is not None})
    if p.grammar is not None:
        out["structured_outputs"] = {"grammar": lark_of(p.grammar)}
    return out

"""kvmesh's sampling parameters as SGLang's, and SGLang's log-probabilities as kvmesh's: what an
engine in this process asks of SGLang (``engine.py``) and what a router sends an SGLang server's
``/generate`` over HTTP (``services/router/upstream/protocols.py``). Plain values; SGLang's own
package is not needed to make or read them."""

from __future__ import annotations

from typing import Any

from shared.messages.sampling import SamplingParams, TokenLogprobs
from shared.model.grammar import lark_of


def sglang_params(p: SamplingParams) -> dict:
    """kvmesh's sampling parameters as SGLang's (its ``SamplingParams`` fields)."""
    out: dict[str, Any] = {
        "max_new_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "ignore_eos": p.ignore_eos,
        "min_new_tokens": p.min_tokens,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "no_stop_trim": True,  # the router trims stop strings from the text it sends
    }
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    if p.logit_bias:
        out["logit_bias"] = {str(t): b for t, b in p.logit_bias}
    if p.grammar is not None:
        out["ebnf"] = lark_of(p.grammar)  # llguidance reads it as Lark
    return out


def logprobs_of(meta: dict, n: int, wanted: int | None) -> list[TokenLogprobs] | None:
    """The last ``n`` tokens' log-probabilities and ``wanted`` most likely (id, logprob), from
    SGLang's ``output_token_logprobs`` / ``output_top_logprobs`` ((logprob, id, text) each)."""
    if wanted is None or not n:
        return None
    chosen = (meta.get("output_token_logprobs") or [])[-n:]
    tops = (meta.get("output_top_logprobs") or [])[-n:]
    out = []
    for i, (logprob, _token, *_) in enumerate(chosen):
        ranked = tops[i] if i < len(tops) and tops[i] else []
        top = tuple((int(t), float(lp)) for lp, t, *_ in ranked[:wanted])
        out.append(TokenLogprobs(float(logprob), top))
    return out


def logprob_fields(p: SamplingParams) -> dict:
    """A request's log-probability fields in SGLang's request (not its sampling parameters):
    the answer's, and from the prompt's first token on when the prompt's are asked for too
    (SGLang then computes the prompt past its cached prefix)."""
    scored = p.prompt_logprobs is not None
    return {
        "return_logprob": p.logprobs is not None or scored,
        "top_logprobs_num": max(p.logprobs or 0, p.prompt_logprobs or 0),
        **({"logprob_start_len": 0} if scored else {}),
    }


def prompt_logprobs_of(meta: dict, wanted: int | None) -> list[TokenLogprobs] | None:
    """The prompt's tokens' scores (each but the first) and ``wanted`` most likely, from
    SGLang's ``input_token_logprobs`` / ``input_top_logprobs`` ((logprob, id, text) each; the
    first token's logprob is None)."""
    if wanted is None or "input_token_logprobs" not in meta:
        return None
    chosen = meta.get("input_token_logprobs") or []
    tops = meta.get("input_top_logprobs") or []
    out = []
    for i, (logprob, _token, *_) in enumerate(chosen[1:], 1):
        ranked = tops[i] if i < len(tops) and tops[i] else []
        top = tuple((int(t), float(lp)) for lp, t, *_ in ranked[:wanted])
        out.append(TokenLogprobs(float(logprob), top))
    return out

"""How a request is put to a server kvmesh did not start, and how its streamed answer reads: token
ids in (the router rendered and tokenized the prompt, so the blocks it hashes are the blocks the
server caches), token ids out.

- ``generate``: vLLM's token-in-token-out endpoint (``/inference/v1/generate``, a server
  started with ``--enable-scale-out``): vLLM's own sampling parameters, no text made on the
  server (it detokenizes only to find stop strings), the answer's tokens as ids.
- ``completions``: any vLLM server's ``/v1/completions`` with the prompt as token ids and
  ``return_token_ids`` (each chunk's new ids; the first also echoes the prompt's).
- ``sglang``: SGLang's native ``/generate`` with ``input_ids`` (its chunks carry the answer's
  ids so far, cumulative; ``meta_info`` says the cached prompt tokens and the finish).

Each reads the tenant's salt as the server's ``cache_salt`` (its prefix cache keeps tenants
apart, and its KV events carry the salt, so the blocks it reports are the router's hashes) and
the retention class as an extra argument kvmesh's storage connector reads where the server runs
it. Which one a server gets is found once, at its first read (``server.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol as Kind

from services.router.dispatch.job import Job
from shared.engine.sglang.params import logprob_fields, logprobs_of, sglang_params
from shared.engine.vllm.params import sampling_fields
from shared.kvstore.hashing import sglang_cache_salt
from shared.messages.generate import Logprobs

FINISHES = ("stop", "length", "abort")


@dataclass(frozen=True)
class Piece:
    """New tokens of the answer, as one chunk of the server's stream says them."""

    token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    finish: str | None = None  # kvmesh's: stop, length or abort
    stop: str | None = None  # the stop string that ended it


def finish_of(reason: object) -> str | None:
    if not reason:
        return None
    if isinstance(reason, dict):  # (SGLang's: {"type": "stop", "matched": ...})
        reason = reason.get("type")
    return reason if reason in FINISHES else "stop"


class Protocol(Kind):
    path: str

    def body(self, job: Job, served: str) -> dict:
        """The request's JSON body."""
        ...

    def pieces(self, chunk: dict, wanted: int | None) -> list[Piece]:
        """A streamed chunk's new tokens (``wanted``: the top log-probabilities asked for)."""
        ...

    def cached(self, chunk: dict) -> int | None:
        """The prompt tokens the server says it reused, on the chunk that says it."""
        ...

    def ends(self, chunk: dict) -> bool:
        """Whether the chunk is the answer's last word (its usage, after its finish)."""
        ...


def cached_of(chunk: dict) -> int | None:
    """The prompt tokens the server says it reused (OpenAI's usage; on the last chunk)."""
    usage = chunk.get("usage") or {}
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


def has_usage(chunk: dict) -> bool:
    return bool(chunk.get("usage"))


class Generate:
    """vLLM's ``/inference/v1/generate``."""

    path = "/inference/v1/generate"

    def body(self, job: Job, served: str) -> dict:
        sampling = sampling_fields(job.sampling)
        sampling["detokenize"] = bool(job.sampling.stop)  # (stop strings are found in text)
        sampling["extra_args"] = {"kvmesh_retention": job.retention}
        body = {
            "token_ids": list(job.prompt_ids),
            "model": served,
            "sampling_params": sampling,
            "stream": True,
            "stream_options": {"include_usage": True},
            "output_mode": "tokens",
        }
        if job.salt:
            body["cache_salt"] = job.salt
        return body

    def pieces(self, chunk: dict, wanted: int | None) -> list[Piece]:
        out = []
        for choice in chunk.get("choices") or ():
            logprobs = None
            content = (choice.get("logprobs") or {}).get("content")
            if wanted is not None and content:
                logprobs = [
                    Logprobs(
                        logprob=c["logprob"],
                        top_ids=[t["token_id"] for t in c.get("top_logprobs", [])[:wanted]],
                        top_logprobs=[t["logprob"] for t in c.get("top_logprobs", [])[:wanted]],
                    )
                    for c in content
                ]
            stop = choice.get("stop_reason")
            out.append(
                Piece(
                    choice.get("token_ids") or [],
                    logprobs,
                    finish_of(choice.get("finish_reason")),
                    stop if isinstance(stop, str) else None,
                )
            )
        return out

    cached = staticmethod(cached_of)
    ends = staticmethod(has_usage)


class Completions:
    """OpenAI's ``/v1/completions`` as vLLM serves it (``return_token_ids``)."""

    path = "/v1/completions"

    def body(self, job: Job, served: str) -> dict:
        sampling = sampling_fields(job.sampling)
        body = {
            **sampling,
            "model": served,
            "prompt": list(job.prompt_ids),
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "vllm_xargs": {"kvmesh_retention": job.retention},
        }
        if job.sampling.logprobs is not None:
            body.update(logprobs=max(1, job.sampling.logprobs), return_tokens_as_token_ids=True)
        if job.salt:
            body["cache_salt"] = job.salt
        return body

    def pieces(self, chunk: dict, wanted: int | None) -> list[Piece]:
        out = []
        for choice in chunk.get("choices") or ():
            stop = choice.get("stop_reason")
            out.append(
                Piece(
                    choice.get("token_ids") or [],
                    completion_logprobs(choice, wanted),
                    finish_of(choice.get("finish_reason")),
                    stop if isinstance(stop, str) else None,
                )
            )
        return out

    cached = staticmethod(cached_of)
    ends = staticmethod(has_usage)


def completion_logprobs(choice: dict, wanted: int | None) -> list[Logprobs] | None:
    """Each new token's log-probability and the ``wanted`` most likely, from OpenAI's
    completion log-probabilities (tokens named ``token_id:N``)."""
    lp = choice.get("logprobs")
    if wanted is None or not lp:
        return None
    out = []
    pairs = zip(lp.get("token_logprobs") or [], lp.get("top_logprobs") or [], strict=False)
    for chosen, top in pairs:
        ranked = sorted(((token_id(k), v) for k, v in (top or {}).items()), key=lambda x: -x[1])
        ranked = ranked[:wanted]
        out.append(
            Logprobs(
                logprob=chosen, top_ids=[t for t, _ in ranked], top_logprobs=[v for _, v in ranked]
            )
        )
    return out


def token_id(key: str) -> int:
    """A token as vLLM's log-probabilities name it with ``return_tokens_as_token_ids``."""
    return int(key.removeprefix("token_id:"))


class Sglang:
    """SGLang's native ``/generate`` (``input_ids`` in; each chunk's ``output_ids`` the new
    tokens, ``meta_info`` the finish and, with it, the cached prompt tokens). Its cache salt is
    the seed of SGLang's page hash chain as kvmesh makes it (``hashing.sglang_cache_salt``), so
    the pages it reports are the router's hashes of the prompt."""

    path = "/generate"

    def body(self, job: Job, served: str) -> dict:
        p = job.sampling
        sampling = sglang_params(p)
        if p.stop:  # (the server has its tokenizer: it finds stop strings itself)
            sampling["stop"] = list(p.stop)
        return {
            "input_ids": list(job.prompt_ids),
            "sampling_params": sampling,
            "stream": True,
            **logprob_fields(p),
            "cache_salt": sglang_cache_salt(job.fingerprint, job.block_size, job.salt),
        }

    def pieces(self, chunk: dict, wanted: int | None) -> list[Piece]:
        meta = chunk.get("meta_info") or {}
        new = list(chunk.get("output_ids") or ())
        reason = meta.get("finish_reason")
        finish = finish_of(reason)
        if not new and finish is None:
            return []
        matched = reason.get("matched") if isinstance(reason, dict) else None
        logprobs = logprobs_of(meta, len(new), wanted)
        return [
            Piece(
                new,
                [Logprobs.of(lp) for lp in logprobs] if logprobs is not None else None,
                finish,
                matched if isinstance(matched, str) else None,
            )
        ]

    def cached(self, chunk: dict) -> int | None:
        meta = chunk.get("meta_info") or {}
        return int(meta["cached_tokens"]) if "cached_tokens" in meta else None

    def ends(self, chunk: dict) -> bool:
        return bool((chunk.get("meta_info") or {}).get("finish_reason"))


PROTOCOLS: dict[str, Protocol] = {
    "generate": Generate(),
    "completions": Completions(),
    "sglang": Sglang(),
}

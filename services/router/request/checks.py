"""A conversation checked against what will answer it, before anything is sent: its model
(404 for one this mesh does not know), its tools, its answer's length within the model's
context, its sampling against the model's vocabulary, the grammar its answer must match (a
tool's schema, or a JSON answer's: a 400 names the field whose schema the grammar library
cannot use), the answers and prompts it asks for within the caller's limits, and the class it
asks for within its key's ceiling. Each a 400 (or 404) naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping

from services.router.errors import ApiError
from services.router.request.conversation import Conversation, ToolError
from services.router.tenancy.admission import PRIORITY_HEADER, KvOptions
from shared.bus import Bus
from shared.bus.adapters import Adapters
from shared.messages.generate import RANKS, Priority
from shared.model.grammar import (
    ANY_OBJECT,
    GrammarError,
    check,
    json_grammar,
    tool_call_grammar,
    vocabulary,
)
from shared.model.lora import kv_fingerprint
from shared.model.text import TextModel

_CHECKED_SCHEMAS: set[str] = set()  # tool schemas the library compiled (agents resend them)


class ServedModels:
    """The models a request may name: the mesh's base models (``known``) and the LoRA
    adapters of them (``adapters``: the settings' and those loaded at run time)."""

    def __init__(self, known: Collection[str], adapters: Adapters) -> None:
        self.known = frozenset(known)
        self.adapters = adapters

    @classmethod
    def of(cls, bus: Bus, known: Collection[str], loras: Mapping[str, str]) -> ServedModels:
        """``loras``: the settings' adapters; a router writes the adapters stream (it is
        followed once ``adapters.start`` is awaited)."""
        return cls(known, Adapters(bus, loras, owner=True))

    @property
    def names(self) -> frozenset[str]:
        return self.known | self.adapters.specs.keys()

    def base(self, name: str) -> str:
        """The model whose tokenizer, template and weights ``name`` uses (an adapter's base)."""
        return self.adapters.base_of(name) or name

    def identity(self, name: str, fingerprint: str) -> tuple[str, str]:
        """The adapter a request of ``name`` computes with ("": none) and the fingerprint of
        its KV (its base's ``fingerprint``, with the adapter's own identity: an adapter's KV
        is never its base's or another adapter's)."""
        spec = self.adapters.specs.get(name)
        if spec is None:
            return "", fingerprint
        return spec.name, kv_fingerprint(fingerprint, spec.digest)


def check_model(conv: Conversation, models: Collection[str], served: Collection[str]) -> None:
    """404 for a model this mesh does not know (not in ``models``) or does not serve (no
    worker has said it serves it: ``served``); 400 for tools that do not fit together."""
    if conv.model not in models or conv.model not in served:
        these = ", ".join(repr(m) for m in sorted(served)) or "none yet"
        raise ApiError(
            404,
            f"model {conv.model!r} does not exist here (served: {these})",
            param="model",
            code="model_not_found",
        )
    try:
        conv.check_tools()
    except ToolError as err:
        raise ApiError(400, str(err), param=err.param) from None


def answer_length(conv: Conversation, n_prompt: int, context: int, default: int) -> int:
    """The answer's most tokens: what the request asked for, or ``default`` within the
    context; 400 when the prompt and the answer exceed the context."""
    room = context - n_prompt
    max_tokens = conv.max_tokens
    if max_tokens is None:
        max_tokens = min(default, room)
    if room < 1 or n_prompt + max_tokens > context:
        prompt_field, max_field = conv.prompt_field, conv.max_tokens_field
        raise ApiError(
            400,
            f"{prompt_field} ({n_prompt} tokens) plus {max_field} ({max_tokens}) exceeds "
            f"the model's context of {context} tokens",
            param=max_field if room >= 1 else prompt_field,
            code="context_length_exceeded",
        )
    return max_tokens


def checked(conv: Conversation, text: TextModel, max_tokens: int) -> str | None:
    """The conversation's sampling checked against the model and the answer's length (400
    for a token id outside its vocabulary, a least length past the most); the grammar its
    answer must match (``answer_grammar``)."""
    vocab_size, sampling = text.config.vocab_size, conv.sampling
    for name, ids in (
        ("logit_bias", [t for t, _ in sampling.logit_bias]),
        ("stop_token_ids", sampling.stop_token_ids),
    ):
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            why = f"{name}: token id {bad} is outside the vocabulary ({vocab_size})"
            raise ApiError(400, why, param=name)
    if sampling.min_tokens > max_tokens:
        why = f"min_tokens: at most {conv.max_tokens_field} ({max_tokens})"
        raise ApiError(400, why, param="min_tokens")
    return answer_grammar(conv, text)


def answer_grammar(conv: Conversation, text: TextModel) -> str | None:
    """The grammar the answer must match (a forced tool call, or JSON), checked against the
    model's vocabulary: a 400 naming the field whose schema the library cannot use. None for
    a free answer."""
    vocab = vocabulary(text.tokenizer, tuple(text.config.eos_ids))
    for tool in conv.tools:  # every tool's schema, forced or not: a bad one is the client's
        key = json.dumps(tool.parameters, sort_keys=True)
        if key not in _CHECKED_SCHEMAS:
            _checked(lambda t=tool: json_grammar(t.parameters), vocab, tool.param)
            if len(_CHECKED_SCHEMAS) >= 4096:
                _CHECKED_SCHEMAS.clear()
            _CHECKED_SCHEMAS.add(key)
    forced = conv.forced_tools
    if forced:
        syntax = text.chat_template.tool_syntax
        return tool_call_grammar([(t.name, t.parameters) for t in forced], syntax, text.tokenizer)
    wanted = conv.json
    if wanted is None:
        return None
    schema = wanted.schema if wanted.schema is not None else ANY_OBJECT
    return _checked(lambda: json_grammar(schema), vocab, wanted.param)


def _checked(make: Callable[[], str], vocab: object, param: str) -> str:
    try:
        grammar = make()
        check(grammar, vocab)
    except GrammarError as err:
        raise ApiError(400, f"{param}: this schema cannot be used: {err}", param=param) from None
    return grammar


def check_choices(conv: Conversation, kv: KvOptions, most: int, prompts: int) -> None:
    """400 naming the field when the request asks for more answers per prompt than the key
    (or, with none set there, the router: ``most``) allows, or more prompts than ``prompts``."""
    key = kv.caller.key
    if key is not None and key.choices:
        most = key.choices
    if conv.best_of > most:
        field = "best_of" if conv.best_of > conv.n else "n"
        raise ApiError(400, f"{field}: at most {most} answers per prompt", param=field)
    if len(conv.batch) > prompts:
        raise ApiError(400, f"prompt: at most {prompts} prompts in one request", param="prompt")


# A prompt token's scores on the wire, at most: the field names and the chosen token's
# log-probability, then each likeliest token's id and log-probability (JSON, full floats).
SCORE_BYTES, SCORE_TOP_BYTES = 64, 32


def check_prompt_scores(conv: Conversation, n_prompt: int, max_payload: int) -> None:
    """400 naming prompt_logprobs when the prompt's scores would not fit the one message
    that carries them from the worker (the bus's largest)."""
    top = conv.sampling.prompt_logprobs
    if top is None:
        return
    size = n_prompt * (SCORE_BYTES + SCORE_TOP_BYTES * top)
    if size > max_payload:
        field = "prompt_logprobs" if conv.prompt_scores else "logprobs"
        most = max_payload // (SCORE_BYTES + SCORE_TOP_BYTES * top)
        raise ApiError(
            400,
            f"{field}: the scores of {n_prompt} prompt tokens with {top} likeliest each do not "
            f"fit one message; at most {most} prompt tokens with {top}",
            param=field,
        )


def service_class(conv: Conversation, kv: KvOptions) -> Priority:
    """The class a request runs at: what it asked for (its API's ``service_tier``, else the
    x-kvmesh-priority header), or its key's default; a 400 naming the field when it asks above
    its key's ceiling."""
    asked, field = conv.service_tier, "service_tier"
    if not asked:
        asked, field = kv.tier, PRIORITY_HEADER
    key = kv.caller.key
    if not asked:
        return key.default_tier if key is not None else "default"  # type: ignore[return-value]
    ceiling = key.ceiling if key is not None else "priority"
    if RANKS[asked] < RANKS[ceiling]:
        raise ApiError(
            400,
            f"{field}: {asked!r} is above what this key may ask for ({ceiling!r} at most)",
            param=field,
        )
    return asked  # type: ignore[return-value]

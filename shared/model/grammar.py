"""Constrained decoding's grammars, with llguidance: what an answer must match.

The router builds a request's grammar (a JSON schema for ``response_format``, the tool-call
form for a forced tool choice), checks it against the model's vocabulary (a schema the library
cannot compile is a 400 naming the field) and sends it to the workers as text in the request's
sampling parameters. Each worker's engine keeps a ``Matcher`` per constrained sequence: before
each token it says which tokens may come next, after it takes the token sampled. A sequence
handed from prefill to decode, or resumed on another worker, has its matcher rebuilt there
from the grammar and the answer's tokens so far: the state is a function of those two.

Why llguidance: it has no dependencies (xgrammar pulls transformers and triton), takes whole
JSON schemas with numeric bounds, nesting and recursion (outlines-core's regexes drop bounds
and cannot recurse) and Lark grammars around them (the ``<tool_call>`` tags), and compiles
lazily: a schema is ready in under a millisecond, a token mask over SmolLM2's 49,152 tokens
takes about 20 µs on this CPU.
"""

from __future__ import annotations

import json
import threading

import llguidance
import numpy as np
from tokenizers import Tokenizer

from shared.model.tokenizer import token_bytes
from shared.model.tools import FALLBACK, LLAMA3, MISTRAL, MISTRAL_MARK, ToolSyntax

TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
ANY_OBJECT: dict = {"type": "object"}
# JSON as Python's json.dumps writes it (", " and ": ", no other whitespace): the form the
# renderer writes tool calls back into the prompt, so an answer's blocks are the next turn's.
JSON_FORM = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar (a schema) the library refuses; the message says why."""


class _Vocabulary:
    """What llguidance reads of a tokenizer: each token's bytes, the special tokens, and a
    way to tokenize text."""

    def __init__(self, tokenizer: Tokenizer, eos_ids: tuple[int, ...]) -> None:
        self._tokenizer = tokenizer
        self.tokens = [token_bytes(tokenizer, i) for i in range(tokenizer.get_vocab_size())]
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        self.special_token_ids = [
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        ]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False).ids


# id(tokenizer) → (the tokenizer, kept alive so its id is not reused; its vocabulary)
_vocabularies: dict[int, tuple[Tokenizer, llguidance.LLTokenizer]] = {}
_lock = threading.Lock()


def vocabulary(tokenizer: Tokenizer, eos_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance reads it (built once per tokenizer: about 0.2 s)."""
    with _lock:
        if id(tokenizer) not in _vocabularies:
            wrapped = llguidance.TokenizerWrapper(_Vocabulary(tokenizer, eos_ids))
            vocab = llguidance.LLTokenizer(wrapped, eos_token=list(eos_ids))
            _vocabularies[id(tokenizer)] = (tokenizer, vocab)
        return _vocabularies[id(tokenizer)][1]


def json_grammar(schema: dict) -> str:
    """An answer that is one JSON value matching ``schema``."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_FORM)
    except ValueError as err:
        raise GrammarError(str(err)) from None


def tool_call_grammar(
    tools: list[tuple[str, dict]], syntax: ToolSyntax = FALLBACK, tokenizer: Tokenizer | None = None
) -> str:
    """An answer that is one tool call of one of ``tools`` ((name, its parameters' schema)),
    its arguments matching that tool's schema, in ``syntax`` (shared/model/tools.py): Hermes'
    ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``, Llama 3's
    ``{"name": ..., "parameters": ...}``, Mistral's ``[TOOL_CALLS][{...}]`` (its marker as the
    special token, when ``tokenizer`` has one)."""
    key = syntax.arguments_key
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, key: params or ANY_OBJECT},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for name, params in tools
    ]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_FORM}
    if syntax.kind == MISTRAL:
        mark = tokenizer.token_to_id(MISTRAL_MARK) if tokenizer is not None else None
        start = f"<[{mark}]>" if mark is not None else json.dumps(MISTRAL_MARK)
        rule = f'start: {start} "[" call "]"'
    elif syntax.kind == LLAMA3:
        rule = "start: call"
    else:
        rule = f"start: {json.dumps(TOOL_CALL_OPEN)} call {json.dumps(TOOL_CALL_CLOSE)}"
    return llguidance.LLMatcher.grammar_from_lark(f"{rule}\ncall: %json {json.dumps(schema)}\n")


def check(grammar: str, vocab: llguidance.LLTokenizer) -> None:
    """GrammarError with the library's reason when it cannot compile ``grammar``."""
    why = llguidance.LLMatcher.validate_grammar(grammar, vocab)
    if why:
        raise GrammarError(why)


class Matcher:
    """One sequence's place in its grammar: which tokens may come next."""

    def __init__(self, grammar: str, vocab: llguidance.LLTokenizer, answer: list[int]) -> None:
        """``answer``: the tokens the sequence's answer already has (a handed-off or resumed
        sequence), taken in order."""
        self._m = llguidance.LLMatcher(vocab, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(self._m.get_error())
        self._mask = np.zeros((1, (vocab.vocab_size + 31) // 32), dtype=np.int32)
        self.vocab_size = vocab.vocab_size
        if answer:
            self.take(answer)

    def allowed(self) -> np.ndarray:
        """A bool per token of the vocabulary: may it come next."""
        self._m.unsafe_compute_mask_ptr(self._mask.ctypes.data, self._mask.nbytes)
        bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
        return bits[: self.vocab_size].astype(bool)

    def take(self, tokens: list[int]) -> None:
        if not self._m.consume_tokens(tokens):
            raise GrammarError(f"the answer left its grammar: {self._m.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete: only an end-of-answer token may follow."""
        return self._m.is_stopped()


def lark_of(grammar: str) -> str:
    """The router's grammar (llguidance's serialized form: shared/model/grammar.py) as the
    Lark text an engine's llguidance backend takes (vLLM's, SGLang's): the same llguidance
    compiles it there, so the answer's constraint is the one the torch engine applies. (A
    Lark grammar is already that text: llguidance keeps it as given.)"""
    if not grammar.lstrip().startswith("{"):
        return grammar
    spec = json.loads(grammar)
    grammars = spec.get("grammars") or []
    if len(grammars) != 1:
        raise ValueError(f"a grammar of {len(grammars)} parts cannot be passed to an engine")
    (one,) = grammars
    if one.get("lark_grammar"):
        return one["lark_grammar"]
    if one.get("json_schema") is not None:
        return f"start: %json {json.dumps(one['json_schema'])}\n"
    raise ValueError("a grammar neither Lark nor a JSON schema cannot be passed to an engine")

"""Constrained decoding in the engine: an answer that must match a grammar does, in a batch
with unconstrained ones (which it leaves unchanged), across a prefill → decode handoff and
when resumed on another engine."""

from __future__ import annotations

import json

import jsonschema
import pytest

from services.router.request.toolcalls import call_parser, calls_of
from shared.messages.sampling import SamplingParams
from shared.model.grammar import json_grammar, tool_call_grammar
from shared.model.tools import ToolSyntax
from tests.engine.conftest import make_engine
from tests.engine.test_batching import run_alone, run_staggered
from tests.engine.test_handoff import hand_off
from tests.engine.test_prefix_reuse import prompt

SCHEMA = {
    "type": "object",
    "properties": {
        "berth": {"type": "integer", "minimum": 1, "maximum": 12},
        "ship": {"type": "string", "maxLength": 12},
        "tugs": {"type": "array", "items": {"enum": ["north", "south"]}, "maxItems": 2},
    },
    "required": ["berth", "ship", "tugs"],
    "additionalProperties": False,
}


def text(model, ids: list[int]) -> str:
    return model.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
def test_a_random_model_answers_in_the_schema(tiny_models, seed: int) -> None:
    model = tiny_models["tiny"]  # random weights: left alone it writes nothing like JSON
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=seed, grammar=json_grammar(SCHEMA))
    out = run_alone(model, prompt(20, seed=seed), params)
    assert out[-1] in model.config.eos_ids  # the grammar completed, then the answer ended
    jsonschema.validate(json.loads(text(model, out)), SCHEMA)


def test_a_forced_tool_call_names_a_tool_and_its_arguments_match(tiny_models) -> None:
    model = tiny_models["tiny"]
    tools = [
        (
            "get_tide",
            {
                "type": "object",
                "properties": {"port": {"type": "string", "maxLength": 20}},
                "required": ["port"],
            },
        ),
        ("book_berth", SCHEMA),
    ]
    params = SamplingParams(
        max_tokens=120, temperature=1.0, seed=9, grammar=tool_call_grammar(tools)
    )
    out = text(model, run_alone(model, prompt(20), params))
    assert out.startswith("<tool_call>\n") and out.endswith("\n</tool_call>")
    call = json.loads(out.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    schema = dict(tools)[call["name"]]
    jsonschema.validate(call["arguments"], schema)


TIDE_SCHEMA = {
    "type": "object",
    "properties": {"port": {"type": "string", "maxLength": 20}},
    "required": ["port"],
    "additionalProperties": False,  # (else random weights may write keys until max_tokens)
}


@pytest.mark.parametrize("kind", ["hermes", "llama3", "mistral"])
def test_a_forced_call_is_written_in_the_syntax_and_parses_back(tiny_models, kind: str) -> None:
    model = tiny_models["tiny"]  # random weights: the grammar alone makes it a call
    syntax = ToolSyntax(kind, native=True)
    grammar = tool_call_grammar([("get_tide", TIDE_SCHEMA)], syntax)
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, grammar=grammar)
    out = model.tokenizer.decode(run_alone(model, prompt(20), params), skip_special_tokens=True)
    parser = call_parser(syntax, streamed=True)
    text, events = parser.feed(out)
    rest, more = parser.finish()
    (call,) = calls_of(events + more)
    assert call.name == "get_tide" and (text + rest).strip() == ""
    jsonschema.validate(json.loads(call.arguments), TIDE_SCHEMA)


def test_constrained_and_free_answers_share_a_batch(tiny_models) -> None:
    model = tiny_models["tiny"]
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    bound = SamplingParams(max_tokens=60, temperature=0, grammar=json_grammar(SCHEMA))
    prompts = [prompt(20, seed=1), prompt(25, seed=2), prompt(30, seed=3)]
    together = run_staggered(model, prompts, [free, bound, free])
    assert together[0] == run_alone(model, prompts[0], free)  # unchanged by its neighbour
    assert together[2] == run_alone(model, prompts[2], free)
    assert together[1] == run_alone(model, prompts[1], bound)
    jsonschema.validate(json.loads(text(model, together[1])), SCHEMA)


def test_the_grammar_state_follows_a_handoff_and_a_resume(tiny_models) -> None:
    model = tiny_models["tiny"]
    ids = prompt(45)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=4, grammar=json_grammar(SCHEMA))
    whole = run_alone(model, ids, params)
    assert hand_off(model, model, ids, params) == whole
    # Resumed after 7 answer tokens on a fresh engine: they end its prompt.
    resumed = SamplingParams(
        max_tokens=60 - 7, temperature=1.0, seed=4, grammar=params.grammar, answer_offset=7
    )
    engine = make_engine(model)
    out = [engine.prefill("r", ids + whole[:7], resumed).token_id]
    while engine.running:
        out += [o.token_id for o in engine.step()]
    assert whole[:7] + out == whole


def test_a_grammar_the_library_cannot_compile_is_refused_at_admission(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"])
    params = SamplingParams(max_tokens=4, grammar='{"grammars": [{"lark_grammar": "start: nope"}]}')
    with pytest.raises(ValueError, match="grammar"):
        engine.prefill("r", prompt(10), params)
    assert engine.pool.used_blocks == 0

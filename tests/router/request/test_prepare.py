"""A request's preparation, as functions: its model and tools checked, its answer's length
within the context, its sampling checked against the model (the grammar its answer must
match); and what a response says about where its time went and how it was routed."""

from __future__ import annotations

import json

import pytest

from services.router.errors import ApiError
from services.router.formats import openai
from services.router.request.checks import (
    answer_length,
    check_model,
    check_prompt_scores,
    checked,
)
from services.router.request.conversation import Conversation, Tool, ToolChoice
from services.router.request.prepare import EXPLAINED, Timing
from services.router.routing.route import Ranked
from shared.messages.sampling import SamplingParams
from shared.model.text import TextModel


def chat(**fields: object) -> Conversation:
    raw = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return openai.conversation(json.dumps(raw).encode(), chat=True)


def test_an_unknown_or_unserved_model_is_404_and_tools_that_do_not_fit_together_400() -> None:
    catalog, served = {"tiny", "tiny-swa"}, {"tiny"}
    for unknown in ("gpt-9", "tiny-swa"):  # not a model at all; a model no worker serves
        with pytest.raises(ApiError) as err:
            check_model(Conversation(unknown), catalog, served)
        assert (err.value.status, err.value.param, err.value.code) == (
            404,
            "model",
            "model_not_found",
        )
        assert err.value.message == f"model {unknown!r} does not exist here (served: 'tiny')"
    check_model(Conversation("tiny"), catalog, served)
    two = (Tool("a", "", {}, "tools[0]"), Tool("a", "", {}, "tools[1]"))
    with pytest.raises(ApiError) as err:
        check_model(Conversation("tiny", tools=two), catalog, served)
    assert err.value.status == 400 and err.value.param == "tools[0]"  # (a second one named so)
    with pytest.raises(ApiError) as err:
        check_model(Conversation("tiny", tool_choice=ToolChoice("required")), catalog, served)
    assert err.value.param == "tool_choice"


def test_the_answer_length_is_asked_or_the_default_within_the_context() -> None:
    assert answer_length(chat(), 100, 4096, 512) == 512
    assert answer_length(chat(), 4000, 4096, 512) == 96  # what room is left
    assert answer_length(chat(max_completion_tokens=7), 100, 4096, 512) == 7
    with pytest.raises(ApiError) as err:
        answer_length(chat(max_completion_tokens=100), 4000, 4096, 512)
    assert err.value.param == "max_completion_tokens" and "exceeds" in err.value.message
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(ApiError) as err:
        answer_length(chat(), 4096, 4096, 512)
    assert err.value.param == "messages"  # no room at all: the prompt is what is too long


def test_the_sampling_is_checked_against_the_model(real_text: TextModel) -> None:
    vocab = real_text.config.vocab_size
    assert checked(chat(logit_bias={"5": 1}), real_text, 16) is None  # a free answer: no grammar
    with pytest.raises(ApiError) as err:
        checked(chat(logit_bias={str(vocab): 1}), real_text, 16)
    assert err.value.param == "logit_bias" and str(vocab) in err.value.message
    grammar = checked(chat(response_format={"type": "json_object"}), real_text, 16)
    assert grammar and "object" in grammar.lower()
    tool = {"type": "function", "function": {"name": "berth", "parameters": {"type": "object"}}}
    forced = checked(chat(tools=[tool], tool_choice="required"), real_text, 16)
    assert forced and "berth" in forced
    with pytest.raises(ApiError) as err:
        checked(chat(stop_token_ids=[2, vocab + 3]), real_text, 16)
    assert err.value.param == "stop_token_ids" and str(vocab + 3) in err.value.message
    assert checked(chat(min_tokens=16), real_text, 16) is None
    with pytest.raises(ApiError) as err:
        checked(chat(min_tokens=17), real_text, 16)
    assert err.value.param == "min_tokens" and "16" in err.value.message


def test_a_schema_the_grammar_library_cannot_use_is_named(real_text: TextModel) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "b", "schema": bad}}
    with pytest.raises(ApiError) as err:
        checked(chat(response_format=fmt), real_text, 16)
    assert err.value.param == "response_format.json_schema.schema"
    assert "cannot be used" in err.value.message


def test_the_conversations_sampling_travels_to_the_job_as_it_is() -> None:
    conv = chat(temperature=0.2, seed=3, stop=["END"])
    assert conv.sampling == SamplingParams(temperature=0.2, seed=3, stop=("END",))
    extended = chat(
        min_p=0.05, repetition_penalty=1.2, ignore_eos=True, min_tokens=3, stop_token_ids=[7]
    )
    assert extended.sampling == SamplingParams(
        min_p=0.05, repetition_penalty=1.2, ignore_eos=True, min_tokens=3, stop_token_ids=(7,)
    )


def route(n: int) -> dict:
    ranked = [Ranked(f"p{i}", lambda i=i: {"cost_s": float(i)}) for i in range(n)]
    return {"policy": "ttft", "chosen": "p0", "candidates": ranked}


def test_a_response_lists_the_best_candidates_and_counts_the_rest() -> None:
    t = Timing(route=route(64))
    out = t.to_dict()["route"]
    assert [c["worker"] for c in out["candidates"]] == [f"p{i}" for i in range(EXPLAINED)]
    assert [c["cost_s"] for c in out["candidates"]] == [float(i) for i in range(EXPLAINED)]
    assert out["others"] == 64 - EXPLAINED and out["chosen"] == "p0"


def test_all_candidates_when_asked() -> None:
    out = Timing(route=route(64), explain_all=True).to_dict()["route"]
    assert len(out["candidates"]) == 64 and "others" not in out


def test_engine_time_is_prefill_plus_decode() -> None:
    t = Timing(prefill_ms=12.5, decode_ms=30.0)
    assert t.engine_ms == 42.5 and t.to_dict()["engine_ms"] == 42.5


def test_prompt_scores_that_would_not_fit_one_message_are_refused_by_name() -> None:
    """The worker sends a prompt's scores with its first token, in one message of the bus."""
    scored = openai.conversation(
        json.dumps({"model": "tiny", "prompt": "x", "prompt_logprobs": 20}).encode(), chat=False
    )
    check_prompt_scores(scored, 1000, 1 << 20)  # ~0.7 MB: fits
    with pytest.raises(ApiError) as err:
        check_prompt_scores(scored, 4000, 1 << 20)
    assert (
        err.value.param == "prompt_logprobs" and "at most 1489 prompt tokens" in err.value.message
    )
    echoed = openai.conversation(
        json.dumps({"model": "tiny", "prompt": "x", "echo": True, "logprobs": 5}).encode(),
        chat=False,
    )
    with pytest.raises(ApiError) as err:
        check_prompt_scores(echoed, 8000, 1 << 20)
    assert err.value.param == "logprobs"
    check_prompt_scores(openai.conversation(b'{"model": "tiny", "prompt": "x"}', False), 8000, 1)

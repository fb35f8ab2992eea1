"""A prepared request's answer as text deltas, over scripted token events (a stand-in for
dispatch: these tests are about the answer's text, not the workers): characters split across
events, stop strings across events (the rest of the answer cancelled), tool calls parsed out,
usage and timing filled in, aborts and deadlines, the hook at the last delta."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

import pytest

from services.router.dispatch.job import Job
from services.router.errors import ApiError
from services.router.formats import openai
from services.router.request.answer import Answers
from services.router.request.prepare import Prepared, Usage
from services.router.request.toolcalls import calls_of
from shared.messages.generate import TokenEvent
from shared.messages.sampling import SamplingParams
from shared.model.text import TextModel


class ScriptedDispatch:
    """Gives each job the events it was given; says whether the reader left early."""

    def __init__(self, events: list[TokenEvent]) -> None:
        self.events = events
        self.closed_early = False

    async def generate(self, job: Job, decision: dict) -> AsyncIterator[TokenEvent]:
        decision.update({"prefill": "on decode", "uncached_tokens": 5})
        done = False
        try:
            for event in self.events:
                yield event
            done = True
        finally:
            self.closed_early = not done


def events_of(ids: list[int], per: int, finish: str = "length") -> list[TokenEvent]:
    out = [
        TokenEvent(request_id="r", index=i, token_ids=ids[i : i + per], worker_id="d1")
        for i in range(0, len(ids), per)
    ]
    out[0] = out[0].model_copy(update={"cached_tokens": 64, "prefill_s": 0.02})
    out[-1] = out[-1].model_copy(update={"finish_reason": finish, "decode_s": 0.1})
    return out


def prepared(text: TextModel, raw: dict, deadline_s: float = 30.0) -> Prepared:
    conv = openai.conversation(json.dumps({"model": "tiny", **raw}).encode(), chat=True)
    sampling = SamplingParams(max_tokens=64, stop=conv.sampling.stop)
    job = Job("r", "tiny", [1] * 70, sampling, time.time() + deadline_s)
    return Prepared(job, conv, text, Usage(70))


HI = {"messages": [{"role": "user", "content": "hi"}]}


async def answer(answers: Answers, p: Prepared) -> list:
    return [d async for d in answers.deltas(p)]


async def test_characters_split_across_events_come_whole(real_text: TextModel) -> None:
    text = "Berth four — naïve 日本 🎉 done."
    ids = real_text.tokenizer.encode(text, add_special_tokens=False).ids
    p = prepared(real_text, HI)
    deltas = await answer(Answers(ScriptedDispatch(events_of(ids, 1))), p)  # type: ignore[arg-type]
    assert "".join(d.text for d in deltas) == text
    assert "\ufffd" not in "".join(d.text for d in deltas), "no half character is ever sent"
    assert deltas[-1].finish_reason == "length"
    assert (p.usage.completion_tokens, p.usage.cached_tokens) == (len(ids), 64)
    t = p.timing
    assert t.workers == ["d1"] and t.prefill_ms == pytest.approx(20) and t.decode_ms > 0
    assert t.first_token_at and t.last_token_at >= t.first_token_at
    assert t.route == {"prefill": "on decode", "uncached_tokens": 5}


async def test_a_stop_string_across_events_ends_the_answer_and_cancels_the_rest(
    real_text: TextModel,
) -> None:
    text = "Berth four is free. Berth five is not. END of the list and more text"
    ids = real_text.tokenizer.encode(text, add_special_tokens=False).ids
    p = prepared(real_text, {**HI, "stop": ["END"]})
    dispatch = ScriptedDispatch(events_of(ids, 2))
    deltas = await answer(Answers(dispatch), p)  # type: ignore[arg-type]
    assert "".join(d.text for d in deltas) == "Berth four is free. Berth five is not. "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_sequence == "END"
    assert dispatch.closed_early, "the rest of the answer is cancelled on its workers"


async def test_a_forced_tool_call_streams_as_call_events_not_text(real_text: TextModel) -> None:
    call = '<tool_call>\n{"name": "berth", "arguments": {"n": 4}}\n</tool_call>'
    ids = real_text.tokenizer.encode(call, add_special_tokens=False).ids
    tool = {"type": "function", "function": {"name": "berth"}}
    p = prepared(real_text, {**HI, "tools": [tool], "tool_choice": "required"})
    deltas = await answer(Answers(ScriptedDispatch(events_of(ids, 3, "stop"))), p)  # type: ignore[arg-type]
    assert "".join(d.text for d in deltas) == ""
    (made,) = calls_of([e for d in deltas for e in d.calls])
    assert made.name == "berth" and json.loads(made.arguments) == {"n": 4}


async def test_the_last_delta_calls_the_hook_once(real_text: TextModel) -> None:
    ids = real_text.tokenizer.encode("Berth four.", add_special_tokens=False).ids
    seen: list[Prepared] = []
    p = prepared(real_text, HI)
    await answer(Answers(ScriptedDispatch(events_of(ids, 2)), on_last=seen.append), p)  # type: ignore[arg-type]
    assert seen == [p]


@pytest.mark.parametrize(("deadline_s", "status"), [(30.0, 503), (-1.0, 504)])
async def test_a_stopped_answer_is_503_and_past_its_deadline_504(
    real_text: TextModel, deadline_s: float, status: int
) -> None:
    abort = TokenEvent(request_id="r", index=0, finish_reason="abort", worker_id="d1")
    p = prepared(real_text, HI, deadline_s)
    with pytest.raises(ApiError) as err:
        await answer(Answers(ScriptedDispatch([abort])), p)  # type: ignore[arg-type]
    assert err.value.status == status

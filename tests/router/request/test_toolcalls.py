"""Tool calls out of an answer's text: streamed in pieces when forced, whole when the model
chose to write one, text when it is not a valid call; pieces reassemble to the whole."""

from __future__ import annotations

import json

import pytest

from services.router.request.toolcalls import CallParser, calls_of

CALL = (
    '<tool_call>\n{"name": "get_tide", "arguments": {"port": "Oslo", "days": [1, 2]}}\n</tool_call>'
)


def run(parser: CallParser, text: str, step: int) -> tuple[str, list]:
    out, events = "", []
    for i in range(0, len(text), step):
        t, e = parser.feed(text[i : i + step])
        out += t
        events += e
    t, e = parser.finish()
    return out + t, events + e


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_a_forced_call_streams_its_name_then_argument_pieces(step: int) -> None:
    text, events = run(CallParser(streamed=True), CALL + CALL, step)
    assert text == ""
    calls = calls_of(events)
    assert [c.name for c in calls] == ["get_tide", "get_tide"]
    assert calls[0].arguments == '{"port": "Oslo", "days": [1, 2]}'
    assert json.loads(calls[1].arguments) == {"port": "Oslo", "days": [1, 2]}
    assert events[0].name == "get_tide" and events[0].id and not events[0].arguments
    if step < 10:
        assert sum(1 for e in events if e.arguments) > 2  # in pieces, as they came
    assert [e.index for e in events if e.done] == [0, 1]


def test_a_call_the_model_chose_is_sent_whole_and_text_around_it_kept() -> None:
    text, events = run(CallParser(streamed=False), "Let me look.\n" + CALL + "\n", 2)
    assert text == "Let me look.\n"
    assert [e.name for e in events if e.name] == ["get_tide"]
    assert sum(1 for e in events if e.arguments) == 1


def test_what_is_not_a_call_stays_text() -> None:
    broken = "<tool_call>\n{not json}\n</tool_call> and <tool_c"
    text, events = run(CallParser(streamed=False), broken, 4)
    assert text == broken and events == []
    text, events = run(CallParser(streamed=False), "a < b and <tool_ not a tag", 1)
    assert text == "a < b and <tool_ not a tag" and events == []


def test_a_forced_call_cut_by_the_length_ends_with_what_was_written() -> None:
    cut = CALL[:50]
    text, events = run(CallParser(streamed=True), cut, 5)
    calls = calls_of(events)
    assert text == "" and calls[0].name == "get_tide"
    assert calls[0].arguments == cut[cut.index('{"po') :]
    assert events[-1].done

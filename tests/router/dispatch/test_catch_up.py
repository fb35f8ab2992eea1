"""A stream that fell behind catches up in one chunk: consecutive token events from the same
worker already in the router's queue go out as one, with nothing lost or reordered."""

from __future__ import annotations

from services.router.dispatch.stream import continues, merged
from shared.messages.generate import Logprobs, TokenEvent


def event(index: int, tokens: list[int], **fields) -> TokenEvent:  # noqa: ANN003
    return TokenEvent(request_id="r", index=index, token_ids=tokens, worker_id="d1", **fields)


def test_consecutive_events_join_with_their_figures_summed_and_the_later_end() -> None:
    first = event(1, [5, 6], kv_bytes=100, kv_transfer_s=0.01, cached_tokens=64)
    middle = event(3, [7], decode_s=0.1)
    last = event(4, [8], finish_reason="length", decode_s=0.2)
    assert continues(first, middle) and continues(middle, last)
    both = merged([first, middle, last])
    assert both.index == 1 and both.token_ids == [5, 6, 7, 8]
    assert both.finish_reason == "length" and both.decode_s == 0.1 + 0.2
    assert both.kv_bytes == 100 and both.kv_transfer_s == 0.01 and both.cached_tokens == 64
    assert both.prefill_s is None  # a figure none had stays absent
    assert both == TokenEvent.model_validate_json(both.model_dump_json())  # a valid event


def test_an_error_a_gap_or_another_worker_is_never_joined() -> None:
    first = event(1, [5])
    assert not continues(first, event(2, [], error="boom", error_code="internal"))
    assert not continues(first, event(3, [7]))  # index 2 is missing
    assert not continues(first, first.model_copy(update={"index": 2, "worker_id": "d2"}))


def test_every_field_an_event_can_carry_survives_the_join() -> None:
    """A field added to TokenEvent is joined too (the prompt's scores were once dropped when a
    stream fell behind)."""
    lp = Logprobs(logprob=-1.0, top_ids=[3], top_logprobs=[-1.0])
    first = event(
        0,
        [5],
        logprobs=[lp],
        prompt_logprobs=[lp, lp],
        cached_tokens=64,
        cached_by_tier={"memory": 64},
        prefill_s=0.1,
        kv_bytes=10,
        kv_transfer_s=0.01,
    )
    last = event(1, [6], logprobs=[lp], finish_reason="stop", stop_string="x", decode_s=0.2)
    both = merged([first, last])
    unset = {"error", "error_code"}  # (an error is never joined: the test above)
    for name in TokenEvent.model_fields.keys() - unset:
        carried = (
            getattr(first, name) != TokenEvent.model_fields[name].default
            or getattr(last, name) != TokenEvent.model_fields[name].default
        )
        if carried:
            assert getattr(both, name) not in (None, [], {}), name
    assert both.prompt_logprobs == [lp, lp] and both.logprobs == [lp, lp]

"""Token events on the wire: a decode step's plain tokens, made as JSON from parts encoded
once, read back as exactly the events a model would have written, beside events with more."""

from __future__ import annotations

import pytest

from shared.messages.generate import Logprobs, PlainTokens, TokenEvent, TokenEvents


@pytest.mark.parametrize(
    "request_id", ["3f2a9c", "chat-42-resume2", 'odd "quoted" \\ id', "naïve-日本-🎉", "\u2028"]
)
def test_plain_tokens_read_back_as_the_events_a_model_writes(request_id: str) -> None:
    plain = PlainTokens(request_id, "decode-7")
    richer = TokenEvent(
        request_id="other",
        index=9,
        token_ids=[5],
        logprobs=[Logprobs(logprob=-0.5, top_ids=[5, 6], top_logprobs=[-0.5, -1.5])],
        finish_reason="length",
        decode_s=0.25,
        worker_id="decode-7",
    )
    data = TokenEvents.joined(
        [plain.event(1, 0), TokenEvents.encoded(richer), plain.event(2**31, 49151)]
    )
    got = TokenEvents.from_bytes(data).events
    expected = [
        TokenEvent(request_id=request_id, index=1, token_ids=[0], worker_id="decode-7"),
        richer,
        TokenEvent(request_id=request_id, index=2**31, token_ids=[49151], worker_id="decode-7"),
    ]
    assert got == expected
    assert TokenEvents.from_bytes(TokenEvents(events=expected).to_bytes()).events == got

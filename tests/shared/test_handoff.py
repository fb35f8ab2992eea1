"""KV handoff tokens: bound to one request and one decode worker, short-lived."""

from __future__ import annotations

import pytest

from shared.security.handoff import handoff_refusal, handoff_token

SECRET = b"s" * 32


def test_a_good_token_passes() -> None:
    token = handoff_token(SECRET, "r1", "decode-0", expires_at=1000.0)
    assert handoff_refusal(SECRET, token, "r1", "decode-0", now=999.0) == ""


@pytest.mark.parametrize(
    ("token_for", "checked_as", "now", "why"),
    [
        (("r2", "decode-0"), ("r1", "decode-0"), 999.0, "not this request's"),
        (("r1", "decode-1"), ("r1", "decode-0"), 999.0, "not this request's"),
        (("r1", "decode-0"), ("r1", "decode-0"), 1002.0, "expired"),
    ],
)
def test_another_requests_or_an_old_token_is_refused(
    token_for: tuple[str, str], checked_as: tuple[str, str], now: float, why: str
) -> None:
    token = handoff_token(SECRET, *token_for, expires_at=1000.0)
    assert why in handoff_refusal(SECRET, token, *checked_as, now=now)


def test_no_token_a_forged_one_or_another_secrets_is_refused() -> None:
    assert handoff_refusal(SECRET, "", "r1", "d", 0) == "no handoff token"
    assert "malformed" in handoff_refusal(SECRET, "x.y", "r1", "d", 0)
    assert "not this request's" in handoff_refusal(SECRET, "2000." + "0" * 64, "r1", "d", 0)
    other = handoff_token(b"o" * 32, "r1", "d", 1000.0)
    assert "not this request's" in handoff_refusal(SECRET, other, "r1", "d", 0)

"""Pins (services/router/tenancy/pins.py): each tenant's pinned KV within its quota, a
conversation's blocks counted once however many turns pin them, released as pins end."""

from __future__ import annotations

import pytest

from services.router.errors import ApiError
from services.router.tenancy.pins import PinLedger

BLOCK = 1000


def test_a_tenants_pins_are_held_within_its_quota_and_released_as_they_end() -> None:
    pins = PinLedger()
    turn1 = ["a", "b"]
    assert pins.pin("acme", 60, turn1, BLOCK, 100, 3600, 5000, now=0) == 60
    assert pins.pinned("acme", now=0) == 2100
    # The next turn: its history's blocks again (later), two more, its answer's room.
    assert pins.pin("acme", 60, [*turn1, "c", "d"], BLOCK, 100, 3600, 5000, now=30) == 90
    assert pins.pinned("acme", now=30) == 4200
    with pytest.raises(ApiError) as err:
        pins.pin("acme", 60, ["e"], BLOCK, 100, 3600, 5000, now=40)
    assert err.value.status == 429 and err.value.param == "x-kvmesh-cache-ttl-s"
    assert err.value.retry_after_s == 20  # the first pin ends at 60
    assert pins.pinned("other", now=40) == 0  # another tenant's quota is its own
    # At 60 the first turn's answer room ends; a and b were pinned again to 90.
    assert pins.pinned("acme", now=61) == 4100
    assert pins.pinned("acme", now=91) == 0


def test_a_pin_longer_than_the_key_may_ask_is_a_400() -> None:
    with pytest.raises(ApiError) as err:
        PinLedger().pin("acme", 7200, ["a"], BLOCK, 0, 3600, 10**9, now=0)
    assert err.value.status == 400 and "at most 3600 s" in err.value.message

"""Keys the router reads (again when the file changes) and per-key limits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from services.router.errors import ApiError
from services.router.tenancy.keys import Caller, KeyRing
from services.router.tenancy.limits import KeyLimiter
from shared.security.keys import KeysFile, new_key


def ring_with(path: Path, *entries) -> KeyRing:  # noqa: ANN002
    KeysFile(list(entries)).write(path)
    return KeyRing(path)


def test_bearer_and_x_api_key_name_the_tenant(tmp_path: Path) -> None:
    key, entry = new_key("acme")
    ring = ring_with(tmp_path / "keys.json", entry)
    assert ring.identify({"authorization": f"Bearer {key}"}).tenant == "acme"
    assert ring.identify({"x-api-key": key}).key == entry
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": f"Basic {key}"}):
        with pytest.raises(ApiError) as err:
            ring.identify(headers)
        assert err.value.status == 401


def test_the_file_is_read_again_when_it_changes_and_a_bad_edit_keeps_the_keys(
    tmp_path: Path,
) -> None:
    path = tmp_path / "keys.json"
    key, entry = new_key("acme")
    ring = ring_with(path, entry)
    keys = KeysFile.read(path)
    keys.revoke(entry.id)
    keys.write(path)
    ring.reload()
    with pytest.raises(ApiError, match="revoked"):
        ring.identify({"x-api-key": key})
    other, entry2 = new_key("beta")
    KeysFile([entry2]).write(path)
    path.write_text(path.read_text().replace("beta", "not a tenant"))
    os.utime(path, ns=(1, 1))  # a changed stamp, whatever the clock's resolution
    ring.reload()  # malformed: the keys read before stay
    with pytest.raises(ApiError, match="revoked"):
        ring.identify({"x-api-key": key})


def test_limits_are_per_key(tmp_path: Path) -> None:
    limiter = KeyLimiter()
    _, slow = new_key("a", rpm=2, concurrency=1)
    _, free = new_key("b")
    a, b = Caller("a", slow), Caller("b", free)
    with limiter.admitted(a):
        with pytest.raises(ApiError) as err, limiter.admitted(a):  # one at once
            pass
        assert err.value.status == 429 and err.value.retry_after_s == 1
        with limiter.admitted(b):
            pass
    with limiter.admitted(a):
        pass
    with pytest.raises(ApiError) as err, limiter.admitted(a):  # the third in a minute
        pass
    assert "2 requests per minute" in err.value.message and err.value.retry_after_s >= 1
    for _ in range(50):
        with limiter.admitted(b):
            limiter.charge_tokens(b, 10_000)

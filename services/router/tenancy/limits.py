"""What each API key may still send: its requests per minute, input tokens per minute and
requests at once (the key's own limits, from the keys file). Over any, 429 with Retry-After
for that key alone."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from services.router.errors import ApiError
from services.router.tenancy.keys import Caller
from shared.security.keys import ApiKey


@dataclass
class _Bucket:
    """A token bucket: ``per_minute`` tokens a minute, as many at once at most."""

    per_minute: int
    level: float = -1.0
    at: float = 0.0

    def take(self, n: float, now: float) -> float:
        """Takes ``n`` when there are; else returns the seconds until there will be."""
        rate = self.per_minute / 60.0
        if self.level < 0:
            self.level = float(self.per_minute)
        else:
            self.level = min(float(self.per_minute), self.level + (now - self.at) * rate)
        self.at = now
        if self.level >= n:
            self.level -= n
            return 0.0
        return (n - self.level) / rate


@dataclass
class _Usage:
    requests: _Bucket
    tokens: _Bucket
    inflight: int = 0


@dataclass
class KeyLimiter:
    """Each key's usage against its limits."""

    usage: dict[str, _Usage] = field(default_factory=dict)

    def _of(self, key: ApiKey) -> _Usage:
        u = self.usage.get(key.id)
        if u is None or u.requests.per_minute != key.rpm or u.tokens.per_minute != key.tpm:
            inflight = u.inflight if u else 0
            u = self.usage[key.id] = _Usage(_Bucket(key.rpm), _Bucket(key.tpm), inflight)
        return u

    @contextmanager
    def admitted(self, caller: Caller) -> Iterator[None]:
        """A request of this caller in progress (its concurrency and request rate)."""
        key = caller.key
        if key is None:
            yield
            return
        u = self._of(key)
        if key.concurrency and u.inflight >= key.concurrency:
            raise _limited(key, f"{key.concurrency} requests in progress at once", 1.0)
        if key.rpm:
            wait = u.requests.take(1, time.monotonic())
            if wait:
                raise _limited(key, f"{key.rpm} requests per minute", wait)
        u.inflight += 1
        try:
            yield
        finally:
            u.inflight -= 1

    def charge_tokens(self, caller: Caller, tokens: int) -> None:
        key = caller.key
        if key is None or not key.tpm:
            return
        if tokens > key.tpm:
            raise ApiError(
                429,
                f"the prompt's {tokens} tokens exceed this key's limit of {key.tpm} input "
                "tokens per minute",
                code="rate_limit_exceeded",
            )
        wait = self._of(key).tokens.take(tokens, time.monotonic())
        if wait:
            raise _limited(key, f"{key.tpm} input tokens per minute", wait)


def _limited(key: ApiKey, what: str, wait_s: float) -> ApiError:
    return ApiError(
        429,
        f"rate limit of key {key.id}: {what}; retry after {math.ceil(wait_s)} s",
        code="rate_limit_exceeded",
        retry_after_s=max(1, math.ceil(wait_s)),
    )

"""Who may come in, and with what: a request's caller (its key's tenant; with auth off, the
tenant header's), its admission (the router's own bounds, then the key's limits), its KV
options from the headers (retention class, tenant, explanations asked for), and the tenant's
salt, part of every block hash the request makes.

A key is accepted as ``Authorization: Bearer <key>`` (OpenAI clients), ``x-api-key: <key>``
(Anthropic clients) or the same names in gRPC metadata. With no keys file configured, auth is
off: every request is let in, and the tenant is what ``x-kvmesh-tenant`` says.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.router.dispatch.workers import LoopLag
from services.router.errors import ApiError, overloaded
from services.router.settings import TenancySettings
from services.router.tenancy.keys import ANONYMOUS, Caller, KeyRing
from services.router.tenancy.limits import KeyLimiter
from services.router.tenancy.pins import CACHE_TTL_HEADER, PinLedger
from shared.messages.generate import QUEUE_SHARE
from shared.messages.kvevents import RETENTIONS
from shared.security.keys import TIERS
from shared.security.salt import SALT_SECRET, tenant_salt
from shared.security.secret import load_or_create

RETENTION_HEADER = "x-kvmesh-retention"
TENANT_HEADER = "x-kvmesh-tenant"
EXPLAIN_HEADER = "x-kvmesh-explain"
PRIORITY_HEADER = "x-kvmesh-priority"  # the class, for a client that cannot set service_tier
DEADLINE_HEADER = "x-kvmesh-ttft-deadline-ms"  # the first token is wanted within this
EXPECTED_HEADER = "x-kvmesh-expected-output-tokens"  # the answer's length an agent expects
MAX_DEADLINE_MS = 3_600_000


@dataclass(frozen=True)
class KvOptions:
    """Whose a request is and how its KV blocks are kept: its caller, its tenant (the salt of
    its hashes), its retention class."""

    retention: str = "chat"
    tenant: str = ""
    explain: bool = False  # every candidate's routing terms in the response, not the best few
    caller: Caller = ANONYMOUS  # (its key's limits are charged its prompt's tokens)
    tier: str = ""  # the class its header asked for ("": none)
    ttft_deadline_ms: float = 0.0  # the first token within this many ms (0: no deadline)
    cache_ttl_s: float = 0.0  # its KV pinned this long (x-kvmesh-cache-ttl-s; 0: not pinned)
    expected_tokens: int = 0  # the answer's length it expects (x-kvmesh-expected-output-tokens)


PLAIN = KvOptions()  # chat retention, no tenant


class Tenancy:
    def __init__(self, settings: TenancySettings, secrets_dir: Path, lag: LoopLag) -> None:
        self.settings = settings
        self.keys = KeyRing(settings.keys_file) if settings.keys_file else None
        self.limiter = KeyLimiter()
        self.salt_secret = load_or_create(secrets_dir, SALT_SECRET)
        self.lag = lag
        self.inflight = 0  # requests admitted and not yet answered
        self.by_tenant: dict[str, int] = {}  # of those, each key's tenant's
        self.weights: dict[str, int] = {}  # each tenant's weight, as its key last said
        self.pins = PinLedger()

    def identify(self, headers: Mapping[str, str], role: str = "user") -> Caller:
        """Who sent the request (401 without a valid key when auth is on; 403 when the
        endpoint needs the admin role)."""
        if self.keys is None:
            return ANONYMOUS
        caller = self.keys.identify(headers)
        assert caller.key is not None
        if role == "admin" and caller.key.role != "admin":
            raise ApiError(403, f"this needs an admin key ({caller.key.id} is a user key)")
        return caller

    @contextlib.contextmanager
    def admitted(self, caller: Caller = ANONYMOUS) -> Iterator[None]:
        """A request in progress; 429 when there are already max_inflight, when the router's
        loop runs more than max_loop_lag_s behind (its answers already wait), or when the
        caller's key is over one of its limits."""
        s = self.settings
        if self.inflight >= s.max_inflight:
            raise overloaded(f"too many requests in progress ({s.max_inflight})")
        if self.lag.seconds > s.max_loop_lag_s:
            raise overloaded(
                f"this router runs {self.lag.seconds:.2f} s behind "
                f"(KVMESH_ROUTER_MAX_LOOP_LAG_S {s.max_loop_lag_s:g})"
            )
        with self.limiter.admitted(caller) if caller.key else contextlib.nullcontext():
            self.inflight += 1
            tenant = caller.tenant if caller.key else None
            if tenant is not None:
                self.by_tenant[tenant] = self.by_tenant.get(tenant, 0) + 1
                self.weights[tenant] = caller.key.weight or 1
            try:
                yield
            finally:
                self.inflight -= 1
                if tenant is not None:
                    left = self.by_tenant[tenant] - 1
                    if left:
                        self.by_tenant[tenant] = left
                    else:
                        del self.by_tenant[tenant], self.weights[tenant]

    def check_share(self, caller: Caller, priority: str) -> None:
        """While the mesh's queues are full: 429 for a key's tenant that has more requests in
        progress here than its share (by weight) of all those in progress among the tenants
        that have some, so that one sending ten times more gets its share, not the mesh's.
        (The priority class is bounded by who may ask for it, its keys' ceilings, not by
        shares.)"""
        if caller.key is None or len(self.by_tenant) < 2 or priority == "priority":
            return
        tenant = caller.tenant
        share = self.inflight * self.weights[tenant] / sum(self.weights.values())
        if self.by_tenant[tenant] > max(1.0, share):
            raise overloaded(
                f"the mesh is full and tenant {tenant!r} has more than its share of the requests "
                f"in progress ({self.by_tenant[tenant]} of {self.inflight}, its share "
                f"{share:.0f})",
                priority,
                "share",
            )

    def admit_class(self, priority: str) -> None:
        """A request in progress of class ``priority`` (counted already): 429 once those in
        progress fill its class's share of max_inflight, so that as the router fills the
        lowest class is refused first (``QUEUE_SHARE``)."""
        limit = max(1, int(self.settings.max_inflight * QUEUE_SHARE[priority]))
        if self.inflight > limit:
            raise overloaded(
                f"too many requests in progress for the {priority} class ({limit} of "
                f"{self.settings.max_inflight})",
                priority,
                "router",
            )

    def pin(self, kv: KvOptions, hashes: list[str], block_bytes: int, answer_bytes: int) -> float:
        """The unix time a request's KV is pinned until (``pins.py``): 0 when it asked for
        no pin."""
        if not kv.cache_ttl_s:
            return 0.0
        key, s = kv.caller.key, self.settings
        max_ttl = float(key.pin_ttl_s) if key and key.pin_ttl_s else s.max_cache_ttl_s
        quota = key.pin_bytes if key and key.pin_bytes else s.pinned_bytes_per_tenant
        ttl, now = kv.cache_ttl_s, time.time()
        return self.pins.pin(kv.tenant, ttl, hashes, block_bytes, answer_bytes, max_ttl, quota, now)

    def charge_tokens(self, caller: Caller, tokens: int) -> None:
        """The prompt's tokens against the caller's key's input-token limit."""
        if caller.key is not None:
            self.limiter.charge_tokens(caller, tokens)

    def kv_options(self, headers: Mapping[str, str], caller: Caller = ANONYMOUS) -> KvOptions:
        """With auth on, the tenant is the key's (a tenant header is ignored)."""
        retention = headers.get(RETENTION_HEADER, "chat") or "chat"
        if retention not in RETENTIONS:
            raise ApiError(
                400,
                f"{RETENTION_HEADER}: one of {', '.join(RETENTIONS)} (got {retention!r})",
                param=RETENTION_HEADER,
            )
        if caller.key is not None:
            tenant = caller.tenant
        else:
            tenant = headers.get(TENANT_HEADER, "")
            if len(tenant) > 256:
                raise ApiError(400, f"{TENANT_HEADER}: at most 256 characters", param=TENANT_HEADER)
        explain = headers.get(EXPLAIN_HEADER, "") == "all"
        return KvOptions(
            retention,
            tenant,
            explain,
            caller,
            _tier(headers),
            _deadline_ms(headers),
            _cache_ttl_s(headers),
            _expected_tokens(headers),
        )

    def salt(self, tenant: str) -> str:
        """The tenant's salt: part of every hash of its blocks and images."""
        return tenant_salt(self.salt_secret, tenant)


def _tier(headers: Mapping[str, str]) -> str:
    tier = headers.get(PRIORITY_HEADER, "")
    if tier not in ("", "auto", *TIERS):
        raise ApiError(
            400,
            f"{PRIORITY_HEADER}: one of auto, {', '.join(TIERS)} (got {tier[:64]!r})",
            param=PRIORITY_HEADER,
        )
    return "" if tier == "auto" else tier


def _deadline_ms(headers: Mapping[str, str]) -> float:
    raw = headers.get(DEADLINE_HEADER, "")
    if not raw:
        return 0.0
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not 0 < ms <= MAX_DEADLINE_MS:  # (nan fails too)
        raise ApiError(
            400,
            f"{DEADLINE_HEADER}: milliseconds, over 0 and at most {MAX_DEADLINE_MS}",
            param=DEADLINE_HEADER,
        )
    return ms


def _cache_ttl_s(headers: Mapping[str, str]) -> float:
    raw = headers.get(CACHE_TTL_HEADER, "")
    if not raw:
        return 0.0
    try:
        ttl = float(raw)
    except ValueError:
        ttl = -1.0
    if not 0 < ttl < math.inf:
        raise ApiError(400, f"{CACHE_TTL_HEADER}: seconds, over 0", param=CACHE_TTL_HEADER)
    return ttl


def _expected_tokens(headers: Mapping[str, str]) -> int:
    raw = headers.get(EXPECTED_HEADER, "")
    if not raw:
        return 0
    if not raw.isdigit() or not 0 < int(raw) <= 10**7:
        raise ApiError(
            400, f"{EXPECTED_HEADER}: a whole number of tokens, over 0", param=EXPECTED_HEADER
        )
    return int(raw)

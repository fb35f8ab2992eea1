"""Pins: how long a conversation's KV is kept whatever eviction would do, and how much of it
each tenant may have pinned at once.

A request that says its conversation will continue (``x-kvmesh-cache-ttl-s``) has its
blocks pinned in the tiers for that long (at most the key's ``pin_ttl_s``, else the router's
``max_cache_ttl_s``): the blocks it stores are pinned where they are stored, those it reads
are pinned again (a ``touched`` event), so a next turn within the time finds its history.
Each pin counts the request's prompt and answer at the model's KV bytes a token against its
tenant until it ends (at most the key's ``pin_bytes``, else ``pinned_bytes_per_tenant``); a
request that would go past it gets a 429 naming the header and the quota. Counted by each
router for what it was sent: with several routers, a tenant may pin up to that much at each.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field

from services.router.errors import ApiError

CACHE_TTL_HEADER = "x-kvmesh-cache-ttl-s"


@dataclass
class PinLedger:
    """Each tenant's pinned bytes: its prompts' blocks, each counted once however many turns
    pin it again (a pin again extends it), and its answers' room; released as pins end."""

    _held: dict[str, int] = field(default_factory=dict)  # tenant → bytes pinned now
    _blocks: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant → hash → until
    # (until, tenant, block hash or "" for an answer's room, its bytes): in order of ending
    _ends: list[tuple[float, str, str, int]] = field(default_factory=list)

    def pinned(self, tenant: str, now: float | None = None) -> int:
        self._release(time.time() if now is None else now)
        return self._held.get(tenant, 0)

    def pin(
        self,
        tenant: str,
        ttl_s: float,
        hashes: list[str],
        block_bytes: int,
        answer_bytes: int,
        max_ttl_s: float,
        quota: int,
        now: float,
    ) -> float:
        """Pin a request's prompt (its blocks' ``hashes``) and its answer's room for
        ``ttl_s``: the unix time the pin ends. A 400 past ``max_ttl_s``; a 429 past the
        tenant's ``quota`` of bytes pinned at once."""
        if ttl_s > max_ttl_s:
            raise ApiError(
                400,
                f"{CACHE_TTL_HEADER}: at most {max_ttl_s:g} s for this key"
                + (" (pins are off on this router)" if not max_ttl_s else ""),
                param=CACHE_TTL_HEADER,
            )
        self._release(now)
        mine = self._blocks.setdefault(tenant, {})
        new = [h for h in dict.fromkeys(hashes) if h not in mine]
        size = len(new) * block_bytes + answer_bytes
        held = self._held.get(tenant, 0)
        if held + size > quota:
            raise ApiError(
                429,
                f"{CACHE_TTL_HEADER}: pinning this conversation's KV ({size} bytes more) would "
                f"take its tenant's pinned KV past its quota of {quota} bytes ({held} pinned "
                "now); send it without the header, or once a pin has ended",
                param=CACHE_TTL_HEADER,
                code="insufficient_quota",
                retry_after_s=max(1, int(self._ends[0][0] - now)) if self._ends else 1,
            )
        until = now + ttl_s
        self._held[tenant] = held + size
        for h in dict.fromkeys(hashes):
            if mine.get(h, 0.0) < until:
                mine[h] = until
                heapq.heappush(self._ends, (until, tenant, h, block_bytes))
        if answer_bytes:
            heapq.heappush(self._ends, (until, tenant, "", answer_bytes))
        return until

    def _release(self, now: float) -> None:
        while self._ends and self._ends[0][0] <= now:
            until, tenant, h, size = heapq.heappop(self._ends)
            if h:
                mine = self._blocks[tenant]
                if mine.get(h) != until:  # pinned again since: it ends later
                    continue
                del mine[h]
                if not mine:
                    del self._blocks[tenant]
            left = self._held[tenant] - size
            if left > 0:
                self._held[tenant] = left
            else:
                del self._held[tenant]

"""The cache plan a request is dispatched with: its prompt's block hashes, and how many of its
leading blocks each location holds (every worker's memory tier, the storage tier), as this
router's own index says (``kvindex.py``: no hop; cachemeta away costs nothing).

Hashing reuses earlier work: a prompt that starts with the same segments as an earlier one (the
next turn of a conversation) has the same tokens there, so the hashes of the full blocks inside
them are taken from that prompt and only the new blocks are hashed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import replace
from typing import Protocol

from prometheus_client import Gauge

from services.router.dispatch.job import Job, Segments
from shared.kvstore.hashing import HASH_SCHEMES, XXH3, scheme_block_hashes
from shared.messages.kvevents import memory_location
from shared.telemetry.tracing import tracer

KEY_SEGMENTS = 6


HASH_BYTES = 81  # a block hash kept: its 32-character string and its list slot


class PrefixHashes:
    """Block hashes of recent prompts, remembered with their segments: a prompt that starts
    with the same segments as an earlier one (the next turn of a conversation) has the same
    tokens there, so the hashes of the full blocks inside them are reused and only the new
    blocks are hashed."""

    def __init__(self, max_prompts: int = 4096, max_bytes: int = 256 << 20) -> None:
        self.max_prompts, self.max_bytes = max_prompts, max_bytes
        self._recent: OrderedDict[tuple, tuple[Segments, list[str], int]] = OrderedDict()
        self.bytes = 0  # what the kept prompts hold: their texts, packed ids and hashes
        self.reused_blocks = 0  # hashes taken from an earlier prompt
        self.hashed_blocks = 0  # hashes computed

    def __len__(self) -> int:
        return len(self._recent)

    def hashes(
        self, segments: Segments, block_size: int, fingerprint: str, salt: str, scheme: str = XXH3
    ) -> list[str]:
        """The block hashes of the prompt made of ``segments``, in hash scheme ``scheme``."""
        # A conversation is known by its opening: through its first user message in a chat
        # (system prompt, then the user's first words), the whole text otherwise.
        key = (fingerprint, block_size, salt, scheme, segments[:KEY_SEGMENTS])
        known: list[str] = []
        entry = self._recent.get(key)
        if entry is not None:
            old_segments, old_hashes, _ = entry
            shared = 0
            for new, old in zip(segments, old_segments, strict=False):
                if new != old:  # text compared by content
                    break
                shared += len(new[1])
            known = old_hashes[: min(len(old_hashes), shared // (4 * block_size))]
        packed = b"".join(p for _, p in segments)
        hashes = HASH_SCHEMES[scheme](packed, block_size, fingerprint, salt, known=known)
        self.reused_blocks += len(known)
        self.hashed_blocks += len(hashes) - len(known)
        cost = sum(len(t) + len(p) for t, p in segments) + HASH_BYTES * len(hashes)
        if entry is not None:
            self.bytes -= entry[2]
        self._recent[key] = (segments, hashes, cost)
        self._recent.move_to_end(key)
        self.bytes += cost
        while self._recent and (
            len(self._recent) > self.max_prompts or self.bytes > self.max_bytes
        ):
            self.bytes -= self._recent.popitem(last=False)[1][2]
        return hashes


class BlockLookup(Protocol):
    """Where a prompt's blocks are: the router's own index (``kvindex.RouterIndex``)."""

    def lookup(self, hashes: list[str], pinned_until: float = 0.0) -> dict[str, int]: ...


PREFIX_BYTES = Gauge(
    "kvmesh_router_prefix_bytes",
    "what those conversations hold: texts, packed ids, hashes (at most KVMESH_ROUTER_PREFIX_BYTES)",
)
PREFIX_PROMPTS = Gauge(
    "kvmesh_router_prefix_prompts",
    "conversations whose block hashes the router remembers, to hash only a next turn's new "
    "blocks (at most KVMESH_ROUTER_PREFIX_PROMPTS)",
)


class CachePlanner:
    def __init__(
        self, kv: BlockLookup, prefix_prompts: int = 4096, prefix_bytes: int = 256 << 20
    ) -> None:
        self.kv = kv
        self.hash_cache = PrefixHashes(prefix_prompts, prefix_bytes)
        PREFIX_PROMPTS.set_function(lambda: len(self.hash_cache))
        PREFIX_BYTES.set_function(lambda: self.hash_cache.bytes)

    async def planned(self, job: Job, block_size: int, scheme: str = XXH3) -> Job:
        """The job with its prompt's block hashes (in the model's workers' hash scheme) and
        where they are (unchanged while no worker of its model says its block size:
        ``block_size`` 0)."""
        hashes = self.hashes(job, block_size, scheme)
        if not block_size:
            return job
        counts = self.lookup(hashes, job.pinned_until)
        if job.near:
            near = memory_location(job.near)
            counts = {**counts, near: max(counts.get(near, 0), len(hashes))}
        return replace(job, block_size=block_size, block_hashes=hashes, cached_blocks=counts)

    def hashes(self, job: Job, block_size: int, scheme: str = XXH3) -> list[str]:
        """The hashes of the prompt's full blocks of ``block_size`` tokens."""
        if not block_size:
            return []
        if job.segments:
            return self.hash_cache.hashes(
                job.segments, block_size, job.fingerprint, job.salt, scheme
            )
        return scheme_block_hashes(
            scheme, job.prompt_ids, block_size, job.fingerprint, job.salt, images=job.images
        )

    def lookup(self, hashes: list[str], pinned_until: float = 0.0) -> dict[str, int]:
        """Per location, the leading blocks it holds (this router's index); those it will
        read pinned until ``pinned_until`` (when later than they are)."""
        if not hashes:
            return {}
        with tracer.start_as_current_span("kv.lookup", attributes={"blocks": len(hashes)}) as span:
            counts = self.kv.lookup(hashes, pinned_until)
            span.set_attribute("held", json.dumps(counts, sort_keys=True))
        return counts

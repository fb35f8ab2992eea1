"""vLLM's KV events as kvmesh's (shared/engine/vllm/events.py), from vLLM's own event types:
its cache's blocks under kvmesh's hashes (recomputed from their tokens, chained on the parent,
salted by the tenant's cache_salt), removals translated, and the storage connector's events
at the storage tier with their retention class and file size."""

from __future__ import annotations

import asyncio

import pytest

from shared.engine.vllm.events import STORAGE_MEDIUM, VllmEventBridge
from shared.kvstore.hashing import block_hashes

kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="the vllm extra")

BS, FP = 4, "fp-test"


def bridge() -> tuple[VllmEventBridge, list[tuple]]:
    said: list[tuple] = []

    async def publish(kind: str, hashes: list[str], tier: str, retention: str, size: int) -> None:
        said.append((kind, hashes, tier, retention, size))

    return VllmEventBridge(FP, BS, publish), said


def stored(hashes: list[int], parent: int | None, tokens: list[int], **extra) -> object:
    return kv_events.BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        **extra,
    )


def test_vllms_blocks_get_kvmeshs_hashes_chained_and_salted_and_removals_follow() -> None:
    b, said = bridge()
    tokens = list(range(100, 112))  # three blocks of 4
    first = stored([11, 12], None, tokens[:8], extra_keys=[("tenant-salt",), None])
    second = stored([13], 12, tokens[8:])
    asyncio.run(b.apply([first, second]))
    ours = block_hashes(tokens, BS, FP, "tenant-salt")
    assert said == [("stored", ours, "memory", "chat", 0)]  # (a batch's, published at once)
    assert ours != block_hashes(tokens, BS, FP)  # another tenant's are others
    said.clear()
    asyncio.run(b.apply([kv_events.BlockRemoved(block_hashes=[12, 99], medium="CPU")]))
    assert said == [("removed", [ours[1]], "memory", "chat", 0)]
    # A block whose parent was never reported is not addressable: nothing is said of it.
    said.clear()
    asyncio.run(b.apply([stored([21], 777, tokens[:4])]))
    assert said == []


def test_the_storage_connectors_events_are_at_the_tier_with_their_class_and_size() -> None:
    b, said = bridge()
    h = "ab" * 32
    event = kv_events.BlockStored(
        block_hashes=[bytes.fromhex(h)],
        parent_block_hash=None,
        token_ids=[],
        block_size=BS,
        lora_id=None,
        medium=f"{STORAGE_MEDIUM}:agent:1536",
        lora_name=None,
    )
    damaged = kv_events.BlockRemoved(
        block_hashes=[bytes.fromhex(h)], medium=f"{STORAGE_MEDIUM}:chat"
    )
    asyncio.run(b.apply([event, damaged]))
    assert said == [
        ("stored", [h], "storage", "agent", 1536),
        ("removed", [h], "storage", "chat", 0),
    ]

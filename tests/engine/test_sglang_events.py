"""SGLang's KV events as kvmesh's (shared/engine/sglang/events.py), made by the pinned release's
own code (tests/sglang_release.py): its cache's event recorder hashes the pages with SGLang's
own page hash and its ZMQ publisher sends them. The bridge names each block by the hash
SGLang's storage gives the page, which is the router's hash of the same prompt for an SGLang
model (``hashing.packed_sglang_hashes``): per tenant, merged events split, GPU and host
memory both the worker's, removals followed, and a batch lost replayed from SGLang's buffer."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from shared import faults
from shared.kvstore.hashing import (
    pack_tokens,
    packed_block_hashes,
    packed_sglang_hashes,
    sglang_cache_salt,
)
from tests.sglang_release import load

BS, FP = 4, "fp-sglang-events"


@pytest.fixture(scope="module")
def sglang():
    load()
    from sglang.srt.disaggregation import kv_events
    from sglang.srt.mem_cache import events, utils

    return kv_events, events, utils


class Key:
    """A stand-in for SGLang's RadixKey (whose module pulls in its GPU model configs): the
    token ids of a radix node and the namespace they are cached under."""

    def __init__(self, token_ids: list[int], cache_salt: str | None) -> None:
        self.token_ids, self.cache_salt = token_ids, cache_salt
        self.extra_key, self.is_bigram = None, False

    def __len__(self) -> int:
        return len(self.token_ids)


def nodes(tokens: list[int], salt: str, cuts: list[int]) -> list[SimpleNamespace]:
    """A radix path of nodes holding ``tokens`` cut at ``cuts`` (a stand-in for SGLang's
    TreeNode: what its event recorder reads of one)."""
    root = SimpleNamespace(parent=None, key=Key([], None), hash_value=[], event_hash_value=None)
    path, parent = [], root
    for start, end in zip([0, *cuts], [*cuts, len(tokens)], strict=True):
        node = SimpleNamespace(
            parent=parent,
            key=Key(tokens[start:end], salt),
            hash_value=None,
            event_hash_value=None,
        )
        path.append(node)
        parent = node
    return path


def router_hashes(tokens: list[int], tenant: str) -> list[str]:
    return packed_sglang_hashes(pack_tokens(tokens), BS, FP, tenant)


def test_the_routers_sglang_hashes_are_sglangs_own_storage_keys(sglang) -> None:
    _, _, utils = sglang
    tokens = list(range(500, 523))  # five full pages and three tokens
    for tenant in ("", "harbour"):
        salt = sglang_cache_salt(FP, BS, tenant)
        theirs = utils.get_storage_hash_str(Key(tokens[:20], salt), None, page_size=BS)
        assert router_hashes(tokens, tenant) == theirs
        # The next turn goes on from the hashes known (the router's cache of prompts).
        known = router_hashes(tokens[:8], tenant)
        assert packed_sglang_hashes(pack_tokens(tokens), BS, FP, tenant, known=known) == theirs
    assert router_hashes(tokens, "harbour") != router_hashes(tokens, "customs")
    assert router_hashes(tokens, "") != packed_block_hashes(pack_tokens(tokens), BS, FP)


async def _through_sglangs_publisher(sglang, tmp_path: Path) -> None:
    from shared.engine.sglang.events import SglangEventBridge

    kv_events, events, _ = sglang
    said: list[tuple] = []

    async def publish(kind: str, hashes: list[str], tier: str, retention: str, size: int) -> None:
        said.append((kind, hashes, tier))

    replay = f"ipc://{tmp_path}/replay"
    bridge = SglangEventBridge(BS, publish, replay)
    endpoint = bridge.bind()
    bridge.start()
    publisher = kv_events.ZmqEventPublisher(
        attn_dp_rank=0, endpoint=endpoint, replay_endpoint=replay
    )
    recorder = events.KVCacheEventRecorder(enabled=True, page_size=BS)

    def send(*record) -> None:  # noqa: ANN002
        for what, node, medium in record:
            getattr(recorder, what)(node, medium)
        publisher.publish(kv_events.KVEventBatch(ts=time.time(), events=recorder.take()))

    async def dropped(*record) -> None:  # noqa: ANN002
        """``record`` sent while the bridge's feed drops batches, once one was dropped."""
        before = bridge.dropped
        faults.ACTIVE.add("kv_feed")
        try:
            send(*record)
            deadline = time.monotonic() + 10
            while bridge.dropped == before and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert bridge.dropped == before + 1, "the batch never reached the bridge"
        finally:
            faults.ACTIVE.discard("kv_feed")

    async def heard(n: int) -> list[tuple]:
        deadline = time.monotonic() + 10
        while len(said) < n and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        got = said[:]
        said.clear()
        return got

    try:
        tokens = list(range(900, 916))  # four pages, in nodes of two, one and one
        a = nodes(tokens, sglang_cache_salt(FP, BS, "harbour"), [8, 12])
        b = nodes(tokens[:8], sglang_cache_salt(FP, BS, "customs"), [])
        gpu, host = kv_events.StorageMedium.GPU, kv_events.StorageMedium.CPU
        # (Sent as soon as the publisher connects: if it is lost as ZMQ's late joiner, the
        # bridge's poll of SGLang's buffer brings it.)
        send(("record_store", a[0], gpu), ("record_store", a[1], gpu))
        ours = router_hashes(tokens, "harbour")
        assert await heard(1) == [("stored", ours[:3], "memory")]  # one merged event
        send(("record_store", b[0], gpu))
        theirs = router_hashes(tokens[:8], "customs")
        assert await heard(1) == [("stored", theirs, "memory")]
        assert not set(theirs) & set(ours)  # tenants apart

        # Host memory holds page 3 as GPU lets it go: still the worker's, then not.
        send(("record_store", a[1], host), ("record_remove", a[1], gpu))
        send(("record_remove", a[1], host))
        assert await heard(1) == [("removed", [ours[2]], "memory")]

        # A batch lost on the way (the feed dropped it): asked again from SGLang's buffer.
        more = list(range(700, 708))
        c = nodes(more, sglang_cache_salt(FP, BS, "harbour"), [4])
        send(("record_store", c[0], gpu))
        assert await heard(1) == [("stored", router_hashes(more[:4], "harbour"), "memory")]
        await dropped(("record_store", c[1], gpu))
        assert said == []
        send(("record_remove", b[0], gpu))
        got = await heard(2)
        next_page = router_hashes(more, "harbour")[1:]
        assert got == [("stored", next_page, "memory"), ("removed", theirs, "memory")]
        replayed = bridge.replayed
        assert replayed >= 1  # (the lost batch came again from SGLang's buffer)

        # The last batch lost, nothing after it: the poll of SGLang's buffer brings it.
        await dropped(("record_remove", c[1], gpu))
        assert await heard(1) == [("removed", next_page, "memory")]
        assert bridge.replayed == replayed + 1
    finally:
        faults.ACTIVE.discard("kv_feed")
        publisher.shutdown()
        await bridge.stop()


def test_sglangs_own_events_reach_kvmesh_under_the_routers_hashes(sglang, tmp_path: Path) -> None:
    asyncio.run(_through_sglangs_publisher(sglang, tmp_path))

"""The KV event wire format kvmesh reads without vLLM or SGLang installed
(shared/engine/kvwire.py), against each pinned release's own event types and encoder: a batch
vLLM's or SGLang's publisher would send reads back with every field kvmesh uses, and one that
cannot be read is refused with ValueError (the bridge starts over on it)."""

from __future__ import annotations

import msgspec
import pytest

from shared.engine import kvwire
from tests.sglang_release import load


def sent(batch: object) -> bytes:
    """A batch as the engines' publishers encode it (msgspec's msgpack encoder)."""
    return msgspec.msgpack.Encoder().encode(batch)


def test_vllms_batches_read_back_with_every_field_kvmesh_uses() -> None:
    kv_events = pytest.importorskip("vllm.distributed.kv_events", reason="the vllm extra")
    stored = kv_events.BlockStored(
        block_hashes=[2**63 - 5, b"\x01" * 32],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[("tenant-salt",), None],
        group_idx=0,
        session_id="s1",
    )
    batch = kv_events.KVEventBatch(
        ts=1.5,
        events=[
            stored,
            kv_events.BlockRemoved(block_hashes=[7], medium="GPU"),
            kv_events.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    got = kvwire.decode(sent(batch))
    assert [type(e).__name__ for e in got] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    first = got[0]
    assert first.block_hashes == [2**63 - 5, b"\x01" * 32]
    assert (first.parent_block_hash, first.token_ids, first.block_size) == (None, list(range(8)), 4)
    assert first.medium == "GPU" and first.extra_keys == [["tenant-salt"], None]
    assert got[1].block_hashes == [7]
    # Each field kvwire declares is one of vLLM's (a rename upstream fails here).
    ours = set(kvwire.BlockStored.__struct_fields__) - {"cache_salt"}
    assert ours <= set(kv_events.BlockStored.__struct_fields__)


def test_sglangs_batches_read_back_with_every_field_kvmesh_uses() -> None:
    load()
    from sglang.srt.disaggregation import kv_events

    batch = kv_events.KVEventBatch(
        ts=2.0,
        events=[
            kv_events.BlockStored(
                block_hashes=[11, 12],
                parent_block_hash=10,
                token_ids=list(range(8)),
                block_size=4,
                lora_id=None,
                medium="CPU_PINNED",
                cache_salt="seed",
            ),
            kv_events.BlockRemoved(block_hashes=[11], medium="GPU"),
        ],
        attn_dp_rank=1,
    )
    got = kvwire.decode(sent(batch))
    assert got[0].block_hashes == [11, 12] and got[0].parent_block_hash == 10
    assert got[0].cache_salt == "seed" and got[0].medium == "CPU_PINNED"
    assert got[1].block_hashes == [11] and got[1].medium == "GPU"
    ours = set(kvwire.BlockStored.__struct_fields__) - {"extra_keys"}
    assert ours <= set(kv_events.BlockStored.__struct_fields__)


def test_a_batch_that_cannot_be_read_is_refused() -> None:
    with pytest.raises(ValueError):
        kvwire.decode(b"\x93\xcb")  # (cut short)
    with pytest.raises(ValueError):
        kvwire.decode(msgspec.msgpack.encode([1.0, [{"type": "BlockStored"}]]))

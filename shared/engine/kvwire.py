"""The KV event wire format vLLM and SGLang publish over ZMQ, read without either installed.

Both engines send frames ``(topic, seq as 8 big-endian bytes, payload)``, the payload a
msgpack ``[ts, events, dp_rank]`` whose events are maps tagged by ``type``: ``BlockStored``,
``BlockRemoved``, ``AllBlocksCleared``. The two engines' ``BlockStored`` differ only in the
fields each adds (vLLM: ``extra_keys`` with the request's ``cache_salt`` in the first block's;
SGLang: ``cache_salt`` itself); the types here hold the union, and fields either adds later
are ignored. A router in front of servers it did not start reads their feeds with these, so
it needs neither engine's package; ``tests/engine/test_kvwire.py`` checks them against both
pinned releases' own types.

Block ids are the engines' own (vLLM: an int or bytes; SGLang: an int): only ever compared,
never read.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockId = int | bytes


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockId]
    parent_block_hash: BlockId | None
    token_ids: list[int | list[int]]  # (SGLang's EAGLE pages: bigrams, not kvmesh's)
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None  # (vLLM) per block; the first's holds the cache_salt
    cache_salt: str | None = None  # (SGLang)


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    block_hashes: list[BlockId]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    pass


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    rank: int | None = None  # the engine's data-parallel rank


DECODER = msgspec.msgpack.Decoder(type=EventBatch)
END_SEQ = -1  # a replay's last frame


def decode(payload: bytes) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    """The events of one batch (ValueError when they cannot be read)."""
    try:
        return DECODER.decode(payload).events
    except msgspec.DecodeError as err:
        raise ValueError(str(err)) from None

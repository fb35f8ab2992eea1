"""The engine KV event bridge's own rules (shared/engine/bridge.py), with a bridge whose
engine speaks JSON (a stand-in for vLLM's and SGLang's msgpack, named as such): batches in
sequence, a gap or an engine started over forgets what was known, a batch that came twice is
applied once, and a block is held while any medium of the engine holds it."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from shared.engine.bridge import KvEventBridge

BS = 2


class JsonBridge(KvEventBridge):
    """A stand-in engine's feed: JSON events; a block's hash is its tokens written out."""

    def decode(self, payload: bytes) -> list:
        try:
            events = json.loads(payload)
        except ValueError as err:
            raise ValueError(str(err)) from None
        return [type(e.pop("type"), (SimpleNamespace,), {})(**e) for e in events]

    def chain(self, event, parent: str | None) -> list[str]:  # noqa: ANN001
        out, t = [], event.token_ids
        for i in range(0, len(t) - 1, BS):
            parent = f"{parent or ''}{t[i]:02x}{t[i + 1]:02x}"
            out.append(parent)
        return out


def stored(ids: list[int], parent: int | None, tokens: list[int], medium: str = "GPU") -> dict:
    return dict(
        type="BlockStored",
        block_hashes=ids,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        medium=medium,
    )


def test_sequence_gaps_restarts_duplicates_and_media() -> None:
    said: list[tuple] = []

    async def publish(kind: str, hashes: list[str], tier: str, retention: str, size: int):
        said.append((kind, hashes))

    bridge = JsonBridge(BS, publish)

    async def run() -> None:
        def batch(seq: int, *events: dict):  # noqa: ANN202
            return bridge.batch(seq, json.dumps(list(events)).encode())

        await batch(0, stored([1, 2], None, [1, 2, 3, 4]))
        assert said == [("stored", ["0102", "01020304"])]
        removal = {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU"}
        await batch(1, stored([2], 1, [3, 4], "CPU"), removal)
        await batch(1, stored([9], None, [9, 9]))  # (batch 1 again: not applied twice)
        assert said[1:] == []  # host memory still holds block 2
        await batch(3, stored([5], None, [5, 6]))  # batch 2 lost: everything known forgotten
        assert said[1:] == [("removed", ["0102", "01020304"]), ("stored", ["0506"])]
        await batch(0, stored([7], None, [7, 8]))  # the engine started over
        assert said[3:] == [("removed", ["0506"]), ("stored", ["0708"])]
        await bridge.batch(1, b"not json")
        assert said[5:] == [("removed", ["0708"])] and bridge.cached() == []

    asyncio.run(run())

"""SGLang's KV events as kvmesh's (``shared/engine/bridge.py``).

SGLang's ``BlockStored`` carries its event ids (the first 8 bytes of a hash chain of its own),
the parent's, the blocks' token ids (consecutive stores merged into one event: split here by
the block size) and the request's ``cache_salt``. Each stored block gets the hash SGLang names
its page with in storage (SHA-256 chained from the ``cache_salt``'s seed:
``shared/kvstore/hashing.py``), which the router computes for the same prompt: a lookup finds
SGLang's blocks in its GPU and host memory and in the storage tier under one hash. A block is
the worker's while its GPU memory or its host memory (``CPU_PINNED``) holds it.

SGLang keeps its last batches for replay (a ROUTER socket at ``replay_endpoint``): a gap in
the sequence numbers (a batch lost, or sent before this side was connected) is asked for
again from there; only what is no longer kept makes the bridge start over.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from typing import Any

from shared.engine.bridge import KvEventBridge
from shared.engine.interface import BlockEvents
from shared.kvstore.hashing import sglang_chain, sglang_seed

log = logging.getLogger(__name__)

REPLAY_WAIT_S = 2.0  # for the replayed batches, each
REPLAY_POLL_S = 2.0  # how often SGLang's buffer is asked for batches past the last one here
END_SEQ = -1  # the replay's last frame


class SglangEventBridge(KvEventBridge):
    def __init__(self, block_size: int, publish: BlockEvents, replay_endpoint: str = "") -> None:
        super().__init__(block_size, publish)
        self.replay_endpoint = replay_endpoint
        self.replayed = 0  # batches that came again by replay

    def start(self) -> None:
        super().start()
        if self.replay_endpoint:
            self._tasks.append(asyncio.create_task(self._poll()))

    async def _poll(self) -> None:
        """Now and then, the batches past the last one applied, from SGLang's buffer: a lost
        batch is otherwise seen only when the next comes (or, the first ones, sent before
        this side was connected, never)."""
        while True:
            await asyncio.sleep(REPLAY_POLL_S)
            first = self.last_seq + 1
            got = await self._replay(first, 2**62, quiet=True)
            for n in sorted(got):
                if n == self.last_seq + 1:
                    self.replayed += 1
                    await self.take(n, got[n])

    def batch_type(self) -> type:
        from sglang.srt.disaggregation.kv_events import KVEventBatch

        return KVEventBatch

    def chain(self, event: Any, parent: str | None) -> list[str]:
        tokens = event.token_ids
        if tokens and not isinstance(tokens[0], int):  # (an EAGLE bigram page: not kvmesh's)
            return []
        packed = struct.pack(f"<{len(tokens)}I", *tokens)
        prev = bytes.fromhex(parent) if parent else sglang_seed(event.cache_salt)
        return sglang_chain(packed, self.block_size, prev)

    def stored(self, event: Any, medium: str) -> list[str]:
        # A merged event says the size of each block it holds: as many ids as full blocks.
        if event.block_size == self.block_size and len(event.token_ids) != self.block_size * len(
            event.block_hashes
        ):
            log.warning(
                "SGLang stored %d ids for %d tokens", len(event.block_hashes), len(event.token_ids)
            )
            return []
        return super().stored(event, medium)

    async def lost(self, first: int, seq: int) -> None:
        """Batches ``first``..``seq - 1`` asked for again from SGLang's replay socket."""
        got = await self._replay(first, seq) if self.replay_endpoint else {}
        if any(n not in got for n in range(first, seq)):
            await super().lost(first, seq)
            return
        log.info("KV events %d..%d from SGLang came again by replay", first, seq - 1)
        for n in range(first, seq):
            self.replayed += 1
            await self.batch(n, got[n])

    async def _replay(self, first: int, seq: int, quiet: bool = False) -> dict[int, bytes]:
        import zmq
        import zmq.asyncio

        socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        socket.connect(self.replay_endpoint)
        got: dict[int, bytes] = {}
        try:
            await socket.send_multipart((b"", first.to_bytes(8, "big")))
            while True:
                frames = await asyncio.wait_for(socket.recv_multipart(), REPLAY_WAIT_S)
                if len(frames) != 4:
                    break
                _, _, seq_bytes, payload = frames
                n = int.from_bytes(seq_bytes, "big", signed=True)
                if n == END_SEQ:
                    break
                if first <= n < seq:
                    got[n] = payload
        except TimeoutError:
            say = log.debug if quiet else log.warning
            say("SGLang's replay socket did not answer in %.0f s", REPLAY_WAIT_S)
        finally:
            socket.close(linger=0)
        return got

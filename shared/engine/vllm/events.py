"""vLLM's KV events as kvmesh's: which blocks its prefix cache holds, in kvmesh's hash space.

vLLM publishes its KV cache events over ZMQ (msgpack ``[ts, events, dp_rank]`` batches, each
under a sequence number): ``BlockStored`` with the blocks' token ids, vLLM's hashes and its
parent block's hash, ``BlockRemoved``, ``AllBlocksCleared``. The publisher connects; this side
binds (on 127.0.0.1, a port of its own). Each stored block gets **kvmesh's** hash, recomputed
from its tokens, chained on its parent's kvmesh hash (the first block's chain starts from the
model's fingerprint, the block size and the tenant salt vLLM carries as the block's
``cache_salt`` extra key), so the router's lookup for a prompt finds vLLM's blocks as it finds
the torch engine's. vLLM's hash → kvmesh's is kept to translate removals. A gap in the
sequence numbers (a batch lost) or an engine that starts over: everything known is reported
removed and the map starts again (blocks still cached are reported again as they are used).
"""

from __future__ import annotations

import asyncio
import logging

from shared import faults
from shared.engine.interface import BlockEvents
from shared.kvstore.hashing import pack_tokens, packed_block_hashes
from shared.kvstore.tiers import MEMORY, STORAGE

# The medium of the storage connector's events (shared/engine/vllm/connector.py), which carry
# kvmesh's hashes already: "kvmesh:<retention>:<bytes of each block's file>" (vLLM's events
# have no field for a size).
STORAGE_MEDIUM = "kvmesh"

log = logging.getLogger(__name__)


class KvEventBridge:
    def __init__(self, fingerprint: str, block_size: int, publish: BlockEvents) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.publish = publish
        self.ours: dict[object, str] = {}  # vLLM's block hash → kvmesh's
        self.last_seq = -1
        self._socket = None
        self._task: asyncio.Task | None = None
        self.endpoint = ""  # what vLLM's publisher connects to

    def bind(self) -> str:
        """Open the subscriber (before vLLM starts: it connects as it starts)."""
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        return self.endpoint

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)

    async def _run(self) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
        assert self._socket is not None
        while True:
            _, seq_bytes, payload = await self._socket.recv_multipart()
            if faults.on("kv_feed"):  # (a test: the engine's feed goes quiet)
                continue
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            try:
                batch = decode(payload)
            except msgspec.DecodeError as err:
                log.warning("a KV event batch vLLM sent could not be read: %s", err)
                await self.resync()
                continue
            if self.last_seq >= 0 and seq != self.last_seq + 1:
                log.warning("KV events %d..%d from vLLM were lost: resync", self.last_seq + 1, seq)
                await self.resync()
            self.last_seq = seq
            try:
                await self.apply(batch.events)
            except Exception:  # one bad batch must not stop the bridge
                log.exception("KV event batch %d", seq)

    async def resync(self) -> None:
        """Forget every block: reported removed (the engine reports them again when used)."""
        gone, self.ours = list(self.ours.values()), {}
        await self.publish("removed", gone, MEMORY, "chat", 0)

    async def apply(self, events: list) -> None:
        stored: list[str] = []
        removed: list[str] = []
        for event in events:
            kind = type(event).__name__
            medium = getattr(event, "medium", None) or ""
            if medium.startswith(f"{STORAGE_MEDIUM}:"):  # the storage connector's: our hashes
                _, retention, size = (medium.split(":") + ["0"])[:3]
                hashes = [bytes(h).hex() for h in event.block_hashes]
                change = "stored" if kind == "BlockStored" else "removed"
                await self.publish(change, hashes, STORAGE, retention, int(size or 0))
            elif kind == "BlockStored":
                stored += self.stored(event)
            elif kind == "BlockRemoved":
                removed += [h for b in event.block_hashes if (h := self.ours.pop(b, None))]
            elif kind == "AllBlocksCleared":
                removed += list(self.ours.values())
                self.ours.clear()
        if removed:
            await self.publish("removed", removed, MEMORY, "chat", 0)
        if stored:
            await self.publish("stored", stored, MEMORY, "chat", 0)

    def stored(self, event) -> list[str]:  # noqa: ANN001 (vllm's BlockStored)
        """kvmesh's hashes of a BlockStored's blocks (none when its parent is unknown)."""
        if event.block_size != self.block_size:
            log.warning(
                "vLLM stored blocks of %d tokens, not %d", event.block_size, self.block_size
            )
            return []
        parent = event.parent_block_hash
        known = [] if parent is None else [self.ours.get(parent)]
        if None in known:
            return []  # its prefix was never reported (or was forgotten): not addressable
        salt = ""
        extra = (event.extra_keys or [None])[0] if parent is None else None
        for key in extra or ():
            if isinstance(key, str):
                salt = key
        out = packed_block_hashes(
            pack_tokens(event.token_ids), self.block_size, self.fingerprint, salt, (), known, 0
        )[len(known) :]
        for vllm_hash, ours in zip(event.block_hashes, out, strict=False):
            self.ours[vllm_hash] = ours
        return out

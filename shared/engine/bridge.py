"""An engine's own KV cache events as kvmesh's: which blocks its prefix cache holds, in the
hash space the router looks prompts up in.

vLLM and SGLang publish their cache events the same way, over ZMQ: frames ``(topic, seq as 8
big-endian bytes, msgpack [ts, events, dp_rank])``, the events ``BlockStored`` (the blocks'
token ids, the engine's ids for them, its id of the block before the first), ``BlockRemoved``
and ``AllBlocksCleared`` (read alike for both: ``kvwire.py``). Each engine's subclass says how
its blocks are named in kvmesh's hash space (``chain``): the bridge recomputes each stored
block's hash from its tokens, chained on its parent's (the engine's ids are not the router's
hashes), and keeps the engine's id → kvmesh's to translate removals.

A block may sit in more than one medium of the engine at once (SGLang's GPU and host memory):
it is held by the worker while any medium holds it, and is reported removed when the last
lets it go.

Both engines keep their last batches for replay (a ROUTER socket at ``replay_endpoint``): a gap
in the sequence numbers (a batch lost, or sent before this side was connected) is asked for
again from there, and the buffer is polled now and then for batches past the last one applied
(the first ones, sent before a subscriber joined, are otherwise never seen). Only what is no
longer kept, or a feed with no replay socket, makes the bridge start over: everything known is
reported removed (blocks still cached are reported again as they are used).

The feed is the engine's publisher: it connects to the bridge's socket (``bind``, an engine
this worker started), or the bridge connects to it (``connect``, a server the router reaches
over the network, whose publisher binds).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from shared import faults
from shared.engine import kvwire
from shared.engine.interface import BlockEvents
from shared.messages.kvevents import MEMORY

log = logging.getLogger(__name__)

REPLAY_WAIT_S = 2.0  # for the replayed batches, each
REPLAY_POLL_S = 2.0  # how often the engine's buffer is asked for batches past the last one here


class KvEventBridge:
    block_size: int

    def __init__(self, block_size: int, publish: BlockEvents, replay_endpoint: str = "") -> None:
        self.block_size = block_size
        self.publish = publish
        self.replay_endpoint = replay_endpoint
        self.replayed = 0  # batches that came again by replay
        self.batches = 0  # batches applied
        self.heard_at = 0.0  # (monotonic) when the last batch came
        self.ours: dict[Any, str] = {}  # the engine's block id → kvmesh's hash
        self.media: dict[Any, set[str]] = {}  # the engine's block id → the media holding it
        self.last_seq = -1
        self.dropped = 0  # batches the kv_feed fault hook dropped
        self._socket = None
        self._tasks: list[asyncio.Task] = []
        self._applying = asyncio.Lock()
        self.endpoint = ""

    # -- what an engine's subclass says ---------------------------------------------------

    def decode(self, payload: bytes) -> list:
        """The events of one batch (raises ValueError when they cannot be read)."""
        return kvwire.decode(payload)

    def chain(self, event: Any, parent: str | None) -> list[str]:
        """kvmesh's hashes of a BlockStored's full blocks, going on from ``parent`` (kvmesh's
        hash of the block before them; None when they start the prompt)."""
        raise NotImplementedError

    async def other(self, event: Any) -> bool:
        """An event the subclass handles itself (True when it did)."""
        return False

    async def lost(self, first: int, seq: int) -> None:
        """Batches ``first``..``seq - 1`` never came: asked for again from the engine's replay
        socket; what it no longer keeps makes the bridge start over."""
        got = await self._replay(first, seq) if self.replay_endpoint else {}
        if any(n not in got for n in range(first, seq)):
            log.warning("KV events %d..%d from the engine were lost: resync", first, seq - 1)
            await self.resync()
            return
        log.info("KV events %d..%d came again by replay", first, seq - 1)
        for n in range(first, seq):
            self.replayed += 1
            await self.batch(n, got[n])

    # -- the feed -------------------------------------------------------------------------

    def bind(self) -> str:
        """Open the subscriber for the engine's publisher to connect to (before the engine
        starts: it connects as it starts)."""
        port = self._subscriber().bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        return self.endpoint

    def connect(self, endpoint: str) -> None:
        """Subscribe to a publisher that binds ``endpoint`` (a server's, over the network;
        ZMQ connects again by itself when it comes back)."""
        self._subscriber().connect(endpoint)
        self.endpoint = endpoint

    def _subscriber(self):  # noqa: ANN202 (a zmq.asyncio socket)
        import zmq
        import zmq.asyncio

        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        return self._socket

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._run())]
        if self.replay_endpoint:
            self._tasks.append(asyncio.create_task(self._poll()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)

    async def _run(self) -> None:
        assert self._socket is not None
        while True:
            _, seq_bytes, payload = await self._socket.recv_multipart()
            if faults.on("kv_feed"):  # (a test: the engine's feed goes quiet)
                self.dropped += 1
                continue
            await self.take(int.from_bytes(seq_bytes, "big", signed=True), payload)

    async def _poll(self) -> None:
        """Now and then, the batches past the last one applied, from the engine's buffer: a
        lost batch is otherwise seen only when the next comes."""
        while True:
            await asyncio.sleep(REPLAY_POLL_S)
            got = await self._replay(self.last_seq + 1, 2**62, quiet=True)
            for n in sorted(got):
                if n == self.last_seq + 1:
                    self.replayed += 1
                    await self.take(n, got[n])

    async def _replay(self, first: int, seq: int, quiet: bool = False) -> dict[int, bytes]:
        """Batches ``first``..``seq - 1`` that the engine's replay socket still keeps."""
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
                if n == kvwire.END_SEQ:
                    break
                if first <= n < seq:
                    got[n] = payload
        except TimeoutError:
            say = log.debug if quiet else log.warning
            say("the engine's replay socket did not answer in %.0f s", REPLAY_WAIT_S)
        finally:
            socket.close(linger=0)
        return got

    async def take(self, seq: int, payload: bytes) -> None:
        """A batch, applied after any other being applied (the feed's and a replay's)."""
        async with self._applying:
            await self.batch(seq, payload)

    async def batch(self, seq: int, payload: bytes) -> None:
        """One batch as it came, numbered ``seq``."""
        if seq == 0 and self.last_seq >= 0:  # the engine started over: so does the map
            await self.resync()
            self.last_seq = -1
        elif seq <= self.last_seq:
            return  # (a replayed batch already applied)
        if seq != self.last_seq + 1:
            await self.lost(self.last_seq + 1, seq)
        try:
            events = self.decode(payload)
        except ValueError as err:
            log.warning("a KV event batch the engine sent could not be read: %s", err)
            await self.resync()
            self.last_seq = seq
            return
        self.last_seq = seq
        self.batches += 1
        self.heard_at = time.monotonic()
        try:
            await self.apply(events)
        except Exception:  # one bad batch must not stop the bridge
            log.exception("KV event batch %d", seq)

    async def resync(self) -> None:
        """Forget every block: reported removed (the engine reports them again when used)."""
        gone, self.ours, self.media = list(self.ours.values()), {}, {}
        await self.publish("removed", gone, MEMORY, "chat", 0)

    async def apply(self, events: list) -> None:
        stored: list[str] = []
        removed: list[str] = []
        for event in events:
            kind = type(event).__name__
            medium = getattr(event, "medium", None) or ""
            if await self.other(event):
                continue
            if kind == "BlockStored":
                stored += self.stored(event, medium)
            elif kind == "BlockRemoved":
                for block in event.block_hashes:
                    held = self.media.get(block)
                    if held is None:
                        continue
                    held.discard(medium)
                    if not held:
                        del self.media[block]
                        removed.append(self.ours.pop(block))
            elif kind == "AllBlocksCleared":
                removed += list(self.ours.values())
                self.ours.clear()
                self.media.clear()
        if removed:
            await self.publish("removed", removed, MEMORY, "chat", 0)
        if stored:
            await self.publish("stored", stored, MEMORY, "chat", 0)

    def stored(self, event: Any, medium: str) -> list[str]:
        """kvmesh's hashes of a BlockStored's blocks new to the worker (none when its parent
        is unknown: its prefix was never reported, or was forgotten)."""
        if event.block_size != self.block_size:
            log.warning(
                "the engine stored blocks of %d tokens, not %d", event.block_size, self.block_size
            )
            return []
        parent = event.parent_block_hash
        known = None if parent is None else self.ours.get(parent)
        if parent is not None and known is None:
            return []
        new = []
        for block, ours in zip(event.block_hashes, self.chain(event, known), strict=False):
            held = self.media.setdefault(block, set())
            if not held:
                self.ours[block] = ours
                new.append(ours)
            held.add(medium)
        return new

    def cached(self) -> list[str]:
        """kvmesh's hashes of every block the engine holds, as its events said."""
        return list(self.ours.values())

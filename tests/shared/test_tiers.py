"""The write-behind queue (shared/kvstore/tiers.py) on a real NATS and real files: queueing
never waits for the disk, the queue is bounded, and what overflows is counted, not stored."""

from __future__ import annotations

import asyncio
import threading
from contextlib import AsyncExitStack
from pathlib import Path

from shared.kvindex.publisher import KvEventPublisher
from shared.kvstore.backend import FileStore
from shared.kvstore.tiers import KvTiers
from tests.procs import connect_as, until


class GatedStore(FileStore):
    """Real files, written only once the test opens the gate (a disk that is slow on cue)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.gate = threading.Event()

    def put(self, key: str, blob: bytes) -> list[str]:
        self.gate.wait(30)
        return super().put(key, blob)


def keys(n: int, seed: int) -> list[str]:
    return [f"{seed:02x}{i:030x}" for i in range(n)]


async def test_queueing_never_waits_for_the_disk_and_overflow_is_counted(
    nats_url: str, mesh_secrets: Path, tmp_path: Path
) -> None:
    store = GatedStore(tmp_path)
    async with AsyncExitStack() as stack:
        bus = await connect_as(nats_url, "prefill", mesh_secrets)
        stack.push_async_callback(bus.close)
        events = KvEventPublisher(bus, "prefill", "w-0", epoch=1.0)
        tiers = KvTiers(bus, events, memory_bytes=0, store=store, queue_blocks=6)
        await tiers.start(stack)
        first, second = keys(4, 1), keys(4, 2)
        # The disk is stuck: queueing returns at once all the same (the first token is sent
        # right after this call on the request's path).
        assert tiers.write_behind(first, [b"a" * 100] * 4, "chat") == 0
        await asyncio.sleep(0)  # the writer takes the first batch and blocks on the disk
        assert tiers.write_behind(second, [b"b" * 100] * 4, "chat") == 2  # 6 at most
        assert (tiers.queued_blocks, tiers.skipped_blocks) == (6, 2)
        assert not any(k in store for k in first + second)
        store.gate.set()

        async def written() -> bool:
            return tiers.written_blocks == 6

        await until(written, 30, "the queued blocks written")
        assert tiers.queued_blocks == 0
        assert all(k in store for k in first + second[:2])
        assert not any(k in store for k in second[2:])  # skipped, never written
        # An event per batch the writer took (the first 4 blocks, then 2), numbered; each block
        # queued was announced (none waits for its event).
        assert (events.made, events.lost, events.unannounced_s()) == (2, 0, 0.0)

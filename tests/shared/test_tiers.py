"""The write-behind queue (shared/kvstore/tiers.py) on a real NATS and real files: queueing
never waits for the disk, the queue is bounded, and what overflows is counted, not stored; a
tier that fills or turns read-only degrades to the memory tier, and recovers."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

from shared.kvindex.publisher import KvEventPublisher
from shared.kvstore.backend import FileStore
from shared.kvstore.tiers import KvTiers
from tests.mounts import remount, small_tmpfs
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
        # (room for six of the blocks below)
        tiers = KvTiers(bus, events, memory_bytes=0, store=store, queue_bytes=600)
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


async def test_a_storage_tier_that_fills_or_turns_read_only_degrades_to_memory_only(
    nats_url: str, mesh_secrets: Path, tmp_path: Path
) -> None:
    """A real tmpfs of 64 KiB: the writes that fit are stored and announced, then the tier
    says "full" and its blocks stay in memory (counted, no temp file left behind); read-only
    says "read_only"; once writable again, the next write after the retry interval works and
    the state clears. Reads go on all along."""
    with small_tmpfs(tmp_path / "tier", 64) as root:
        store = FileStore(root)
        async with AsyncExitStack() as stack:
            bus = await connect_as(nats_url, "prefill", mesh_secrets)
            stack.push_async_callback(bus.close)
            events = KvEventPublisher(bus, "prefill", "w-0", epoch=1.0)
            tiers = KvTiers(bus, events, 1 << 20, store, queue_bytes=64 << 20, retry_s=0.3)
            await tiers.start(stack)
            blob = os.urandom(12 << 10)
            first = keys(12, 3)
            tiers.write_behind(first, [blob] * 12, "chat")

            def written(n: int) -> Callable[[], Awaitable[bool]]:
                async def check() -> bool:
                    return tiers.written_blocks >= n

                return check

            async def retry_due() -> bool:
                return tiers.store_retry_in_s == 0

            await until(written(12), 30, "the first blocks handled")
            stored = [k for k in first if k in store]
            assert 0 < len(stored) < 12 and first[: len(stored)] == stored
            assert tiers.store_error == "full" and tiers.unstored_blocks == 12 - len(stored)
            assert all(k in tiers.memory for k in first)  # the memory tier has them all
            assert not list(root.rglob("*.tmp"))  # the write that failed left nothing
            # Reads still work: the stored ones come back from the files.
            assert len(await asyncio.to_thread(tiers._read_files, stored)) == len(stored)

            remount(root, "ro")
            await until(retry_due, 5, "the retry interval over")  # the next write tries
            tiers.write_behind(keys(2, 4), [blob] * 2, "chat")
            await until(written(14), 30, "the read-only try")
            assert tiers.store_error == "read_only"

            remount(root, "rw")
            for k in stored:
                store.delete(k)
            tiers.write_behind(keys(2, 5), [blob] * 2, "chat")  # within the interval: skipped
            await until(written(16), 30, "the skipped ones")
            assert not any(k in store for k in keys(2, 5)) and tiers.store_error == "read_only"
            assert tiers.store_retry_in_s > 0
            await until(retry_due, 5, "the retry interval over")
            tiers.write_behind(keys(2, 6), [blob] * 2, "chat")
            await until(written(18), 30, "the write after the interval")
            assert all(k in store for k in keys(2, 6)) and tiers.store_error == ""
            assert tiers.unstored_blocks == 12 - len(stored) + 2 + 2


def test_a_block_file_that_cannot_be_read_is_a_miss_counted(tmp_path: Path) -> None:
    store = FileStore(tmp_path)
    key = keys(1, 7)[0]
    store.path(key).mkdir()  # where the file should be: reading it fails (EISDIR)
    assert store.get(key) is None and store.read_errors == 1

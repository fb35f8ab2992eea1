"""A holder's own copy of the index (a router's): cachemeta's latest snapshot, then the KV
event stream from the snapshot's position on, applied as it comes (an ordered consumer: in
stream order, none skipped; after a reconnect it resumes where it was).

Starting, it reads the snapshot and catches up with the stream as it stood: until then it
says it is not caught up, and how long that took is reported. No snapshot yet (a young mesh):
the whole stream, from its first message.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from contextlib import AsyncExitStack

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from shared.bus import Bus, BusError, subjects
from shared.kvindex import table
from shared.kvindex.view import DEFAULT_TTL_S, KvIndex, SnapshotError

log = logging.getLogger(__name__)

SNAPSHOT_SEQ = "Kvmesh-Index-Seq"
SNAPSHOT_DIGEST = "Kvmesh-Index-Sha256"
SNAPSHOT_TRIES = 3  # a snapshot replaced while it was read: read again


async def publish_snapshot(bus: Bus, data: bytes, seq: int) -> None:
    """The snapshot where holders find it: the last message of its subject (in parts)."""
    await bus.put_last(
        subjects.KV_INDEX_SNAPSHOT,
        data,
        headers={SNAPSHOT_SEQ: str(seq), SNAPSHOT_DIGEST: hashlib.sha256(data).hexdigest()},
        retry_s=10,
    )


async def read_snapshot(bus: Bus) -> bytes | None:
    """The latest snapshot; None when there is none (or none whole: a warning)."""
    for _ in range(SNAPSHOT_TRIES):
        try:
            stored = await bus.read_last(subjects.KV_INDEX_STREAM, subjects.KV_INDEX_SNAPSHOT)
        except BusError as err:  # a part gone: replaced while it was read
            log.info("index snapshot: %s; reading again", err)
            continue
        if stored is None:
            return None
        data, headers = stored
        if hashlib.sha256(data).hexdigest() == headers.get(SNAPSHOT_DIGEST):
            return data
    log.warning("the index snapshot changed each time it was read: following the stream")
    return None


class IndexFollower:
    def __init__(self, bound_s: float, catch_up_s: float = 60.0) -> None:
        self.catch_up_s = catch_up_s
        self.index = KvIndex(DEFAULT_TTL_S, lru=False, bound_s=bound_s)
        self.caught_up = asyncio.Event()
        self.took_s = 0.0  # snapshot read and stream caught up, at start
        self.from_snapshot = 0  # blocks the snapshot held

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        started = time.monotonic()
        await asyncio.to_thread(table.warm)  # (compiled before the loop needs it)
        await bus.ensure_stream(
            subjects.KV_EVENTS_STREAM, [subjects.KV_EVENTS_ALL], create_only=True
        )
        await bus.ensure_stream(
            subjects.KV_INDEX_STREAM,
            [subjects.KV_INDEX_ALL],
            last_per_subject=True,
            create_only=True,
        )
        data = await read_snapshot(bus)
        if data is not None:
            try:
                index = await asyncio.to_thread(
                    KvIndex.from_snapshot, data, None, False, self.index.feeds.bound_s
                )
            except SnapshotError as err:
                log.warning("index snapshot unreadable (%s): following the whole stream", err)
            else:
                self.index, self.from_snapshot = index, len(index)
        target = (await bus.js.stream_info(subjects.KV_EVENTS_STREAM)).state.last_seq
        if self.index.seq >= target:
            self.caught_up.set()
        start = self.index.seq + 1
        config = ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start > 1 else DeliverPolicy.ALL,
            opt_start_seq=start if start > 1 else None,
        )

        async def on_msg(raw: Msg) -> None:
            seq = raw.metadata.sequence.stream
            self.index.apply_message(raw.data, seq)
            if seq >= target and not self.caught_up.is_set():
                self.caught_up.set()

        sub = await bus.js.subscribe(
            subjects.KV_EVENTS_ALL,
            stream=subjects.KV_EVENTS_STREAM,
            ordered_consumer=True,
            config=config,
            cb=on_msg,
        )
        stack.push_async_callback(sub.unsubscribe)
        try:
            await asyncio.wait_for(self.caught_up.wait(), self.catch_up_s)
        except TimeoutError:
            log.warning(
                "index: not caught up with the KV event stream within %g s (at %d of %d); "
                "routing by what it has",
                self.catch_up_s,
                self.index.seq,
                target,
            )
        self.took_s = time.monotonic() - started
        log.info(
            "index: %d blocks (%d from a snapshot at stream position %d), caught up to %d "
            "in %.2f s",
            len(self.index),
            self.from_snapshot,
            start - 1,
            self.index.seq,
            self.took_s,
        )

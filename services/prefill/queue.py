"""The prefill queue: online tasks before batch work, each in the order they arrived,
including those that join late.

A task with images joins once its embeddings are here, but keeps the place it had when it
arrived: encoding overlaps its wait in the queue instead of adding to it, and a slow encode
holds up nobody else. A batch task waits while any online task is queued, and a batch
prefill in progress pauses between two chunks when one arrives (an online task waits for one
batch chunk at most).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

from shared.messages.generate import GenerateTask

RANKS = {"online": 0, "batch": 1}


class ArrivalQueue:
    def __init__(self) -> None:
        self._queue: asyncio.PriorityQueue[tuple[int, int, GenerateTask]] = asyncio.PriorityQueue()
        self._arrivals = itertools.count()
        self._resumed = itertools.count(-1, -1)  # before every batch task that arrived
        self.online_waiting = 0  # (read by the engine thread: pause a batch prefill for them)

    def ticket(self) -> int:
        """A task's place, taken when it arrives."""
        return next(self._arrivals)

    def put(self, task: GenerateTask, ticket: int | None = None) -> None:
        rank = RANKS[task.priority]
        self.online_waiting += rank == 0
        self._queue.put_nowait((rank, self.ticket() if ticket is None else ticket, task))

    def put_first(self, task: GenerateTask) -> None:
        """A paused batch prefill: it goes on once no online task waits, before other batch
        work (it holds its blocks meanwhile)."""
        self.put(task, next(self._resumed))

    async def get(self) -> GenerateTask:
        rank, _, task = await self._queue.get()
        self.online_waiting -= rank == 0
        return task

    def peek(self) -> GenerateTask | None:
        heap = self._queue._queue  # type: ignore[attr-defined]  # a heap: [0] comes next
        return heap[0][2] if heap else None

    def __iter__(self) -> Iterator[GenerateTask]:
        return iter([task for *_, task in self._queue._queue])  # type: ignore[attr-defined]

    def qsize(self) -> int:
        return self._queue.qsize()

    def empty(self) -> bool:
        return self._queue.empty()

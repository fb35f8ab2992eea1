"""The prefill queue: by class, then by the first token's due time where a client set one,
then each tenant its share by weight (start-time fair queueing), then arrival.

A class goes before every lower one (``shared/messages/generate.py``). Within a class, tasks
whose client said when the first token is due go first, soonest first (the router refuses up
front those it estimates cannot make it). The others are shared between tenants by weight: a
task's tag is its tenant's virtual time when it arrived, or the end of its tenant's previous
task's share if later (each task's share: its prompt's tokens ÷ its tenant's weight), and the
lowest tag goes next; the queue's virtual time is the tag of the last task taken. A tenant
sending ten times more then waits behind its own work, not in front of everyone's.

A task with images joins once its embeddings are here, but keeps the place it had when it
arrived: encoding overlaps its wait in the queue instead of adding to it, and a slow encode
holds up nobody else. A batch task waits while any task of a higher class is queued, and a
batch prefill in progress pauses between two chunks when one arrives (such a task waits for
one batch chunk at most).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from shared.messages.generate import RANKS, GenerateTask
from shared.telemetry.metrics import QUEUE_WAIT, QUEUED

BATCH = RANKS["batch"]


@dataclass(frozen=True)
class Ticket:
    """A task's place, taken when it arrived: its arrival number and its fair-share tag."""

    arrival: int
    tag: float
    at: float = field(default_factory=time.monotonic)  # (its wait is counted from then)


class ArrivalQueue:
    def __init__(self) -> None:
        self._queue: asyncio.PriorityQueue[tuple[tuple, float, GenerateTask]] = (
            asyncio.PriorityQueue()
        )
        self.by_class: Counter[str] = Counter()  # tasks queued, per class
        self._arrivals = itertools.count()
        self._resumed = itertools.count(-1, -1)  # before every batch task that arrived
        self.online_waiting = 0  # tasks above batch (read by the engine thread: they pause it)
        self.virtual = 0.0  # the tag of the last task taken
        self._finish: dict[str, float] = {}  # per tenant: where its last task's share ends

    def ticket(self, task: GenerateTask) -> Ticket:
        """A task's place, taken when it arrives (its tenant's share counted from then)."""
        start = max(self.virtual, self._finish.get(task.salt, 0.0))
        self._finish[task.salt] = start + max(1, len(task.token_ids)) / task.weight
        return Ticket(next(self._arrivals), start)

    def put(self, task: GenerateTask, ticket: Ticket | None = None) -> None:
        ticket = ticket or self.ticket(task)
        rank = RANKS[task.priority]
        self.online_waiting += rank < BATCH
        due = task.ttft_first_by or math.inf
        self._queue.put_nowait(((rank, due, ticket.tag, ticket.arrival), ticket.at, task))
        self._count(task.priority, 1)

    def put_first(self, task: GenerateTask) -> None:
        """A paused batch prefill: it goes on once no task of a higher class waits, before
        other batch work (it holds its blocks meanwhile)."""
        self.put(task, Ticket(next(self._resumed), -math.inf))

    async def get(self) -> GenerateTask:
        (rank, _, tag, _), at, task = await self._queue.get()
        self.online_waiting -= rank < BATCH
        self._count(task.priority, -1)
        QUEUE_WAIT.labels(task.priority).observe(time.monotonic() - at)
        if tag > self.virtual:
            self.virtual = tag
        self._forget_idle()
        return task

    def _count(self, priority: str, n: int) -> None:
        self.by_class[priority] += n
        QUEUED.labels(priority).set(self.by_class[priority])

    def _forget_idle(self) -> None:
        """Tenants whose shares end before the queue's virtual time are as new ones: forgotten
        (their entries would otherwise grow with every tenant ever seen)."""
        if len(self._finish) > 4 * (self.qsize() + 16):
            self._finish = {t: f for t, f in self._finish.items() if f > self.virtual}

    def peek(self) -> GenerateTask | None:
        heap = self._queue._queue  # type: ignore[attr-defined]  # a heap: [0] comes next
        return heap[0][2] if heap else None

    def __iter__(self) -> Iterator[GenerateTask]:
        return iter([task for *_, task in self._queue._queue])  # type: ignore[attr-defined]

    def qsize(self) -> int:
        return self._queue.qsize()

    def empty(self) -> bool:
        return self._queue.empty()

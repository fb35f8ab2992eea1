"""Scripted workers for in-process dispatch tests: they speak the mesh's wire protocol over a
real nats-server (tasks with request/reply, token events on the router's reply subject,
cancels) and answer as the test scripts them. No engine and no kvmesh process: these tests
are about the router's dispatch, not the model.

A script is a coroutine ``script(worker, task) -> TaskAck``; what it publishes afterwards (in
a task of its own, so the ack goes first) is up to it: ``tokens`` publishes an answer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from services.router.dispatch.workers import WorkerRegistry
from shared.bus import Bus, subjects
from shared.messages.generate import Cancel, GenerateTask, TaskAck, TokenEvent, TokenEvents
from shared.messages.heartbeat import Heartbeat, Load

Script = Callable[["ScriptedWorker", GenerateTask], Awaitable[TaskAck]]


@dataclass
class ScriptedWorker:
    bus: Bus
    role: str  # prefill or decode
    service_id: str
    script: Script
    kv_blocks: int = 64
    tasks: list[GenerateTask] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    _running: set[asyncio.Task] = field(default_factory=set)

    def heartbeat(self, status: str = "ready") -> Heartbeat:
        now = time.time()
        return Heartbeat(
            service_id=self.service_id,
            role=self.role,
            version="test",
            status=status,
            addresses={"kv": f"127.0.0.1:1{self.service_id[-1]}"},
            models=["tiny"],
            load=Load(kv_blocks_total=self.kv_blocks, kv_block_size=16),
            interval_s=1.0,
            started_at=now - 1,
            sent_at=now,
        )

    async def start(self, registry: WorkerRegistry) -> None:
        await self.bus.serve(subjects.tasks(self.role, self.service_id), GenerateTask, self._task)
        await self.bus.subscribe(subjects.CANCEL, Cancel, self._cancel)
        registry.observe(self.heartbeat(), time.monotonic())

    async def _task(self, task: GenerateTask) -> TaskAck:
        self.tasks.append(task)
        return await self.script(self, task)

    async def _cancel(self, cancel: Cancel) -> None:
        if any(t.request_id == cancel.request_id for t in self.tasks):
            self.cancelled.append(cancel.request_id)

    def later(self, work: Awaitable[None]) -> None:
        """Run ``work`` after the ack is out (held until it ends)."""
        task = asyncio.ensure_future(work)
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def publish(self, task: GenerateTask, *events: TokenEvent) -> None:
        await self.bus.publish(task.reply_subject, TokenEvents(events=list(events)))

    def event(self, task: GenerateTask, index: int, tokens: list[int], **fields) -> TokenEvent:  # noqa: ANN003
        return TokenEvent(
            request_id=task.request_id,
            index=index,
            token_ids=tokens,
            worker_id=fields.pop("worker_id", self.service_id),
            **fields,
        )


def tokens(answer: list[int], per_event: int = 1, gap_s: float = 0.0, stop_at: int = -1) -> Script:
    """Accept, then publish ``answer`` (after the tokens the task says were sent already) in
    events of ``per_event`` tokens, the last with finish_reason "length"; ``stop_at``: go
    silent after that many tokens of this task (a frozen worker)."""

    async def script(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        rest = answer[task.sampling.answer_offset :][: task.sampling.max_tokens]

        async def send() -> None:
            for i in range(0, len(rest), per_event):
                if 0 <= stop_at <= i:
                    return
                chunk = rest[i : i + per_event]
                last = i + per_event >= len(rest)
                extra = {"cached_tokens": 0, "prefill_s": 0.01} if i == 0 else {}
                event = worker.event(
                    task, i, chunk, finish_reason="length" if last else None, **extra
                )
                await worker.publish(task, event)
                if gap_s:
                    await asyncio.sleep(gap_s)

        worker.later(send())
        return TaskAck(accepted=True)

    return script


def busy() -> Script:
    async def script(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        return TaskAck(accepted=False, reason="busy")

    return script


def silent(for_s: float = 0.3) -> Script:
    """Acks too late (a frozen worker: the router's ask times out first)."""

    async def script(worker: ScriptedWorker, task: GenerateTask) -> TaskAck:
        await asyncio.sleep(for_s)
        return TaskAck(accepted=False, reason="too late")

    return script

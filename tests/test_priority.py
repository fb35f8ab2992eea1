"""Online requests before batch work: the prefill queue's order (services/prefill/queue.py)."""

from __future__ import annotations

import time

from services.prefill.queue import ArrivalQueue
from shared.engine.sampling import SamplingParams
from shared.messages.generate import GenerateTask


def task(rid: str, priority: str = "online") -> GenerateTask:
    return GenerateTask(
        request_id=rid,
        model="tiny",
        token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4),
        reply_subject="kvmesh.reply.r",
        decode_id="decode-0",
        decode_kv_address="127.0.0.1:1",
        deadline=time.time() + 60,
        priority=priority,
    )


async def test_online_tasks_go_before_batch_work_each_in_arrival_order() -> None:
    queue = ArrivalQueue()
    late = queue.ticket()  # an online task that arrived first but joins late (its images)
    for rid, priority in [("b1", "batch"), ("o1", "online"), ("b2", "batch"), ("o2", "online")]:
        queue.put(task(rid, priority))
    queue.put(task("b3", "batch"))
    queue.put(task("o0", "online"), late)
    assert queue.peek().request_id == "o0"
    got = [(await queue.get()).request_id for _ in range(6)]
    assert got == ["o0", "o1", "o2", "b1", "b2", "b3"]

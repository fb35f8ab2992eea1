"""The prefill queue's order (services/prefill/queue.py): by class, then due time, then each
tenant its share by weight, then arrival; a task joining late keeps its place."""

from __future__ import annotations

import time

from services.prefill.queue import ArrivalQueue
from shared.messages.generate import GenerateTask
from shared.messages.sampling import SamplingParams


def task(
    rid: str,
    priority: str = "default",
    tenant: str = "t",
    weight: int = 1,
    tokens: int = 3,
    due: float = 0.0,
) -> GenerateTask:
    return GenerateTask(
        request_id=rid,
        model="tiny",
        token_ids=[1] * tokens,
        sampling=SamplingParams(max_tokens=4),
        reply_subject="kvmesh.reply.r",
        decode_id="decode-0",
        decode_kv_address="127.0.0.1:1",
        deadline=time.time() + 60,
        priority=priority,
        salt=tenant,
        weight=weight,
        ttft_first_by=due,
    )


async def drain(queue: ArrivalQueue) -> list[str]:
    return [(await queue.get()).request_id for _ in range(queue.qsize())]


async def test_a_scripted_burst_goes_by_class_then_arrival_batch_last() -> None:
    queue = ArrivalQueue()
    late = task("d0")
    ticket = queue.ticket(late)  # a default task that arrived first but joins late (images)
    for rid, priority in [
        ("b1", "batch"),
        ("f1", "flex"),
        ("d1", "default"),
        ("p1", "priority"),
        ("b2", "batch"),
        ("d2", "default"),
        ("p2", "priority"),
        ("f2", "flex"),
    ]:
        queue.put(task(rid, priority))
    queue.put(late, ticket)
    assert queue.peek().request_id == "p1"
    assert queue.by_class == {"priority": 2, "default": 3, "flex": 2, "batch": 2}
    assert await drain(queue) == ["p1", "p2", "d0", "d1", "d2", "f1", "f2", "b1", "b2"]
    assert queue.online_waiting == 0


async def test_a_paused_batch_prefill_goes_on_before_other_batch_work_after_the_rest() -> None:
    queue = ArrivalQueue()
    queue.put(task("b1", "batch"))
    queue.put(task("d1"))
    queue.put_first(task("paused", "batch"))
    assert await drain(queue) == ["d1", "paused", "b1"]


async def test_a_first_token_due_soonest_goes_first_within_its_class() -> None:
    queue = ArrivalQueue()
    now = time.time()
    queue.put(task("plain"))
    queue.put(task("later", due=now + 5))
    queue.put(task("sooner", due=now + 1))
    queue.put(task("high", "priority"))
    assert await drain(queue) == ["high", "sooner", "later", "plain"]


async def test_tenants_share_a_class_by_weight_not_by_what_they_send() -> None:
    """A heavy tenant queues ten tasks before a light one's three arrive: the light one's
    go next, not after the heavy one's; with weight 2, a tenant takes two turns to one."""
    queue = ArrivalQueue()
    for i in range(10):
        queue.put(task(f"heavy{i}", tenant="heavy", tokens=100))
    for i in range(3):
        queue.put(task(f"light{i}", tenant="light", tokens=100))
    order = await drain(queue)
    assert order[:6] == ["heavy0", "light0", "heavy1", "light1", "heavy2", "light2"]
    assert order[6:] == [f"heavy{i}" for i in range(3, 10)]

    for i in range(6):
        queue.put(task(f"a{i}", tenant="a", tokens=100, weight=2))
        queue.put(task(f"b{i}", tenant="b", tokens=100))
    order = await drain(queue)
    assert [r[0] for r in order[:9]].count("a") == 6  # a's six in b's first three's time
    assert order.index("a5") < order.index("b3")


async def test_a_tenant_back_after_a_pause_is_not_owed_its_idle_time() -> None:
    """Shares are counted from the queue's virtual time: a tenant quiet for a while does not
    come back with credit to take every turn."""
    queue = ArrivalQueue()
    for i in range(8):
        queue.put(task(f"busy{i}", tenant="busy", tokens=100))
    await drain(queue)
    queue.put(task("busy8", tenant="busy", tokens=100))
    queue.put(task("back0", tenant="back", tokens=100))
    queue.put(task("back1", tenant="back", tokens=100))
    assert await drain(queue) == ["back0", "busy8", "back1"]

"""The engine thread's calls when the service stops: answered, never left waiting (a caller
left waiting holds the service's shutdown until NATS gives up draining it)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from shared.hosting.runner import EngineRunner, EngineStopped


async def test_calls_still_queued_or_made_after_the_engine_stops_fail_at_once() -> None:
    runner = EngineRunner(SimpleNamespace(running=[]))  # no steps: calls only
    gate, inside = threading.Event(), threading.Event()

    def wait(engine: object) -> bool:
        inside.set()
        return gate.wait(10)

    def total(engine: object, numbers: list[int]) -> int:
        return sum(numbers)

    busy = runner.call(wait)  # the engine thread is in a call
    queued = runner.call(total, [1, 2])  # waits behind it
    loop = asyncio.get_running_loop()
    assert await loop.run_in_executor(None, inside.wait, 10)  # (under load it takes a while)
    closing = asyncio.ensure_future(runner.close())

    def stop_queued() -> bool:  # ahead of the waiting call (it ranks first)
        return any(job[-1] is StopIteration for job in list(runner._loop._jobs.queue))

    while not stop_queued():
        await asyncio.sleep(0.005)
    gate.set()
    await closing
    assert await busy is True  # the call in progress finished
    with pytest.raises(EngineStopped, match="total: the engine has stopped"):
        await asyncio.wait_for(queued, 5)
    with pytest.raises(EngineStopped):
        await asyncio.wait_for(runner.call(total, [3]), 5)


class Raising:
    """An engine (a fake, named as such) whose steps raise, holding two running sequences."""

    def __init__(self) -> None:
        self.running = ["a", "b"]
        self.steps = 0

    def step(self) -> list:
        self.steps += 1
        raise RuntimeError("the kernel fell over")

    def abort(self, seq_id: str) -> None:
        self.running.remove(seq_id)


async def test_a_step_that_raises_aborts_the_batch_and_says_so_once() -> None:
    engine = Raising()
    runner = EngineRunner(engine)  # type: ignore[arg-type]
    failed: asyncio.Future = asyncio.get_running_loop().create_future()
    runner.start_stepping(lambda outs, took: None, lambda held, why: failed.set_result((held, why)))
    held, why = await asyncio.wait_for(failed, 5)
    assert held == ["a", "b"] and why == "RuntimeError: the kernel fell over"
    # The engine thread answers a call after it (it is not stuck stepping), and has stepped no
    # more: the batch was aborted, so there is nothing to step and the loop does not spin.
    for _ in range(3):
        assert await asyncio.wait_for(runner.call(lambda engine: engine.steps), 5) == 1
    assert engine.running == []
    await runner.close()

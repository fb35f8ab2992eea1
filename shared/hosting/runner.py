"""The engine's loop on a thread of its own, and a worker's handle on it.

``EngineLoop`` is the thread: engine calls never overlap (the engine is not thread-safe), and
once stepping is on it runs decode steps back to back for as long as sequences are running,
doing queued calls (receive a handoff, abort, a local prefill) between two steps, and hands
each step's tokens on without waiting, so the batch never waits on Python bookkeeping or
NATS. It runs in the worker's process (``EngineRunner``: the event loop stays free while the
engine computes) or in a process of its own (``shared/hosting/process.py``: the steps then
share no GIL with the worker's event loop).

What a worker asks is an op of ``shared/engine/ops.py``, called with the engine first.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from shared.engine import ops
from shared.engine.interface import Engine, StepOutput
from shared.messages.generate import RANKS, Priority

log = logging.getLogger(__name__)

OnStep = Callable[[list[StepOutput], float], None]
# A step that raised: the sequences it held (aborted, their blocks freed) and why.
OnFailed = Callable[[list[str], str], None]
# How a call's result goes back: (result, None) or (None, error), on the engine thread.
Reply = Callable[[Any, BaseException | None], None]


class EngineStopped(RuntimeError):
    """The engine's loop has stopped (the service is closing): the call is not run."""


class EngineLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # (rank, arrival, job): online requests' calls before batch work's, each in order.
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._on_step: OnStep | None = None
        self._on_failed: OnFailed | None = None
        self.closed = False
        # The engine thread holds the GIL most of the time it computes (a small model's pass
        # is mostly Python); by default another thread waits up to 5 ms for it, which would
        # starve the event loop (token events, handoffs, a finished call's result).
        sys.setswitchinterval(0.0005)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def put(self, rank: int, fn: Callable, args: tuple, kwargs: dict, reply: Reply | None) -> None:
        """Queue ``fn(engine, *args, **kwargs)``; ``reply`` gets its outcome (None: a
        failure is logged). After ``close``, ``reply`` gets EngineStopped at once."""
        if self.closed:
            if reply is not None:
                reply(None, EngineStopped(f"{fn.__name__}: the engine has stopped"))
            return
        self._jobs.put((rank, next(self._arrivals), (fn, args, kwargs, reply)))

    def start_stepping(self, on_step: OnStep, on_failed: OnFailed) -> None:
        """From now on, step whenever sequences are running; ``on_step(outputs, seconds)``
        is called on the engine thread after each step, ``on_failed(seq_ids, why)`` after a
        step that raised (neither may block)."""
        self._on_step, self._on_failed = on_step, on_failed
        self._jobs.put((0, next(self._arrivals), None))  # wake the thread

    def close(self) -> None:
        self.closed = True
        self._jobs.put((-1, next(self._arrivals), StopIteration))
        self._thread.join(timeout=5)

    def _run(self) -> None:
        """The queued calls, then one step (when stepping and sequences run), and again.
        Calls are short (a join, an abort, a prefill of a short prompt), so new sequences
        join at the next step."""
        while True:
            stepping = self._on_step is not None and bool(self.engine.running)
            try:
                *_, job = self._jobs.get(block=not stepping)
            except queue.Empty:
                self._step()
                continue
            if job is StopIteration:
                self._refuse_queued()
                return
            if job is not None:
                self.run(*job)

    def _refuse_queued(self) -> None:
        """Stopping: calls still queued are answered EngineStopped (their callers would
        otherwise wait for ever, and hold the service's shutdown)."""
        while True:
            try:
                *_, job = self._jobs.get(block=False)
            except queue.Empty:
                return
            if job is not None and job is not StopIteration:
                fn, _, _, reply = job
                if reply is not None:
                    reply(None, EngineStopped(f"{fn.__name__}: the engine has stopped"))

    def run(self, fn: Callable, args: tuple, kwargs: dict, reply: Reply | None) -> None:
        """``fn(engine, *args, **kwargs)`` now, on the calling thread (the loop's own, or,
        for an op that touches only what is its own, a thread beside it)."""
        try:
            result = fn(self.engine, *args, **kwargs)
        except BaseException as err:  # the caller gets it; a fire-and-forget call is logged
            if reply is None:
                log.error("engine call %s failed", fn.__name__, exc_info=err)
            else:
                reply(None, err)
            return
        if reply is not None:
            reply(result, None)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = ops.step(self.engine)
        except Exception as err:  # the batch's sequences fail, never a loop that spins
            log.exception("decode step failed")
            held = list(self.engine.running)
            for seq_id in held:
                try:
                    self.engine.abort(seq_id)
                except Exception:
                    log.exception("abort of %s after a failed step", seq_id)
            assert self._on_failed is not None
            self._on_failed(held, f"{type(err).__name__}: {err}")
            return
        assert self._on_step is not None
        self._on_step(outputs, time.perf_counter() - started)


class EngineRunner:
    """The engine in the worker's process, on its ``EngineLoop`` thread; each call's result
    comes back to the event loop as a future."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._loop = EngineLoop(engine)

    def call(
        self, fn: Callable[..., Any], *args, priority: Priority = "default", **kwargs
    ) -> asyncio.Future:
        """Run op ``fn`` (of ``shared/engine/ops.py``) with the engine, between two steps;
        await the result when needed. Calls queued meanwhile run by their request's class
        (``priority``: a lower class's wait while a higher one's are queued), then in order."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def reply(result: Any, err: BaseException | None) -> None:
            if loop.is_closed():
                return
            loop.call_soon_threadsafe(_settle, future, result, err)

        self._loop.put(RANKS[priority], fn, args, kwargs, reply)
        return future

    def submit(self, fn: Callable[..., Any], *args) -> None:
        """Queue op ``fn`` without waiting for it; a failure is logged."""
        self._loop.put(0, fn, args, {}, None)

    async def beside(self, fn: Callable[..., Any], *args) -> Any:
        """Run op ``fn`` beside the steps, not between them (it touches only what is its
        own: a reserved sequence's blocks)."""
        return await asyncio.to_thread(fn, self.engine, *args)

    def start_stepping(self, on_step: OnStep, on_failed: OnFailed) -> None:
        """Step whenever sequences are running; ``on_step(outputs, seconds)`` is called on
        the event loop after each step, ``on_failed(seq_ids, why)`` after one that raised."""
        loop = asyncio.get_running_loop()
        self._loop.start_stepping(
            lambda outs, took: loop.call_soon_threadsafe(on_step, outs, took),
            lambda held, why: loop.call_soon_threadsafe(on_failed, held, why),
        )

    async def close(self) -> None:
        await asyncio.to_thread(self._loop.close)


def _settle(future: asyncio.Future, result: object, err: BaseException | None) -> None:
    if future.cancelled():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(result)

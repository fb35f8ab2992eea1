"""The engine on a thread of its own.

The event loop stays free while the engine computes, and engine calls never overlap (the
engine is not thread-safe). A decode worker also turns on stepping: the thread then runs
decode steps back to back for as long as sequences are running, doing queued calls (receive
a handoff, abort, a local prefill) between two steps, and hands each step's tokens to the
event loop without waiting for it, so the batch never waits on Python bookkeeping or NATS.
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
from typing import TypeVar

from shared.engine.interface import Engine, StepOutput
from shared.messages.generate import Priority

log = logging.getLogger(__name__)

T = TypeVar("T")

OnStep = Callable[[list[StepOutput], float], None]


RANKS = {"online": 0, "batch": 1}  # queued calls of online requests go first


class EngineStopped(RuntimeError):
    """The engine thread has stopped (the service is closing): the call is not run."""


class EngineRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # (rank, arrival, job): online requests' calls before batch work's, each in order.
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._arrivals = itertools.count()
        self._on_step: OnStep | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        # The engine thread holds the GIL most of the time it computes (a small model's pass
        # is mostly Python); by default another thread waits up to 5 ms for it, which would
        # starve the event loop (token events, handoffs, a finished call's result).
        sys.setswitchinterval(0.0005)
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def call(
        self, fn: Callable[..., T], *args, priority: Priority = "online", **kwargs
    ) -> asyncio.Future[T]:
        """Run ``fn`` on the engine thread (between two steps); await the result when needed.
        A batch request's calls (``priority``) wait while online requests' are queued."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        if self._closed:  # a call while the service stops (a late cancel): never a hang
            future.set_exception(EngineStopped(f"{fn.__name__}: the engine has stopped"))
            return future
        self._put(RANKS[priority], (fn, args, kwargs, loop, future))
        return future

    def submit(self, fn: Callable[..., object], *args) -> None:
        """Queue ``fn`` on the engine thread without waiting for it; a failure is logged."""
        self._put(0, (fn, args, {}, None, None))

    def _put(self, rank: int, job: object) -> None:
        self._jobs.put((rank, next(self._arrivals), job))

    def start_stepping(self, on_step: OnStep) -> None:
        """From now on, step whenever sequences are running; ``on_step(outputs, seconds)``
        is called on the event loop after each step."""
        self._loop = asyncio.get_running_loop()
        self._on_step = on_step
        self._put(0, None)  # wake the thread

    def close(self) -> None:
        self._closed = True
        self._put(-1, StopIteration)
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
                self._do(*job)

    def _refuse_queued(self) -> None:
        """Stopping: calls still queued are answered EngineStopped (their callers would
        otherwise wait for ever, and hold the service's shutdown)."""
        while True:
            try:
                *_, job = self._jobs.get(block=False)
            except queue.Empty:
                return
            if job is not None and job is not StopIteration:
                fn, _, _, loop, future = job
                if loop is not None and not loop.is_closed():
                    err = EngineStopped(f"{fn.__name__}: the engine has stopped")
                    loop.call_soon_threadsafe(_settle, future, None, err)

    def _do(self, fn, args, kwargs, loop, future) -> None:  # noqa: ANN001
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:  # the caller gets it; a fire-and-forget call is logged
            if loop is None:
                log.error("engine call %s failed", fn.__name__, exc_info=err)
            else:
                loop.call_soon_threadsafe(_settle, future, None, err)
            return
        if loop is not None:
            loop.call_soon_threadsafe(_settle, future, result, None)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("decode step failed")
            return
        took = time.perf_counter() - started
        assert self._loop is not None and self._on_step is not None
        self._loop.call_soon_threadsafe(self._on_step, outputs, took)


def _settle(future: asyncio.Future, result: object, err: BaseException | None) -> None:
    if future.cancelled():
        return
    if err is not None:
        future.set_exception(err)
    else:
        future.set_result(result)

"""A worker's engine in a process of its own, beside the worker (as vLLM's engine core and
SGLang's scheduler run): its loop steps the batch without sharing a GIL with the worker's
event loop, which publishes tokens, takes handoffs and talks to NATS meanwhile.

The worker starts it (``ProcessRunner.start``) with the engine's name, the model, the state
dir and the engine's options on its stdin, and one end of a socket pair. The process loads the
engine, says it is ready (the model's config, its stats), then runs an ``EngineLoop``
(``shared/hosting/runner.py``): the worker's calls are ops of ``shared/engine/ops.py`` by name, each
answered with its result; once stepping, each step's tokens come as a frame of their own. Each
frame back carries the engine's state (its stats, the running sequences), which is what the
worker reads of it (``EngineView``). Frames are ``shared/hosting/wire.py``'s: no pickle.

The process ends when the worker closes it, or when the worker's end of the socket closes
(the worker died). A worker whose engine's process dies stops too: it cannot serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared import faults
from shared.engine import ops
from shared.engine.interface import EngineOptions, EngineStats, StepOutput
from shared.hosting import wire
from shared.hosting.runner import EngineLoop, EngineStopped, OnFailed, OnStep
from shared.messages.generate import RANKS, Priority
from shared.messages.sampling import SamplingParams
from shared.model.catalog import ModelSource
from shared.model.config import ModelConfig

log = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a big model from a cold disk
STOP_TIMEOUT_S = 10.0


@dataclass
class EngineView:
    """The engine as its worker reads it: what its process last said (after each call and
    each step). ``can_admit`` answers from that: a reservation it let through that no longer
    fits is refused by the engine itself (PoolExhausted)."""

    config: ModelConfig
    block_size: int
    max_running: int
    last: EngineStats
    running: list[str]

    def stats(self) -> EngineStats:
        return self.last

    def can_admit(self, n_prompt: int, params: SamplingParams, held_blocks: int = 0) -> bool:
        total = min(n_prompt + params.max_tokens, self.config.max_context)
        need = -(-total // self.block_size) - held_blocks
        free = self.last.kv_blocks_total - self.last.kv_blocks_used
        return self.last.sequences < self.max_running and need <= free


class ProcessRunner:
    """The worker's side: the same calls as ``EngineRunner``'s, answered over the socket."""

    def __init__(
        self, proc: subprocess.Popen, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.proc = proc
        self._reader, self._writer = reader, writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future] = {}
        self._on_step: OnStep | None = None
        self._on_failed: OnFailed | None = None
        self._closing = False
        self.engine: EngineView  # set by start
        self.on_lost: Callable[[str], None] = _exit_worker
        self._reading: asyncio.Task | None = None

    @classmethod
    async def start(
        cls, engine: str, model: ModelSource, state_dir: Path, options: EngineOptions
    ) -> ProcessRunner:
        """Start the engine's process and wait until its model is loaded."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        spec = {"engine": engine, "model": model, "state_dir": Path(state_dir), "options": options}
        parts: list = []
        header = wire.encode(spec, parts)
        root = str(Path(__file__).resolve().parents[2])  # (this checkout, wherever started)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", "shared.hosting.process", str(theirs.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=(theirs.fileno(),),
            env={**os.environ, "PYTHONPATH": path},
        )
        theirs.close()
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(header).encode())
        proc.stdin.close()
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=2**20)
        runner = cls(proc, reader, writer)
        try:
            got = await asyncio.wait_for(wire.read_frame_async(reader), START_TIMEOUT_S)
        except BaseException:
            proc.kill()
            raise
        if got is None or "ready" not in got[0]:
            proc.wait()
            why = got[0].get("error", "") if got else f"it exited ({proc.returncode})"
            raise RuntimeError(f"the engine's process did not start: {why}")
        ready = wire.decode(got[0]["ready"], got[1])
        runner.engine = EngineView(
            config=ready["config"],
            block_size=ready["block_size"],
            max_running=options.max_running,
            last=ready["stats"],
            running=[],
        )
        runner._reading = asyncio.create_task(runner._read())
        return runner

    def call(
        self, fn: Callable[..., Any], *args, priority: Priority = "default", **kwargs
    ) -> asyncio.Future:
        """Run op ``fn`` in the engine's process, between two steps; its result as a future."""
        return self._ask({"rank": RANKS[priority]}, fn, args, kwargs)

    def submit(self, fn: Callable[..., Any], *args) -> None:
        if not self._closing:
            self._send({"call": 0, "rank": 0}, fn, args, {})

    async def beside(self, fn: Callable[..., Any], *args) -> Any:
        """Run op ``fn`` in the engine's process beside the steps (on a thread of its own
        there: it touches only a reserved sequence's blocks)."""
        return await self._ask({"beside": True}, fn, args, {})

    def _ask(self, header: dict, fn: Callable, args: tuple, kwargs: dict) -> asyncio.Future:
        """Send a call that is answered (by its id); its answer as a future."""
        future = asyncio.get_running_loop().create_future()
        if self._closing or self.proc.poll() is not None:
            future.set_exception(EngineStopped(f"{fn.__name__}: the engine has stopped"))
            return future
        call_id = next(self._ids)
        self._waiting[call_id] = future
        self._send({**header, "call": call_id}, fn, args, kwargs)
        return future

    def start_stepping(self, on_step: OnStep, on_failed: OnFailed) -> None:
        self._on_step, self._on_failed = on_step, on_failed
        self._writer.writelines(wire.frame({"stepping": True}, []))
        faults.LISTENERS.append(self._faults)  # (tests' fault hooks reach the engine)
        self._faults(set(faults.ACTIVE))

    def _faults(self, active: set[str]) -> None:
        if not self._closing:
            self._writer.writelines(wire.frame({"faults": sorted(active)}, []))

    def _send(self, header: dict, fn: Callable, args: tuple, kwargs: dict) -> None:
        if ops.OPS.get(fn.__name__) is not fn:
            raise TypeError(f"{fn.__name__} is not an engine op")
        parts: list = []
        header |= {
            "op": fn.__name__,
            "args": wire.encode(list(args), parts),
            "kwargs": wire.encode(kwargs, parts),
        }
        self._writer.writelines(wire.frame(header, parts))

    async def _read(self) -> None:
        """Frames from the engine's process: calls' answers and steps' tokens."""
        why = "its socket closed"
        try:
            while (got := await wire.read_frame_async(self._reader)) is not None:
                self._got(*got)
        except Exception as err:  # a broken frame: nothing after it can be trusted
            why = f"a frame could not be read: {err}"
            log.exception("engine process")
        if not self._closing:  # its socket closes before it is reaped: its exit code waited for
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.proc.wait, 1.0)
        self._lost(why)

    def _got(self, header: dict, parts: list[bytes]) -> None:
        view = self.engine
        if "stats" in header:
            view.last = wire.decode(header["stats"], [])
            view.running = header["running"]
        if "step" in header:
            if self._on_step is not None:
                self._on_step(wire.decode_outputs(header["step"]), header["took"])
            return
        if "failed" in header:
            if self._on_failed is not None:
                self._on_failed(header["failed"], header["why"])
            return
        future = self._waiting.pop(header.get("call", 0), None)
        if future is None or future.cancelled():
            return
        if "error" in header:
            future.set_exception(wire.decode_error(header["error"]))
        else:
            future.set_result(wire.decode(header.get("result"), parts))

    def _lost(self, why: str) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(EngineStopped(f"the engine's process stopped: {why}"))
        self._waiting.clear()
        if not self._closing:
            code = self.proc.poll()
            self.on_lost(f"the engine's process ended ({why}; exit code {code})")

    async def close(self) -> None:
        """Stop the engine's process (its calls still queued are answered EngineStopped)."""
        self._closing = True
        if self._faults in faults.LISTENERS:
            faults.LISTENERS.remove(self._faults)
        if self.proc.poll() is None:
            try:
                self._writer.writelines(wire.frame({"stop": True}, []))
                await self._writer.drain()
                await asyncio.to_thread(self.proc.wait, STOP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                log.warning("the engine's process did not stop in %g s: killed", STOP_TIMEOUT_S)
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
        if self._reading is not None:
            await asyncio.wait([self._reading], timeout=1.0)  # the last answers read
            self._reading.cancel()
        self._writer.close()


def _exit_worker(why: str) -> None:
    """A worker without its engine cannot serve: it exits (what a crash would do), and its
    supervisor starts it again; its requests move on as from any worker that died."""
    log.critical("%s: this worker exits", why)
    logging.shutdown()
    os._exit(70)


# -- the engine's process ---------------------------------------------------------------------


class _Host:
    """The engine's side: frames in on the main thread, the engine on its loop's thread."""

    def __init__(self, sock: socket.socket, engine) -> None:  # noqa: ANN001 (an Engine)
        self.sock = sock
        self.engine = engine
        self.loop = EngineLoop(engine)
        self._send_lock = threading.Lock()
        self._beside = ThreadPoolExecutor(1, thread_name_prefix="beside")
        self._sent_state: tuple | None = None

    def send(self, header: dict, parts: list | None = None) -> None:
        """A frame to the worker, with the engine's state when it changed (taken under the
        lock, so that frames carry it in the order they are sent)."""
        with self._send_lock:
            buffers = wire.frame(header | self.state(), parts or [])
            if sum(len(b) for b in buffers) < 2**16:
                self.sock.sendall(b"".join(buffers))
            else:  # (KV: not copied into one buffer first)
                for buf in buffers:
                    self.sock.sendall(buf)

    def state(self) -> dict:
        """The engine's stats and running sequences, when they changed since last sent."""
        stats, running = self.engine.stats(), list(self.engine.running)
        if (stats, running) == self._sent_state:
            return {}
        self._sent_state = (stats, running)
        return {"stats": wire.encode(stats, []), "running": running}

    def on_step(self, outputs: list[StepOutput], took: float) -> None:
        self.send({"step": wire.encode_outputs(outputs), "took": took})

    def on_failed(self, held: list[str], why: str) -> None:
        self.send({"failed": held, "why": why})

    def reply(self, call_id: int, op: str) -> Callable[[Any, BaseException | None], None]:
        """How a call is answered: its result or error, with the engine's state after it (a
        call submitted without waiting, ``call_id`` 0, sends the state alone; its failure is
        logged here)."""

        def answer(result: Any, err: BaseException | None) -> None:
            header: dict = {"call": call_id}
            parts: list = []
            if not call_id:
                if err is not None and not isinstance(err, EngineStopped):
                    log.error("engine call %s failed", op, exc_info=err)
            elif err is not None:
                header["error"] = wire.encode_error(err)
            else:
                try:
                    header["result"] = wire.encode(result, parts)
                except TypeError as bad:
                    header["error"] = wire.encode_error(RuntimeError(str(bad)))
                    parts = []
            with contextlib.suppress(OSError):  # the worker is gone: serve() sees it
                self.send(header, parts)

        return answer

    def serve(self) -> None:
        source = self.sock.makefile("rb", buffering=2**20)
        while True:
            got = wire.read_frame(source)
            if got is None or "stop" in got[0]:
                break
            header, parts = got
            if "stepping" in header:
                self.loop.start_stepping(self.on_step, self.on_failed)
                continue
            if "faults" in header:  # the worker's fault hooks, switched by a test
                faults.ACTIVE.clear()
                faults.ACTIVE.update(str(name) for name in header["faults"])
                continue
            op = str(header.get("op", ""))
            fn = ops.OPS.get(op)
            answer = self.reply(int(header.get("call", 0)), op)
            if fn is None:
                answer(None, ValueError(f"no engine op {op!r}"))
                continue
            args = wire.decode(header.get("args", []), parts)
            kwargs = wire.decode(header.get("kwargs", {"$dict": {}}), parts)
            if header.get("beside"):
                self._beside.submit(self.loop.run, fn, tuple(args), kwargs, answer)
            else:
                self.loop.put(int(header.get("rank", 0)), fn, tuple(args), kwargs, answer)
        self.loop.close()
        self._beside.shutdown(wait=True)


def main() -> int:
    from shared.engine.registry import load_engine
    from shared.logs import setup_logging

    setup_logging(os.environ.get("KVMESH_LOG_LEVEL", "info"))
    # Ended by its worker (which drains first on a signal), or by its socket closing: a
    # Ctrl-C or SIGTERM to the whole process group must not stop it under a draining worker.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=int(sys.argv[1]))
    spec = wire.decode(json.loads(sys.stdin.buffer.read()), [])
    started = time.monotonic()
    try:
        engine = load_engine(spec["engine"], spec["model"], spec["state_dir"], spec["options"])
        engine.start()
    except Exception as err:
        log.exception("the engine did not load")
        sock.sendall(b"".join(wire.frame({"error": f"{type(err).__name__}: {err}"}, [])))
        return 1
    ready = {"config": engine.config, "block_size": engine.block_size, "stats": engine.stats()}
    host = _Host(sock, engine)
    parts: list = []
    host.send({"ready": wire.encode(ready, parts)}, parts)
    log.info("engine process %d ready in %.1f s", os.getpid(), time.monotonic() - started)
    try:
        host.serve()
    except (EOFError, OSError, wire.WireError) as err:
        log.error("engine process: %s", err)
    engine.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

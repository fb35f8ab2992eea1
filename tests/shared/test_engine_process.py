"""The torch engine in a process of its own (shared/hosting/process.py), driven as a decode
worker drives it: the same tokens as the engine on a thread, its errors raised as the same
types, its state read from what it last said, and a process that dies or stops answers every
call waiting on it."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from shared.engine import ops
from shared.engine.interface import EngineOptions, PoolExhausted, StepOutput
from shared.engine.registry import load_engine
from shared.hosting.process import ProcessRunner
from shared.hosting.runner import EngineRunner, EngineStopped
from shared.messages.sampling import SamplingParams
from shared.model.catalog import resolve

OPTIONS = EngineOptions(block_size=16, kv_cache_tokens=1024, threads=1, max_running=4)
PROMPT = list(range(5, 45))
GREEDY = SamplingParams(max_tokens=12, temperature=0)


async def answer(runner: EngineRunner | ProcessRunner, rid: str) -> tuple[list[int], int]:
    """A prompt prefilled and stepped to its end: its tokens, and the blocks exported with
    it (the last turn's, for the tiers)."""
    done: asyncio.Future = asyncio.get_running_loop().create_future()
    tokens: list[int] = []
    steps: list[float] = []  # what each step took, as the runner said

    def on_step(outputs: list[StepOutput], took: float) -> None:
        steps.append(took)
        for out in outputs:
            tokens.append(out.token_id)
            if out.finish_reason and not done.done():
                done.set_result(out)

    out, took = await runner.call(ops.timed_prefill, rid, PROMPT, GREEDY, None)
    assert took > 0 and out.seq_id == rid
    tokens.append(out.token_id)

    def on_failed(held: list[str], why: str) -> None:
        done.set_exception(AssertionError(f"the step failed: {why}"))

    runner.start_stepping(on_step, on_failed)
    last = await asyncio.wait_for(done, 60)
    assert last.finish_reason == "length"
    assert steps and min(steps) > 0
    blobs, kept = await runner.call(ops.export_upto, rid, 0, None, None, True)
    assert kept == (PROMPT + tokens)[: len(blobs) * OPTIONS.block_size]
    return tokens, len(blobs)


async def test_the_engine_in_its_process_answers_as_on_a_thread(state_dir: Path) -> None:
    source = resolve("tiny", {})
    local = await asyncio.to_thread(load_engine, "torch", source, state_dir, OPTIONS)
    local.start()
    thread = EngineRunner(local)
    own = await ProcessRunner.start("torch", source, state_dir, OPTIONS)
    try:
        assert own.proc.pid != os.getpid()
        assert own.engine.config.fingerprint == local.config.fingerprint
        assert own.engine.block_size == 16
        expected = await answer(thread, "a")
        assert await answer(own, "a") == expected  # token for token, and the blocks kept
        assert own.engine.stats().sequences == 0 and own.engine.running == []
        # Its errors come back as the engine raised them.
        with pytest.raises(ValueError, match="exceeds the model's context"):
            await own.call(ops.reserve, "long", [1] * 10, SamplingParams(max_tokens=10**6))
        fits = own.engine.can_admit(len(PROMPT), GREEDY)
        assert fits
        held = [own.call(ops.reserve, f"r{i}", PROMPT, GREEDY) for i in range(4)]
        await asyncio.gather(*held)
        assert own.engine.stats().sequences == 4
        assert not own.engine.can_admit(len(PROMPT), GREEDY)  # (max_running is 4)
        with pytest.raises(PoolExhausted, match="4 sequences"):
            await own.call(ops.reserve, "r4", PROMPT, GREEDY)
        for i in range(4):
            own.submit(ops.abort, f"r{i}")
        await own.call(ops.free, "none")  # behind the aborts
        assert own.engine.stats().sequences == 0
    finally:
        await own.close()
        await thread.close()
    assert own.proc.returncode == 0
    with pytest.raises(EngineStopped):
        await own.call(ops.free, "after")


async def test_a_worker_whose_engine_process_dies_is_told_and_no_call_hangs(
    state_dir: Path,
) -> None:
    own = await ProcessRunner.start("torch", resolve("tiny", {}), state_dir, OPTIONS)
    lost: asyncio.Future = asyncio.get_running_loop().create_future()
    own.on_lost = lost.set_result
    try:
        await own.call(ops.reserve, "x", PROMPT, GREEDY)
        os.kill(own.proc.pid, signal.SIGKILL)
        waiting = own.call(ops.join, "x", 7)
        with pytest.raises(EngineStopped, match="the engine's process stopped"):
            await asyncio.wait_for(waiting, 10)
        why = await asyncio.wait_for(lost, 10)
        assert "the engine's process ended" in why and "-9" in why
    finally:
        await own.close()

"""The decode engine's loop on a thread of the worker, or in a process of its own: what the
worker's own work costs the decode steps.

For each placement of the loop (``thread``: ``EngineRunner``; ``process``: ``ProcessRunner``,
the default of decode workers) and each load of the worker's event loop (idle: it only takes
the tokens; busy: it spends ``--publish-us`` of Python on each step's tokens, as publishing
them does, and is busy half of the rest of the time, as handoffs, NATS and spans keep it), a
batch of sequences decodes ``--tokens`` tokens each, ``--trials`` times. Reported, per token of
a sequence: the time it took (TPOT), the engine's step compute, and the rest (between steps).

Prints a table, then one JSON line with the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from shared.engine import ops
from shared.engine.interface import EngineOptions, StepOutput
from shared.engine.registry import load_engine
from shared.hosting.process import ProcessRunner
from shared.hosting.runner import EngineRunner
from shared.messages.sampling import SamplingParams
from shared.model.catalog import resolve


def spin(seconds: float) -> None:
    """Python work holding the GIL (what the event loop's own work does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def busy_loop() -> None:
    """The worker's event loop busy half the time with other work, 1 ms at a time."""
    while True:
        spin(1e-3)
        await asyncio.sleep(1e-3)


async def decode(
    runner: EngineRunner | ProcessRunner, batch: int, tokens: int, publish_s: float, trial: int
) -> tuple[float, float, int]:
    """A batch decoded to its end, from when every sequence is in it: (wall seconds, seconds
    of step compute, steps)."""
    done = asyncio.Event()
    finished: set[str] = set()
    steps: list[tuple[float, float]] = []  # (when its tokens came, its compute)

    def on_step(outputs: list[StepOutput], took: float) -> None:
        steps.append((time.perf_counter(), took))
        spin(publish_s)
        finished.update(o.seq_id for o in outputs if o.finish_reason)
        if len(finished) == batch:
            done.set()

    def on_failed(held: list[str], why: str) -> None:
        raise SystemExit(f"a decode step failed: {why}")

    runner.start_stepping(on_step, on_failed)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    ids = [f"t{trial}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):  # distinct prompts of 40 tokens
        prompt = list(range(100 + 50 * i + trial, 140 + 50 * i + trial))
        await runner.call(ops.timed_prefill, rid, prompt, params, None)
    started = time.perf_counter()
    await asyncio.wait_for(done.wait(), 600)
    for rid in ids:
        await runner.call(ops.free, rid)
    after = [(at, took) for at, took in steps if at > started]
    return after[-1][0] - started, sum(took for _, took in after), len(after)


async def measure(args: argparse.Namespace, placement: str, load: str, batch: int) -> dict:
    options = EngineOptions(
        block_size=64, kv_cache_tokens=16384, threads=args.threads, max_running=64
    )
    source = resolve(args.model, {})
    state = Path(args.state_dir)
    if placement == "process":
        runner: EngineRunner | ProcessRunner = await ProcessRunner.start(
            "torch", source, state, options
        )
    else:
        engine = await asyncio.to_thread(load_engine, "torch", source, state, options)
        engine.start()
        runner = EngineRunner(engine)
    busy = asyncio.create_task(busy_loop()) if load == "busy" else None
    publish_s = args.publish_us * 1e-6 if load == "busy" else 0.0
    tpot, step, between = [], [], []
    try:
        for trial in range(args.trials + 1):  # the first warms up
            wall, took, steps = await decode(runner, batch, args.tokens, publish_s, trial)
            if trial:
                tpot.append(wall / steps * 1e3)
                step.append(took / steps * 1e3)
                between.append((wall - took) / steps * 1e3)
            print(f"  {placement} {load} batch {batch}: trial {trial}", file=sys.stderr)
    finally:
        if busy is not None:
            busy.cancel()
        await runner.close()
    return {
        "tpot_ms": round(statistics.median(tpot), 3),
        "step_ms": round(statistics.median(step), 3),
        "between_ms": round(statistics.median(between), 3),
    }


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per sequence")
    ap.add_argument("--batches", default="1,8", help="sequences decoding together")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    ap.add_argument("--publish-us", type=float, default=150, help="the loop's work per step")
    ap.add_argument("--state-dir", default="")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args.state_dir = args.state_dir or tmp
        rows = []
        for batch in (int(b) for b in args.batches.split(",")):
            for load in ("idle", "busy"):
                for placement in ("thread", "process"):
                    figures = await measure(args, placement, load, batch)
                    rows.append({"batch": batch, "load": load, "placement": placement, **figures})
    print(f"{'batch':>5}  {'loop':<5} {'engine loop':<12} {'TPOT':>9} {'step':>9} {'between':>9}")
    for r in rows:
        print(
            f"{r['batch']:>5}  {r['load']:<5} {r['placement']:<12} {r['tpot_ms']:>7.3f}ms"
            f" {r['step_ms']:>7.3f}ms {r['between_ms']:>7.3f}ms"
        )
    out = {f"{r['placement']}_{r['load']}_b{r['batch']}_tpot_ms": r["tpot_ms"] for r in rows}
    out |= {f"{r['placement']}_{r['load']}_b{r['batch']}_between_ms": r["between_ms"] for r in rows}
    print(json.dumps({"model": args.model, "tokens": args.tokens, **out}))


if __name__ == "__main__":
    asyncio.run(main())

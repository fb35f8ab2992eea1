"""A prefill profile of the torch engine on this machine, for the simulator's world
(``simulator/profile.py``): the seconds to compute ``uncached`` prompt tokens after ``cached``
ones held in the engine's memory, over a grid of both, and of one pass over several short
prompts together (what a prefill worker batches). Each point is the median of ``--runs``;
the spread is how far runs fell from their medians.

Writes the profile (JSON) to ``--out``; prints a table, then as its last line one JSON object:
the tokens/s with nothing cached, how the cost per token grows with the context, the batch
speed-up and the spread.

    .venv/bin/python bench/profile.py [--model smollm2-135m-instruct] [--threads 2]
        [--cached 0,1024,2048,4096] [--uncached 64,256,1024,2048] [--out profile.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.engine.interface import EngineOptions, PrefillRequest  # noqa: E402
from shared.engine.sampling import SamplingParams  # noqa: E402
from shared.engine.torch.engine import TorchEngine  # noqa: E402
from shared.engine.torch.loader import load_model  # noqa: E402
from simulator.profile import EngineProfile  # noqa: E402

BLOCK = 64
ONE = SamplingParams(max_tokens=1)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


class Measure:
    """Timed prefills on one engine, each over a prefix already held in its memory."""

    def __init__(self, engine: TorchEngine, runs: int) -> None:
        self.engine = engine
        self.runs = runs
        self.n = 0
        self.deviations: list[float] = []  # |run - median| / median, every point

    def median(self, runs: list[float]) -> float:
        m = statistics.median(runs)
        self.deviations += [abs(r - m) / m for r in runs]
        return m

    def prefill_s(self, cached: int, uncached: int) -> float:
        e, prompt = self.engine, ids(cached + uncached, seed=cached * 7919 + uncached)
        prefix = None
        if cached:  # its KV computed once, then held: each run reads it from memory
            e.prefill("held", prompt[: cached + 1], ONE)
            prefix = e.import_blocks(e.export_blocks("held", 0, cached // BLOCK))
            e.free("held")
        runs = []
        for _ in range(self.runs):
            self.n += 1
            sid = f"p{self.n}"
            start = time.perf_counter()
            e.prefill(sid, prompt, ONE, prefix=prefix)
            runs.append(time.perf_counter() - start)
            e.free(sid)
        if prefix is not None:
            e.release(prefix)
        return self.median(runs)

    def batch_s(self, prompts: int, tokens: int) -> float:
        runs = []
        for r in range(self.runs):
            batch = [
                PrefillRequest(f"b{self.n}-{i}", ids(tokens, seed=1000 * r + i), ONE)
                for i in range(prompts)
            ]
            self.n += 1
            start = time.perf_counter()
            self.engine.prefill_batch(batch)
            runs.append(time.perf_counter() - start)
            for req in batch:
                self.engine.free(req.seq_id)
        return self.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cached", default="0,1024,2048,4096")
    parser.add_argument("--uncached", default="64,256,1024,2048")
    parser.add_argument("--batch", default="1,2,4,8", help="short prompts in one pass")
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("profile.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cached = tuple(int(v) // BLOCK * BLOCK for v in args.cached.split(","))
    uncached = tuple(int(v) for v in args.uncached.split(","))
    sizes = tuple(int(v) for v in args.batch.split(","))

    say(f"loading {args.model}")
    model = load_model(args.model, Path(".kvmesh"))
    options = EngineOptions(block_size=BLOCK, kv_cache_tokens=4 * (max(cached) + max(uncached)))
    engine = TorchEngine(model, options)
    engine.start()
    m = Measure(engine, args.runs)
    m.prefill_s(0, 256)  # warm-ups: each path's first passes are slower
    for n in sizes:
        m.batch_s(n, args.batch_tokens)
    m.deviations.clear()
    batch = []  # (before the long contexts: their large buffers slow what follows a while)
    for n in sizes:
        batch.append((n, m.batch_s(n, args.batch_tokens)))
        say(f"  {n} prompts of {args.batch_tokens} tokens in one pass: {batch[-1][1] * 1e3:.1f} ms")
    seconds = []
    for c in cached:
        row = []
        for u in uncached:
            row.append(m.prefill_s(c, u))
            say(f"  {u} tokens after {c} cached: {row[-1] * 1e3:.1f} ms")
        seconds.append(tuple(row))
    profile = EngineProfile(
        engine=f"torch, {args.threads} threads",
        model=args.model,
        machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
        cached=cached,
        uncached=uncached,
        seconds=tuple(seconds),
        spread=round(statistics.median(m.deviations), 4),
        batch_tokens=args.batch_tokens,
        batch=tuple(batch),
    )
    args.out.write_text(profile.to_json())

    print("cached \\ uncached | " + " | ".join(f"{u}" for u in uncached) + "  (tok/s)")
    for c, row in zip(cached, seconds, strict=True):
        print(f"{c} | " + " | ".join(f"{u / s:.0f}" for u, s in zip(uncached, row, strict=True)))
    print("prompts in one pass | ms | tokens/s")
    for n, s in batch:
        print(f"{n} | {s * 1e3:.1f} | {n * args.batch_tokens / s:.0f}")
    u = uncached[len(uncached) // 2]
    growth = profile.prefill_s(max(cached), u) / profile.prefill_s(0, u)
    figures = {
        "tok_s_uncached_only": round(profile.tok_s(0, max(uncached))),
        "cost_per_token_at_max_context_vs_none": round(growth, 3),
        "batch_speedup": round(sizes[-1] * batch[0][1] / batch[-1][1], 2),
        "spread": profile.spread,
        "profile": str(args.out),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()

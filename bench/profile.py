"""A prefill profile of the torch engine (or, with --engine vllm, vLLM's) on this machine,
for the simulator's world (``simulator/profile.py``): the seconds to compute ``uncached``
prompt tokens after ``cached`` ones held in the engine's memory, over a grid of both, and of
one pass over several short prompts together (what a prefill worker batches). Each point is
the median of ``--runs``; the spread is how far runs fell from their medians.

Writes the profile (JSON) to ``--out``; prints a table, then as its last line one JSON object:
the tokens/s with nothing cached, how the cost per token grows with the context, the batch
speed-up and the spread.

    .venv/bin/python bench/profile.py [--engine torch|vllm] [--model smollm2-135m-instruct]
        [--threads 2] [--cached 0,1024,2048,4096] [--uncached 64,256,1024,2048] [--out profile.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# (bench/ itself is left off the path: its vllm.py would stand in for the vllm package)
sys.path[:] = [str(REPO), *(p for p in sys.path if Path(p or ".").resolve() != REPO / "bench")]

from bench.harness import emit, say  # noqa: E402
from simulator.measure import profile_engine, profile_vllm  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--engine", default="torch", choices=("torch", "vllm"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cached", default="0,1024,2048,4096")
    parser.add_argument("--uncached", default="64,256,1024,2048")
    parser.add_argument("--batch", default="1,2,4,8", help="short prompts in one pass")
    parser.add_argument("--batch-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path("profile.json"))
    args = parser.parse_args()
    cached = tuple(int(v) for v in args.cached.split(","))
    uncached = tuple(int(v) for v in args.uncached.split(","))
    sizes = tuple(int(v) for v in args.batch.split(","))
    measure = profile_vllm if args.engine == "vllm" else profile_engine
    profile = measure(
        args.model, args.threads, cached, uncached, sizes, args.batch_tokens, args.runs, say=say
    )
    cached, batch, seconds = profile.cached, profile.batch, profile.seconds
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
    emit(figures)


if __name__ == "__main__":
    main()

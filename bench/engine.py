"""Engine benchmark on the real model (fp32, the machine's threads).

Prints a table, then as its last line one JSON object with: prefill_cold_tok_s,
prefill_hit96_speedup, decode_b1_tok_s, decode_b8_tok_s, decode_b32_tok_s,
hf_decode_b1_tok_s, bw_bound_b1_tok_s (and a few more figures for context).

    .venv/bin/python bench/engine.py [--threads 2] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import say  # noqa: E402
from shared.engine.interface import EngineOptions  # noqa: E402
from shared.engine.torch.engine import TorchEngine  # noqa: E402
from shared.engine.torch.loader import load_model  # noqa: E402
from shared.messages.sampling import SamplingParams  # noqa: E402
from shared.model.gguf import REAL_MODEL, find_gguf  # noqa: E402

BLOCK = 64


def median_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def bench_prefill(engine: TorchEngine, n: int = 4096) -> dict:
    ids = prompt_ids(n)
    one = SamplingParams(max_tokens=1)
    counter = iter(range(10**6))

    def cold() -> None:
        sid = f"cold{next(counter)}"
        engine.prefill(sid, ids, one)
        engine.free(sid)

    say(f"prefill: {n} tokens cold (3 runs)")
    t_cold = median_time(cold)
    # 96% cached: the prefix (whole blocks) already in this worker's memory.
    cut = int(n * 0.96) // BLOCK * BLOCK
    engine.prefill("src", ids[: cut + 1], one)
    blob = engine.export_kv("src")
    prefix = engine.import_kv(blob)
    engine.free("src")

    def hit() -> None:
        sid = f"hit{next(counter)}"
        engine.prefill(sid, ids, one, prefix=prefix)
        engine.free(sid)

    say(f"prefill: {n} tokens with {cut} cached (3 runs)")
    t_hit = median_time(hit)

    def hit_with_import() -> None:
        sid = f"imp{next(counter)}"
        p = engine.import_kv(blob)
        engine.prefill(sid, ids, one, prefix=p)
        engine.free(sid)
        engine.release(p)

    t_import = median_time(hit_with_import)
    engine.release(prefix)
    return {
        "prefill_tokens": n,
        "cached_tokens": cut,
        "prefill_cold_s": t_cold,
        "prefill_hit96_s": t_hit,
        "prefill_hit96_import_s": t_import,
        "kv_bytes": len(blob),
    }


def bench_decode(engine: TorchEngine, batch: int, steps: int = 32, prompt_len: int = 128) -> float:
    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    ids = [prompt_ids(prompt_len, seed=i) for i in range(batch)]
    for i in range(batch):
        engine.prefill(f"d{batch}-{i}", ids[i], params)
    engine.step()  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - t
    for i in range(batch):
        engine.free(f"d{batch}-{i}")
    return batch * steps / elapsed


def profile_b1(engine: TorchEngine, steps: int = 5) -> str:
    """Where single-stream decode time goes: the top torch ops of a few steps."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    engine.prefill("prof", prompt_ids(128), params)
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    engine.free("prof")
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=6)


def bench_hf(prompt_len: int = 128, new_tokens: int = 32) -> float:
    from transformers import AutoModelForCausalLM

    path = find_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    ids = torch.tensor([prompt_ids(prompt_len)])
    kw = dict(do_sample=False, pad_token_id=2, eos_token_id=None)

    def generate(n: int) -> None:
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    with torch.no_grad():
        generate(4)
        total = median_time(lambda: generate(new_tokens + 1))
        first = median_time(lambda: generate(1))
    return new_tokens / (total - first)  # decode only: the prompt's prefill taken out


def bandwidth_bound(engine: TorchEngine) -> tuple[float, float, int]:
    """Memory read bandwidth (read every weight once, best of 5) and bytes read per token."""
    model = engine.model
    dense = ("wqkv", "wo", "w13", "w2", "norm")
    tensors = [w for name, w in model.w.items() if name.rsplit(".", 1)[-1].endswith(dense)]
    tensors.append(model.lm_head)
    per_token = sum(t.nbytes for t in tensors)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for w in tensors:
            w.sum()
        best = min(best, time.perf_counter() - t)
    bw = per_token / best
    return bw, bw / per_token, per_token


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    state = Path(".kvmesh")
    say("loading the real model (cold, then warm)")
    load_model(REAL_MODEL, state)
    t = time.perf_counter()
    model = load_model(REAL_MODEL, state)
    warm_load = time.perf_counter() - t
    engine = TorchEngine(model, EngineOptions(block_size=BLOCK, kv_cache_tokens=65536))
    engine.start()

    pre = bench_prefill(engine)
    decode = {}
    for b in (1, 8, 32):
        say(f"decode: batch {b}")
        decode[b] = bench_decode(engine, b)
    bw, bound, per_token = bandwidth_bound(engine)
    say("profiling batch-1 decode")
    profile_table = profile_b1(engine)
    hf = None
    if not args.skip_hf:
        say("transformers generate, batch 1")
        hf = bench_hf()

    cold_tok_s = pre["prefill_tokens"] / pre["prefill_cold_s"]
    speedup = pre["prefill_cold_s"] / pre["prefill_hit96_s"]
    rows = [
        ("warm model load", f"{warm_load:.1f} s"),
        (
            f"prefill {pre['prefill_tokens']} tokens, cold",
            f"{cold_tok_s:.0f} tok/s ({pre['prefill_cold_s']:.2f} s)",
        ),
        (
            f"prefill, {pre['cached_tokens']} cached (in memory)",
            f"{pre['prefill_hit96_s']:.3f} s = {speedup:.1f}x faster",
        ),
        (
            "prefill, same prefix imported from bytes",
            f"{pre['prefill_hit96_import_s']:.3f} s = "
            f"{pre['prefill_cold_s'] / pre['prefill_hit96_import_s']:.1f}x faster "
            f"({pre['kv_bytes'] / 1e6:.0f} MB of KV)",
        ),
        ("decode batch 1", f"{decode[1]:.1f} tok/s"),
        ("decode batch 8 (total)", f"{decode[8]:.1f} tok/s"),
        ("decode batch 32 (total)", f"{decode[32]:.1f} tok/s"),
        ("HF transformers generate, batch 1", f"{hf:.1f} tok/s" if hf else "skipped"),
        ("memory read bandwidth", f"{bw / 1e9:.1f} GB/s"),
        ("weights read per token", f"{per_token / 1e6:.0f} MB"),
        ("bandwidth bound, batch 1", f"{bound:.1f} tok/s"),
        ("decode b1 / bound", f"{decode[1] / bound:.0%}"),
        ("decode b1 / HF", f"{decode[1] / hf:.1f}x" if hf else "-"),
        ("decode b32 / HF b1", f"{decode[32] / hf:.1f}x" if hf else "-"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'figure':<{width}}  value")
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("\nwhere batch-1 decode time goes (torch profiler, 5 steps):")
    print(profile_table)
    print(
        json.dumps(
            {
                "prefill_cold_tok_s": round(cold_tok_s, 1),
                "prefill_hit96_speedup": round(speedup, 2),
                "decode_b1_tok_s": round(decode[1], 2),
                "decode_b8_tok_s": round(decode[8], 2),
                "decode_b32_tok_s": round(decode[32], 2),
                "hf_decode_b1_tok_s": round(hf, 2) if hf else None,
                "bw_bound_b1_tok_s": round(bound, 2),
                "warm_load_s": round(warm_load, 2),
                "memory_bandwidth_gb_s": round(bw / 1e9, 2),
            }
        )
    )


if __name__ == "__main__":
    main()

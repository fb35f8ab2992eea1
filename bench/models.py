"""Models by path: per architecture and file format, what loading and serving one costs here.

For each architecture kvmesh serves (llama, llama with Llama 3.1's rope scaling, mistral,
qwen2, qwen3) a checkpoint of SmolLM2-135M's size with random weights is written as a Hugging
Face directory (bf16 safetensors, as checkpoints ship) and as a GGUF file (Q8_0); the bundled
SmolLM2 is measured as its GGUF file and exported to a Hugging Face directory. Each one is
loaded in a fresh process twice: cold (an empty state dir: conversion, the weights cache
written) and warm (the cache read, memory-mapped), and measured: load time, peak resident
memory, prefill tok/s (one 512-token prompt; eight 64-token prompts in one pass) and
decode tok/s (batch 1 and 8), and the max |logit difference| against transformers' fp32
forward pass of the same checkpoint (a GGUF file: against the weights it was quantized from).
Then `kvmesh up` (what `make run` starts: the real model, every service) is timed to a
healthy /health, cold and with the caches warm.

Prints a table, then as its last line one JSON object with those figures.

    .venv/bin/python bench/models.py [--threads 2] [--skip-up] [--archs llama,qwen2]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import Up, emit, say  # noqa: E402

SIZE = dict(  # SmolLM2-135M's dimensions
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
PER_ARCH = {"mistral": {"head_dim": 64, "sliding_window": 4096}, "qwen3": {"head_dim": 64}}
ARCHS = ["llama", "llama3-rope", "mistral", "qwen2", "qwen3"]


# -- one model in one process (run as: models.py --one KIND PATH STATE REFERENCE) ---------------


def peak_rss_mib() -> float:
    """The process's peak resident memory (weights, KV pool pages touched, torch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def median(run: Callable[[], float], repeats: int = 3) -> float:
    return statistics.median(run() for _ in range(repeats))


def measure_one(kind: str, path: str, state: str, reference: str, threads: int) -> dict:
    """Load the model, measure it, and compare its logits with transformers' from
    ``reference`` (a Hugging Face directory; "" for none)."""
    import torch

    torch.set_num_threads(threads)
    from shared.engine.interface import EngineOptions, PrefillRequest
    from shared.engine.torch.engine import TorchEngine
    from shared.engine.torch.loader import load_model
    from shared.messages.sampling import SamplingParams
    from shared.model.catalog import ModelSource, resolve

    source = resolve(path, {}) if kind == "name" else ModelSource("bench", kind, Path(path))
    t = time.perf_counter()
    model = load_model(source, Path(state))
    load_s = time.perf_counter() - t
    engine = TorchEngine(model, EngineOptions(kv_cache_tokens=16384, threads=threads))
    engine.start()
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(100, 40000, (n,), generator=g).tolist()

    one = SamplingParams(max_tokens=1)
    engine.prefill("warm", ids(64), one)  # (first-call costs out of the timings)
    engine.free("warm")

    def prefill_b1() -> float:
        t = time.perf_counter()
        engine.prefill("p1", ids(512), one)
        elapsed = time.perf_counter() - t
        engine.free("p1")
        return 512 / elapsed

    def prefill_b8() -> float:
        batch = [PrefillRequest(f"p8-{i}", ids(64), one) for i in range(8)]
        t = time.perf_counter()
        engine.prefill_batch(batch)
        elapsed = time.perf_counter() - t
        for r in batch:
            engine.free(r.seq_id)
        return 8 * 64 / elapsed

    prefill = {1: median(prefill_b1), 8: median(prefill_b8)}  # (a pass here is ±20% at times)
    decode = {}
    for n in (1, 8):
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i in range(n):
            engine.prefill(f"d{n}-{i}", ids(128), params)
        engine.step()
        t, steps = time.perf_counter(), 16
        for _ in range(steps):
            engine.step()
        decode[n] = n * steps / (time.perf_counter() - t)
        for i in range(n):
            engine.free(f"d{n}-{i}")
    diff = None
    if reference:
        diff = logit_diff(model, reference, ids(64))
    return {
        "load_s": round(load_s, 2),
        "rss_mib": round(peak_rss_mib()),  # after the runs: what serving touched
        "prefill_b1_tok_s": round(prefill[1], 1),
        "prefill_b8_tok_s": round(prefill[8], 1),
        "decode_b1_tok_s": round(decode[1], 1),
        "decode_b8_tok_s": round(decode[8], 1),
        "max_logit_diff": diff,
    }


def logit_diff(model, reference: str, ids: list[int]) -> float:  # noqa: ANN001
    import torch
    import transformers

    from shared.engine.torch.model import KVCache, Segment, Transformer

    ours = Transformer(model.config, {k: v.float() for k, v in model.weights.items()})
    n = len(ids)
    cache = KVCache(model.config, n, torch.float32)
    with torch.no_grad():
        hidden = ours.forward(
            torch.tensor(ids), torch.arange(n), [Segment(0, n, torch.arange(n))], cache
        )
        got = ours.logits(hidden)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            reference, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        expected = hf(torch.tensor([ids])).logits[0]
    return float((got - expected).abs().max())


# -- the checkpoints and the runs -------------------------------------------------------------


def checkpoints(work: Path, archs: list[str]) -> list[tuple[str, str, str, str, str]]:
    """(arch, format, kind, path, reference directory) for every model measured."""
    from shared.model.catalog import resolve
    from shared.model.export import export
    from tests.checkpoints import gguf_checkpoint, hf_checkpoint

    out = []
    for arch in archs:
        say(f"writing {arch}: a Hugging Face directory (bf16) and a GGUF file (Q8_0)")
        size = {**SIZE, **PER_ARCH.get(arch, {})}
        model = hf_checkpoint(work / arch, arch, seed=1, dtype="bfloat16", size=size)
        gguf = gguf_checkpoint(work / f"{arch}.gguf", model, arch, "Q8_0")
        del model
        out += [(arch, "hf bf16", "hf", str(work / arch), str(work / arch))]
        out += [(arch, "gguf Q8_0", "gguf", str(gguf), str(work / arch))]
    say("exporting the bundled SmolLM2 to a Hugging Face directory")
    exported = export(resolve("smollm2-135m-instruct", {}), work / "export-state", work / "smollm2")
    out += [("smollm2 (bundled)", "gguf Q4_1", "name", "smollm2-135m-instruct", str(exported))]
    out += [("smollm2 (exported)", "hf fp32", "hf", str(exported), str(exported))]
    return out


def run_one(kind: str, path: str, state: Path, reference: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--one", kind, path, str(state), reference]
    done = subprocess.run(
        [*cmd, "--threads", str(threads)], capture_output=True, text=True, timeout=900, cwd=ROOT
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def time_up(state: Path, timeout_s: float = 300) -> float:
    """Seconds from starting `kvmesh up` (the real model, every service) to /health 200 with
    every service ready."""
    with Up(state=state) as up:
        while time.perf_counter() - up.started_at < timeout_s:
            if up.proc.poll() is not None:
                raise SystemExit(f"kvmesh up exited with {up.proc.returncode}:\n{up.tail()}")
            try:
                with urllib.request.urlopen(f"{up.url}/health", timeout=2) as r:
                    body = json.loads(r.read())
                if r.status == 200 and all(body["roles"].get(k) for k in ("prefill", "decode")):
                    return time.perf_counter() - up.started_at
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"kvmesh up not healthy within {timeout_s} s")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-up", action="store_true")
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--one", nargs=4, metavar=("KIND", "PATH", "STATE", "REFERENCE"))
    args = parser.parse_args()
    if args.one:
        emit(measure_one(*args.one, threads=args.threads))
        return
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvmesh-models-") as tmp:
        work = Path(tmp)
        for arch, fmt, kind, path, ref in checkpoints(work, args.archs.split(",")):
            state = work / f"state-{len(rows)}"
            say(f"{arch} {fmt}: cold load")
            cold = run_one(kind, path, state, ref, args.threads)
            say(f"{arch} {fmt}: warm load")
            warm = run_one(kind, path, state, "", args.threads)
            rows.append({"arch": arch, "format": fmt, "cold": cold, "warm": warm})
        up = {}
        if not args.skip_up:
            say("kvmesh up: cold (an empty state dir)")
            up["cold_s"] = round(time_up(work / "up-state"), 1)
            say("kvmesh up: warm (the same state dir)")
            up["warm_s"] = round(time_up(work / "up-state"), 1)
    head = (
        "arch",
        "format",
        "load cold s",
        "load warm s",
        "peak RSS MiB",
        "prefill b1",
        "prefill b8",
    )
    head += ("decode b1", "decode b8", "max |dlogit|")
    print(" | ".join(head))
    for r in rows:
        c, w = r["cold"], r["warm"]
        diff = c["max_logit_diff"]
        print(
            f"{r['arch']} | {r['format']} | {c['load_s']} | {w['load_s']} | {w['rss_mib']:.0f} | "
            f"{w['prefill_b1_tok_s']} | {w['prefill_b8_tok_s']} | {w['decode_b1_tok_s']} | "
            f"{w['decode_b8_tok_s']} | {'-' if diff is None else f'{diff:.2e}'}"
        )
    if up:
        print(f"kvmesh up to healthy: cold {up['cold_s']} s, warm {up['warm_s']} s")
    figures = {
        f"{r['arch']} {r['format']}": {
            "load_cold_s": r["cold"]["load_s"],
            "load_warm_s": r["warm"]["load_s"],
            "rss_mib": r["warm"]["rss_mib"],
            "prefill_b1_tok_s": r["warm"]["prefill_b1_tok_s"],
            "prefill_b8_tok_s": r["warm"]["prefill_b8_tok_s"],
            "decode_b1_tok_s": r["warm"]["decode_b1_tok_s"],
            "decode_b8_tok_s": r["warm"]["decode_b8_tok_s"],
            "max_logit_diff": r["cold"]["max_logit_diff"],
        }
        for r in rows
    }
    emit({"models": figures, "kvmesh_up": up})


if __name__ == "__main__":
    main()

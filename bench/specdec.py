"""Speculative decoding on the real model: n-gram drafts verified in the decode pass, with no
speculation, fixed draft lengths, and the adaptive per-request length.

Four workloads of 20 prompts, greedy, up to --tokens new tokens: code editing (a function of
Python's standard library with a small change asked, the whole function answered), extractive
answers (quote the passage's sentence about something), open-ended writing, and a mix of the
three. Batch 1 (prompt by prompt) and batch 8. Policies run alternated on each prompt (or
batch), one engine each, on the same weights. Per workload and policy: tokens/s (output tokens
over decode time, prefill excluded), the speedup over off, accepted tokens per sequence-step,
drafted tokens verified per output token; and the workload's copy rate (share of the answer's
3-grams found in its prompt, from off's answers). Every policy's answers are compared with
off's, token for token.

Prints a table, then as its last line one JSON object: speedup_code_b1, speedup_open_b1,
speedup_mix_b1, speedup_mix_b8, adaptive_vs_fixed5_mix_b1, adaptive_vs_fixed5_mix_b8,
adaptive_vs_best_fixed_worst, identical_outputs (and per-workload figures).

    .venv/bin/python bench/specdec.py [--threads 2] [--tokens 192] [--prompts 20] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import base64  # noqa: E402
import calendar  # noqa: E402
import collections  # noqa: E402
import difflib  # noqa: E402
import fnmatch  # noqa: E402
import heapq  # noqa: E402
import json as json_module  # noqa: E402
import os.path  # noqa: E402
import shutil  # noqa: E402
import string  # noqa: E402
import textwrap  # noqa: E402

from bench.harness import emit, say  # noqa: E402
from shared.engine.interface import EngineOptions  # noqa: E402
from shared.engine.torch.engine import TorchEngine  # noqa: E402
from shared.engine.torch.loader import load_model  # noqa: E402
from shared.messages.sampling import SamplingParams  # noqa: E402
from shared.model.gguf import REAL_MODEL  # noqa: E402
from shared.model.text import load_text_model  # noqa: E402

POLICIES = [("off", 0), ("fixed", 1), ("fixed", 2), ("fixed", 3), ("fixed", 5), ("fixed", 8)]
POLICIES.append(("adaptive", 0))
FUNCTIONS = [
    textwrap.dedent,
    textwrap.indent,
    shutil.copyfileobj,
    os.path.relpath,
    os.path.commonprefix,
    fnmatch.filter,
    heapq.nsmallest,
    calendar.isleap,
    calendar.leapdays,
    string.capwords,
    base64.b32encode,
    difflib.get_close_matches,
    json_module.dump,
    collections.namedtuple,
    shutil.which,
    os.path.expanduser,
    heapq.merge,
    fnmatch.translate,
    textwrap.shorten,
    calendar.weekday,
]
CHANGES = [
    "Rename its first parameter to `data`.",
    "Add a docstring line saying it is part of the harbour toolkit.",
    "Replace every double quote in string literals with single quotes.",
    "Add type hints to its parameters.",
]
PASSAGES = [
    (m.__doc__ or "").strip()
    for m in (json_module, textwrap, heapq, difflib, string, shutil, base64, calendar, collections)
]
TOPICS = [
    "a lighthouse keeper's last night",
    "why cities grow near rivers",
    "a letter to a future engineer",
    "the smell of rain on a harbour",
    "a chess game between two old friends",
    "how bread changed history",
    "a robot learning to paint",
    "the first day at a new school",
    "a storm seen from a ship",
    "what makes a good teacher",
]


def _source(fn) -> str | None:  # noqa: ANN001
    try:
        return textwrap.dedent(inspect.getsource(fn))[:2400]
    except (OSError, TypeError):  # written in C here
        return None


SOURCES = [src for fn in FUNCTIONS if (src := _source(fn))]


def code_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        src = SOURCES[i % len(SOURCES)]
        change = CHANGES[i % len(CHANGES)]
        out.append(f"```python\n{src}\n```\n{change} Answer with the whole function.")
    return out


def extract_prompts(n: int) -> list[str]:
    out = []
    for i in range(n):
        passage = PASSAGES[i % len(PASSAGES)][:1800]
        words = [w for w in passage.split() if len(w) > 6]
        topic = words[(i * 7) % len(words)] if words else "it"
        out.append(
            f"Passage:\n{passage}\n\nQuote, word for word, the sentences of the passage that "
            f"mention {topic!r}, then the sentence after them."
        )
    return out


def open_prompts(n: int) -> list[str]:
    return [f"Write a short essay about {TOPICS[i % len(TOPICS)]}." for i in range(n)]


def mix_prompts(n: int) -> list[str]:
    """A third of each kind, other items than the workloads of one kind start with."""
    kinds = [code_prompts(n + 7), extract_prompts(n + 7), open_prompts(n + 7)]
    return [kinds[i % 3][i // 3 + 7] for i in range(n)]


def copy_rate(prompt: list[int], answer: list[int]) -> tuple[int, int]:
    grams = {tuple(prompt[i : i + 3]) for i in range(len(prompt) - 2)}
    mine = [tuple(answer[i : i + 3]) for i in range(len(answer) - 2)]
    return sum(g in grams for g in mine), len(mine)


def run_batch(engine: TorchEngine, prompts: list[list[int]], tokens: int, kv: dict) -> tuple:
    """Prefill the batch (not timed), decode it to the end: answers, decode seconds. ``kv``:
    each prompt's full blocks, exported by the first policy's engine and imported by the
    others' (the prompts' prefill is the same for every policy: done once)."""
    params = SamplingParams(max_tokens=tokens, temperature=0)
    ids = [f"r{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    outs = []
    for sid, p in zip(ids, prompts, strict=True):
        key = tuple(p)
        prefix = engine.import_blocks(kv[key]) if kv.get(key) else None
        outs.append([engine.prefill(sid, p, params, prefix=prefix).token_id])
        if prefix is not None:
            engine.release(prefix)
        elif key not in kv:
            kv[key] = engine.export_blocks(sid, 0, (len(p) - 1) // engine.block_size)
    started = time.perf_counter()
    while engine.running:
        for o in engine.step():
            outs[ids.index(o.seq_id)].append(o.token_id)
    took = time.perf_counter() - started
    for sid in ids:
        engine.free(sid)
    return outs, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument(
        "--only", default="", help="comma-separated runs to do, as the JSON names them (code_b1)"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    state = Path.home() / ".cache" / "kvmesh-bench"
    say(f"loading {REAL_MODEL} ...")
    model = load_model(REAL_MODEL, state)
    text = load_text_model(REAL_MODEL, state)
    engines = {}
    for mode, k in POLICIES:
        options = EngineOptions(
            block_size=64,
            kv_cache_tokens=8 * (1024 + args.tokens + 64),
            speculative=mode,
            fixed_draft=max(k, 1),
            max_draft=8,
        )
        engines[(mode, k)] = TorchEngine(model, options)
        engines[(mode, k)].start()
    workloads = {
        "code": code_prompts(args.prompts),
        "extract": extract_prompts(args.prompts),
        "open": open_prompts(args.prompts),
        "mix": mix_prompts(args.prompts),
    }
    results: dict = {}
    identical = True
    for batch in args.batch:
        for name, prompts in workloads.items():
            if args.only and f"{name}_b{batch}" not in args.only.split(","):
                continue
            ids = [
                model.tokenizer.encode(
                    text.chat_template.render([{"role": "user", "content": p}]),
                    add_special_tokens=False,
                ).ids[-1000:]
                for p in prompts
            ]
            kv: dict = {}
            per = {p: {"tokens": 0, "seconds": 0.0, "drafted": 0, "accepted": 0} for p in POLICIES}
            copied = [0, 0]
            for start in range(0, len(ids), batch):
                group = ids[start : start + batch]
                say(f"b{batch} {name}: prompts {start + 1}-{start + len(group)} of {len(ids)}")
                reference = None
                for policy in POLICIES:
                    engine = engines[policy]
                    before = engine.stats()
                    outs, took = run_batch(engine, group, args.tokens, kv)
                    after = engine.stats()
                    r = per[policy]
                    r["tokens"] += sum(len(o) - 1 for o in outs)  # the first is prefill's
                    r["seconds"] += took
                    r["drafted"] += after.draft_tokens - before.draft_tokens
                    r["accepted"] += after.accepted_tokens - before.accepted_tokens
                    if reference is None:
                        reference = outs
                        for p, o in zip(group, outs, strict=True):
                            hit, n = copy_rate(p, o)
                            copied[0] += hit
                            copied[1] += n
                    elif outs != reference:
                        identical = False
                        say(f"  {policy}: answers differ from off's")
            off = per[("off", 0)]
            rows = {}
            for policy, r in per.items():
                tok_s = r["tokens"] / r["seconds"]
                seq_steps = max(1, r["tokens"] - r["accepted"])
                rows[f"{policy[0]}{policy[1] or ''}"] = {
                    "tok_s": round(tok_s, 2),
                    "speedup": round(tok_s / (off["tokens"] / off["seconds"]), 4),
                    "accepted_per_step": round(r["accepted"] / seq_steps, 3),
                    "drafted_per_token": round(r["drafted"] / max(1, r["tokens"]), 3),
                }
            rows["copy_rate"] = round(copied[0] / max(1, copied[1]), 3)
            results[f"{name}_b{batch}"] = rows
            say(json.dumps({f"{name}_b{batch}": rows, "identical": identical}))  # as it goes
    print(
        f"\nReal model ({REAL_MODEL}), greedy, up to {args.tokens} new tokens, "
        f"{args.threads} threads"
    )
    names = [f"{m}{k or ''}" for m, k in POLICIES]
    print(f"{'workload':<12}{'copy':>6}" + "".join(f"{n:>10}" for n in names))
    for key, rows in results.items():
        cells = "".join(f"{rows[n]['tok_s']:>10.1f}" for n in names)
        print(f"{key:<12}{rows['copy_rate']:>6.2f}{cells}   tok/s")
        cells = "".join(f"{rows[n]['speedup']:>10.3f}" for n in names)
        print(f"{'':<18}{cells}   × off")
        cells = "".join(f"{rows[n]['accepted_per_step']:>10.2f}" for n in names)
        print(f"{'':<18}{cells}   accepted/step")
        cells = "".join(f"{rows[n]['drafted_per_token']:>10.2f}" for n in names)
        print(f"{'':<18}{cells}   drafted/token")

    def ratio(key: str, a: str, b: str) -> float | None:  # (None: a run not done)
        rows = results.get(key)
        return round(rows[a]["tok_s"] / rows[b]["tok_s"], 4) if rows else None

    fixed = [n for n in names if n.startswith("fixed")]
    worst = min(
        rows["adaptive"]["tok_s"] / max(rows[n]["tok_s"] for n in fixed)
        for rows in results.values()
    )
    summary = {
        "speedup_code_b1": ratio("code_b1", "adaptive", "off"),
        "speedup_open_b1": ratio("open_b1", "adaptive", "off"),
        "speedup_mix_b1": ratio("mix_b1", "adaptive", "off"),
        "speedup_mix_b8": ratio("mix_b8", "adaptive", "off"),
        "adaptive_vs_fixed5_mix_b1": ratio("mix_b1", "adaptive", "fixed5"),
        "adaptive_vs_fixed5_mix_b8": ratio("mix_b8", "adaptive", "fixed5"),
        "adaptive_vs_best_fixed_worst": round(worst, 4),
        "identical_outputs": identical,
        "workloads": results,
    }
    emit(summary)


if __name__ == "__main__":
    main()

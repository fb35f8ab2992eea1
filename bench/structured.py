"""Constrained decoding's cost on the real model (fp32, the machine's threads).

Batches of 1 and 8 sequences decode the same prompts twice: constrained by a JSON schema
(each step masks the logits by the grammar) and free; the time per decode step, per token, is
compared over the steps both runs make. Also: the schema's compile time (grammar from the
schema, checked against the vocabulary, a matcher made) and how many constrained answers
parse and validate.

Prints a table, then as its last line one JSON object: constrained_tpot_overhead_b1,
constrained_tpot_overhead_b8 (fractions: 0.05 is 5% slower per token), valid_ratio,
compile_ms, tpot_ms (per batch and mode).

    .venv/bin/python bench/structured.py [--threads 2] [--steps 48] [--rounds 3]
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

import jsonschema  # noqa: E402

from bench.harness import say  # noqa: E402
from shared.engine.interface import EngineOptions  # noqa: E402
from shared.engine.torch.engine import TorchEngine  # noqa: E402
from shared.engine.torch.loader import load_model  # noqa: E402
from shared.messages.sampling import SamplingParams  # noqa: E402
from shared.model.gguf import REAL_MODEL  # noqa: E402
from shared.model.grammar import Matcher, check, json_grammar, vocabulary  # noqa: E402
from shared.model.text import load_text_model  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "ships": {
            "type": "array",
            "minItems": 6,
            "maxItems": 8,
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "berth": {"type": "integer", "minimum": 1, "maximum": 12},
                    "cargo": {"enum": ["grain", "coal", "containers", "timber", "fish"]},
                },
                "required": ["name", "berth", "cargo"],
                "additionalProperties": False,
            },
        },
        "summary": {"type": "string", "maxLength": 120},
    },
    "required": ["ships", "summary"],
    "additionalProperties": False,
}
QUESTIONS = [
    "List the ships in the harbour today as JSON.",
    "Which ships are at which berths, and what do they carry? Answer in JSON.",
    "Give the harbour master's morning list of ships as JSON.",
    "Report every ship at berth with its cargo, as JSON.",
]


def step_times(
    engine: TorchEngine, prompts: list[list[int]], params: SamplingParams, steps: int
) -> tuple[list[float], list[list[int]]]:
    """The batch prefilled, then ``steps`` decode steps timed one by one (the outputs run on
    to their end after, for validity)."""
    ids = [f"s{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    outs = [[engine.prefill(sid, p, params).token_id] for sid, p in zip(ids, prompts, strict=True)]
    times = []
    while engine.running:
        started = time.perf_counter()
        done = engine.step()
        took = time.perf_counter() - started
        if len(times) < steps and len(done) == len(prompts):  # every sequence in the step
            times.append(took)
        for o in done:
            outs[ids.index(o.seq_id)].append(o.token_id)
    for sid in ids:
        engine.free(sid)
    return times, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    state = Path.home() / ".cache" / "kvmesh-bench"
    say(f"loading {REAL_MODEL} ...")
    model = load_model(REAL_MODEL, state)
    text = load_text_model(REAL_MODEL, state)
    engine = TorchEngine(model, EngineOptions(block_size=64, kv_cache_tokens=32768))
    engine.start()

    say("compiling the schema ...")
    vocab = vocabulary(model.tokenizer, tuple(model.config.eos_ids))
    compiles = []
    for _ in range(20):
        started = time.perf_counter()
        grammar = json_grammar(SCHEMA)
        check(grammar, vocab)
        Matcher(grammar, vocab, [])
        compiles.append(time.perf_counter() - started)
    compile_ms = statistics.median(compiles) * 1e3

    rendered = [text.chat_template.render([{"role": "user", "content": q}]) for q in QUESTIONS * 2]
    prompts = [model.tokenizer.encode(r, add_special_tokens=False).ids for r in rendered]
    free = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    bound = SamplingParams(max_tokens=400, temperature=0, grammar=grammar)
    tpot: dict[str, dict[str, float]] = {}
    answers: list[list[int]] = []
    for batch in (1, 8):
        per = {"free": [], "constrained": []}
        for r in range(args.rounds):
            say(f"batch {batch}, round {r + 1}/{args.rounds} ...")
            for mode, params in (("free", free), ("constrained", bound)):
                times, outs = step_times(engine, prompts[:batch], params, args.steps)
                per[mode] += times
                if mode == "constrained" and r == 0:
                    answers += outs
        tpot[f"b{batch}"] = {m: statistics.median(t) * 1e3 for m, t in per.items()}

    valid = 0
    for out in answers:
        try:
            jsonschema.validate(json.loads(model.tokenizer.decode(out)), SCHEMA)
            valid += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    overhead = {b: round(t["constrained"] / t["free"] - 1, 4) for b, t in tpot.items()}
    print(f"\nReal model ({REAL_MODEL}), {args.threads} threads; time per decode step (median)")
    print(f"{'batch':<8}{'free ms':>10}{'constrained ms':>16}{'overhead':>10}")
    for b, t in tpot.items():
        print(f"{b:<8}{t['free']:>10.2f}{t['constrained']:>16.2f}{overhead[b]:>10.1%}")
    print(f"schema compile (grammar, check, matcher): {compile_ms:.2f} ms")
    print(f"constrained answers valid: {valid}/{len(answers)}")
    print(
        json.dumps(
            {
                "constrained_tpot_overhead_b1": overhead["b1"],
                "constrained_tpot_overhead_b8": overhead["b8"],
                "valid_ratio": round(valid / len(answers), 4),
                "compile_ms": round(compile_ms, 3),
                "tpot_ms": {b: {m: round(v, 3) for m, v in t.items()} for b, t in tpot.items()},
            }
        )
    )


if __name__ == "__main__":
    main()

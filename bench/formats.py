"""API formats: what the router adds per format, and the cache across formats.

1. In process, with the real model's tokenizer and chat template: the router's time to turn a
   request body into prompt token ids (the format's adapter, then the renderer) on an
   agent-like conversation of about 77K tokens (the repository's own files as tool output),
   per format: "cold" (a router that never saw the conversation: every message tokenized) and
   "warm" (the next turn: the history's messages are in the token cache). Then the time the
   cache-miss explanation adds to that request (its parts' digests, finding the earlier turn,
   remembering it).
2. `kvmesh up` on the tiny model (the real model's tokenizer and template; its context is 4K):
   one conversation of about 2.5K tokens sent as turn 1 in one format and, with the answer and
   a new question, as turn 2 in another, for every pair of Chat Completions, Messages and
   Responses; turn 2's cached tokens against turn 1's full blocks (a 3×3 table).

Prints the tables, then as its last line one JSON object: convert_render_p50_us (per format,
cold and warm), explain_p50_us, cross_format_cached (per pair: cached tokens, ratio),
cross_format_min_ratio.

    .venv/bin/python bench/formats.py [--reps 30] [--skip-stack]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Stack, say  # noqa: E402
from services.router.dispatch.plan import PrefixHashes  # noqa: E402
from services.router.formats import anthropic as anthropic_api  # noqa: E402
from services.router.formats import openai as openai_api  # noqa: E402
from services.router.formats import responses as responses_api  # noqa: E402
from services.router.observe.cachemiss import CacheMisses, Prompt, PromptParts  # noqa: E402
from services.router.request.render import Renderer  # noqa: E402
from shared.model.text import TextModel, load_text_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
TARGET_TOKENS = 77_000
FORMATS = ("chat", "messages", "responses")


# -- one conversation in three formats ---------------------------------------------------------


def agent_conversation(model: TextModel, target: int) -> tuple[str, list[tuple[str, str]]]:
    """A system prompt and alternating user (a file's text, as a tool's output would be) and
    assistant turns, about ``target`` tokens in all."""
    system = (REPO / "README.md").read_text()[:6000]
    files = sorted(p for p in REPO.glob("**/*.py") if ".venv" not in p.parts)
    turns: list[tuple[str, str]] = []
    total = len(model.tokenizer.encode(system).ids)
    for path in files:
        text = f"Contents of {path.relative_to(REPO)}:\n{path.read_text()}"
        n = len(model.tokenizer.encode(text).ids)
        if total + n > target:
            break
        turns += [("user", text), ("assistant", f"Read {path.name}; {n} tokens, noted.")]
        total += n + 12
    turns.append(("user", "Now list every module that imports the bus."))
    return system, turns


def body(fmt: str, system: str, turns: list[tuple[str, str]], **extra: object) -> dict:
    """The same conversation as each format's request body."""
    msgs = [{"role": r, "content": t} for r, t in turns]
    if fmt == "chat":
        return {
            "model": "tiny",
            "messages": [{"role": "system", "content": system}, *msgs],
            **extra,
        }
    if fmt == "messages":
        return {"model": "tiny", "system": system, "messages": msgs, "max_tokens": 8, **extra}
    return {"model": "tiny", "instructions": system, "input": msgs, **extra}


ADAPTERS = {
    "chat": lambda b: openai_api.conversation(b, chat=True),
    "messages": anthropic_api.conversation,
    "responses": responses_api.conversation,
}


def p50_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def conversion(reps: int) -> tuple[dict, float, int]:
    """Per format: p50 µs of adapter + renderer, cold and warm; the explanation's p50 µs; the
    conversation's tokens. One event loop throughout, as in the router (a long prompt is
    tokenized on the loop's thread pool)."""
    model = load_text_model("tiny", Path(tempfile.mkdtemp(prefix="kvmesh-formats-")))
    system, turns = agent_conversation(model, TARGET_TOKENS)
    out, tokens = asyncio.run(_conversion(model, system, turns, reps))
    return out, explanation_cost(model, system, turns, reps), tokens


async def _conversion(
    model: TextModel, system: str, turns: list, reps: int
) -> tuple[dict[str, dict[str, float]], int]:
    out: dict[str, dict[str, float]] = {}
    tokens = 0
    for fmt in FORMATS:
        raw = json.dumps(body(fmt, system, turns)).encode()
        warm_renderer = Renderer(8_000_000)
        warm_renderer.add("tiny", model)
        cold, warm = [], []
        for i in range(reps + 1):
            renderers = [(warm_renderer, warm)]
            if i < max(3, reps // 5):  # a cold render takes a while: fewer of them
                fresh = Renderer(8_000_000)
                fresh.add("tiny", model)
                renderers.append((fresh, cold))
            for renderer, samples in renderers:
                started = time.perf_counter()
                conv = ADAPTERS[fmt](raw)
                rendered = await renderer.render(conv, model, [])
                took = time.perf_counter() - started
                if not (renderer is warm_renderer and i == 0):  # that one fills its cache
                    samples.append(took)
            tokens = len(rendered.ids)
        out[fmt] = {"cold": p50_us(cold), "warm": p50_us(warm)}
        say(f"{fmt}: {tokens} tokens, cold {out[fmt]['cold']} µs, warm {out[fmt]['warm']} µs")
    return out, tokens


def explanation_cost(model: TextModel, system: str, turns: list, reps: int) -> float:
    """What the cache-miss explanation adds to a request of this conversation, p50 µs: a
    tenant that sent the turn before, then sends this turn (whose blocks were all cached)."""
    raw = json.dumps(body("chat", system, turns)).encode()
    renderer = Renderer(8_000_000)
    renderer.add("tiny", model)
    conv = openai_api.conversation(raw, chat=True)
    rendered = asyncio.run(renderer.render(conv, model, []))
    hashes = PrefixHashes().hashes(rendered.segments, 64, "fp", "salt")
    before = openai_api.conversation(
        json.dumps(body("chat", system, turns[:-2])).encode(), chat=True
    )
    rendered_before = asyncio.run(renderer.render(before, model, []))
    hashes_before = PrefixHashes().hashes(rendered_before.segments, 64, "fp", "salt")
    samples = []
    for i in range(reps):
        misses = CacheMisses(64 << 20)
        old = PromptParts.of("t", before, [])
        n = len(rendered_before.ids)
        earlier = Prompt(f"a{i}", "tiny", old.parts, n, 64, "".join(hashes_before))
        misses.remember("t", earlier, old.texts)
        started = time.perf_counter()
        seen = PromptParts.of("t", conv, [])
        prompt = Prompt(f"b{i}", "tiny", seen.parts, len(rendered.ids), 64, "".join(hashes))
        cached = len(hashes) * 64
        misses.explain("t", prompt, seen.texts, cached, conv, rendered.segments, model.tokenizer)
        misses.remember("t", prompt, seen.texts)
        samples.append(time.perf_counter() - started)
    return p50_us(samples)


# -- the cache across formats ------------------------------------------------------------------


def post(url: str, payload: dict) -> dict:
    req = urllib.request.Request(
        url, json.dumps(payload).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def ask(stack: Stack, fmt: str, system: str, turns: list) -> tuple[str, int, int]:
    """The answer's text, the prompt's tokens and its cached tokens, read from the format's
    own usage fields."""
    extra: dict = {"temperature": 0}
    extra["max_output_tokens" if fmt == "responses" else "max_tokens"] = 8
    out = post(stack.url + PATHS[fmt], body(fmt, system, turns, **extra))
    if fmt == "chat":
        u = out["usage"]
        text = out["choices"][0]["message"]["content"]
        return text, u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"]
    if fmt == "messages":
        u = out["usage"]
        prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
        return out["content"][0]["text"], prompt, u["cache_read_input_tokens"]
    u = out["usage"]
    text = "".join(c["text"] for item in out["output"] for c in item.get("content", []))
    return text, u["input_tokens"], u["input_tokens_details"]["cached_tokens"]


def cross_format(stack: Stack) -> dict[str, dict]:
    history = [
        ("user", "The harbour's berth schedule for the week follows. " * 60),
        ("assistant", "Noted: berths 1 to 6, with the pilots' hours. " * 20),
        ("user", "And the tug roster, with each crew's shift. " * 60),
    ]
    out = {}
    for first in FORMATS:
        for second in FORMATS:
            system = f"[{first}->{second} {uuid.uuid4().hex[:8]}] You keep the harbour's books."
            answer, prompt_1, _ = ask(stack, first, system, history)
            turn_2 = [*history, ("assistant", answer), ("user", "Which tug is free at dawn?")]
            _, prompt_2, cached = ask(stack, second, system, turn_2)
            allowed = prompt_1 // 64 * 64
            out[f"{first}->{second}"] = {
                "turn1_tokens": prompt_1,
                "turn2_tokens": prompt_2,
                "cached_tokens": cached,
                "ratio": round(cached / allowed, 4) if allowed else None,
            }
            say(f"{first} → {second}: {cached} of {allowed} cached")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--skip-stack", action="store_true")
    args = parser.parse_args()
    say(f"conversion and rendering, {args.reps} repetitions per format ...")
    per_format, explain_us, tokens = conversion(args.reps)
    print(f"\nAdapter + renderer, {tokens}-token conversation (p50, µs)")
    print(f"{'format':<10} {'cold':>12} {'warm':>12}")
    for fmt, t in per_format.items():
        print(f"{fmt:<10} {t['cold']:>12,.1f} {t['warm']:>12,.1f}")
    print(f"cache-miss explanation (digests, earlier turn, remember): {explain_us:,.1f} µs")
    cross: dict[str, dict] = {}
    if not args.skip_stack:
        say("starting kvmesh up (tiny model) ...")
        stack = Stack("tiny", 1)
        try:
            stack.wait_ready()
            cross = cross_format(stack)
        finally:
            stack.stop()
        print("\nTurn 2's cached tokens / turn 1's full blocks (turn 1 in the row's format)")
        print(f"{'':<10}" + "".join(f"{f:>12}" for f in FORMATS))
        for first in FORMATS:
            cells = "".join(f"{cross[f'{first}->{s}']['ratio']:>12.3f}" for s in FORMATS)
            print(f"{first:<10}{cells}")
    ratios = [c["ratio"] for c in cross.values() if c["ratio"] is not None]
    print(
        json.dumps(
            {
                "conversation_tokens": tokens,
                "convert_render_p50_us": per_format,
                "explain_p50_us": explain_us,
                "cross_format_cached": cross,
                "cross_format_min_ratio": min(ratios) if ratios else None,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())

"""Several answers to one prompt, and the prompt scored: what they cost.

`kvmesh up` on the tiny model (1 prefill, 1 decode worker with room for 64K tokens). For
each of ``--reps`` fresh prompts of about ``--tokens`` tokens:

1. ``n=8`` in one request (the prompt prefilled once: the other seven candidates start once a
   decode worker holds the first, and share its prompt's blocks there) against 8 separate
   requests with the same prompt sent at once (what a client without ``n`` does): wall time,
   answer tokens per second, the prompt tokens the workers computed (their
   ``kvmesh_prefill_tokens``), and the most KV blocks decode held at once (polled).
2. The cost of the prompt's scores on a prompt already cached: a request that reuses the
   cache (``max_tokens`` 1) against ``echo`` + ``logprobs`` + ``max_tokens`` 0 (a cached block
   has no logits, so the prompt is computed whole and each row's log-softmax taken).

Prints the tables, then as its last line one JSON object with the medians: n8_s, separate8_s,
n8_tok_s, separate8_tok_s, n8_prefill_tokens, separate8_prefill_tokens, n8_decode_blocks,
separate8_decode_blocks, uncached_request_ms, cached_request_ms, scored_request_ms,
scoring_cost_ratio.

    .venv/bin/python bench/choices.py [--reps 3] [--tokens 2000] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Stack, say  # noqa: E402

N = 8
SENTENCE = "The harbour master logs each ship that berths at the quay before dawn. "


def prompt_of(tokens: int) -> str:
    """A fresh prompt of about ``tokens`` tokens (the tiny model's tokenizer: ~14 a sentence)."""
    return f"{uuid.uuid4()} " + SENTENCE * max(1, tokens // 14)


def computed(url: str) -> float:
    """Prompt tokens the stack's workers have computed so far."""
    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
        health = json.loads(r.read())
    total = 0.0
    for workers in health["roles"].values():
        for w in workers:
            if not w.get("address") or w["id"].startswith(("router", "cachemeta", "encoder")):
                continue
            with urllib.request.urlopen(f"{w['address']}/metrics", timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith('kvmesh_prefill_tokens_total{kind="computed"}'):
                        total += float(line.split()[-1])
    return total


async def complete(session: aiohttp.ClientSession, url: str, body: dict) -> dict:
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
        return await resp.json()


def decode_address(url: str) -> str:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
        health = json.loads(r.read())
    return next(w["address"] for w in health["roles"]["decode"])


async def peak_blocks(session: aiohttp.ClientSession, decode: str, peak: list[int]) -> None:
    """The most KV blocks decode holds, read from its own /health until cancelled."""
    while True:
        async with session.get(f"{decode}/health") as resp:
            peak[0] = max(peak[0], (await resp.json())["load"]["kv_blocks_used"])
        await asyncio.sleep(0.01)


async def several(url: str, prompt: str, max_tokens: int, together: bool) -> dict:
    """N answers to ``prompt``: one request with n=N (``together``) or N requests at once."""
    base = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1}
    before, peak = computed(url), [0]
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        polling = asyncio.create_task(peak_blocks(session, decode_address(url), peak))
        if together:
            bodies = [await complete(session, url, {**base, "n": N, "seed": 1})]
        else:
            asks = [complete(session, url, {**base, "seed": 1 + i}) for i in range(N)]
            bodies = await asyncio.gather(*asks)
        took = time.perf_counter() - started
        polling.cancel()
    tokens = sum(b["usage"]["completion_tokens"] for b in bodies)
    return {
        "s": took,
        "tok_s": tokens / took,
        "prefill_tokens": computed(url) - before,
        "decode_blocks": peak[0],
    }


async def scoring(url: str, prompt: str) -> dict:
    """A cached prompt answered (one token) against the same prompt scored (echo, logprobs)."""
    base = {"model": "tiny", "prompt": prompt, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        started = time.perf_counter()
        await complete(session, url, {**base, "max_tokens": 1})
        uncached_ms = (time.perf_counter() - started) * 1e3
        for _ in range(50):  # (its blocks are stored after its first token: until they are)
            started = time.perf_counter()
            plain = await complete(session, url, {**base, "max_tokens": 1})
            cached_ms = (time.perf_counter() - started) * 1e3
            if plain["usage"]["prompt_tokens_details"]["cached_tokens"]:
                break
            await asyncio.sleep(0.1)
        started = time.perf_counter()
        await complete(session, url, {**base, "max_tokens": 0, "echo": True, "logprobs": 1})
        scored_ms = (time.perf_counter() - started) * 1e3
    cached = plain["usage"]["prompt_tokens_details"]["cached_tokens"]
    return {
        "uncached_ms": uncached_ms,
        "cached_ms": cached_ms,
        "scored_ms": scored_ms,
        "cached_tokens": cached,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    say("starting kvmesh up (tiny model) ...")
    # Room in decode for N answers of the prompt each (separate requests share no KV there).
    room = str(4 * 16384)
    stack = Stack("tiny", 1, {"KVMESH_DECODE_KV_CACHE_TOKENS": room})
    runs: list[dict] = []
    try:
        stack.wait_ready()
        for rep in range(args.reps):
            say(f"rep {rep + 1}/{args.reps}: n={N} ...")
            together = asyncio.run(
                several(stack.url, prompt_of(args.tokens), args.max_tokens, True)
            )
            say(f"rep {rep + 1}/{args.reps}: {N} separate requests ...")
            apart = asyncio.run(several(stack.url, prompt_of(args.tokens), args.max_tokens, False))
            say(f"rep {rep + 1}/{args.reps}: the prompt scored ...")
            scored = asyncio.run(scoring(stack.url, prompt_of(args.tokens)))
            runs.append({"n8": together, "separate8": apart, "scoring": scored})
    finally:
        stack.stop()

    def median(path: tuple[str, str]) -> float:
        return statistics.median(r[path[0]][path[1]] for r in runs)

    print(f"\n{N} answers to one ~{args.tokens}-token prompt, {args.max_tokens} tokens each")
    print(
        f"{'':<24}{'wall s':>10}{'answer tok/s':>14}{'prompt tokens computed':>24}"
        f"{'decode KV blocks (peak)':>25}"
    )
    for key, name in (("n8", f"n={N}, one request"), ("separate8", f"{N} requests at once")):
        print(
            f"{name:<24}{median((key, 's')):>10.2f}{median((key, 'tok_s')):>14.1f}"
            f"{median((key, 'prefill_tokens')):>24.0f}{median((key, 'decode_blocks')):>25.0f}"
        )
    cached_ms, scored_ms = median(("scoring", "cached_ms")), median(("scoring", "scored_ms"))
    uncached_ms = median(("scoring", "uncached_ms"))
    print(f"\nA ~{args.tokens}-token prompt answered (1 token): {uncached_ms:.1f} ms uncached,")
    print(f"{cached_ms:.1f} ms cached; scored (echo, logprobs, max_tokens 0) once cached:")
    print(f"{scored_ms:.1f} ms (×{scored_ms / cached_ms:.2f} the cached answer; the prompt is")
    print("computed whole, and every row's logits made: the LM head over the prompt)")
    print(
        json.dumps(
            {
                "n8_s": median(("n8", "s")),
                "separate8_s": median(("separate8", "s")),
                "n8_tok_s": median(("n8", "tok_s")),
                "separate8_tok_s": median(("separate8", "tok_s")),
                "n8_prefill_tokens": median(("n8", "prefill_tokens")),
                "separate8_prefill_tokens": median(("separate8", "prefill_tokens")),
                "n8_decode_blocks": median(("n8", "decode_blocks")),
                "separate8_decode_blocks": median(("separate8", "decode_blocks")),
                "uncached_request_ms": uncached_ms,
                "cached_request_ms": cached_ms,
                "scored_request_ms": scored_ms,
                "scoring_cost_ratio": scored_ms / cached_ms,
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())

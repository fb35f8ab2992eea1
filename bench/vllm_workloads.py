"""The workloads of ``bench/vllm.py`` parts (b) and (d), and what they measure, against any
OpenAI-compatible server (kvmesh's router, or vLLM's own): prompts as token ids, so every
server sees the same tokens and the cache's best case can be computed exactly.

(b) agent sessions: a system prompt every session shares, then turns that each re-send the
history with a new tool result and the agent's own record of its last answer. Sessions run
``clients`` at a time, each session's turns in order. Per request: TTFT (streamed) and the
prompt tokens the server says came from a cache. The infinite-cache bound counts, per request,
the leading full blocks some earlier request's prompt already had (a cache that never forgets,
shared by every worker), up to the last token, which is always computed.

(d) new long prompts (no cache can serve them), ``clients`` at a time: TTFT and the gaps
between streamed tokens, where a long prefill beside a running answer shows.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import openai

from bench.harness import pct

BLOCK = 64
RETRY_S = 0.2  # after a 429


@dataclass
class Session:
    turns: list[list[int]] = field(default_factory=list)  # each turn's whole prompt


def agent_sessions(
    sessions: int, turns: int, system: int, step: int, answer: int, seed: int = 0
) -> list[Session]:
    """``sessions`` of ``turns`` prompts: ``system`` shared tokens, then per turn ``step`` new
    tokens (a tool's result) after the ``answer`` tokens the agent recorded of its last turn."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(200, 40000) for _ in range(n)]

    shared = ids(system)
    out = []
    for _ in range(sessions):
        s, prompt = Session(), [*shared, *ids(step)]
        for _ in range(turns):
            s.turns.append(prompt)
            prompt = [*prompt, *ids(answer), *ids(step)]
        out.append(s)
    return out


def infinite_cache_tokens(prompts: list[list[int]]) -> list[int]:
    """Per prompt (in the order sent), the tokens a cache that never forgets would serve:
    the leading full blocks an earlier prompt had, the last token excepted."""
    seen: set[tuple[int, ...]] = set()
    out = []
    for p in prompts:
        usable = (len(p) - 1) // BLOCK
        hit = 0
        while hit < usable and tuple(p[: (hit + 1) * BLOCK]) in seen:
            hit += 1
        out.append(hit * BLOCK)
        seen.update(tuple(p[: (i + 1) * BLOCK]) for i in range(len(p) // BLOCK))
    return out


@dataclass
class Asked:
    prompt: list[int]
    ttft_ms: float
    cached: int
    gaps_ms: list[float]
    sent: float = 0.0  # perf_counter when it was sent
    refused: int = 0  # 429s before it was taken


async def ask(client: openai.AsyncOpenAI, model: str, prompt: list[int], n: int) -> Asked:
    """One streamed completion: TTFT (from the first ask), gaps between tokens, cached prompt
    tokens (usage)."""
    start = time.perf_counter()
    first = last = 0.0
    gaps, cached, refused = [], 0, 0
    while True:  # a 429 (overloaded) is asked again shortly, as clients do; its wait counts
        try:
            stream = await client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=n,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            break
        except openai.RateLimitError:
            refused += 1
            await asyncio.sleep(RETRY_S)
    async for chunk in stream:
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens if details else 0) or 0
        if not chunk.choices or not chunk.choices[0].text:
            continue
        now = time.perf_counter()
        if not first:
            first = now
        else:
            gaps.append((now - last) * 1e3)
        last = now
    return Asked(prompt, (first - start) * 1e3, cached, gaps, start, refused)


async def run_sessions(
    base: str, model: str, sessions: list[Session], clients: int, answer: int
) -> list[Asked]:
    """The sessions, ``clients`` at a time, each session's turns in order."""
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    todo = list(reversed(sessions))
    done: list[Asked] = []

    async def one() -> None:
        while todo:
            for prompt in todo.pop().turns:
                done.append(await ask(client, model, prompt, answer))

    await asyncio.gather(*(one() for _ in range(clients)))
    await client.close()
    return done


async def run_new_prompts(
    base: str, model: str, n: int, length: int, clients: int, answer: int, seed: int = 1
) -> list[Asked]:
    """``n`` prompts of ``length`` new tokens (a session of one turn each)."""
    rng = random.Random(seed)
    sessions = [Session([[rng.randrange(200, 40000) for _ in range(length)]]) for _ in range(n)]
    return await run_sessions(base, model, sessions, clients, answer)


def summary(asked: list[Asked]) -> dict:
    """Hit ratio (cached prompt tokens / prompt tokens), its infinite-cache bound, TTFT and
    inter-token latency."""
    ttft = [a.ttft_ms for a in asked]
    gaps = [g for a in asked for g in a.gaps_ms]
    seconds = [a.gaps_ms[0] for a in asked if a.gaps_ms]  # first token → second
    prompt_tokens = sum(len(a.prompt) for a in asked)
    in_order = sorted(asked, key=lambda a: a.sent)
    bound = sum(infinite_cache_tokens([a.prompt for a in in_order]))
    return {
        "requests": len(asked),
        "refused_429": sum(a.refused for a in asked),
        "hit_ratio": round(sum(a.cached for a in asked) / prompt_tokens, 4),
        "infinite_cache_hit_ratio": round(bound / prompt_tokens, 4),
        "ttft_mean_ms": round(statistics.mean(ttft), 1),
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p99_ms": round(pct(ttft, 99), 1),
        "itl_p50_ms": round(statistics.median(gaps), 1) if gaps else None,
        "itl_p99_ms": round(pct(gaps, 99), 1) if gaps else None,
        # (P/D: the hand-over, the KV loaded from the tier and the last block computed)
        "second_token_gap_p50_ms": round(statistics.median(seconds), 1) if seconds else None,
    }

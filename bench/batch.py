"""Batch work against online traffic: throughput, cache hits, and what a running batch does to
online requests' time to first token.

The workload: --requests chat requests over --prefixes shared system prompts of about
--prefix-tokens tokens each (agent-like: a long fixed preamble, a short question), greedy,
--max-tokens answers, in shuffled order. On one `kvmesh up` stack (1 prefill, 1 decode):

(a) the lines as one batch (the Batches API, `kvmesh batch`'s path), and the same lines sent
    online by --clients concurrent clients; each under a tenant of its own, so neither reuses
    the other's blocks. Throughput (requests/s) and hit ratio (cached prompt tokens / prompt
    tokens), beside the bound: every shared prefix computed once, every other line reusing
    the full blocks of what it shares with its group.
(b) an online load of --online-rps requests/s (streamed, their own prompts) measured alone and
    while the batch runs: time to first token p50/p99.

Last line JSON: batch_vs_online_throughput, batch_hit_ratio, batch_hit_bound,
online_hit_ratio, online_ttft_p50_ms_alone, online_ttft_p50_ms_with_batch,
online_ttft_p99_ms_alone, online_ttft_p99_ms_with_batch, online_ttft_p50_ratio_with_batch.

    .venv/bin/python bench/batch.py [--model tiny|smollm2-135m] [--requests 400]
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Stack, emit, pct, say  # noqa: E402
from shared.model.text import load_text_model  # noqa: E402

WORDS = [
    "berth",
    "tide",
    "pilot",
    "cargo",
    "crane",
    "manifest",
    "vessel",
    "harbour",
    "draft",
    "quay",
    "ballast",
    "anchor",
    "customs",
    "container",
    "tug",
    "bollard",
    "mooring",
    "channel",
    "beacon",
    "dredge",
    "warehouse",
    "schedule",
    "weather",
    "swell",
    "permit",
    "inspection",
    "gangway",
    "fuel",
    "bunker",
    "lashing",
    "reefer",
    "hazard",
    "clearance",
    "arrival",
    "departure",
]


def system_prompt(k: int, tokens: int) -> str:
    rng = random.Random(k)
    words = [rng.choice(WORDS) for _ in range(int(tokens * 0.8))]
    return f"Agent profile {k}. Rules and reference data follow. " + " ".join(words)


def workload(args: argparse.Namespace) -> list[dict]:
    lines = []
    for i in range(args.requests):
        k = i % args.prefixes
        lines.append(
            {
                "custom_id": f"req-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": args.model,
                    "messages": [
                        {"role": "system", "content": system_prompt(k, args.prefix_tokens)},
                        {"role": "user", "content": f"Task {i}: which berth for ship {i * 7}?"},
                    ],
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                },
            }
        )
    random.Random(0).shuffle(lines)
    return lines


def hit_bound(lines: list[dict], model: str, block: int) -> tuple[float, int]:
    """The hit ratio if every shared prefix is computed once (and the rest of each prompt),
    and the prompt tokens in all."""
    text = load_text_model(model, Path(tempfile.mkdtemp(prefix="kvmesh-bench-")))
    groups: dict[str, list[list[int]]] = {}
    for line in lines:
        messages = line["body"]["messages"]
        ids = text.tokenizer.encode(text.chat_template.render(messages)).ids
        groups.setdefault(messages[0]["content"], []).append(ids)
    reusable = total = 0
    for prompts in groups.values():
        first = prompts[0]
        common = min(
            next((j for j, (a, b) in enumerate(zip(first, p, strict=False)) if a != b), len(p))
            for p in prompts
        )
        reusable += (len(prompts) - 1) * (common // block) * block
        total += sum(len(p) for p in prompts)
    return reusable / total, total


# -- (a) the batch, and the same lines online ------------------------------------------------


async def run_batch(session: aiohttp.ClientSession, url: str, lines: list[dict]) -> dict:
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO(data), filename="bench.jsonl")
    async with session.post(f"{url}/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    started = time.perf_counter()
    body = {
        "input_file_id": file_id,
        "endpoint": "/v1/chat/completions",
        "completion_window": "24h",
    }
    async with session.post(f"{url}/v1/batches", json=body) as r:
        batch = await r.json()
    shown = -1
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.25)
        async with session.get(f"{url}/v1/batches/{batch['id']}") as r:
            batch = await r.json()
        counts = batch["request_counts"]
        done = counts["completed"] + counts["failed"]
        if done // 25 != shown // 25:
            say(f"  batch: {done}/{counts['total']} ({batch['status']})")
            shown = done
    took = time.perf_counter() - started
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise SystemExit(f"the batch ended {batch['status']}: {batch['request_counts']}")
    async with session.get(f"{url}/v1/files/{batch['output_file_id']}/content") as r:
        out = [json.loads(x) for x in (await r.text()).splitlines() if x]
    usage = [o["response"]["body"]["usage"] for o in out]
    return {
        "seconds": took,
        "prompt": sum(u["prompt_tokens"] for u in usage),
        "cached": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage),
    }


async def run_online(
    session: aiohttp.ClientSession, url: str, lines: list[dict], clients: int
) -> dict:
    queue = list(lines)
    usage: list[dict] = []
    started = time.perf_counter()

    async def client() -> None:
        while queue:
            line = queue.pop()
            async with session.post(f"{url}/v1/chat/completions", json=line["body"]) as r:
                if r.status != 200:
                    raise SystemExit(f"online request: HTTP {r.status}: {await r.text()}")
                usage.append((await r.json())["usage"])
            if len(usage) % 50 == 0:
                say(f"  online: {len(usage)}/{len(lines)}")

    await asyncio.gather(*(client() for _ in range(clients)))
    return {
        "seconds": time.perf_counter() - started,
        "prompt": sum(u["prompt_tokens"] for u in usage),
        "cached": sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage),
    }


# -- (b) online requests' TTFT, alone and beside the batch -----------------------------------


async def online_ttfts(
    session: aiohttp.ClientSession, url: str, model: str, n: int, rps: float, tag: str
) -> list[float]:
    ttfts: list[float] = []

    async def one(i: int) -> None:
        body = {
            "model": model,
            "messages": [
                {"role": "system", "content": f"Desk {tag}-{i}. " + system_prompt(1000 + i, 200)},
                {"role": "user", "content": "Is berth 4 free?"},
            ],
            "max_tokens": 4,
            "temperature": 0,
            "stream": True,
        }
        sent = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            first = None
            async for raw in r.content:
                if first is None and raw.startswith(b"data: {"):
                    first = time.perf_counter() - sent
            ttfts.append(first if first is not None else float("nan"))

    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(one(i)))
        await asyncio.sleep(1 / rps)
    await asyncio.gather(*tasks)
    return ttfts


async def measure(args: argparse.Namespace, url: str, lines: list[dict]) -> dict:
    timeout = aiohttp.ClientTimeout(total=3600)
    tenants = {name: {"x-kvmesh-tenant": f"bench-{name}"} for name in ("batch", "online", "b2")}
    async with aiohttp.ClientSession(timeout=timeout, headers=tenants["online"]) as online_s:
        say(f"(a) {len(lines)} lines online, {args.clients} clients")
        online = await run_online(online_s, url, lines, args.clients)
        say("(b) online requests alone")
        alone = await online_ttfts(online_s, url, args.model, args.online, args.online_rps, "a")
    async with aiohttp.ClientSession(timeout=timeout, headers=tenants["batch"]) as batch_s:
        say(f"(a) {len(lines)} lines as one batch")
        batch = await run_batch(batch_s, url, lines)
    # (b) the batch again (another tenant: nothing cached for it), online requests meanwhile.
    async with (
        aiohttp.ClientSession(timeout=timeout, headers=tenants["b2"]) as b2_s,
        aiohttp.ClientSession(timeout=timeout, headers=tenants["online"]) as online_s,
    ):
        say("(b) online requests while a batch runs")
        running = asyncio.create_task(run_batch(b2_s, url, lines))
        await asyncio.sleep(2.0)  # the batch under way
        beside = await online_ttfts(online_s, url, args.model, args.online, args.online_rps, "b")
        if running.done():
            say("  (the batch ended before the online requests did: use more --requests)")
        await running
    return {"online": online, "batch": batch, "alone": alone, "beside": beside}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prefixes", type=int, default=20)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--online", type=int, default=20, help="online requests in (b), each way")
    ap.add_argument("--online-rps", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    ap.add_argument(
        "--batch-concurrency", type=int, default=16, help="a batch's lines in flight at most"
    )
    args = ap.parse_args()

    lines = workload(args)
    block = 64
    bound, tokens = hit_bound(lines, args.model, block)
    say(f"{len(lines)} lines, {tokens} prompt tokens; hit bound {bound:.3f}")
    extra = {
        "KVMESH_PREFILL_KV_CACHE_TOKENS": "65536",
        "KVMESH_DECODE_KV_CACHE_TOKENS": "65536",
        "KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS": "64",
        "KVMESH_ROUTER_BATCH_CONCURRENCY": str(args.batch_concurrency),
    }
    stack = Stack(args.model, args.threads, extra)
    try:
        stack.wait_ready(timeout_s=300)
        got = asyncio.run(measure(args, stack.url, lines))
    finally:
        stack.stop()
    online, batch = got["online"], got["batch"]
    online_rps = len(lines) / online["seconds"]
    batch_rps = len(lines) / batch["seconds"]
    alone, beside = got["alone"], got["beside"]
    fig = {
        "batch_vs_online_throughput": round(batch_rps / online_rps, 3),
        "batch_hit_ratio": round(batch["cached"] / batch["prompt"], 4),
        "batch_hit_bound": round(bound, 4),
        "online_hit_ratio": round(online["cached"] / online["prompt"], 4),
        "online_ttft_p50_ms_alone": round(pct(alone, 50, 1e3), 1),
        "online_ttft_p50_ms_with_batch": round(pct(beside, 50, 1e3), 1),
        "online_ttft_p99_ms_alone": round(pct(alone, 99, 1e3), 1),
        "online_ttft_p99_ms_with_batch": round(pct(beside, 99, 1e3), 1),
        "online_ttft_p50_ratio_with_batch": round(
            statistics.median(beside) / statistics.median(alone), 3
        ),
        "model": args.model,
        "requests": len(lines),
    }
    print(f"{'':<28}{'requests/s':>12}{'hit ratio':>11}{'seconds':>9}")
    print(f"{'batch':<28}{batch_rps:>12.2f}{fig['batch_hit_ratio']:>11.3f}{batch['seconds']:>9.1f}")
    print(
        f"{f'online ({args.clients} clients)':<28}{online_rps:>12.2f}"
        f"{fig['online_hit_ratio']:>11.3f}{online['seconds']:>9.1f}"
    )
    print(f"hit bound (each prefix once): {bound:.3f}")
    print(f"{'online TTFT':<28}{'p50 ms':>12}{'p99 ms':>11}")
    for name, values in (("alone", alone), ("with a batch running", beside)):
        print(f"{name:<28}{pct(values, 50, 1e3):>12.1f}{pct(values, 99, 1e3):>11.1f}")
    emit(fig)


if __name__ == "__main__":
    main()

"""Who goes first when the mesh is full: classes, tenants' shares and pinned conversations.

`kvmesh up` on the tiny model with 2 prefill and 2 decode workers, API keys on (two tenants
of equal weight, one allowed the priority class). First the mesh's capacity: requests of
``--tokens`` uncached prompt tokens and ``--max-tokens`` answer tokens, as many at once as it
takes (req/s at saturation). Then, each phase open-loop (Poisson arrivals) for ``--seconds``:

(a) interactive requests (``service_tier: priority``) at ``--interactive`` × capacity, alone;
    then again while a flood of ``flex`` requests arrives at 2× capacity;
(b) a light tenant at ``--light`` × capacity, alone; then while a heavy tenant (same class and
    weight) offers ten times as much, both together above capacity;
(c) two agent conversations, one pinned (``x-kvmesh-cache-ttl-s``) and one not, each a first
    turn, then other traffic that fills the memory and storage tiers (cachemeta's capacity is
    small here), then each conversation's next turn: the share of its prompt cached.

Prints a table (TTFT p50/p99 of each class and tenant, alone and under load, requests refused
with 429), then as its last line one JSON object: capacity_rps, interactive_alone_p99_ms,
interactive_flood_p99_ms, interactive_ratio (target ≤ 1.3), light_alone_p99_ms,
light_loaded_p99_ms, light_ratio (≤ 1.5), pinned_cached_ratio (≥ 0.95), unpinned_cached_ratio,
refused (per phase and class) and every phase's figures.

    .venv/bin/python bench/priority.py [--seconds 30] [--tokens 400] [--max-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.harness import Stack, pct, say  # noqa: E402

WORDS = ["harbour", "berth", "crane", "tide", "pilot", "quay", "ledger", "manifest", "cargo"]
BLOCK_BYTES = 65_552  # a tiny-model block in the storage tier (64 tokens)


def prompt(tokens: int, rng: random.Random) -> str:
    """A fresh prompt of about ``tokens`` tokens (nothing cached: its first words unique)."""
    head = f"{uuid.uuid4()} " * 2
    return head + " ".join(rng.choice(WORDS) for _ in range(max(1, tokens - 40)))


def ms(values: list[float], p: float) -> float | None:
    """The ``p``-th percentile of seconds, in milliseconds (None for none)."""
    return round(pct(values, p, 1e3), 1) if values else None


async def ask(
    session: aiohttp.ClientSession, url: str, body: dict, key: str, headers: dict | None = None
) -> tuple[int, float, dict]:
    """One streamed completion: its status, its TTFT (s), its usage."""
    sent = time.perf_counter()
    ttft, usage = 0.0, {}
    hdrs = {"Authorization": f"Bearer {key}", **(headers or {})}
    async with session.post(f"{url}/v1/completions", json=body, headers=hdrs) as resp:
        if resp.status != 200:
            await resp.read()
            return resp.status, 0.0, {}
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if not ttft and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - sent
            usage = chunk.get("usage") or usage
    return 200, ttft or time.perf_counter() - sent, usage


class Load:
    """Open-loop arrivals of one kind of request, and what became of them."""

    def __init__(self, name: str, rate: float, body: dict, key: str, tokens: int) -> None:
        self.name, self.rate, self.body, self.key, self.tokens = name, rate, body, key, tokens
        self.ttfts: list[float] = []
        self.refused = 0
        self.failed = 0

    async def run(self, session: aiohttp.ClientSession, url: str, seconds: float) -> None:
        rng = random.Random(hash(self.name) & 0xFFFF)
        end, tasks = time.monotonic() + seconds, []
        while time.monotonic() < end:
            body = {**self.body, "prompt": prompt(self.tokens, rng)}
            tasks.append(asyncio.create_task(self._one(session, url, body)))
            await asyncio.sleep(rng.expovariate(self.rate))
        await asyncio.gather(*tasks)

    async def _one(self, session: aiohttp.ClientSession, url: str, body: dict) -> None:
        try:
            status, ttft, _ = await ask(session, url, body, self.key)
        except aiohttp.ClientError:
            self.failed += 1
            return
        if status == 200:
            self.ttfts.append(ttft)
        elif status == 429:
            self.refused += 1
        else:
            self.failed += 1

    def figures(self) -> dict:
        return {
            "offered_rps": round(self.rate, 2),
            "answered": len(self.ttfts),
            "ttft_p50_ms": ms(self.ttfts, 50),
            "ttft_p99_ms": ms(self.ttfts, 99),
            "refused": self.refused,
            "failed": self.failed,
        }


async def phase(url: str, loads: list[Load], seconds: float) -> dict[str, dict]:
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(load.run(session, url, seconds) for load in loads))
    return {load.name: load.figures() for load in loads}


async def capacity(url: str, key: str, body: dict, tokens: int, seconds: float) -> float:
    """Requests answered a second with 16 always in flight."""
    rng, done = random.Random(1), 0
    end = time.monotonic() + seconds

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while time.monotonic() < end:
            status, _, _ = await ask(session, url, {**body, "prompt": prompt(tokens, rng)}, key)
            done += status == 200

    started = time.monotonic()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(client(session) for _ in range(16)))
    return done / (time.monotonic() - started)


async def conversations(url: str, key: str, tokens: int, others: int) -> dict[str, float]:
    """Each conversation's next turn's share of its prompt cached, after ``others`` prompts."""
    rng = random.Random(7)
    history = {name: prompt(tokens * 6, rng) for name in ("pinned", "unpinned")}
    pin = {"pinned": {"x-kvmesh-cache-ttl-s": "600"}, "unpinned": {}}
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with aiohttp.ClientSession() as session:
        for name, text in history.items():
            await ask(session, url, {**body, "prompt": text}, key, pin[name])
        await asyncio.sleep(2)  # (their blocks stored and indexed)
        sem = asyncio.Semaphore(8)

        async def other(i: int) -> None:
            async with sem:
                await ask(session, url, {**body, "prompt": prompt(tokens * 3, rng)}, key)

        await asyncio.gather(*(other(i) for i in range(others)))
        await asyncio.sleep(3)  # (cachemeta's eviction runs every second here)
        out = {}
        for name, text in history.items():
            turn = text + " And then? " + prompt(40, rng)
            _, _, usage = await ask(session, url, {**body, "prompt": turn}, key, pin[name])
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            out[f"{name}_cached_tokens"] = cached
            out[f"{name}_prompt_tokens"] = usage.get("prompt_tokens", 0)
    return out


def keys(path: Path, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh", "keys", "--file", str(path), "add", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="each phase's length")
    ap.add_argument("--tokens", type=int, default=400, help="a request's prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--interactive", type=float, default=0.3, help="× capacity, in (a)")
    ap.add_argument(
        "--light", type=float, default=0.15, help="× capacity, in (b) (the heavy one: 10×)"
    )
    args = ap.parse_args()
    state = Path(f"/tmp/kvmesh-priority-{uuid.uuid4().hex[:8]}")
    state.mkdir(parents=True)
    keys_file = state / "keys.json"
    light = keys(keys_file, "--tenant", "light")
    heavy = keys(keys_file, "--tenant", "heavy")
    # 96 blocks of room in the storage tier and 24 in each memory tier: (c) fills them.
    extra = {
        "KVMESH_ROUTER_KEYS_FILE": str(keys_file),
        "KVMESH_CACHEMETA_STORE_CAPACITY_BYTES": str(96 * BLOCK_BYTES),
        "KVMESH_CACHEMETA_GC_INTERVAL_S": "1",
        "KVMESH_PREFILL_MEMORY_TIER_BYTES": str(24 * BLOCK_BYTES),
        "KVMESH_DECODE_MEMORY_TIER_BYTES": str(24 * BLOCK_BYTES),
    }
    say("starting kvmesh up (tiny model, 2 prefill and 2 decode workers) ...")
    stack = Stack("tiny", 1, extra, args=("--prefill", "2", "--decode", "2"))
    figures: dict = {}
    try:
        stack.wait_ready(key=light)
        base = {"model": "tiny", "max_tokens": args.max_tokens, "temperature": 0, "stream": True}
        say("capacity: 16 requests at once ...")
        rps = asyncio.run(capacity(stack.url, light, base, args.tokens, args.seconds / 2))
        figures["capacity_rps"] = round(rps, 2)
        say(f"capacity {rps:.2f} req/s")
        high = {**base, "service_tier": "priority"}
        low = {**base, "service_tier": "flex"}

        def interactive() -> Load:
            return Load("interactive", args.interactive * rps, high, light, args.tokens)

        say("(a) interactive alone ...")
        figures["a_alone"] = asyncio.run(phase(stack.url, [interactive()], args.seconds))
        say("(a) interactive under a flex flood at 2x capacity ...")
        flood = Load("flood", 2 * rps, low, heavy, args.tokens)
        figures["a_flood"] = asyncio.run(phase(stack.url, [interactive(), flood], args.seconds))
        time.sleep(5)  # (the flood's queues drain)

        def lighter() -> Load:
            return Load("light", args.light * rps, base, light, args.tokens)

        say("(b) the light tenant alone ...")
        figures["b_alone"] = asyncio.run(phase(stack.url, [lighter()], args.seconds))
        say("(b) the light tenant beside a heavy one offering 10x ...")
        heavier = Load("heavy", 10 * args.light * rps, base, heavy, args.tokens)
        figures["b_loaded"] = asyncio.run(phase(stack.url, [lighter(), heavier], args.seconds))
        time.sleep(5)
        say("(c) a pinned and an unpinned conversation, and traffic that evicts ...")
        figures["c"] = asyncio.run(conversations(stack.url, light, args.tokens, 60))
    finally:
        stack.stop()

    a0, a1 = figures["a_alone"]["interactive"], figures["a_flood"]["interactive"]
    b0, b1 = figures["b_alone"]["light"], figures["b_loaded"]["light"]
    print(
        f"\ncapacity: {figures['capacity_rps']} req/s ({args.tokens}-token prompts, "
        f"{args.max_tokens}-token answers; 2 prefill, 2 decode workers, the tiny model)"
    )
    print(
        f"{'phase':<34}{'offered/s':>10}{'answered':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'429':>6}"
    )
    for name, rows in (
        ("(a) interactive alone", figures["a_alone"]),
        ("(a) under a flex flood (2x)", figures["a_flood"]),
        ("(b) light tenant alone", figures["b_alone"]),
        ("(b) beside a heavy tenant (10x)", figures["b_loaded"]),
    ):
        for load, f in rows.items():
            print(
                f"{name + ': ' + load:<34}{f['offered_rps']:>10}{f['answered']:>10}"
                f"{f['ttft_p50_ms'] or 0:>9.1f}ms{f['ttft_p99_ms'] or 0:>9.1f}ms{f['refused']:>6}"
            )
    c = figures["c"]
    print(
        f"(c) next turn cached: pinned {c['pinned_cached_tokens']} of "
        f"{c['pinned_prompt_tokens']} tokens, unpinned {c['unpinned_cached_tokens']} of "
        f"{c['unpinned_prompt_tokens']}"
    )

    def ratio(x: float | None, y: float | None) -> float | None:
        return round(x / y, 3) if x and y else None

    pinned = c["pinned_cached_tokens"] / max(1, c["pinned_prompt_tokens"])
    unpinned = c["unpinned_cached_tokens"] / max(1, c["unpinned_prompt_tokens"])
    print(
        json.dumps(
            {
                "capacity_rps": figures["capacity_rps"],
                "interactive_alone_p99_ms": a0["ttft_p99_ms"],
                "interactive_flood_p99_ms": a1["ttft_p99_ms"],
                "interactive_ratio": ratio(a1["ttft_p99_ms"], a0["ttft_p99_ms"]),
                "light_alone_p99_ms": b0["ttft_p99_ms"],
                "light_loaded_p99_ms": b1["ttft_p99_ms"],
                "light_ratio": ratio(b1["ttft_p99_ms"], b0["ttft_p99_ms"]),
                "pinned_cached_ratio": round(pinned, 3),
                "unpinned_cached_ratio": round(unpinned, 3),
                "phases": figures,
            }
        )
    )


if __name__ == "__main__":
    sys.exit(main())

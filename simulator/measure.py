"""Measuring a torch engine for a simulated world: its prefill profile (``EngineProfile``: the
seconds to compute ``uncached`` prompt tokens after ``cached`` ones held in its memory, over a
grid, and of one pass over several short prompts) and how fast it takes KV in (from bytes in
memory, as a memory-tier hit; from the storage tier's files). ``bench/profile.py`` writes a
profile; ``simulator/validate.py`` builds the world of a live mesh's own workers from these.
Each point is the median of ``runs``; the spread is how far runs fell from their medians.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.engine.interface import Engine, EngineOptions, PrefillRequest
from shared.engine.registry import load_engine, load_owning_engine
from shared.kvstore.backend import FileStore
from shared.messages.sampling import SamplingParams
from shared.model.catalog import resolve
from simulator.profile import EngineProfile

BLOCK = 64
ONE = SamplingParams(max_tokens=1)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


class Measure:
    """Timed prefills on one engine, each over a prefix already held in its memory."""

    def __init__(self, engine: Engine, runs: int) -> None:
        self.engine = engine
        self.runs = runs
        self.n = 0
        self.deviations: list[float] = []  # |run - median| / median, every point

    def median(self, runs: list[float]) -> float:
        m = statistics.median(runs)
        self.deviations += [abs(r - m) / m for r in runs]
        return m

    def prefill_s(self, cached: int, uncached: int) -> float:
        e, prompt = self.engine, ids(cached + uncached, seed=cached * 7919 + uncached)
        prefix = None
        if cached:  # its KV computed once, then held: each run reads it from memory
            e.prefill("held", prompt[: cached + 1], ONE)
            prefix = e.import_blocks(e.export_blocks("held", 0, cached // BLOCK))
            e.free("held")
        runs = []
        for _ in range(self.runs):
            self.n += 1
            sid = f"p{self.n}"
            start = time.perf_counter()
            e.prefill(sid, prompt, ONE, prefix=prefix)
            runs.append(time.perf_counter() - start)
            e.free(sid)
        if prefix is not None:
            e.release(prefix)
        return self.median(runs)

    def batch_s(self, prompts: int, tokens: int) -> float:
        runs = []
        for r in range(self.runs):
            batch = [
                PrefillRequest(f"b{self.n}-{i}", ids(tokens, seed=1000 * r + i), ONE)
                for i in range(prompts)
            ]
            self.n += 1
            start = time.perf_counter()
            self.engine.prefill_batch(batch)
            runs.append(time.perf_counter() - start)
            for req in batch:
                self.engine.free(req.seq_id)
        return self.median(runs)


def engine(model: str, threads: int, kv_tokens: int, state_dir: Path = Path(".kvmesh")) -> Engine:
    """The torch engine on ``model`` (a name the catalog knows), started."""
    torch.set_num_threads(threads)
    options = EngineOptions(block_size=BLOCK, kv_cache_tokens=kv_tokens, threads=threads)
    e = load_engine("torch", resolve(model, {}), state_dir, options)
    e.start()
    return e


def profile_engine(
    model: str,
    threads: int,
    cached: tuple[int, ...],
    uncached: tuple[int, ...],
    batch: tuple[int, ...] = (1, 2, 4, 8),
    batch_tokens: int = 64,
    runs: int = 3,
    say: Callable[[str], None] = lambda _: None,
) -> EngineProfile:
    """The profile of ``model`` on a torch engine of ``threads`` threads, on this machine."""
    cached = tuple(c // BLOCK * BLOCK for c in cached)
    say(f"loading {model}")
    m = Measure(engine(model, threads, 4 * (max(cached) + max(uncached))), runs)
    m.prefill_s(0, 256)  # warm-ups: each path's first passes are slower
    for n in batch:
        m.batch_s(n, batch_tokens)
    m.deviations.clear()
    passes = []  # (before the long contexts: their large buffers slow what follows a while)
    for n in batch:
        passes.append((n, m.batch_s(n, batch_tokens)))
        say(f"  {n} prompts of {batch_tokens} tokens in one pass: {passes[-1][1] * 1e3:.1f} ms")
    seconds = []
    for c in cached:
        row = []
        for u in uncached:
            row.append(m.prefill_s(c, u))
            say(f"  {u} tokens after {c} cached: {row[-1] * 1e3:.1f} ms")
        seconds.append(tuple(row))
    return EngineProfile(
        engine=f"torch, {threads} threads",
        model=model,
        machine=f"{platform.machine()}, {torch.get_num_threads()} threads",
        cached=cached,
        uncached=uncached,
        seconds=tuple(seconds),
        spread=round(statistics.median(m.deviations), 4),
        batch_tokens=batch_tokens,
        batch=tuple(passes),
    )


@dataclass(frozen=True)
class KvRates:
    """How fast an engine takes KV in, and how much a token's KV is."""

    bytes_per_token: int
    memory_gb_s: float  # imported from bytes in memory (a memory-tier hit)
    storage_gb_s: float  # read from the storage tier's files, then imported


def kv_rates(model: str, threads: int, tokens: int = 2048, runs: int = 3) -> KvRates:
    """Blocks of a ``tokens``-token prompt imported from bytes and from a FileStore."""
    e = engine(model, threads, 4 * tokens)
    e.prefill("src", ids(tokens + 1, seed=1), ONE)
    blobs = e.export_blocks("src", 0, tokens // BLOCK)
    e.free("src")
    size = sum(len(b) for b in blobs)
    with tempfile.TemporaryDirectory() as tmp:
        store = FileStore(Path(tmp))
        for i, blob in enumerate(blobs):
            store.put(f"{i:08x}", blob)

        def from_memory() -> None:
            e.release(e.import_blocks(list(blobs)))

        def from_store() -> None:
            read = [bytes(store.get(f"{i:08x}")) for i in range(len(blobs))]  # type: ignore[arg-type]
            e.release(e.import_blocks(read))

        rates = []
        for load in (from_memory, from_store):
            load()  # (warm)
            took = []
            for _ in range(runs):
                start = time.perf_counter()
                load()
                took.append(time.perf_counter() - start)
            rates.append(size / statistics.median(took) / 1e9)
    return KvRates(round(size / (len(blobs) * BLOCK)), rates[0], rates[1])


def profile_vllm(
    model: str,
    threads: int,
    cached: tuple[int, ...],
    uncached: tuple[int, ...],
    batch: tuple[int, ...] = (1, 2, 4, 8),
    batch_tokens: int = 64,
    runs: int = 3,
    state_dir: Path = Path(".kvmesh"),
    say: Callable[[str], None] = lambda _: None,
) -> EngineProfile:
    """The same profile of ``model`` on a vLLM engine (its own prefix cache holds the cached
    tokens: a prompt's prefix is computed once, then each run sends it with new tokens after
    it and times its first token; a batch is prompts sent at once)."""
    import asyncio

    cached = tuple(c // BLOCK * BLOCK for c in cached)
    options = EngineOptions(
        block_size=BLOCK, kv_cache_tokens=8 * (max(cached) + max(uncached)), threads=threads
    )
    deviations: list[float] = []

    def median(times: list[float]) -> float:
        m = statistics.median(times)
        deviations.extend(abs(t - m) / m for t in times)
        return m

    async def run() -> EngineProfile:
        say(f"starting vLLM on {model}")
        e = load_owning_engine("vllm", resolve(model, {}), state_dir, options)
        await e.start()
        n = 0

        async def first_token(prompt: list[int]) -> float:
            nonlocal n
            n += 1
            start = time.perf_counter()
            async for _ in e.generate(f"r{n}", prompt, ONE):
                return time.perf_counter() - start
            raise AssertionError("no token")

        try:
            await first_token(ids(256, seed=1))  # warm-up
            passes = []
            for k in batch:
                times = []
                for r in range(runs + 1):
                    prompts = [ids(batch_tokens, seed=10_000 * k + 100 * r + i) for i in range(k)]
                    start = time.perf_counter()
                    await asyncio.gather(*(first_token(p) for p in prompts))
                    if r:  # (the first: a warm-up of this size)
                        times.append(time.perf_counter() - start)
                passes.append((k, median(times)))
                say(f"  {k} prompts of {batch_tokens} tokens at once: {passes[-1][1] * 1e3:.1f} ms")
            seconds = []
            for c in cached:
                prefix = ids(c, seed=7919 + c)
                if c:
                    await first_token(prefix)  # held in vLLM's prefix cache from here on
                row = []
                for u in uncached:
                    times = [
                        await first_token(prefix + ids(u, seed=31 * u + r + c)) for r in range(runs)
                    ]
                    row.append(median(times))
                    say(f"  {u} tokens after {c} cached: {row[-1] * 1e3:.1f} ms")
                seconds.append(tuple(row))
        finally:
            await e.stop()
        return EngineProfile(
            engine=f"vllm (CPU, eager, fp32), {threads} threads",
            model=model,
            machine=f"{platform.machine()}, {threads} threads",
            cached=cached,
            uncached=uncached,
            seconds=tuple(seconds),
            spread=round(statistics.median(deviations), 4),
            batch_tokens=batch_tokens,
            batch=tuple(passes),
        )

    return asyncio.run(run())

"""kvmesh with vLLM workers, against vLLM alone; four parts, run one after the other on this
machine with the same model (the bundled SmolLM2, exported to a Hugging Face directory) and
the same vLLM settings (eager, fp32, prefix caching, block size 64):

(a) vLLM's own OpenAI server against `kvmesh up --prefill 0 --decode 1` with a vLLM decode
    worker (whole requests), streamed chats with new prompts at 1 and 4 clients: TTFT and
    inter-token latency p50 / p99, and the mesh's added TTFT (kvmesh's p50 minus vLLM's).
(c) turn 2 of conversations whose turn 1 had 2K and 4K prompt tokens, on an engine whose own
    cache is empty: TTFT with turn 1 loaded from kvmesh's storage tier (vLLM's KV connector)
    against computing it again.
(b) agent sessions (a shared system prompt, histories growing turn by turn,
    ``bench/vllm_workloads.py``) over 2 vLLM workers behind kvmesh's ttft policy, behind round
    robin, and over one vLLM server with its own prefix cache only: hit ratio against the
    infinite-cache bound, TTFT mean / p99.
(d) new long prompts, 4 at a time: P/D (a vLLM prefill worker, a vLLM decode worker, the KV
    through the storage tier) against 2 aggregated vLLM workers: TTFT and inter-token latency.

Prints tables, then as its last line one JSON object with those figures.

    .venv/bin/python bench/vllm.py [--parts acbd] [--requests 12] [--sessions 6] ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder leads the path, where it would shadow vLLM itself.
sys.path[:] = [str(REPO), *(p for p in sys.path if Path(p or ".").resolve() != REPO / "bench")]

from bench.harness import Up, emit, free_port, pct, say, stop, wait_http  # noqa: E402
from bench.vllm_workloads import (  # noqa: E402
    agent_sessions,
    run_new_prompts,
    run_sessions,
    summary,
)

MODEL = "smollm2-135m-instruct"
TEXT = (
    "You are reviewing a design document about a distributed cache for language model serving. "
    "Summarize the trade-offs between keeping KV blocks in worker memory and in a shared "
    "storage tier, and say which one you would pick for a chat product."
)


async def drive(base: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    """``requests`` streamed chats, ``clients`` at a time: TTFT and inter-token gaps (ms)."""
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
    ttft: list[float] = []
    gaps: list[float] = []
    queue = list(range(requests))

    async def one() -> None:
        while queue:
            queue.pop()
            start = time.perf_counter()
            last = None
            stream = await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": f"[{uuid.uuid4().hex}]\n{TEXT}"}],
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
            )
            async for chunk in stream:
                if not chunk.choices or not chunk.choices[0].delta.content:
                    continue
                now = time.perf_counter()
                if last is None:
                    ttft.append((now - start) * 1e3)
                else:
                    gaps.append((now - last) * 1e3)
                last = now

    await asyncio.gather(*(one() for _ in range(clients)))
    await client.close()
    return {
        "ttft_p50_ms": round(statistics.median(ttft), 1),
        "ttft_p99_ms": round(pct(ttft, 99), 1),
        "itl_p50_ms": round(statistics.median(gaps), 1),
        "itl_p99_ms": round(pct(gaps, 99), 1),
    }


def measure(base: str, model: str, args: argparse.Namespace) -> dict:
    asyncio.run(drive(base, model, 1, 2, 8))  # warm-up
    out = {}
    for clients in (1, 4):
        say(f"  {clients} client(s), {args.requests} requests")
        out[clients] = asyncio.run(drive(base, model, clients, args.requests, args.max_tokens))
    return out


@contextlib.contextmanager
def vllm_server(directory: Path) -> Iterator[str]:
    """vLLM's own OpenAI server for the model; yields its base URL."""
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory)]
    cmd += ["--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--dtype", "float32", "--enforce-eager", "--block-size", "64", "--seed", "0"]
    cmd += ["--enable-prefix-caching", "--max-model-len", "8192"]
    cmd += ["--enable-prompt-tokens-details"]  # cached tokens in usage, as kvmesh gives them
    say("vLLM's own OpenAI server: starting")
    proc = subprocess.Popen(
        cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 300, proc)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        stop(proc)


@contextlib.contextmanager
def kvmesh(state: Path, prefill: int, decode: int, policy: str = "ttft") -> Iterator[str]:
    """`kvmesh up` with vLLM workers (``prefill`` of them, ``decode`` of them), the router
    on ``policy``; yields the router's base URL."""
    env = dict(
        KVMESH_ROUTER_ROUTING_POLICY=policy,
        KVMESH_PREFILL_ENGINE="vllm",
        KVMESH_PREFILL_MODEL=MODEL,
        KVMESH_DECODE_ENGINE="vllm",
        KVMESH_DECODE_MODEL=MODEL,
        KVMESH_LOG_LEVEL="info",  # (its "kvmesh is up" line)
    )
    args = ["--prefill", str(prefill), "--decode", str(decode), "--encoder", "0"]
    say(f"kvmesh ({prefill} vLLM prefill, {decode} vLLM decode, {policy}): starting")
    with Up(args, env, state) as up:
        start = time.monotonic()
        while b"kvmesh is up" not in (state / "up.log").read_bytes():
            if up.proc.poll() is not None:
                raise SystemExit(f"kvmesh up exited with {up.proc.returncode}")
            if time.monotonic() - start > 300:
                raise SystemExit("kvmesh up not up within 300 s")
            time.sleep(0.5)
        yield f"{up.url}/v1"


def vllm_alone(directory: Path, args: argparse.Namespace) -> dict:
    with vllm_server(directory) as base:
        return measure(base, MODEL, args)


def kvmesh_in_front(state: Path, args: argparse.Namespace) -> dict:
    with kvmesh(state, prefill=0, decode=1) as base:
        return measure(base, MODEL, args)


def agents(work: Path, directory: Path, args: argparse.Namespace) -> dict:
    """(b) the agent sessions over 2 vLLM workers behind kvmesh (ttft, round robin), and
    over one vLLM server with its own prefix cache only."""
    sessions = agent_sessions(args.sessions, args.turns, system=768, step=160, answer=24)
    n = sum(len(s.turns) for s in sessions)

    def run(base: str) -> dict:
        say(f"  {len(sessions)} sessions of {args.turns} turns ({n} requests), 3 at a time")
        asyncio.run(run_new_prompts(base, MODEL, 2, 80, 1, 2, seed=99))  # warm-up
        return summary(asyncio.run(run_sessions(base, MODEL, sessions, 3, 16)))

    out = {}
    for policy in ("ttft", "round_robin"):
        with kvmesh(work / f"state-{policy}", prefill=0, decode=2, policy=policy) as base:
            out[f"kvmesh_{policy}"] = run(base)
    with vllm_server(directory) as base:
        out["vllm_one"] = run(base)
    return out


def pd_vs_aggregated(work: Path, args: argparse.Namespace) -> dict:
    """(d) new long prompts: 1 vLLM prefill + 1 vLLM decode (P/D through the storage tier)
    against 2 vLLM workers that do both (aggregated, ttft)."""
    out = {}
    for name, prefill, decode in (("pd", 1, 1), ("aggregated", 0, 2)):
        with kvmesh(work / f"state-{name}", prefill=prefill, decode=decode) as base:
            say(f"  {args.pd_requests} new {args.pd_tokens}-token prompts, 4 at a time")
            asyncio.run(run_new_prompts(base, MODEL, 2, 80, 1, 2, seed=99))  # warm-up
            asked = asyncio.run(
                run_new_prompts(base, MODEL, args.pd_requests, args.pd_tokens, 4, 48)
            )
            out[name] = summary(asked)
    say(f"  the prompt's KV ({args.pd_tokens} tokens) through the tier vs over gRPC")
    out["transport"] = kv_transport(work / "state", args.pd_tokens)
    return out


def kv_transport(state: Path, tokens: int, reps: int = 3) -> dict:
    """The two ways a P/D prompt's KV could travel, for ``tokens`` of the model's KV (fp32,
    64-token blocks, kvformat): through the storage tier (``FileStore`` put, then get, as the
    prefill and decode engines' connectors do) and over kvmesh's gRPC handoff stream on
    loopback (1 MiB chunks, as the prefill worker sends them). Best of ``reps``, ms."""
    import grpc

    from shared.kvstore.backend import FileStore
    from shared.model.text import load_config
    from shared.proto import kv_pb2, kv_pb2_grpc

    block = 64 * load_config(MODEL, state).kv_bytes_per_token()
    blobs = [os.urandom(block) for _ in range(tokens // 64)]
    store = FileStore(state / "kvstore-transport")

    def through_tier(rep: int) -> float:
        start = time.perf_counter()
        for i, b in enumerate(blobs):
            store.put(f"{rep:04x}{i:060x}", b)
        for i in range(len(blobs)):
            assert store.get(f"{rep:04x}{i:060x}") is not None
        return (time.perf_counter() - start) * 1e3

    class Sink(kv_pb2_grpc.KvHandoffServicer):
        async def Handoff(self, chunks, context):  # noqa: ANN001, ANN201, N802
            got = 0
            async for chunk in chunks:
                got += len(chunk.data)
                if chunk.done:
                    yield kv_pb2.HandoffStatus(ok=True, error=str(got))

    async def over_grpc() -> list[float]:
        server = grpc.aio.server()
        kv_pb2_grpc.add_KvHandoffServicer_to_server(Sink(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        opts = [("grpc.max_receive_message_length", 8 << 20)]
        times = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) as channel:
            stub = kv_pb2_grpc.KvHandoffStub(channel)
            data = b"".join(blobs)
            for _ in range(reps):
                start = time.perf_counter()
                call = stub.Handoff()
                for offset in range(0, len(data), 1 << 20):
                    await call.write(kv_pb2.KvChunk(data=data[offset : offset + (1 << 20)]))
                await call.write(kv_pb2.KvChunk(done=b"{}"))
                status = await call.read()
                assert int(status.error) == len(data)
                times.append((time.perf_counter() - start) * 1e3)
                call.cancel()
        await server.stop(None)
        return times

    tier = min(through_tier(r) for r in range(reps))
    stream = min(asyncio.run(over_grpc()))
    mb = len(blobs) * block / 1e6
    return {
        "tokens": tokens,
        "mb": round(mb, 1),
        "tier_ms": round(tier, 1),
        "grpc_ms": round(stream, 1),
    }


def turn_two_from_storage(state: Path, lengths: list[int], reps: int) -> dict:
    """Turn-2 TTFT of an engine whose own cache is empty: turn 1 (prompt and answer) loaded
    from kvmesh's storage tier through the connector, against the same engine computing it
    again (no tier). Turn 1 is computed by a first engine, which then stops: what the second
    finds is only what the tier holds, as for a turn that lands on another worker."""
    from shared.engine.interface import EngineOptions
    from shared.engine.vllm.engine import VllmEngine
    from shared.kvstore.backend import FileStore
    from shared.messages.sampling import SamplingParams
    from shared.model.catalog import resolve

    rng = random.Random(0)
    store = state / "kvstore-turn2"

    def engine(tier: bool) -> VllmEngine:
        options = EngineOptions(kv_cache_tokens=32768, kv_store_dir=str(store) if tier else "")
        return VllmEngine.load(resolve(MODEL, {}), state, options)

    written: list[str] = []  # what the connector writes for turn 1 (maybe on its way)

    async def ask(e: VllmEngine, rid: str, ids: list[int], n: int) -> tuple[float, list[int]]:
        start, first, out = time.perf_counter(), 0.0, []
        async for piece in e.generate(rid, ids, SamplingParams(max_tokens=n, temperature=0)):
            first = first or time.perf_counter()
            out += piece.token_ids
            written.extend(piece.stored)
        return (first - start) * 1e3, out

    async def run() -> dict:
        turns: dict[int, list[list[int]]] = {}
        writer = engine(tier=True)
        await writer.start()
        say("  turn 1 on a first engine (its blocks written to the tier)")
        for n in lengths:
            for r in range(reps):
                prompt = [rng.randrange(100, 40000) for _ in range(n)]
                _, answer = await ask(writer, f"t1-{n}-{r}", prompt, 32)
                question = [rng.randrange(100, 40000) for _ in range(24)]
                turns.setdefault(n, []).append(prompt + answer + question)
        tier = FileStore(store)
        while any(h not in tier for h in written):  # the writer thread's last blocks
            await asyncio.sleep(0.01)
        await writer.stop()
        figures: dict = {}
        for tier in (True, False):
            e = engine(tier)
            await e.start()
            await ask(e, "warm", [rng.randrange(100, 40000) for _ in range(80)], 2)
            name = "storage" if tier else "recompute"
            say(f"  turn 2 on a fresh engine: {name}")
            for n, asks in turns.items():
                times = [(await ask(e, f"t2-{name}-{n}-{i}", t, 1))[0] for i, t in enumerate(asks)]
                figures.setdefault(n, {})[f"{name}_ttft_ms"] = round(statistics.median(times), 1)
            await e.stop()
        for f in figures.values():
            f["speedup"] = round(f["recompute_ttft_ms"] / f["storage_ttft_ms"], 2)
        return figures

    return asyncio.run(run())


PARTS = "acbd"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", default=PARTS, help="which parts to run (a, b, c, d)")
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--turn2-lengths", default="2048,4096", help="turn-1 prompt tokens")
    parser.add_argument("--turn2-reps", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=6, help="(b) agent sessions")
    parser.add_argument("--turns", type=int, default=4, help="(b) turns per session")
    parser.add_argument("--pd-requests", type=int, default=12, help="(d) prompts")
    parser.add_argument("--pd-tokens", type=int, default=1024, help="(d) tokens per prompt")
    args = parser.parse_args()
    from shared.model.catalog import resolve
    from shared.model.export import export

    figures: dict = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-vllm-") as tmp:
        work = Path(tmp)
        say("exporting the bundled SmolLM2 to a Hugging Face directory")
        directory = export(resolve(MODEL, {}), work / "state", work / "smollm2")
        if "a" in args.parts:
            say("(a) vLLM alone vs kvmesh's router in front of it")
            figures["vllm_alone"] = vllm_alone(directory, args)
            figures["kvmesh_vllm"] = kvmesh_in_front(work / "state", args)
        if "c" in args.parts:
            say("(c) turn 2 from kvmesh's storage tier vs recomputed (engines in this process)")
            lengths = [int(n) for n in args.turn2_lengths.split(",")]
            turn2 = turn_two_from_storage(work / "state", lengths, args.turn2_reps)
            figures["turn2_storage_vs_recompute"] = turn2
        if "b" in args.parts:
            say("(b) agent sessions: kvmesh ttft vs round robin over 2 vLLM workers, one vLLM")
            figures["agents"] = agents(work, directory, args)
        if "d" in args.parts:
            say("(d) P/D vs aggregated")
            figures["pd_vs_aggregated"] = pd_vs_aggregated(work, args)
    print_tables(figures)
    emit(figures)


def print_tables(figures: dict) -> None:
    if "vllm_alone" in figures:
        alone, mesh = figures["vllm_alone"], figures["kvmesh_vllm"]
        print("setup | clients | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms")
        for name, by_clients in (("vLLM alone", alone), ("kvmesh + vLLM", mesh)):
            for clients, f in by_clients.items():
                print(
                    f"{name} | {clients} | {f['ttft_p50_ms']} | {f['ttft_p99_ms']} | "
                    f"{f['itl_p50_ms']} | {f['itl_p99_ms']}"
                )
        added = {c: round(mesh[c]["ttft_p50_ms"] - alone[c]["ttft_p50_ms"], 1) for c in (1, 4)}
        share = round(added[1] / alone[1]["ttft_p50_ms"], 3)
        figures.update(mesh_added_ttft_p50_ms=added, mesh_added_ttft_share_1=share)
        print(f"mesh's added TTFT p50: {added[1]} ms at 1 client ({share:.1%}), {added[4]} at 4")
    if "turn2_storage_vs_recompute" in figures:
        print("turn-1 prompt tokens | turn-2 TTFT from the tier ms | recomputed ms | speed-up")
        for n, f in figures["turn2_storage_vs_recompute"].items():
            print(f"{n} | {f['storage_ttft_ms']} | {f['recompute_ttft_ms']} | {f['speedup']}")
    for part in ("agents", "pd_vs_aggregated"):
        if part not in figures:
            continue
        transport = figures[part].pop("transport", None)
        print(
            "setup | hit ratio | infinite-cache bound | TTFT mean ms | TTFT p50 | TTFT p99 | "
            "ITL p50 ms | ITL p99 | 1st→2nd token p50 ms | 429s"
        )
        for name, f in figures[part].items():
            print(
                f"{name} | {f['hit_ratio']} | {f['infinite_cache_hit_ratio']} | "
                f"{f['ttft_mean_ms']} | {f['ttft_p50_ms']} | {f['ttft_p99_ms']} | "
                f"{f['itl_p50_ms']} | {f['itl_p99_ms']} | {f['second_token_gap_p50_ms']} | "
                f"{f['refused_429']}"
            )
        if transport is not None:
            figures[part]["transport"] = transport
            print(
                f"a {transport['tokens']}-token prompt's KV ({transport['mb']} MB): through the "
                f"tier {transport['tier_ms']} ms, over gRPC {transport['grpc_ms']} ms"
            )
    if "agents" in figures:
        a = figures["agents"]
        ttft = a["kvmesh_ttft"]
        share = round(ttft["hit_ratio"] / max(1e-9, ttft["infinite_cache_hit_ratio"]), 3)
        figures["agents_ttft_hit_vs_bound"] = share
        print(f"(b) ttft's hit ratio / the infinite-cache bound: {share}")


if __name__ == "__main__":
    main()

"""vLLM alone against kvmesh's router in front of the same vLLM engine (aggregated).

The same model (the bundled SmolLM2, exported to a Hugging Face directory), the same vLLM
settings (eager, fp32, prefix caching, block size 64), the same streamed chat prompts and
answer length, on this machine, one after the other:

- vLLM's own OpenAI server (`python -m vllm.entrypoints.openai.api_server`);
- `kvmesh up --prefill 0 --decode 1 --encoder 0` with `KVMESH_DECODE_ENGINE=vllm`: the router,
  cachemeta and one decode worker running vLLM in its process (whole requests).

At 1 and 4 concurrent clients: TTFT and inter-token latency p50 / p99, and the mesh's added
TTFT (kvmesh's p50 minus vLLM's). Each prompt is new (a unique first line), so no prefix cache
serves it. Then turn 2 of conversations whose turn 1 had 2K and 4K prompt tokens, on an engine
whose own cache is empty: its TTFT with turn 1 loaded from kvmesh's storage tier (vLLM's KV
connector) against computing it again. Prints tables, then as its last line one JSON object
with those figures.

    .venv/bin/python bench/vllm.py [--requests 12] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m-instruct"
TEXT = (
    "You are reviewing a design document about a distributed cache for language model serving. "
    "Summarize the trade-offs between keeping KV blocks in worker memory and in a shared "
    "storage tier, and say which one you would pick for a chat product."
)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[:4]} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not up within {timeout_s} s")


def stop(proc: subprocess.Popen, timeout_s: float) -> None:
    """Ctrl-C, as a person would stop it; killed if it does not end in time."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


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


def vllm_alone(directory: Path, args: argparse.Namespace) -> dict:
    port = free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(directory)]
    cmd += ["--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["--dtype", "float32", "--enforce-eager", "--block-size", "64", "--seed", "0"]
    cmd += ["--enable-prefix-caching", "--max-model-len", "8192"]
    say("vLLM's own OpenAI server: starting")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 300, proc)
        return measure(f"http://127.0.0.1:{port}/v1", MODEL, args)
    finally:
        stop(proc, 30)


def kvmesh_in_front(state: Path, args: argparse.Namespace) -> dict:
    http = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(
        KVMESH_STATE_DIR=str(state),
        KVMESH_NATS_URL=f"nats://127.0.0.1:{free_port()}",
        KVMESH_ROUTER_HTTP_PORT=str(http),
        KVMESH_ROUTER_GRPC_PORT="0",
        KVMESH_DECODE_ENGINE="vllm",
        KVMESH_DECODE_MODEL=MODEL,
    )
    cmd = [sys.executable, "-m", "kvmesh", "up", "--prefill", "0", "--encoder", "0"]
    say("kvmesh (router, cachemeta, one vLLM decode worker): starting")
    log = (state / "up.log").open("wb")
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        start = time.monotonic()
        while b"kvmesh is up" not in (state / "up.log").read_bytes():
            if proc.poll() is not None:
                raise SystemExit(f"kvmesh up exited with {proc.returncode}")
            if time.monotonic() - start > 300:
                raise SystemExit("kvmesh up not up within 300 s")
            time.sleep(0.5)
        return measure(f"http://127.0.0.1:{http}/v1", MODEL, args)
    finally:
        stop(proc, 60)
        log.close()


def turn_two_from_storage(state: Path, lengths: list[int], reps: int) -> dict:
    """Turn-2 TTFT of an engine whose own cache is empty: turn 1 (prompt and answer) loaded
    from kvmesh's storage tier through the connector, against the same engine computing it
    again (no tier). Turn 1 is computed by a first engine, which then stops: what the second
    finds is only what the tier holds, as for a turn that lands on another worker."""
    from shared.engine.interface import EngineOptions
    from shared.engine.sampling import SamplingParams
    from shared.engine.vllm.engine import VllmEngine
    from shared.model.catalog import resolve

    rng = random.Random(0)
    store = state / "kvstore-turn2"

    def engine(tier: bool) -> VllmEngine:
        options = EngineOptions(kv_cache_tokens=32768, kv_store_dir=str(store) if tier else "")
        return VllmEngine.load(resolve(MODEL, {}), state, options)

    async def ask(e: VllmEngine, rid: str, ids: list[int], n: int) -> tuple[float, list[int]]:
        start, first, out = time.perf_counter(), 0.0, []
        async for piece in e.generate(rid, ids, SamplingParams(max_tokens=n, temperature=0)):
            first = first or time.perf_counter()
            out += piece.token_ids
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
        await asyncio.sleep(2)  # the writer thread's last blocks
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--turn2-lengths", default="2048,4096", help="turn-1 prompt tokens")
    parser.add_argument("--turn2-reps", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from shared.model.catalog import resolve
    from shared.model.export import export

    with tempfile.TemporaryDirectory(prefix="kvmesh-vllm-") as tmp:
        work = Path(tmp)
        say("exporting the bundled SmolLM2 to a Hugging Face directory")
        directory = export(resolve(MODEL, {}), work / "state", work / "smollm2")
        alone = vllm_alone(directory, args)
        mesh = kvmesh_in_front(work / "state", args)
        say("turn 2 from kvmesh's storage tier vs recomputed (vLLM engines in this process)")
        lengths = [int(n) for n in args.turn2_lengths.split(",")]
        turn2 = turn_two_from_storage(work / "state", lengths, args.turn2_reps)
    print("setup | clients | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms")
    for name, figures in (("vLLM alone", alone), ("kvmesh + vLLM", mesh)):
        for clients, f in figures.items():
            print(
                f"{name} | {clients} | {f['ttft_p50_ms']} | {f['ttft_p99_ms']} | "
                f"{f['itl_p50_ms']} | {f['itl_p99_ms']}"
            )
    added = {c: round(mesh[c]["ttft_p50_ms"] - alone[c]["ttft_p50_ms"], 1) for c in (1, 4)}
    share = round(added[1] / alone[1]["ttft_p50_ms"], 3)
    print(f"mesh's added TTFT p50: {added[1]} ms at 1 client ({share:.1%}), {added[4]} ms at 4")
    print("turn-1 prompt tokens | turn-2 TTFT from the tier ms | recomputed ms | speed-up")
    for n, f in turn2.items():
        print(f"{n} | {f['storage_ttft_ms']} | {f['recompute_ttft_ms']} | {f['speedup']}")
    print(
        json.dumps(
            {
                "vllm_alone": alone,
                "kvmesh_vllm": mesh,
                "mesh_added_ttft_p50_ms": added,
                "mesh_added_ttft_share_1": share,
                "turn2_storage_vs_recompute": turn2,
            }
        )
    )


if __name__ == "__main__":
    main()

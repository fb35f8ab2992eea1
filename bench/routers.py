"""Routers head to head in front of the same `vllm serve` servers: kvmesh's router (default
policy, `kvmesh up --upstream`), SMG (`smg launch --policy cache_aware`), vllm-router with
`--policy kv_aware` fed by the servers' own KV events and with `--policy cache_aware`, and
round robin (vllm-router's).

Each router gets fresh servers (`kvmesh model vllm-serve`'s command: the bundled model exported,
prefix caching on, KV events on a port with a replay socket beside it, eager, one core each),
then two workloads through the official OpenAI client, streamed chats:

- agent sessions: a system prompt every session shares, each turn re-sending the growing
  history (the agent's own answers and a new tool result), ``--clients`` sessions at a time;
- a chat mix with no sharing: new conversations of mixed lengths, ``--mix-clients`` at a time.

Per router and workload: TTFT mean, p50, p99; end-to-end latency mean; the servers' own prefix
cache hit ratio (their /metrics, before and after); requests per second; the router's CPU
seconds per request (its processes, from /proc). The peers install from the package registry
into a venv of this bench's own (``--peers``, made when missing), never the project's.

    .venv/bin/python bench/routers.py [--servers 2] [--sessions 8] [--turns 5] [--chats 24]

``--runs N`` goes over every router N times, in rounds; the table shows each figure's median.
Prints a table, then as its last line one JSON object with those figures (and every run's).
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
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil

REPO = Path(__file__).resolve().parent.parent
# Run as a script, this file's folder leads the path, where it would shadow vLLM itself.
sys.path[:] = [str(REPO), *(p for p in sys.path if Path(p or ".").resolve() != REPO / "bench")]

from bench.harness import emit, free_port, own_venv, pct, say, stop, wait_http  # noqa: E402
from shared.engine.vllm.serve import REPLAY_OFFSET, serve_command  # noqa: E402

MODEL = "smollm2-135m-instruct"
PEERS = {"smg": "smg==1.13.0", "vllm-router": "vllm-router==0.1.17"}
ROUTERS = ("kvmesh", "smg", "vllm-router-kv", "vllm-router-cache", "round-robin")
WORDS = " ".join(
    (
        "harbour tide vessel cargo berth crane pilot anchor customs manifest container quay",
        "dredge buoy ledger schedule freight ballast draught mooring tug lock channel beacon",
        "signal weather gale current swell hull keel rudder deck hold hatch winch capstan rope",
        "chain fender bollard gantry reefer pallet invoice tariff broker agent clerk port",
    )
).split()


def started(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A process of its own session (stopped with everything it started)."""
    out = log.open("ab")
    return subprocess.Popen(
        argv,
        env=env or os.environ.copy(),
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


# -- the peers, in a venv of their own ------------------------------------------------------


def peers_venv(path: Path) -> Path:
    """The venv with SMG and vllm-router (made from the package registry when missing)."""
    return own_venv(path, list(PEERS.values()), list(PEERS))


# -- the servers ----------------------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    events: str  # its KV events' endpoint, and the replay socket's
    replay: str


@contextlib.contextmanager
def servers(work: Path, n: int) -> Iterator[list[Server]]:
    """``n`` fresh vLLM servers of the bundled model, one core each."""
    from shared.model.catalog import resolve
    from shared.model.export import hf_directory
    from shared.model.text import text_of

    state = work / "state"
    source = resolve(MODEL, {})
    config = text_of(source, state).config
    directory = hf_directory(source, config, state)
    out = []
    for i in range(n):
        port, events = free_port(), free_port()
        argv = serve_command(directory, MODEL, port, events, host="127.0.0.1", eager=True)
        argv += ["--dtype", "float32", "--seed", "0", "--max-model-len", "8192"]
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": str(i % os.cpu_count()),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        }
        proc = started(argv, work / f"vllm-{i}.log", env)
        out.append(
            Server(
                proc,
                f"http://127.0.0.1:{port}",
                f"tcp://127.0.0.1:{events}",
                f"tcp://127.0.0.1:{events + REPLAY_OFFSET}",
            )
        )
    try:
        for s in out:
            wait_http(f"{s.url}/health", 300, s.proc)
        yield out
    finally:
        for s in out:
            stop(s.proc, group=True)


def cache_counts(urls: list[str]) -> tuple[float, float]:
    """The servers' prefix cache (hits, queries) in tokens, summed."""
    hits = queries = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


# -- the routers ----------------------------------------------------------------------------


@contextlib.contextmanager
def router(name: str, work: Path, backends: list[Server], peers: Path) -> Iterator[tuple[str, int]]:
    """The router in front of ``backends``: its base URL, and its process's pid."""
    port = free_port()
    urls = [s.url for s in backends]
    env = None
    if name == "kvmesh":
        state = work / "kvmesh"
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
        env.update(
            KVMESH_STATE_DIR=str(state),
            KVMESH_NATS_URL=f"nats://127.0.0.1:{free_port()}",
            KVMESH_ROUTER_HTTP_PORT=str(port),
            KVMESH_ROUTER_GRPC_PORT="0",
            KVMESH_LOG_LEVEL="warning",
        )
        argv = [sys.executable, "-m", "kvmesh", "up"]
        argv += [a for u in urls for a in ("--upstream", f"{MODEL}={u}")]
    elif name == "smg":
        argv = [str(peers / "smg"), "launch", "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--policy", "cache_aware", "--worker-urls", *urls]
    else:
        policy = {"vllm-router-kv": "kv_aware", "vllm-router-cache": "cache_aware"}.get(
            name, "round_robin"
        )
        argv = [str(peers / "vllm-router"), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--policy", policy, "--worker-urls", *urls]
        if policy == "kv_aware":
            for s in backends:
                argv += ["--kv-event-source", f"{s.url}={s.events}"]
                argv += ["--kv-event-replay-source", f"{s.url}={s.replay}"]
            argv += ["--kv-event-block-size", "32", "--kv-event-model", MODEL]
    say(f"{name}: {' '.join(argv[:3])} ...")
    proc = started(argv, work / f"{name}.log", env)
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", 300, proc)
        time.sleep(2.0)  # (its first reads of the servers' state)
        yield f"http://127.0.0.1:{port}/v1", proc.pid
    finally:
        stop(proc, group=True)


def cpu_seconds(pid: int, skip: set[int]) -> tuple[float, float]:
    """CPU seconds of the router's process, and of it with every process it started (but
    ``skip``: the servers): kvmesh's NATS server and cachemeta, and `kvmesh up` itself."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    router = total = 0.0
    for p in procs:
        if p.pid in skip:
            continue
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
            line = " ".join(p.cmdline())
            # (a peer's router is the process started; kvmesh's, the router child of `up`)
            if "services.router" in line or (p is root and "kvmesh" not in line):
                router += t.user + t.system
    return router, total


# -- the workloads --------------------------------------------------------------------------


@dataclass
class Asked:
    ttft_ms: float
    e2e_ms: float
    ok: bool = True


@dataclass
class Result:
    asked: list[Asked] = field(default_factory=list)
    wall_s: float = 0.0


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def chat(
    client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int
) -> tuple[Asked, str]:
    start = time.perf_counter()
    first, out = 0.0, []
    try:
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True
        )
        async for chunk in stream:
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                first = first or time.perf_counter()
                out.append(piece)
    except openai.APIError as err:
        say(f"  request failed: {err}")
        return Asked(0.0, 0.0, ok=False), ""
    end = time.perf_counter()
    return Asked(((first or end) - start) * 1e3, (end - start) * 1e3), "".join(out)


async def agent(base: str, args: argparse.Namespace) -> Result:
    """Sessions sharing a system prompt, each turn the history plus a tool's result."""
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    rng = random.Random(args.seed)
    system = "You are a port operations agent. Tools: " + text(rng, args.system_words)
    tasks = [text(rng, 30) for _ in range(args.sessions)]
    todo = list(range(args.sessions))
    result = Result()

    async def run() -> None:
        while todo:
            n = todo.pop(0)
            local = random.Random(args.seed * 1000 + n)
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": tasks[n]},
            ]
            for _ in range(args.turns):
                asked, answer = await chat(client, messages, args.max_tokens)
                result.asked.append(asked)
                messages += [
                    {"role": "assistant", "content": answer or "(no answer)"},
                    {"role": "user", "content": "Tool result: " + text(local, args.tool_words)},
                ]

    start = time.perf_counter()
    await asyncio.gather(*(run() for _ in range(args.clients)))
    result.wall_s = time.perf_counter() - start
    await client.close()
    return result


async def mix(base: str, args: argparse.Namespace) -> Result:
    """New conversations of mixed lengths (nothing shared), ``mix_clients`` at a time."""
    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=600)
    rng = random.Random(args.seed + 1)
    prompts = [text(rng, rng.randint(60, args.chat_words)) for _ in range(args.chats)]
    result = Result()

    async def run() -> None:
        while prompts:
            asked, _ = await chat(
                client, [{"role": "user", "content": prompts.pop()}], args.max_tokens
            )
            result.asked.append(asked)

    start = time.perf_counter()
    await asyncio.gather(*(run() for _ in range(args.mix_clients)))
    result.wall_s = time.perf_counter() - start
    await client.close()
    return result


def figures(result: Result, hits: float, queries: float, cpu_s: tuple[float, float]) -> dict:
    ok = [a for a in result.asked if a.ok]
    ttft = [a.ttft_ms for a in ok]
    return {
        "requests": len(result.asked),
        "failed": len(result.asked) - len(ok),
        "ttft_mean_ms": round(statistics.fmean(ttft), 1) if ttft else 0.0,
        "ttft_p50_ms": round(pct(ttft, 50), 1),
        "ttft_p99_ms": round(pct(ttft, 99), 1),
        "e2e_mean_ms": round(statistics.fmean(a.e2e_ms for a in ok), 1) if ok else 0.0,
        "hit_ratio": round(hits / queries, 3) if queries else 0.0,
        "rps": round(len(ok) / result.wall_s, 3) if result.wall_s else 0.0,
        "router_cpu_ms_per_request": round(cpu_s[0] / max(1, len(result.asked)) * 1e3, 2),
        "all_cpu_ms_per_request": round(cpu_s[1] / max(1, len(result.asked)) * 1e3, 2),
    }


def measure(name: str, work: Path, args: argparse.Namespace, peers: Path) -> dict:
    out = {}
    with (
        servers(work, args.servers) as backends,
        router(name, work, backends, peers) as (base, pid),
    ):
        urls = [s.url for s in backends]
        skip = {s.proc.pid for s in backends}
        for workload, run in (("agent", agent), ("mix", mix)):
            hits0, queries0 = cache_counts(urls)
            cpu0 = cpu_seconds(pid, skip)
            result = asyncio.run(run(base, args))
            hits1, queries1 = cache_counts(urls)
            cpu1 = cpu_seconds(pid, skip)
            cpu = (cpu1[0] - cpu0[0], cpu1[1] - cpu0[1])
            out[workload] = figures(result, hits1 - hits0, queries1 - queries0, cpu)
            f = out[workload]
            say(
                f"  {workload:5}: TTFT mean {f['ttft_mean_ms']:.0f} ms, p99 {f['ttft_p99_ms']:.0f}"
                f" ms, hit {f['hit_ratio']:.3f}, {f['rps']:.2f} req/s, router CPU "
                f"{f['router_cpu_ms_per_request']:.1f} ms/request (all its processes "
                f"{f['all_cpu_ms_per_request']:.1f}), {f['failed']} failed"
            )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", default=",".join(ROUTERS), help=f"comma list of {ROUTERS}")
    p.add_argument("--servers", type=int, default=2, help="vllm serve processes")
    p.add_argument("--sessions", type=int, default=8, help="agent sessions")
    p.add_argument("--turns", type=int, default=5, help="turns per agent session")
    p.add_argument("--system-words", type=int, default=700, help="the shared system prompt")
    p.add_argument("--tool-words", type=int, default=120, help="each turn's tool result")
    p.add_argument("--chats", type=int, default=24, help="new conversations in the mix")
    p.add_argument("--chat-words", type=int, default=900, help="the longest of them")
    p.add_argument("--clients", type=int, default=4, help="agent sessions at a time")
    p.add_argument("--mix-clients", type=int, default=2, help="new chats at a time")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers", type=Path, default=REPO / ".bench" / "peers", help="their venv")
    p.add_argument("--work", type=Path, help="keep the servers' and routers' logs here")
    p.add_argument(
        "--runs", type=int, default=1, help="rounds over every router (the table: medians)"
    )
    args = p.parse_args()
    peers = peers_venv(args.peers)
    names = args.routers.split(",")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="kvmesh-routers-") as tmp:
        for n in range(args.runs):  # (rounds, not one router's runs in a row: drift hits all)
            for i, name in enumerate(names):
                say(f"[round {n + 1}/{args.runs}, {i + 1}/{len(names)}] {name}")
                work = (args.work or Path(tmp)) / f"{name}-{n}"
                work.mkdir(parents=True, exist_ok=True)
                runs[name].append(attempt(name, work, args, peers))
    results = {name: medians(done) for name, done in runs.items()}
    print_table(results)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    emit({"routers": results, "runs": runs, "settings": settings})


def attempt(name: str, work: Path, args: argparse.Namespace, peers: Path) -> dict:
    """One run of a router's workloads, or why it could not run here."""
    try:
        return measure(name, work, args, peers)
    except SystemExit as err:  # (a router that cannot run here: why, and go on)
        say(f"  {name} could not run: {err}")
        logs = sorted(work.glob(f"{name}*.log"))
        tail = logs[0].read_text(errors="replace")[-1500:] if logs else ""
        return {"error": f"{err}: {tail}"}


def medians(done: list[dict]) -> dict:
    """Each workload's figures, the median of the runs that ran (an error when none did)."""
    ran = [d for d in done if "error" not in d]
    if not ran:
        return done[-1]
    return {
        workload: {
            k: round(statistics.median(d[workload][k] for d in ran), 3) for k in ran[0][workload]
        }
        for workload in ran[0]
    }


def print_table(results: dict) -> None:
    head = f"{'router':18} {'workload':8} {'TTFT mean':>9} {'p50':>7} {'p99':>7} {'e2e':>7} "
    head += f"{'hit':>6} {'req/s':>6} {'CPU ms/req':>10} {'(all)':>7}"
    print(head)
    for name, by in results.items():
        if "error" in by:
            print(f"{name:18} could not run: {by['error'][:200]}")
            continue
        for workload, f in by.items():
            print(
                f"{name:18} {workload:8} {f['ttft_mean_ms']:9.0f} {f['ttft_p50_ms']:7.0f} "
                f"{f['ttft_p99_ms']:7.0f} {f['e2e_mean_ms']:7.0f} {f['hit_ratio']:6.3f} "
                f"{f['rps']:6.2f} {f['router_cpu_ms_per_request']:10.1f} "
                f"{f['all_cpu_ms_per_request']:7.1f}"
            )


if __name__ == "__main__":
    main()

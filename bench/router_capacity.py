"""One router's streaming capacity: tokens per second it streams, the CPU it takes, and the
inter-token latency it adds, against the Rust router (sglang-router) measured the same way.

kvmesh: `kvmesh up` on the tiny model (1 prefill worker, --decode workers) whose decode workers
run the fake-paced engine (shared/engine/fake.py, named as a fake: real prefill, then a fixed
token every --step-ms and no compute, so decode is never the limit). The anchor:
`sglang-router` over the fake upstream (bench/fake_upstream.py) sending a chunk every
--step-ms (5 by default, near DeepInfer's 4: 256 streams then offer 51,200 tokens/s). For
each concurrency (64 → 1,024 streaming clients on 127.0.0.1, each asking again as soon as
an answer ends, --seconds measured after a warm-up): the tokens per second the
clients receive, the streams that got tokens in the window, the router process's CPU (share of
one core; on this two-core machine the clients, NATS and the workers share it), tokens per
router CPU-second (what one core of router carries), and the gaps between a stream's tokens at
the client, p50/p99, minus the step interval (what the path adds).

The client is lean (raw asyncio sockets, tokens counted in the byte stream, no JSON parsed) so
that its own cost is small; it runs in its own process.

Last line JSON (at 256 streams unless --at): router_tokens_s, router_tokens_per_cpu_s,
router_added_itl_p50_ms, router_added_itl_p99_ms, anchor_tokens_s, anchor_tokens_per_cpu_s,
anchor_added_itl_p99_ms, and every concurrency's figures.

    .venv/bin/python bench/router_capacity.py [--streams 64 256 1024] [--seconds 8]
        [--token-links on|off]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import Up, free_port, say, stop, wait_http  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# The fixed token's text (both servers), counted in the byte stream: a chunk that carries
# several (a stream catching up) counts for each.
TOKEN = b" tok"
CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK


# -- the client (its own process) -------------------------------------------------------------


async def stream_forever(
    i: int,
    host: str,
    port: int,
    body: bytes,
    window: list[float],
    out: dict,
) -> None:
    """Ask, read the stream to its end, ask again, until the window ends. Tokens arriving
    inside ``window`` (set once every stream has its first token) are counted; the gaps
    between a stream's successive tokens are kept."""
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while time.perf_counter() < window[1]:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):  # refused (busy, not ready): again soon
                out["errors"] += 1
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.lower().split(b"\r\n")
                        if line.startswith(b"content-length:")
                    ),
                    0,
                )
                await reader.readexactly(length)
                # As a client should: after Retry-After (1 s), spread out (no herd of retries).
                await asyncio.sleep(random.uniform(0.5, 1.5))
                continue
            last = None
            buffer = b""
            while True:
                data = await reader.read(65536)
                if not data:
                    return
                now = time.perf_counter()
                buffer = buffer[-8:] + data
                # (in the new bytes and the few before them, which hold no whole token)
                n = buffer[-(len(data) + len(TOKEN) - 1) :].count(TOKEN)
                if n:
                    out["flowing"].add(i)
                    if window[0] <= now < window[1]:
                        out["tokens"] += n
                        out["live"].add(i)
                        if last is not None:
                            out["gaps"].append(now - last)
                            out["gaps"].extend([0.0] * (n - 1))
                    last = now
                if b"[DONE]" in buffer or buffer.endswith(b"0\r\n\r\n"):
                    break
    finally:
        writer.close()


def client_process(  # noqa: PLR0913
    host: str,
    port: int,
    streams: int,
    model: str,
    max_tokens: int,
    warm_s: float,
    seconds: float,
    queue: multiprocessing.Queue,
    measuring: multiprocessing.Event,
) -> None:
    import uvloop

    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "Say tok."}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    out: dict = {"tokens": 0, "gaps": [], "live": set(), "flowing": set(), "errors": 0}

    async def main() -> None:
        # The window opens a second after every stream has its first token (the ramp, with
        # its prefills and refusals, is not measured), or after warm_s at the latest.
        start = time.perf_counter()
        window = [float("inf"), float("inf")]
        tasks = [
            asyncio.create_task(stream_forever(i, host, port, body, window, out))
            for i in range(streams)
        ]
        while len(out["flowing"]) < streams and time.perf_counter() < start + warm_s:
            await asyncio.sleep(0.05)
        window[0] = time.perf_counter() + 1.0
        window[1] = window[0] + seconds
        measuring.set()
        await asyncio.sleep(window[1] - time.perf_counter())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    uvloop.run(main())
    gaps = sorted(out["gaps"])
    queue.put(
        {
            "tokens": out["tokens"],
            "live": len(out["live"]),
            "errors": out["errors"],
            "gap_p50": gaps[len(gaps) // 2] if gaps else None,
            "gap_p99": gaps[int(0.99 * len(gaps))] if gaps else None,
        }
    )


def added(gap: float | None, step: float) -> float | None:
    """What the path adds to a gap between tokens; a token that came in one chunk with the
    one before (a stream catching up) adds nothing it can be blamed for on its own: 0."""
    return None if gap is None else round(max(0.0, gap - step) * 1e3, 2)


def measure(url: str, router_pid: int, streams: int, model: str, args: argparse.Namespace) -> dict:
    host, port = url.removeprefix("http://").split(":")
    queue: multiprocessing.Queue = multiprocessing.Queue()
    measuring = multiprocessing.Event()
    client = multiprocessing.Process(
        target=client_process,
        args=(host, int(port), streams, model, args.max_tokens, args.warm, args.seconds)
        + (queue, measuring),
    )
    client.start()
    measuring.wait(args.warm + 30)
    time.sleep(1.0)
    cpu0, t0 = cpu_seconds(router_pid), time.perf_counter()
    time.sleep(args.seconds)
    cpu1, t1 = cpu_seconds(router_pid), time.perf_counter()
    got = queue.get(timeout=120)
    client.join(30)
    step = args.step_ms / 1e3
    tokens_s = got["tokens"] / args.seconds
    cpu = (cpu1 - cpu0) / (t1 - t0)
    return {
        "streams": streams,
        "live": got["live"],
        "refused": got["errors"],
        "tokens_s": round(tokens_s),
        "router_cpu": round(cpu, 3),
        "tokens_per_cpu_s": round(tokens_s / cpu) if cpu else None,
        "itl_p50_ms": round(got["gap_p50"] * 1e3, 2) if got["gap_p50"] is not None else None,
        "itl_p99_ms": round(got["gap_p99"] * 1e3, 2) if got["gap_p99"] is not None else None,
        "added_itl_p50_ms": added(got["gap_p50"], step),
        "added_itl_p99_ms": added(got["gap_p99"], step),
    }


# -- the two systems ------------------------------------------------------------------------


def children_of(pid: int) -> list[tuple[int, str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append((int(entry.name), cmd))
    return found


def kvmesh_stack(args: argparse.Namespace) -> tuple[Up, int]:
    """`kvmesh up` with decode on the fake-paced engine, ready: the stack and its router's pid."""
    env = dict(
        KVMESH_PREFILL_MODEL="tiny",
        KVMESH_DECODE_MODEL="tiny",
        KVMESH_BENCH_ENGINES="true",
        KVMESH_DECODE_ENGINE="fake-paced",
        KVMESH_FAKE_STEP_MS=str(args.step_ms),
        KVMESH_PREFILL_THREADS="1",
        KVMESH_DECODE_THREADS="1",
        KVMESH_DECODE_KV_CACHE_TOKENS=str(max(args.streams) * (args.max_tokens + 128)),
        KVMESH_DECODE_KV_STORE="false",  # the answers are a fake's: nothing to keep
        KVMESH_DECODE_MEMORY_TIER_BYTES="0",
        KVMESH_DECODE_MAX_RUNNING=str(max(args.streams) + 64),
        KVMESH_ROUTER_MAX_INFLIGHT=str(max(args.streams) * 2),
        KVMESH_ROUTER_TOKEN_LINKS=str(args.token_links == "on").lower(),
    )
    up = Up(["--decode", str(args.decode), "--encoder", "0"], env)
    up.wait_ready(180)
    router = next(pid for pid, cmd in children_of(up.proc.pid) if "services.router" in cmd)
    return up, router


def anchor_stack(args: argparse.Namespace) -> tuple[list[subprocess.Popen], str, int]:
    up, port = free_port(), free_port()
    upstream = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "fake_upstream.py"), "--port", str(up)]
        + ["--itl-ms", str(args.step_ms)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(f"http://127.0.0.1:{up}/health")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        + ["--port", str(port), "--worker-urls", f"http://127.0.0.1:{up}"]
        + ["--log-level", "error", "--max-concurrent-requests", str(max(args.streams) * 2)]
        + ["--prometheus-port", str(free_port())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/v1/models")
    return [upstream, router], url, router.pid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--at", type=int, default=256, help="the concurrency the JSON headlines")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured, per concurrency")
    ap.add_argument(
        "--warm", type=float, default=60.0, help="at most, for every stream's first token"
    )
    ap.add_argument(
        "--step-ms",
        type=float,
        default=5.0,
        help="between a stream's tokens",
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=1500,
        help="per answer (long enough that a stream's one answer spans warm-up and window)",
    )
    ap.add_argument("--decode", type=int, default=1, help="kvmesh decode workers")
    ap.add_argument("--skip-anchor", action="store_true")
    ap.add_argument(
        "--token-links",
        choices=("on", "off"),
        default="on",
        help="decode's token events on links straight to the router (the default), or NATS",
    )
    args = ap.parse_args()
    results: dict[str, list[dict]] = {"kvmesh": [], "anchor": []}

    def sweep(system: str, url: str, pid: int, model: str) -> None:
        for n in args.streams:
            say(f"{system}: {n} streams")
            results[system].append(measure(url, pid, n, model, args))
            say(f"  {results[system][-1]}")

    say("starting kvmesh (tiny model, decode on the fake-paced engine)")
    up, pid = kvmesh_stack(args)
    with up:
        sweep("kvmesh", up.url, pid, "tiny")
    if not args.skip_anchor:
        say("starting the anchor: sglang-router over the fake upstream")
        procs, url, pid = anchor_stack(args)
        try:
            sweep("anchor", url, pid, "fake")
        finally:
            for p in procs:
                stop(p, 10)

    print(f"streaming, a token every {args.step_ms:g} ms per stream, {args.seconds:g} s measured")
    head = (
        "system",
        "streams",
        "tok/s",
        "router CPU",
        "tok/CPU-s",
        "ITL p50",
        "ITL p99",
        "added p99",
    )
    print("{:<8}{:>8}{:>10}{:>12}{:>11}{:>10}{:>10}{:>11}".format(*head))
    for system, rows in results.items():
        for r in rows:
            print(
                f"{system:<8}{r['streams']:>8}{r['tokens_s']:>10}{r['router_cpu']:>12.2f}"
                f"{r['tokens_per_cpu_s'] or 0:>11}{r['itl_p50_ms'] or 0:>8.1f}ms"
                f"{r['itl_p99_ms'] or 0:>8.1f}ms{r['added_itl_p99_ms'] or 0:>9.1f}ms"
            )

    def at(system: str) -> dict:
        rows = results[system]
        return next((r for r in rows if r["streams"] == args.at), rows[-1] if rows else {})

    k, a = at("kvmesh"), at("anchor")
    print(
        json.dumps(
            {
                "router_tokens_s": k.get("tokens_s"),
                "router_tokens_per_cpu_s": k.get("tokens_per_cpu_s"),
                "router_added_itl_p50_ms": k.get("added_itl_p50_ms"),
                "router_added_itl_p99_ms": k.get("added_itl_p99_ms"),
                "anchor_tokens_s": a.get("tokens_s"),
                "anchor_tokens_per_cpu_s": a.get("tokens_per_cpu_s"),
                "anchor_added_itl_p99_ms": a.get("added_itl_p99_ms"),
                "streams": args.at,
                "all": results,
            }
        )
    )


if __name__ == "__main__":
    main()

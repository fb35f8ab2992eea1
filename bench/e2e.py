"""End-to-end benchmark of the request path: a real stack, concurrent streaming clients.

Starts `kvmesh up` (1 prefill, 1 decode worker) on the tiny model, so compute is small and
the mesh itself is measured; then the same on the fake-paced engine (no prefill compute, a
decode step every millisecond, no tiers: what is left is the mesh, beside the anchor below);
then on the real model. Drives 1, 8 and 32 concurrent streaming chat clients (raw
server-sent events over aiohttp, kept-alive connections). Prints a table, then as its last
line one JSON object with the tiny model's figures at 8 clients: ttft_p50_ms, ttft_p99_ms,
tpot_p50_ms, rps, kv_transfer_mb_s, mesh_overhead_p50_ms; mesh_overhead_p50_ms_1 (1
client); the fake-paced stack's fake_overhead_p50_ms[_1] and its ratio to the anchor's best
(of its two connection modes), fake_vs_anchor[_1]; each stack's hop table
(hops_ms_<stack>_<clients>), its processes' CPU per request
(cpu_ms_per_request_<stack>_<clients>: router, prefill, decode, its engine's process,
nats-server...) and wake-ups per request (wakeups_per_request_<stack>_<clients>: its
threads' voluntary context switches, each a message that woke it, about: on a VM each costs
tens of microseconds of the sender's and the receiver's CPU), and the token events'
transit from worker to router (token_transit_ms_<stack>_<clients>: mean, p50, p99, from
the router's kvmesh_token_transit_seconds); and the anchor's: anchor_overhead_p50_ms (8 clients),
anchor_overhead_p50_ms_1, and the same on kept-alive connections
(anchor_keepalive_overhead_p50_ms[_1]).

mesh overhead = what the client waited (request sent → last chunk) minus the time the
engines computed for the request (prefill + its decode steps, reported by the workers).

The anchor: `sglang-router` (the Rust router) in front of a fake upstream that answers at once
(bench/fake_upstream.py, no model behind it), the same client and answer length; its added
latency = request sent → last chunk through the router minus the same straight to the
upstream, p50, the two asked in turn. Measured both on a new connection per request and on
kept-alive connections (where the router's unset TCP_NODELAY meets the client's delayed ACK).

--auth / --tls: also TTFT p50 at 1 client on stacks without and with API keys / TLS
(`kvmesh up --tls`: HTTPS, mutual TLS on NATS and the KV handoff), up side by side and asked
in turn; the JSON gains <variant>_ttft_p50_ms and security_added_p50_ms.

    .venv/bin/python bench/e2e.py [--skip-real] [--requests 3] [--auth] [--tls]
        [--token-links on|off]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import Stack, emit, free_port, pct, say, wait_http  # noqa: E402
from tests.procs import metrics  # noqa: E402

FAKE_STEP_MS = 1  # the fake-paced decode's step: paced, no compute (its time is the engine's)
PROMPT = (
    "You are reviewing a long design document about a distributed cache for language model "
    "serving. Summarize the trade-offs between keeping KV blocks in worker memory and in a "
    "shared storage tier, and say which one you would pick for a chat product. "
)


async def one_request(
    session: aiohttp.ClientSession, url: str, model: str, i: int, max_tokens: int
) -> dict:
    """One streaming chat request, read as raw server-sent events (a lean client, so its own
    parsing cost is not charged to the mesh)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"({i}) {PROMPT}"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = None
    tokens = 0
    timing: dict = {}
    rid = f"e2e-{uuid.uuid4().hex[:16]}"  # (finds its spans in the traces)
    headers = {"x-request-id": rid}
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first or now
                last = now
            if chunk.get("usage"):
                timing = chunk.get("kvmesh", {})
                tokens = chunk["usage"]["completion_tokens"]
    done = time.perf_counter()
    return {
        "id": rid,
        "ttft": (first or done) - sent,
        "tpot": ((last - first) / (tokens - 1)) if first and last and tokens > 1 else None,
        "latency": done - sent,
        "engine": timing.get("engine_ms", 0.0) / 1e3,
        "decode_ms": timing.get("decode_ms", 0.0),
        "kv_bytes": timing.get("kv_bytes", 0),
        "kv_s": timing.get("kv_transfer_ms", 0.0) / 1e3,
    }


class Anchor:
    """`sglang-router` over the fake upstream, each in its own process on free ports."""

    def __init__(self) -> None:
        up, port = free_port(), free_port()
        self.upstream_url = f"http://127.0.0.1:{up}"
        self.url = f"http://127.0.0.1:{port}"
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(REPO / "bench" / "fake_upstream.py"), "--port", str(up)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        ]
        wait_http(f"{self.upstream_url}/health")
        router = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"]
        router += ["--port", str(port), "--worker-urls", self.upstream_url, "--log-level", "error"]
        router += ["--prometheus-port", str(free_port())]
        self.procs.append(
            subprocess.Popen(router, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        )
        wait_http(f"{self.url}/v1/models")

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


async def anchor_added(
    anchor: Anchor, clients: int, rounds: int, max_tokens: int, keepalive: bool
) -> float:
    """p50 of (through the router − straight to the upstream), request sent → last chunk, in
    ms; ``clients`` at once, the two targets in turn each round."""
    connector = aiohttp.TCPConnector(limit=0, force_close=not keepalive)
    async with aiohttp.ClientSession(connector=connector) as session:
        for url in (anchor.upstream_url, anchor.url):  # warm-up: connections, first paths
            await one_request(session, url, "fake", -1, max_tokens)
        times: dict[str, list[float]] = {anchor.upstream_url: [], anchor.url: []}
        for r in range(rounds):
            for url in times:
                figs = await asyncio.gather(
                    *(
                        one_request(session, url, "fake", r * 100 + c, max_tokens)
                        for c in range(clients)
                    )
                )
                times[url] += [f["latency"] for f in figs]
    direct = statistics.median(times[anchor.upstream_url])
    return round((statistics.median(times[anchor.url]) - direct) * 1e3, 2)


def measure_anchor(max_tokens: int, rounds: int = 40) -> dict:
    say("starting the anchor: sglang-router over a fake upstream")
    anchor = Anchor()
    out = {}
    try:
        for keepalive in (False, True):
            for clients in (1, 8):
                name = "anchor_keepalive_overhead_p50_ms" if keepalive else "anchor_overhead_p50_ms"
                name += "_1" if clients == 1 else ""
                out[name] = asyncio.run(
                    anchor_added(anchor, clients, rounds, max_tokens, keepalive)
                )
                say(f"  {name}: {out[name]:.2f}")
    finally:
        anchor.stop()
    return out


async def drive(
    url: str,
    model: str,
    clients: int,
    per_client: int,
    max_tokens: int,
    key: str = "",
) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    headers = {"Authorization": f"Bearer {key}"} if key else None
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def worker(c: int) -> list[dict]:
            return [
                await one_request(session, url, model, c * 1000 + r, max_tokens)
                for r in range(per_client)
            ]

        await one_request(session, url, model, -1, 4)  # warm-up
        started = time.perf_counter()
        per_worker = await asyncio.gather(*(worker(c) for c in range(clients)))
        wall = time.perf_counter() - started
    results = [r for rs in per_worker for r in rs]

    kv_bytes = sum(r["kv_bytes"] for r in results)
    kv_s = sum(r["kv_s"] for r in results)
    tpots = [r["tpot"] for r in results if r["tpot"] is not None]
    overhead = [r["latency"] - r["engine"] for r in results]
    return {
        "results": results,
        "requests": len(results),
        "ttft_p50_ms": round(pct([r["ttft"] for r in results], 50, 1e3), 2),
        "ttft_p99_ms": round(pct([r["ttft"] for r in results], 99, 1e3), 2),
        "tpot_p50_ms": round(statistics.median(tpots) * 1e3, 2) if tpots else None,
        "rps": round(len(results) / wall, 2),
        "kv_transfer_mb_s": round(kv_bytes / kv_s / 1e6, 1) if kv_s else None,
        "mesh_overhead_p50_ms": round(pct(overhead, 50, 1e3), 2),
    }


# Where a request's time goes, hop by hop, from the spans every service wrote (the stack's
# trace files) and the points each marked on the path (their events: shared/telemetry/
# tracing.py's mark_span): each hop ends where the next begins, so they add up to the
# request's time as the router saw it. "(engine)" hops are the models' compute; the rest is
# the mesh's. Beside the chain, hops that overlap it (the first token's own way out).
HOPS = (
    ("router: read, render, tokenize", "root.start", "prepared"),
    ("router: hash, look up, route", "prepared", "routed"),
    ("task to prefill (NATS)", "routed", "prefill.start"),
    ("prefill: queue, cached KV", "prefill.start", "compute.start"),
    ("prefill compute (engine)", "compute.start", "compute.end"),
    ("prefill: decode's reservation answered", "compute.end", "reserved"),
    ("prefill: first token sent (NATS)", "reserved", "first_sent"),
    ("prefill: KV exported", "first_sent", "exported"),
    ("KV over gRPC, into decode", "exported", "kv.receive.end"),
    ("decode: KV written, joined", "kv.receive.end", "joined"),
    ("decode steps (engine)", "", ""),
    ("decode: between steps", "joined", "decode.end"),
    ("last token to the response's end", "decode.end", "root.end"),
)
BESIDE = (
    ("  router: route to task acked", "routed", "acked"),
    ("  first token: prefill to router", "first_sent", "first_token"),
    ("  first token: router to client", "first_token", "first_write"),
    ("  decode: joined to first step out", "joined", "first_step"),
)
NAMES = {"kv.lookup": "lookup", "prefill.compute": "compute"}  # span name → its hop key


def hops(trace_dir: Path, results: list[dict]) -> dict[str, float]:
    """Median ms of each hop (HOPS, BESIDE) over the requests in ``results`` (their spans
    found by request id); the decode steps' compute is what decode reported for each."""
    by_trace: dict[str, list[dict]] = defaultdict(list)
    roots: dict[str, str] = {}
    for path in trace_dir.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            by_trace[span["trace_id"]].append(span)
            if span["parent_id"] is None and span["name"].startswith("/v1/"):
                roots[span["attributes"].get("kvmesh.request_id", "")] = span["trace_id"]
    per_hop: dict[str, list[float]] = defaultdict(list)
    for r in results:
        spans = by_trace.get(roots.get(r["id"], ""), [])
        at: dict[str, int] = {}
        for span in spans:
            name = span["name"]
            key = "root" if span["parent_id"] is None else NAMES.get(name, name)
            at.setdefault(f"{key}.start", span["start_ns"])
            at.setdefault(f"{key}.end", span["end_ns"])
            for event, t_ns in span.get("events", ()):
                at.setdefault(event, t_ns)
        needed = {p for _, start, end in HOPS for p in (start, end) if p}
        if not needed <= at.keys():
            continue  # its spans not all written, or prefilled on decode (no handoff)
        steps_ms = r["decode_ms"]
        for name, start, end in HOPS + BESIDE:
            if not start:
                per_hop[name].append(steps_ms)
                continue
            if start not in at or end not in at:
                continue
            took = (at[end] - at[start]) / 1e6
            per_hop[name].append(took - steps_ms if name.startswith("decode: between") else took)
    return {name: round(statistics.median(v), 2) for name, v in per_hop.items()}


PROCESS_ORDER = (
    "router",
    "prefill",
    "decode",
    "decode engine",
    "nats-server",
    "cachemeta",
    "encoder",
)


def per_request(before: dict, after: dict, n: int) -> tuple[dict, dict]:
    """Each process's CPU (ms) and wake-ups (``Up.cpu_and_wakeups``) while ``n`` requests
    ran, per request."""
    kinds = sorted(after, key=PROCESS_ORDER.index)
    cpu = {k: round((after[k][0] - before.get(k, (0.0, 0))[0]) / n * 1e3, 2) for k in kinds}
    woken = {k: round((after[k][1] - before.get(k, (0.0, 0))[1]) / n, 1) for k in kinds}
    return cpu, woken


def transit(before: dict, after: dict) -> dict[str, float | None]:
    """The router's kvmesh_token_transit_seconds between two scrapes: mean, and the bucket
    bounds under which half and 99% of the messages came (ms)."""
    name = "kvmesh_token_transit_seconds"

    def delta(sample: str, labels: tuple = ()) -> float:
        key = (f"{name}_{sample}", labels)
        return after.get(key, 0.0) - before.get(key, 0.0)

    count = delta("count")
    if not count:
        return {"mean": None, "p50": None, "p99": None}
    buckets = sorted(
        (float(dict(labels)["le"]), delta("bucket", labels))
        for (sample, labels) in after
        if sample == f"{name}_bucket"
    )
    out: dict[str, float | None] = {"mean": round(delta("sum") / count * 1e3, 3)}
    for q in (50, 99):
        bound = next((le for le, n in buckets if n >= count * q / 100), float("inf"))
        out[f"p{q}"] = round(bound * 1e3, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-real", action="store_true", help="only the tiny model")
    ap.add_argument(
        "--stacks",
        default="tiny,fake,smollm2",
        help="which stacks, of tiny, fake (the fake-paced engine) and smollm2 (the real model)",
    )
    ap.add_argument(
        "--model",
        metavar="NAME=PATH",
        default="",
        help="the tiny and fake stacks serve this checkpoint's text side instead of the tiny "
        "model's (where the bundled model is not installed: bench/gpu.py)",
    )
    ap.add_argument("--requests", type=int, default=3, help="requests per client (tiny model)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--anchor-rounds", type=int, default=40, help="the anchor's rounds a mode")
    ap.add_argument(
        "--auth",
        action="store_true",
        help="also compare TTFT at 1 client with API keys off and on (tiny model, same run)",
    )
    ap.add_argument(
        "--tls",
        action="store_true",
        help="also compare TTFT at 1 client with TLS off and on (with --auth: both at once)",
    )
    ap.add_argument(
        "--decode-engine",
        choices=("process", "thread"),
        default="process",
        help="where decode's engine loop runs: a process of its own (the default) or a thread "
        "of the worker (KVMESH_DECODE_ENGINE_PROCESS)",
    )
    ap.add_argument(
        "--token-links",
        choices=("on", "off"),
        default="on",
        help="workers' token events on links straight to the router (the default), or NATS",
    )
    args = ap.parse_args()
    placement = {
        "KVMESH_DECODE_ENGINE_PROCESS": str(args.decode_engine == "process").lower(),
        "KVMESH_ROUTER_TOKEN_LINKS": str(args.token_links == "on").lower(),
    }
    # (name, model, engine env, requests per client): the tiny model computing on both
    # workers; the fake-paced engine (no model compute: the mesh alone, beside the anchor);
    # the real model.
    fake = {  # (the fake's blocks are not worth keeping: no tiers)
        "KVMESH_BENCH_ENGINES": "true",
        "KVMESH_PREFILL_ENGINE": "fake-paced",
        "KVMESH_DECODE_ENGINE": "fake-paced",
        "KVMESH_FAKE_PREFILL": "1",
        "KVMESH_FAKE_STEP_MS": str(FAKE_STEP_MS),
        "KVMESH_PREFILL_KV_STORE": "false",
        "KVMESH_DECODE_KV_STORE": "false",
        "KVMESH_PREFILL_MEMORY_TIER_BYTES": "0",
        "KVMESH_DECODE_MEMORY_TIER_BYTES": "0",
    }
    small, served = "tiny", ()
    if args.model:  # (every service of the stack serves it: the router, workers, encoder)
        small, path = args.model.split("=", 1)
        served = ("--model", f"{small}={Path(path).resolve()}")
    runs = [("tiny", small, {}, args.requests), ("fake", small, fake, args.requests)]
    runs.append(("smollm2", "smollm2-135m-instruct", {}, 1))
    wanted = set(args.stacks.split(",")) - ({"smollm2"} if args.skip_real else set())
    runs = [
        (name, model, {**placement, **extra}, n) for name, model, extra, n in runs if name in wanted
    ]
    rows = []
    summary: dict = {}
    for name, model, extra, per_client in runs:
        say(f"{name}: a stack on {model} (1 prefill, 1 decode worker; {extra or 'torch'})")
        stack = Stack(model, 1, extra, args=served if model == small else ())
        try:
            stack.wait_ready()
            # Warmed first: a process's first requests build what it keeps (imports, schemas,
            # the tokenizer's caches), at a cost that is no request's.
            asyncio.run(drive(stack.url, model, 2, 3, args.max_tokens))
            for clients in (1, 8, 32):
                say(f"{name}: {clients} clients x {per_client} requests")
                cpu, seen = stack.cpu_and_wakeups(), metrics(stack.url)
                fig = asyncio.run(drive(stack.url, model, clients, per_client, args.max_tokens))
                fig["cpu_ms"], fig["wakeups"] = per_request(
                    cpu, stack.cpu_and_wakeups(), fig["requests"] + 1
                )
                fig["transit_ms"] = transit(seen, metrics(stack.url))
                time.sleep(1.0)  # the services write their spans within half a second
                fig["hops"] = hops(stack.dir / "traces", fig.pop("results"))
                rows.append((name, clients, fig))
                if name == "tiny" and clients == 8:
                    summary.update({k: v for k, v in fig.items() if k not in ("requests", "hops")})
                if name == "tiny" and clients == 1:
                    summary["mesh_overhead_p50_ms_1"] = fig["mesh_overhead_p50_ms"]
                if name == "fake" and clients in (1, 8):
                    key = "fake_overhead_p50_ms" + ("_1" if clients == 1 else "")
                    summary[key] = fig["mesh_overhead_p50_ms"]
                if name in ("tiny", "fake") and clients in (1, 8, 32):
                    summary[f"hops_ms_{name}_{clients}"] = fig["hops"]
                    summary[f"cpu_ms_per_request_{name}_{clients}"] = fig["cpu_ms"]
                    summary[f"wakeups_per_request_{name}_{clients}"] = fig["wakeups"]
                    summary[f"token_transit_ms_{name}_{clients}"] = fig["transit_ms"]
        finally:
            stack.stop()
    head = (
        "model",
        "clients",
        "reqs",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "req/s",
        "KV MB/s",
        "mesh overhead p50",
    )
    print("{:<22}{:>8}{:>6}{:>10}{:>10}{:>10}{:>8}{:>9}{:>19}".format(*head))
    for model, clients, f in rows:
        print(
            f"{model:<22}{clients:>8}{f['requests']:>6}{f['ttft_p50_ms']:>8.1f}ms"
            f"{f['ttft_p99_ms']:>8.1f}ms{f['tpot_p50_ms'] or 0:>8.1f}ms{f['rps']:>8.1f}"
            f"{f['kv_transfer_mb_s'] or 0:>9.1f}{f['mesh_overhead_p50_ms']:>17.1f}ms"
        )
    shown = [(m, c, f) for m, c, f in rows if f["hops"]]
    if shown:
        print("\nwhere a request's time goes, p50 of each hop (ms), from the services' spans:")
        print(f"{'hop':<36}" + "".join(f"{f'{m[:7]} x{c}':>12}" for m, c, _ in shown))
        for name, _, _ in HOPS + BESIDE:
            print(f"{name:<36}" + "".join(f"{f['hops'].get(name, 0):>12.2f}" for *_, f in shown))
    print("\nCPU per request (ms), by process (the stack's whole CPU while it ran, by requests):")
    kinds = sorted({k for *_, f in rows for k in f["cpu_ms"]}, key=PROCESS_ORDER.index)
    print(f"{'process':<36}" + "".join(f"{f'{m[:7]} x{c}':>12}" for m, c, _ in rows))
    for kind in kinds:
        print(f"{kind:<36}" + "".join(f"{f['cpu_ms'].get(kind, 0):>12.2f}" for *_, f in rows))
    print(f"{'all':<36}" + "".join(f"{sum(f['cpu_ms'].values()):>12.2f}" for *_, f in rows))
    print("\nwake-ups per request, by process (its threads' voluntary context switches):")
    for kind in kinds:
        print(f"{kind:<36}" + "".join(f"{f['wakeups'].get(kind, 0):>12.1f}" for *_, f in rows))
    print(f"{'all':<36}" + "".join(f"{sum(f['wakeups'].values()):>12.1f}" for *_, f in rows))
    print("\ntoken events, a worker's send to the router's receipt (ms; p50, p99: bucket bounds):")
    for stat in ("mean", "p50", "p99"):
        print(f"{stat:<36}" + "".join(f"{f['transit_ms'][stat] or 0:>12.3f}" for *_, f in rows))
    anchor = measure_anchor(args.max_tokens, args.anchor_rounds)
    print(
        f"anchor (sglang-router over a fake upstream, {args.max_tokens} chunks), added p50: "
        f"{anchor['anchor_overhead_p50_ms_1']:.2f} ms at 1 client, "
        f"{anchor['anchor_overhead_p50_ms']:.2f} ms at 8 (a new connection per request); "
        f"{anchor['anchor_keepalive_overhead_p50_ms_1']:.2f} / "
        f"{anchor['anchor_keepalive_overhead_p50_ms']:.2f} ms on kept-alive connections"
    )
    summary.update(anchor)
    for clients, suffix in ((1, "_1"), (8, "")):
        # The anchor at its best: kept-alive connections meet its unset TCP_NODELAY at one
        # client (a delayed ACK each request), a new connection per request does not.
        ours = summary[f"fake_overhead_p50_ms{suffix}"]
        theirs = min(
            anchor[f"anchor_overhead_p50_ms{suffix}"],
            anchor[f"anchor_keepalive_overhead_p50_ms{suffix}"],
        )
        summary[f"fake_vs_anchor{suffix}"] = round(ours / max(theirs, 0.01), 2)
        print(
            f"kvmesh over the fake-paced engine (no model compute), added p50 at {clients} "
            f"client(s): "
            f"{ours:.2f} ms = {summary[f'fake_vs_anchor{suffix}']:.2f}x the anchor's best "
            f"{theirs:.2f} ms"
        )
    if args.auth or args.tls:
        summary.update(security_comparison(args.auth, args.tls, args.max_tokens))
    emit(summary)


def security_comparison(auth: bool, tls: bool, max_tokens: int, rounds: int = 60) -> dict:
    """TTFT p50 at 1 client, tiny model: a stack with neither, one per feature asked for and
    one with both. All are up at once and take one request each in turn, so a slower minute
    of the machine falls on every variant alike."""
    keys_file = Path(tempfile.mkdtemp(prefix="kvmesh-bench-keys-")) / "keys.json"
    key = subprocess.run(
        [sys.executable, "-m", "kvmesh", "keys", "--file", str(keys_file), "add", "--tenant", "b"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    variants = [("off", False, False)]
    if auth:
        variants.append(("auth", True, False))
    if tls:
        variants.append(("tls", False, True))
    if auth and tls:
        variants.append(("auth_tls", True, True))
    stacks = {}
    try:
        for name, with_auth, with_tls in variants:
            say(f"starting a tiny stack: {name}")
            extra = {"KVMESH_ROUTER_KEYS_FILE": str(keys_file)} if with_auth else {}
            stacks[name] = (Stack("tiny", 1, extra, tls=with_tls), key if with_auth else "")
        for stack, k in stacks.values():
            stack.wait_ready(key=k)
        ttft = asyncio.run(in_turn(stacks, rounds, max_tokens))
    finally:
        for stack, _ in stacks.values():
            stack.stop()
    out = {f"{name}_ttft_p50_ms": round(statistics.median(v) * 1e3, 2) for name, v in ttft.items()}
    on = variants[-1][0]
    out["security_added_p50_ms"] = round(out[f"{on}_ttft_p50_ms"] - out["off_ttft_p50_ms"], 2)
    print(f"1 client, {rounds} requests each, turn by turn:")
    for name in ttft:
        print(f"  {name:<9} TTFT p50 {out[f'{name}_ttft_p50_ms']:.2f} ms")
    print(f"  {on} adds {out['security_added_p50_ms']:.2f} ms at p50")
    return out


async def in_turn(
    stacks: dict[str, tuple[Stack, str]], rounds: int, max_tokens: int
) -> dict[str, list[float]]:
    """One request to each stack in turn, ``rounds`` times; each stack's client keeps its
    connection (as real clients do: a TLS handshake is not paid per request)."""
    sessions = {}
    for name, (stack, key) in stacks.items():
        headers = {"Authorization": f"Bearer {key}"} if key else None
        connector = aiohttp.TCPConnector(ssl=stack.ssl if stack.tls else True)
        sessions[name] = aiohttp.ClientSession(connector=connector, headers=headers)
    ttft: dict[str, list[float]] = {name: [] for name in stacks}
    try:
        for r in range(rounds):
            for name, (stack, _) in stacks.items():
                fig = await one_request(sessions[name], stack.url, "tiny", r, max_tokens)
                ttft[name].append(fig["ttft"])
            if (r + 1) % 10 == 0:
                say(f"  {r + 1}/{rounds} rounds")
    finally:
        for session in sessions.values():
            await session.close()
    return ttft


if __name__ == "__main__":
    main()

"""The mesh on one host and across four, and a host lost mid-stream.

Both meshes are the same services (a 3-node NATS cluster, cachemeta, a router, a prefill and
two decode workers; tiny model, TLS everywhere), in network namespaces on a bridge
(tests/hosts.py): first all in one namespace ("one host"), then spread as in
tests/test_hosts.py: NATS nodes on hosts 1-3, cachemeta and the router on host 0, prefill on
host 1, decode on hosts 2 and 3. The client is outside both, through the bridge, so the
difference is the mesh's own hops crossing veths (router ↔ NATS ↔ workers, the KV hand-over
from prefill to decode over gRPC).

Each mesh answers REQUESTS streamed requests one after another, each a new prompt past the
local-prefill bound (prefilled on one worker, its KV handed to decode): TTFT and whole-answer
p50/p99. Then, across hosts, the host-loss fault: CLIENTS clients stream long greedy answers
(their references taken on the calm mesh); once every one is streaming, host 2 (a NATS node
and decode-0) is cut off (its veth down). Of the requests in flight: how many were on the
cut worker, how many moved (their usage names both decode workers), lost (an error, or an
answer not the reference token for token); recovery: the longest a moved stream went
without a token (the router gives a silent worker KVMESH_ROUTER_TOKEN_TIMEOUT_S); rejoin:
from the host back to decode-0 ready again.

Needs root (network namespaces). Prints a table; the last line is one JSON object.

    .venv/bin/python bench/hosts.py [--requests 40] [--clients 4] [--answer 400]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)

from shared.search import percentile  # noqa: E402
from tests.hosts import Hosts, Mesh, mesh_on  # noqa: E402

SPREAD = {"cachemeta-0": 0, "router-0": 0, "prefill-0": 1, "decode-0": 2, "decode-1": 3}
NATS_HOSTS = (1, 2, 3)
CUT_HOST, CUT_WORKER = 2, "decode-0"
TOKEN_TIMEOUT_S = "3"


def stream(mesh: Mesh, prompt: str, max_tokens: int, log: list[float] | None = None) -> dict:
    """One streamed greedy completion: its text, usage's workers, TTFT and total (ms);
    ``log`` gets each chunk's arrival time."""
    started = time.perf_counter()
    chunks = mesh.client(timeout=120).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, first, workers = [], 0.0, []
    for chunk in chunks:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            first = first or now
            text.append(chunk.choices[0].text)
            if log is not None:
                log.append(now)
        if chunk.usage:
            workers = chunk.model_extra["kvmesh"]["workers"]
    return {
        "text": "".join(text),
        "workers": workers,
        "ttft_ms": (first - started) * 1e3,
        "total_ms": (time.perf_counter() - started) * 1e3,
    }


def latencies(mesh: Mesh, name: str, requests: int) -> dict:
    stream(mesh, f"{name}: a first request, to warm the workers up", 8)
    ttft, total = [], []
    for i in range(requests):
        prompt = " ".join(f"{name}-berth{i}-{j}" for j in range(120))  # ~500 new tokens
        answer = stream(mesh, prompt, 8)
        ttft.append(answer["ttft_ms"])
        total.append(answer["total_ms"])
        print(f"  {name}: {i + 1}/{requests}", end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {
        "requests": requests,
        "ttft_p50_ms": statistics.median(ttft),
        "ttft_p99_ms": percentile(sorted(ttft), 99),
        "total_p50_ms": statistics.median(total),
    }


def host_loss(mesh: Mesh, clients: int, answer: int) -> dict:
    prompts = [
        f"Tell story number {i} of a lighthouse keeper and her ships. " * 3 for i in range(clients)
    ]
    print("  references on the calm mesh", file=sys.stderr)
    references = [stream(mesh, prompt, answer)["text"] for prompt in prompts]
    logs: list[list[float]] = [[] for _ in prompts]
    results: list[dict | BaseException] = [RuntimeError("never finished")] * clients

    def client(i: int) -> None:
        try:
            results[i] = stream(mesh, prompts[i], answer, logs[i])
        except Exception as err:  # noqa: BLE001 (counted as lost)
            results[i] = err

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while min(len(log) for log in logs) < 40 and time.monotonic() < deadline:
        time.sleep(0.01)
    health = mesh.health()
    on_cut = mesh.get(f"{health[CUT_WORKER]['address']}/health")["load"]["inflight"]
    print(f"  cutting host {CUT_HOST} ({CUT_WORKER} holds {on_cut})", file=sys.stderr)
    mesh.hosts.cut(CUT_HOST)
    try:
        for thread in threads:
            thread.join(timeout=300)
    finally:
        mesh.hosts.heal(CUT_HOST)
    healed_at = time.perf_counter()
    mesh.ready(CUT_WORKER, timeout_s=120)
    rejoin_s = time.perf_counter() - healed_at
    # Whether the router's own NATS node was on the cut host (then it moves to another
    # node first: recovery takes KVMESH_NATS_LOST_AFTER_S more).
    router_log = mesh.procs["router-0"].log_path.read_text()
    router_lost_nats = "disconnected from NATS" in router_log

    moved = [
        i
        for i, r in enumerate(results)
        if isinstance(r, dict) and {"decode-0", "decode-1"} <= set(r["workers"])
    ]
    lost = [
        i for i, r in enumerate(results) if not isinstance(r, dict) or r["text"] != references[i]
    ]
    stalls = [max(b - a for a, b in zip(logs[i], logs[i][1:], strict=False)) for i in moved]
    return {
        "in_flight": clients,
        "on_cut_worker": on_cut,
        "moved": len(moved),
        "lost": len(lost),
        "errors": sum(not isinstance(r, dict) for r in results),
        "recovery_s": max(stalls, default=0.0),
        "router_lost_its_nats_node": router_lost_nats,
        "rejoin_s": rejoin_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--answer", type=int, default=400, help="tokens per fault-run answer")
    parser.add_argument("--dir", type=Path, help="keep the meshes' logs and state here")
    args = parser.parse_args()
    settings = {"KVMESH_ROUTER_TOKEN_TIMEOUT_S": TOKEN_TIMEOUT_S}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.dir or scratch
        print("one host: starting the mesh", file=sys.stderr)
        with (
            Hosts(1) as hosts,
            mesh_on(
                hosts, Path(tmp) / "one", dict.fromkeys(SPREAD, 0), (0, 0, 0), **settings
            ) as mesh,
        ):
            one = latencies(mesh, "one", args.requests)
        print("four hosts: starting the mesh", file=sys.stderr)
        with (
            Hosts(4) as hosts,
            mesh_on(hosts, Path(tmp) / "four", SPREAD, NATS_HOSTS, **settings) as mesh,
        ):
            four = latencies(mesh, "four", args.requests)
            fault = host_loss(mesh, args.clients, args.answer)

    print(f"\n{'':<26}{'one host':>12}{'four hosts':>12}")
    for key, label in (
        ("requests", "requests"),
        ("ttft_p50_ms", "TTFT p50 (ms)"),
        ("ttft_p99_ms", "TTFT p99 (ms)"),
        ("total_p50_ms", "answer p50 (ms, 8 tok)"),
    ):
        print(f"{label:<26}{one[key]:>12.1f}{four[key]:>12.1f}")
    print(f"\nhost {CUT_HOST} cut mid-stream (a NATS node and {CUT_WORKER}):")
    for key, value in fault.items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value).lower()
        print(f"  {key:<28}{shown:>8}")
    print(
        json.dumps(
            {
                "requests": one["requests"] + four["requests"],
                "errors": fault["errors"],
                "ttft_p50_ms_one_host": round(one["ttft_p50_ms"], 1),
                "ttft_p50_ms_across_hosts": round(four["ttft_p50_ms"], 1),
                "veth_cost_ms": round(four["ttft_p50_ms"] - one["ttft_p50_ms"], 1),
                "host_loss": {
                    k: round(v, 2) if isinstance(v, float) else v for k, v in fault.items()
                },
            }
        )
    )


if __name__ == "__main__":
    main()

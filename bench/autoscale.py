"""`kvmesh up --autoscale` under a load that rises and stops: a timeline of the load, the
pools, TTFT and errors.

A local stack (tiny model, no encoder) with ``--autoscale 1:MAX --autoscale-every 1``, the
router's plan over the last WINDOW seconds with a TTFT p50 target of TARGET_MS. Load: one
client for the first phase, CLIENTS clients for the second, none for the third; each client
sends prompts of ~300 new tokens (all prefilled by a prefill worker), one after another. Every
5 s a row: clients, prefill and decode workers ready (the router's /health), the plan's
recommendation (/v1/plan), requests answered and their TTFT p50, errors.

Prints the timeline; the last line is one JSON object: requests, errors, most prefill workers,
seconds from the load rising to the second worker serving, from the load stopping to the pool
back at one.

    .venv/bin/python bench/autoscale.py [--clients 4] [--max 3] [--phase 40]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parent.parent
sys.path[0] = str(REPO)

from bench.harness import Up, emit  # noqa: E402
from tests.procs import get_json  # noqa: E402

WINDOW_S = 12
TARGET_MS = 20
PROMPT = " ".join(f"berth{i}" for i in range(150))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max", type=int, default=3, help="the most workers of a pool")
    parser.add_argument("--phase", type=float, default=40.0, help="seconds a load phase lasts")
    args = parser.parse_args()
    env = dict(
        KVMESH_PREFILL_MODEL="tiny",
        KVMESH_DECODE_MODEL="tiny",
        KVMESH_PREFILL_THREADS="1",
        KVMESH_DECODE_THREADS="1",
        KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS="0",
        KVMESH_ROUTER_PLAN_WINDOW_S=str(WINDOW_S),
        KVMESH_ROUTER_PLAN_TTFT_P50_S=str(TARGET_MS / 1e3),
        KVMESH_ROUTER_PLAN_TTFT_P99_S=str(5 * TARGET_MS / 1e3),
        KVMESH_ROUTER_PLAN_TPOT_MEAN_S="1",
        KVMESH_LOG_LEVEL="info",  # (its "kvmesh is up" line, and its scaling)
    )
    up = Up(["--encoder", "0", "--autoscale", f"1:{args.max}", "--autoscale-every", "1"], env)
    state = up.dir
    url = up.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
    clients = [0]  # how many run now
    done: list[tuple[float, float, list[str]]] = []  # (time, ttft s, workers)
    errors: list[str] = []
    stop = threading.Event()

    def load(k: int) -> None:
        i = 0
        while not stop.is_set():
            if k >= clients[0]:
                time.sleep(0.05)
                continue
            i += 1
            started = time.perf_counter()
            try:
                chunks = client.completions.create(
                    model="tiny",
                    prompt=f"{k}-{i} {PROMPT}",
                    max_tokens=4,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                first, workers = 0.0, []
                for chunk in chunks:
                    if chunk.choices and chunk.choices[0].text and not first:
                        first = time.perf_counter() - started
                    if chunk.usage:
                        workers = chunk.model_extra["kvmesh"]["workers"]
                done.append((time.monotonic(), first, workers))
            except Exception as err:  # noqa: BLE001 (counted)
                errors.append(str(err))

    try:
        deadline = time.monotonic() + 120
        while "kvmesh is up" not in (state / "up.log").read_text(errors="replace"):
            if time.monotonic() > deadline or up.proc.poll() is not None:
                sys.exit(f"kvmesh up did not start: see {state / 'up.log'}")
            time.sleep(0.5)
        threads = [threading.Thread(target=load, args=(k,)) for k in range(args.clients)]
        for t in threads:
            t.start()
        phases = [(1, args.phase), (args.clients, args.phase), (0, args.phase + WINDOW_S + 15)]
        start = time.monotonic()
        rows, rose_at, stopped_at, second_serving, back_to_one = [], None, None, None, None
        print(
            f"{'t (s)':>6}{'clients':>9}{'prefill':>9}{'decode':>8}{'plan':>10}"
            f"{'answered':>10}{'TTFT p50':>10}{'errors':>8}"
        )
        for n, length in phases:
            clients[0] = n
            if n == args.clients:
                rose_at = time.monotonic()
            if n == 0:
                stopped_at = time.monotonic()
            phase_end = time.monotonic() + length
            while time.monotonic() < phase_end:
                time.sleep(5)
                now = time.monotonic()
                roles = get_json(f"{url}/health")[1]["roles"]
                ready = {r: sum(w["status"] == "ready" for w in roles[r]) for r in roles}
                plan = get_json(f"{url}/v1/plan")[1]["recommended"]
                recent = [ttft for t, ttft, _ in done if now - 5 <= t <= now]
                p50 = statistics.median(recent) * 1e3 if recent else 0.0
                if second_serving is None and any("prefill-1" in w for _, _, w in done):
                    second_serving = now
                if stopped_at and back_to_one is None and ready["prefill"] == 1:
                    back_to_one = now
                row = {
                    "t_s": round(now - start),
                    "clients": n,
                    "prefill": ready["prefill"],
                    "decode": ready["decode"],
                    "plan": f"{plan['prefill']}+{plan['decode']}",
                    "answered": len(recent),
                    "ttft_p50_ms": round(p50, 1),
                    "errors": len(errors),
                }
                rows.append(row)
                print(
                    f"{row['t_s']:>6}{n:>9}{row['prefill']:>9}{row['decode']:>8}"
                    f"{row['plan']:>10}{row['answered']:>10}{p50:>9.1f}ms{len(errors):>8}",
                    flush=True,
                )
        stop.set()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        up.stop(60)
    emit(
        {
            "requests": len(done),
            "errors": len(errors),
            "most_prefill_workers": max(r["prefill"] for r in rows),
            "scale_up_s": round(second_serving - rose_at, 1) if second_serving else None,
            "scale_down_s": round(back_to_one - stopped_at, 1) if back_to_one else None,
            "log": str(state / "up.log"),
        }
    )


if __name__ == "__main__":
    main()

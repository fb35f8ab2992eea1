"""Faults inside a live mesh, each made real, and what a client saw: a tiny stack on 127.0.0.1
(router, cachemeta, two prefill and two decode workers with fault hooks on), greedy answers
compared with the calm mesh's.

  decode killed     kill -9 the decode worker streaming an answer
  decode raises     its engine's steps raise (engine_step hook) mid-answer
  prefill raises    the prefill worker holding a prompt's prefix raises (engine_prefill)
  storage full      a prefill worker on a 16 KiB tmpfs storage tier (root only)

Per fault: the answer complete and identical to the calm one; the longest wait between two
streamed tokens (stall_ms) or the answer's time to first token against the calm one
(ttft_ms); how long until the router no longer lists the worker (dropped_ms) or shows the
state (shown_ms). Prints a table; the last line is one JSON object with those per fault.

    .venv/bin/python bench/faults.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import emit, say  # noqa: E402
from tests.mounts import small_tmpfs  # noqa: E402
from tests.procs import get_json, wait_until  # noqa: E402
from tests.stack import Stack, start_stack  # noqa: E402

IDS = ("router-0", "cachemeta-0", "prefill-0", "prefill-1", "decode-0", "decode-1")
HOOKS = {"KVMESH_FAULT_HOOKS": "true", "KVMESH_ROUTER_LOCAL_PREFILL_MAX_TOKENS": "0"}
ANSWER = dict(model="tiny", prompt="Tell me everything about tides.", max_tokens=300)


def stream(stack: Stack, on_first=None, **body: object) -> tuple[str, float, float]:  # noqa: ANN001
    """A greedy streamed answer: its text, its time to first token and its longest gap
    between two chunks (ms). ``on_first`` runs once the first chunk came."""
    started = time.perf_counter()
    chunks = stack.client().completions.create(stream=True, temperature=0, **{**ANSWER, **body})
    text, last, first, gap = "", None, 0.0, 0.0
    for chunk in chunks:
        now = time.perf_counter()
        if last is None:
            first = now - started
            if on_first is not None:
                on_first()
        else:
            gap = max(gap, now - last)
        last = now
        if chunk.choices:
            text += chunk.choices[0].text
    return text, first * 1e3, gap * 1e3


def holder(stack: Stack, role: str) -> str:
    """The worker of ``role`` holding a request now."""
    for sid in (f"{role}-0", f"{role}-1"):
        if get_json(f"{stack.advertised(sid)}/health")[1]["load"]["inflight"]:
            return sid
    raise AssertionError(f"no {role} worker holds the request")


def put_fault(stack: Stack, sid: str, name: str) -> None:
    request = urllib.request.Request(f"{stack.advertised(sid)}/faults/{name}", method="PUT")
    urllib.request.urlopen(request, timeout=5)


def listed(stack: Stack, sid: str) -> bool:
    return sid in stack.health()


def decode_killed(stack: Stack, calm: str) -> dict:
    killed: dict[str, object] = {}

    def watch(sid: str, at: float) -> None:  # beside the stream, which goes on meanwhile
        wait_until(lambda: not listed(stack, sid), 30, 0.002, what=f"{sid} dropped")
        killed["dropped_ms"] = (time.perf_counter() - at) * 1e3

    def kill() -> None:
        sid = holder(stack, "decode")
        at = time.perf_counter()
        os.kill(stack.procs[sid].popen.pid, signal.SIGKILL)
        killed["sid"] = sid
        killed["watch"] = threading.Thread(target=watch, args=(sid, at))
        killed["watch"].start()  # type: ignore[attr-defined]

    text, _, gap = stream(stack, kill)
    killed["watch"].join()  # type: ignore[attr-defined]
    sid = str(killed["sid"])
    stack.start(sid)
    stack.wait_ready([sid])
    return {"same": text == calm, "stall_ms": gap, "dropped_ms": killed["dropped_ms"]}


def decode_raises(stack: Stack, calm: str) -> dict:
    broken: list[str] = []

    def fault() -> None:
        broken.append(holder(stack, "decode"))
        put_fault(stack, broken[0], "engine_step")

    text, _, gap = stream(stack, fault)
    sid = broken[0]
    stack.restart(sid, **HOOKS)
    stack.wait_ready([sid])
    return {"same": text == calm, "stall_ms": gap}


def prefill_raises(stack: Stack, n: int) -> dict:
    """A prompt answered on the calm mesh, then again while the prefill worker holding it
    in its memory tier (the router's first pick) raises: the same answer, from the other."""
    prompt = f"Harbour log {n}: ships in, ships out, tide noted. " * 20
    calm, calm_ttft, _ = stream(stack, prompt=prompt, max_tokens=8)
    owner = _owner(stack)
    put_fault(stack, owner, "engine_prefill")
    text, ttft, _ = stream(stack, prompt=prompt, max_tokens=8)
    stack.restart(owner, **HOOKS)
    stack.wait_ready([owner])
    return {"same": text == calm, "ttft_ms": ttft, "calm_ttft_ms": calm_ttft}


def _owner(stack: Stack) -> str:
    used = {
        sid: get_json(f"{stack.advertised(sid)}/health")[1]["load"]["memory_tier_bytes"]
        for sid in ("prefill-0", "prefill-1")
    }
    return max(used, key=used.get)


def storage_full(stack: Stack, tmp: Path) -> dict:
    with small_tmpfs(tmp / "tier", 16) as tier:
        stack.restart("prefill-0", KVMESH_KV_STORE_DIR=str(tier), **HOOKS)
        stack.procs["prefill-1"].stop()
        try:
            stack.wait_ready(["prefill-0"])
            started = time.perf_counter()
            answered = 0
            for i in range(3):
                prompt = f"Berth {i}: " + "ships in, ships out, tide noted. " * 40
                text, _, _ = stream(stack, prompt=prompt, max_tokens=4)
                answered += bool(text)
            wait_until(
                lambda: get_json(f"{stack.url}/health")[1]["storage_unwritten"],
                30,
                0.01,
                what="the full tier shown",
            )
            shown = (time.perf_counter() - started) * 1e3
        finally:
            stack.restart("prefill-0", **HOOKS)
            stack.start("prefill-1", **HOOKS)
            stack.wait_ready(["prefill-0", "prefill-1"])
    return {"same": answered == 3, "shown_ms": shown}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-faults-") as tmp:
        say("starting a tiny stack (two prefill, two decode workers)")
        stack = start_stack("faults", Path(tmp) / "stack", IDS, **HOOKS)
        try:
            calm, _, _ = stream(stack)
            for r in range(args.repeats):
                say(f"round {r + 1} of {args.repeats}")
                for name, run in (
                    ("decode killed", lambda: decode_killed(stack, calm)),
                    ("decode raises", lambda: decode_raises(stack, calm)),
                    ("prefill raises", lambda r=r: prefill_raises(stack, r)),
                ):
                    results.setdefault(name, []).append(run())
                    say(f"  {name}: {results[name][-1]}")
            if os.geteuid() == 0:
                results["storage full"] = [storage_full(stack, Path(tmp))]
                say(f"  storage full: {results['storage full'][-1]}")
        finally:
            stack.stop()
    summary = {}
    print(f"{'fault':16} {'runs':>4} {'same':>5}  figures (median, max)")
    for name, runs in results.items():
        figures = {
            k: (round(statistics.median(r[k] for r in runs), 1), round(max(r[k] for r in runs), 1))
            for k in runs[0]
            if k != "same"
        }
        same = sum(r["same"] for r in runs)
        text = ", ".join(f"{k} {m} / {x}" for k, (m, x) in figures.items())
        print(f"{name:16} {len(runs):>4} {same:>5}  {text}")
        summary[name.replace(" ", "_")] = {"runs": len(runs), "same": same, **figures}
    emit(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The router process's footprint: import time, start time, resident memory, torch or not.

For each run: a fresh router process (``python -m services.router``) on a real nats-server;
the time from spawning it to its first HTTP answer, its resident memory then; then cachemeta
and one prefill and one decode worker (tiny model) join, a few chat requests go through the
router, and its resident memory is read again (the tokenizer, chat template and token cache
are loaded by then). Whether torch is in the process is read from ``/proc/<pid>/maps``
(libtorch mapped or not), which works from outside whatever the code imports. The import time
of the router's service module is measured in a separate interpreter.

    .venv/bin/python bench/router_footprint.py [--runs 3]

Prints a table, then as its last line one JSON object: router_import_s, router_ready_s,
router_rss_ready_mb, router_rss_serving_mb (medians over the runs), torch_mapped (any run).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import emit, free_port, say  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def torch_mapped(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def http_status(url: str) -> int | None:
    """The status of GET url, or None when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as err:
        return err.code
    except OSError:
        return None


def workers_ready(url: str) -> bool:
    """A prefill and a decode worker are ready (images need no encoder here)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as err:
        body = json.loads(err.read())
    except OSError:
        return False
    roles = body["roles"]
    return all(any(w["status"] == "ready" for w in roles[r]) for r in ("prefill", "decode"))


def wait_for(check, timeout_s: float, what: str, interval_s: float = 0.005):  # noqa: ANN001, ANN201
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := check():
            return value
        time.sleep(interval_s)
    raise SystemExit(f"router_footprint: timed out waiting for {what}")


def chat(url: str, text: str) -> None:
    body = json.dumps(
        {
            "model": "tiny",
            "max_tokens": 4,
            "temperature": 0,
            "messages": [{"role": "user", "content": text}],
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/chat/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200


def import_seconds() -> float:
    code = (
        "import time; t = time.perf_counter(); import services.router.service; "
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"router_footprint: import failed:\n{out.stderr}")
    return float(out.stdout.strip())


def spawn(role: str, env: dict[str, str], logs: Path) -> subprocess.Popen:
    log = open(logs / f"{role}.log", "ab")  # noqa: SIM115
    return subprocess.Popen(
        [sys.executable, "-m", f"services.{role}"],
        env={**env, "KVMESH_SERVICE_ID": f"{role}-0"},
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def one_run(env: dict[str, str], url: str, logs: Path) -> dict:
    started = time.monotonic()
    router = spawn("router", env, logs)
    procs = [router]
    try:
        wait_for(lambda: http_status(f"{url}/health"), 60, "the router's first answer")
        ready_s = time.monotonic() - started
        row = {"ready_s": ready_s, "rss_ready_mb": rss_mb(router.pid)}
        row["torch_ready"] = torch_mapped(router.pid)
        procs += [spawn(role, env, logs) for role in ("cachemeta", "prefill", "decode")]
        wait_for(lambda: workers_ready(url), 120, "the workers", 0.1)
        for i in range(4):
            chat(url, f"Request {i}: name three colours of the sea at dawn.")
        row["rss_serving_mb"] = rss_mb(router.pid)
        row["torch_serving"] = torch_mapped(router.pid)
        return row
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvmesh-footprint-"))
    nats_port, http_port = free_port(), free_port()
    nats_bin = Path(sys.executable).parent / "nats-server"
    nats = subprocess.Popen(
        [str(nats_bin), "-a", "127.0.0.1", "-p", str(nats_port), "-js", "-sd", str(work / "js")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(
        KVMESH_NATS_URL=f"nats://127.0.0.1:{nats_port}",
        KVMESH_STATE_DIR=str(work / "state"),
        KVMESH_ROUTER_HTTP_PORT=str(http_port),
        KVMESH_ROUTER_GRPC_PORT="0",
        KVMESH_PREFILL_MODEL="tiny",
        KVMESH_DECODE_MODEL="tiny",
        KVMESH_PREFILL_THREADS="1",
        KVMESH_DECODE_THREADS="1",
        KVMESH_PREFILL_KV_CACHE_TOKENS="4096",
        KVMESH_DECODE_KV_CACHE_TOKENS="4096",
        KVMESH_TRACE_EXPORTER="none",
        KVMESH_LOG_LEVEL="warning",
    )
    url = f"http://127.0.0.1:{http_port}"
    rows = []
    try:
        imports = []
        for run in range(args.runs):
            say(f"run {run + 1}/{args.runs}: import, start, serve")
            imports.append(import_seconds())
            rows.append(one_run(env, url, work))
    finally:
        nats.terminate()
        nats.wait()
    head = ("run", "import s", "ready s", "RSS ready MB", "RSS serving MB")
    print(f"{head[0]:>4} {head[1]:>9} {head[2]:>8} {head[3]:>13} {head[4]:>15} torch")
    for i, (imp, row) in enumerate(zip(imports, rows, strict=True)):
        torch = "yes" if row["torch_ready"] or row["torch_serving"] else "no"
        print(
            f"{i + 1:>4} {imp:>9.3f} {row['ready_s']:>8.3f} {row['rss_ready_mb']:>13.1f} "
            f"{row['rss_serving_mb']:>15.1f} {torch}"
        )
    figures = {
        "router_import_s": round(statistics.median(imports), 3),
        "router_ready_s": round(statistics.median(r["ready_s"] for r in rows), 3),
        "router_rss_ready_mb": round(statistics.median(r["rss_ready_mb"] for r in rows), 1),
        "router_rss_serving_mb": round(statistics.median(r["rss_serving_mb"] for r in rows), 1),
        "torch_mapped": any(r["torch_ready"] or r["torch_serving"] for r in rows),
    }
    shutil.rmtree(work, ignore_errors=True)
    emit(figures)


if __name__ == "__main__":
    main()

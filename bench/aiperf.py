"""NVIDIA's AIPerf (the load harness Dynamo uses) against kvmesh, beside kvmesh's own figures for
the same requests.

AIPerf runs from a venv of this bench's own (``--venv``, made from the package registry when
missing; never the project's) against `kvmesh up` on the real model, two ways:

1. ``chat``: synthetic streaming chat (``--requests`` requests, ``--concurrency`` at a time,
   ``--isl`` prompt tokens and ``--osl`` answer tokens on average);
2. ``trace``: a replay in Mooncake's trace format: the first ``--trace-requests`` rows of
   ``--trace`` (Mooncake's JSONL: timestamp, input_length, output_length, hash_ids), their
   lengths and blocks scaled down by ``--scale`` to fit the small model on a CPU, replayed on
   their timestamps (``--speedup`` times faster); rows sharing hash ids share prompt blocks.

AIPerf counts tokens with kvmesh's own export of the model (``kvmesh model export``), laid out
as the Hugging Face Hub's cache holds a downloaded repo (``kvmesh/smollm2-135m-instruct`` at
revision ``main``), with HF_HUB_OFFLINE set: nothing reaches the Hub. A plain directory path
does not work for a trace replay: AIPerf 0.13's trace loader sets HF_HUB_OFFLINE in its worker
processes, and offline its ``Tokenizer.from_pretrained`` resolves every name through the Hub's
cache (``snapshot_download(local_files_only=True)``), so a path is refused as a repo id
(``HFValidationError``). (The fix upstream: in ``_load_from_hub``, load a name that is an
existing directory directly, before the offline branch.)

Each run's requests carry a tenant of their own (``x-kvmesh-tenant``), so kvmesh's figures for
exactly those requests come from its /v1/stats (TTFT percentiles, from 30%-wide buckets, and
cache hits) and /metrics (TTFT and TPOT means).

    .venv/bin/python bench/aiperf.py [--requests 48] [--concurrency 4] [--trace-requests 130]

Prints a table (AIPerf's TTFT, ITL and throughput beside kvmesh's), then as its last line one
JSON object: per run, AIPerf's and kvmesh's figures and the requests AIPerf counted as errors.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import Up, emit, own_venv, say  # noqa: E402

MODEL = "smollm2-135m-instruct"
REPO_ID = f"kvmesh/{MODEL}"  # the tokenizer's name in the Hub cache made for AIPerf
AIPERF = "aiperf==0.13.0"
TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
MOONCAKE_BLOCK = 512  # tokens a hash id stands for in Mooncake's traces


def scaled_trace(source: Path, rows: int, scale: int, speedup: float, out: Path) -> int:
    """The first ``rows`` of a Mooncake trace with lengths ÷ ``scale`` (answers at most 32
    tokens) and timestamps ÷ ``speedup``, written to ``out``; the block size it implies."""
    block = MOONCAKE_BLOCK // scale
    lines = []
    with source.open() as f:
        for line, _ in zip(f, range(rows), strict=False):
            row = json.loads(line)
            n = len(row["hash_ids"])  # (its last block partly filled: in ((n-1)·block, n·block])
            length = min(n * block, max((n - 1) * block + 1, row["input_length"] // scale))
            lines.append(
                {
                    "timestamp": int(row["timestamp"] / speedup),
                    "input_length": length,
                    "output_length": max(1, min(32, row["output_length"])),
                    "hash_ids": row["hash_ids"],
                }
            )
    out.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return block


def hub_cache(export: Path, cache: Path, repo: str) -> None:
    """kvmesh's export of the model as the Hugging Face Hub's cache holds a downloaded repo
    (``models--OWNER--NAME/snapshots/REV/`` and ``refs/main`` naming REV), so that AIPerf,
    offline, finds ``repo`` there (see the module's docstring)."""
    files = sorted(f for f in export.iterdir() if f.suffix == ".json")
    digest = hashlib.sha1(b"".join(f.read_bytes() for f in files)).hexdigest()
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / digest
    snapshot.mkdir(parents=True, exist_ok=True)
    for f in files:
        shutil.copyfile(f, snapshot / f.name)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(digest)


def aiperf(bin: Path, url: str, cache: Path, tenant: str, out: Path, extra: list[str]) -> dict:
    """One `aiperf profile` run; its summary (the JSON export), the run's log on failure."""
    argv = [str(bin / "aiperf"), "profile", "--model", MODEL, "--url", url]
    argv += ["--endpoint-type", "chat", "--streaming", "--tokenizer", REPO_ID]
    argv += ["--header", f"x-kvmesh-tenant:{tenant}", "--random-seed", "0"]
    argv += ["--output-artifact-dir", str(out), "--ui-type", "none", *extra]
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    env["TRANSFORMERS_OFFLINE"] = "1"
    say(f"aiperf ({tenant}): {' '.join(argv[2:])}")
    done = subprocess.run(argv, env=env, cwd=out.parent, capture_output=True, text=True)
    (out.parent / f"{tenant}.log").write_text(done.stdout + done.stderr)
    found = sorted(out.rglob("*aiperf*.json"))
    if done.returncode != 0 or not found:
        tail = (done.stdout + done.stderr)[-3000:]
        raise SystemExit(f"aiperf ({tenant}) failed with {done.returncode}:\n{tail}")
    return json.loads(found[-1].read_text())


def metric(summary: dict, name: str, stat: str) -> float | None:
    """A figure of AIPerf's export (its records by metric tag, each with avg/p50/p99...)."""
    records = summary.get("records", summary)
    entry = records.get(name)
    if isinstance(entry, dict):
        return entry.get(stat)
    return None


def scrape(url: str) -> dict[str, float]:
    """kvmesh's /metrics samples of interest: TTFT and TPOT sums and counts."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("kvmesh_ttft_seconds_", "kvmesh_tpot_seconds_")) and "{" not in name:
            out[name] = float(value)
    return out


def kvmesh_figures(url: str, tenant: str, before: dict, after: dict) -> dict:
    """What kvmesh measured of the run: its tenant's TTFT percentiles and cache hits, and the
    TTFT and TPOT means over the run (every request in it was the tenant's)."""
    stats = json.loads(urllib.request.urlopen(f"{url}/v1/stats", timeout=10).read())
    mine = stats["by_tenant"].get(tenant, {})

    def mean(kind: str) -> float | None:
        n = after.get(f"kvmesh_{kind}_seconds_count", 0) - before.get(
            f"kvmesh_{kind}_seconds_count", 0
        )
        s = after.get(f"kvmesh_{kind}_seconds_sum", 0) - before.get(f"kvmesh_{kind}_seconds_sum", 0)
        return round(s / n * 1e3, 2) if n else None

    return {
        "requests": mine.get("requests"),
        "ttft_p50_ms": mine.get("ttft_p50_ms"),
        "ttft_p99_ms": mine.get("ttft_p99_ms"),
        "ttft_mean_ms": mean("ttft"),
        "tpot_mean_ms": mean("tpot"),
        "input_cache_hit_ratio": mine.get("input_cache_hit_ratio"),
    }


def aiperf_figures(summary: dict) -> dict:
    def r(x: float | None, n: int = 2) -> float | None:
        return round(x, n) if x is not None else None

    return {
        "requests": metric(summary, "request_count", "avg"),
        "errors": metric(summary, "error_request_count", "avg") or 0,
        "ttft_p50_ms": r(metric(summary, "time_to_first_token", "p50")),
        "ttft_p99_ms": r(metric(summary, "time_to_first_token", "p99")),
        "ttft_mean_ms": r(metric(summary, "time_to_first_token", "avg")),
        "itl_mean_ms": r(metric(summary, "inter_token_latency", "avg")),
        "itl_p99_ms": r(metric(summary, "inter_token_latency", "p99")),
        "output_tok_s": r(metric(summary, "output_token_throughput", "avg"), 1),
        "requests_s": r(metric(summary, "request_throughput", "avg"), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--isl", type=int, default=256, help="prompt tokens, on average (chat)")
    ap.add_argument("--osl", type=int, default=32, help="answer tokens, on average (chat)")
    ap.add_argument("--trace", type=Path, default=TRACE, help="a Mooncake trace (JSONL)")
    ap.add_argument("--trace-requests", type=int, default=130, help="(rows from 50 share)")
    ap.add_argument("--scale", type=int, default=64, help="the trace's lengths ÷ this")
    ap.add_argument("--speedup", type=float, default=2.0, help="the trace's clock × this")
    ap.add_argument("--venv", type=Path, default=REPO / ".bench" / "aiperf", help="its venv")
    ap.add_argument("--skip-trace", action="store_true")
    args = ap.parse_args()

    bin = own_venv(args.venv, [AIPERF], ["aiperf"])
    runs: dict[str, dict] = {}
    with Up() as up:
        say("kvmesh up (the real model): starting")
        up.wait_ready(300)
        export, cache = up.dir / "export", up.dir / "hub"
        subprocess.run(
            [sys.executable, "-m", "kvmesh", "model", "export", MODEL, "--to", str(export)],
            env={**os.environ, "KVMESH_STATE_DIR": str(up.dir)},
            cwd=REPO,
            check=True,
            capture_output=True,
        )
        hub_cache(export, cache, REPO_ID)
        work = up.dir / "aiperf"
        work.mkdir()
        plans = {
            "chat": [
                "--concurrency", str(args.concurrency),
                "--request-count", str(args.requests),
                "--prompt-input-tokens-mean", str(args.isl),
                "--prompt-output-tokens-mean", str(args.osl),
            ],
        }  # fmt: skip
        if not args.skip_trace:
            trace = work / "trace.jsonl"
            block = scaled_trace(args.trace, args.trace_requests, args.scale, args.speedup, trace)
            plans["trace"] = [
                "--input-file", str(trace),
                "--custom-dataset-type", "mooncake_trace",
                "--fixed-schedule",
                "--prompt-input-tokens-block-size", str(block),
            ]  # fmt: skip
        for name, extra in plans.items():
            tenant = f"aiperf-{name}"
            before = scrape(up.url)
            summary = aiperf(bin, up.url, cache, tenant, work / name, extra)
            after = scrape(up.url)
            runs[name] = {
                "aiperf": aiperf_figures(summary),
                "kvmesh": kvmesh_figures(up.url, tenant, before, after),
            }
            say(f"  {name}: {runs[name]}")

    print(
        f"{'run':<7}{'by':<8}{'requests':>9}{'TTFT p50':>10}{'p99':>9}{'mean':>9}{'ITL/TPOT':>10}"
    )
    for name, run in runs.items():
        for by in ("aiperf", "kvmesh"):
            f = run[by]
            itl = f.get("itl_mean_ms", f.get("tpot_mean_ms"))
            print(
                f"{name:<7}{by:<8}{f['requests'] or 0:>9.0f}{f['ttft_p50_ms'] or 0:>10.1f}"
                f"{f['ttft_p99_ms'] or 0:>9.1f}{f['ttft_mean_ms'] or 0:>9.1f}{itl or 0:>10.2f}"
            )
    emit({"aiperf": AIPERF, "model": MODEL, "runs": runs})


if __name__ == "__main__":
    main()

"""The prefix-cache timing attack, measured ("Leaking Secrets from Prefix Caches", arXiv
2411.18191; vLLM CVE-2025-46570).

A victim tenant sends 100 prompts. An attacker then times, with the real model, 100 requests
that begin with a victim prompt's first block (64 tokens) and 100 that share nothing, each
followed by its own 64 tokens, in random order: time to first token, streamed. The ROC AUC of
TTFT as a classifier of "the victim sent this block" is measured twice on a fresh stack with
API keys on: the attacker with a key of its own tenant (salts differ: the probe should learn
nothing, AUC near 0.5), and with a key of the victim's tenant (one salt: the probe itself
works, AUC near 1).

Prints a table; the last line is one JSON object: probe_auc_salted, probe_auc_shared (and each
run's median TTFT of both kinds).

    .venv/bin/python bench/probe.py [--probes 100] [--model smollm2-135m-instruct]
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import REPO, Stack, emit, say  # noqa: E402

BLOCK = 64  # tokens per KV block


def add_key(keys_file: Path, tenant: str) -> str:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh",
            "keys",
            "--file",
            str(keys_file),
            "add",
            "--tenant",
            tenant,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return run.stdout.strip()


def ttft_s(host: str, key: str, model: str, prompt: list[int]) -> float:
    """Request sent → first streamed token."""
    body = json.dumps(
        {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True}
    )
    conn = http.client.HTTPConnection(host, timeout=120)
    try:
        started = time.perf_counter()
        conn.request(
            "POST",
            "/v1/completions",
            body,
            {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        if resp.status != 200:
            raise SystemExit(f"HTTP {resp.status}: {resp.read()[:300]!r}")
        while True:
            line = resp.readline()
            if not line or line.startswith(b"data: "):
                break
        took = time.perf_counter() - started
        resp.read()
        return took
    finally:
        conn.close()


def auc(positives: list[float], negatives: list[float]) -> float:
    """P(a miss is slower than a hit): the ROC AUC of TTFT as the classifier (ties half)."""
    wins = sum((n > p) + 0.5 * (n == p) for p in positives for n in negatives)
    return wins / (len(positives) * len(negatives))


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def run(model: str, shared: bool, probes: int, threads: int, seed: int) -> dict:
    rng = random.Random(seed)
    keys_file = Path(tempfile.mkdtemp(prefix="kvmesh-probe-")) / "keys.json"
    victim = add_key(keys_file, "victim")
    attacker = add_key(keys_file, "victim" if shared else "attacker")
    say(f"{'shared salt' if shared else 'salted'}: starting the stack ({model})")
    stack = Stack(model, threads, {"KVMESH_ROUTER_KEYS_FILE": str(keys_file)})
    try:
        stack.wait_ready(300, key=victim)
        host = stack.url.removeprefix("http://")
        secrets = [tokens(rng, BLOCK) for _ in range(probes)]
        for i, block in enumerate(secrets):  # the victim's prompts
            ttft_s(host, victim, model, block + tokens(rng, BLOCK))
            if (i + 1) % 25 == 0:
                say(f"  victim sent {i + 1}/{probes}")
        time.sleep(2)  # their blocks indexed
        kinds = [("hit", s) for s in secrets] + [("miss", tokens(rng, BLOCK)) for _ in secrets]
        rng.shuffle(kinds)
        times: dict[str, list[float]] = {"hit": [], "miss": []}
        for i, (kind, block) in enumerate(kinds):
            times[kind].append(ttft_s(host, attacker, model, block + tokens(rng, BLOCK)))
            if (i + 1) % 50 == 0:
                say(f"  probes {i + 1}/{len(kinds)}")
        return {
            "auc": auc(times["hit"], times["miss"]),
            "hit_ms": statistics.median(times["hit"]) * 1e3,
            "miss_ms": statistics.median(times["miss"]) * 1e3,
        }
    finally:
        stack.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--probes", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1, help="per worker")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    salted = run(args.model, False, args.probes, args.threads, args.seed)
    shared = run(args.model, True, args.probes, args.threads, args.seed + 1)
    print(f"{'attacker':<26}{'AUC':>7}{'hit TTFT p50':>15}{'miss TTFT p50':>15}")
    for name, r in (("own tenant (salted)", salted), ("victim's tenant (shared)", shared)):
        print(f"{name:<26}{r['auc']:>7.3f}{r['hit_ms']:>13.1f}ms{r['miss_ms']:>13.1f}ms")
    out = {
        "probe_auc_salted": round(salted["auc"], 3),
        "probe_auc_shared": round(shared["auc"], 3),
        "salted_hit_ms": round(salted["hit_ms"], 2),
        "salted_miss_ms": round(salted["miss_ms"], 2),
        "shared_hit_ms": round(shared["hit_ms"], 2),
        "shared_miss_ms": round(shared["miss_ms"], 2),
    }
    emit(out)


if __name__ == "__main__":
    main()

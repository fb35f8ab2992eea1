"""The fuzzers at a larger budget than the suite's (tests/test_fuzz.py runs the same ones
small): against a live tiny stack on 127.0.0.1 (router with API keys, cachemeta, prefill,
decode, encoder),

  - Schemathesis's command line on every operation of /openapi.json, every check it has
    (``positive_data_acceptance`` replaced by tests/fuzzing.py's ``refusals_name_a_rule``),
    ``--examples`` per operation, seeded;
  - Hypothesis on the gRPC API: ``--grpc`` GenerateRequest messages drawn from the
    descriptor, and as many one field away from an answered one; each must be answered or
    refused with a documented code and a reason.

Then the mesh must still be healthy and answer. Prints a table; the last line is one JSON
object: http_cases, http_operations, http_failures, grpc_cases, grpc_answered, grpc_refused,
grpc_failures, healthy_after, seconds.

    .venv/bin/python bench/fuzz.py [--examples 50] [--grpc 1000] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import grpc
from hypothesis import given, seed, settings

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.harness import say  # noqa: E402
from shared.proto import api_pb2  # noqa: E402
from tests.fuzzing import ask_grpc, messages, mutants, schemathesis_run  # noqa: E402
from tests.procs import kvmesh_keys  # noqa: E402
from tests.stack import TINY_ENCODER, Stack, start_stack  # noqa: E402
from tests.test_fuzz import ANSWERED, LIKELY, REFUSALS  # noqa: E402

IDS = ("router-0", "cachemeta-0", "prefill-0", "decode-0", "encoder-0")


def fuzz_grpc(stack: Stack, key: str, cases: int, seed_: int) -> tuple[Counter, list[str]]:
    """``cases`` drawn messages and as many mutants; the outcomes, and what broke a rule."""
    seen: Counter[str] = Counter()
    broken: list[str] = []
    descriptor = api_pb2.GenerateRequest.DESCRIPTOR

    for strategy in (messages(descriptor, LIKELY), mutants(ANSWERED, LIKELY)):

        @seed(seed_)
        @settings(max_examples=cases, deadline=None, database=None)
        @given(request=strategy)
        def one(request: api_pb2.GenerateRequest) -> None:
            seen["cases"] += 1
            if seen["cases"] % 200 == 0:
                say(f"  gRPC: {seen['cases']} cases")
            outcome, details = ask_grpc(stack.grpc, key, request)
            seen[outcome] += 1
            if outcome != "answered" and (grpc.StatusCode[outcome] not in REFUSALS or not details):
                broken.append(f"{outcome}: {details!r} for {request}")

        one()
    return seen, broken


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=50, help="Schemathesis, per operation")
    parser.add_argument("--grpc", type=int, default=1000, help="gRPC messages of each kind")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvmesh-fuzz-") as tmp:
        keys = Path(tmp) / "keys.toml"
        key = kvmesh_keys(keys, "add", "--tenant", "fuzz", "--admin")
        say("starting a tiny stack")
        stack = start_stack(
            "fuzz", Path(tmp) / "stack", IDS, KVMESH_ROUTER_KEYS_FILE=str(keys), **TINY_ENCODER
        )
        try:
            say(f"Schemathesis: {args.examples} examples per operation, seed {args.seed}")
            http = schemathesis_run(stack.url, key, args.seed, args.examples, timeout_s=3600)
            if http.returncode:
                say(http.output[-6000:])
            say(f"Hypothesis on gRPC: {args.grpc} cases of each kind")
            outcomes, broken = fuzz_grpc(stack, key, args.grpc, args.seed)
            for line in broken[:10]:
                say(f"  broken: {line[:300]}")
            healthy = all(s["status"] == "ready" for s in stack.health().values())
        finally:
            stack.stop()
    seconds = time.perf_counter() - started
    refused = sum(v for k, v in outcomes.items() if k not in ("cases", "answered"))
    rows = [
        ("HTTP (Schemathesis)", http.cases, http.operations, "", "", http.failures),
        ("gRPC (Hypothesis)", outcomes["cases"], 1, outcomes["answered"], refused, len(broken)),
    ]
    print(
        f"{'fuzzer':22} {'cases':>7} {'operations':>10} {'answered':>9} {'refused':>8} "
        f"{'failures':>8}"
    )
    for name, cases, ops, answered, ref, failures in rows:
        print(f"{name:22} {cases:>7} {ops:>10} {answered!s:>9} {ref!s:>8} {failures:>8}")
    print(f"refusals by code: {dict(sorted((k, v) for k, v in outcomes.items() if k.isupper()))}")
    print(f"healthy after: {healthy}; {seconds:.0f} s")
    print(
        json.dumps(
            {
                "http_cases": http.cases,
                "http_operations": http.operations,
                "http_failures": http.failures,
                "http_links_followed": http.links,
                "grpc_cases": outcomes["cases"],
                "grpc_answered": outcomes["answered"],
                "grpc_refused": refused,
                "grpc_failures": len(broken),
                "healthy_after": healthy,
                "seconds": round(seconds, 1),
            }
        )
    )
    return 0 if not http.failures and not broken and healthy else 1


if __name__ == "__main__":
    sys.exit(main())

"""An agent-like trace, seeded: sessions of tool-call turns a few seconds apart, each turn
re-sending the session's whole history.

A session belongs to one of a few agent apps; the app's system prompt and tool definitions
(6–24K tokens) open every one of its sessions. Then the task (0.5–4K tokens), and per turn the
model's tool call (the turn's output, 30–400 tokens) and the tool's result (lognormal, median
about 2K tokens) join the history; the next turn comes when the call has been decoded and the
tool has run (1–8 s later). Sessions start as a Poisson process whose rate swells and ebbs
(sessions bunch, as traffic does), 8–40 turns each.

Block hashes follow the tokens: a full block's hash is fixed by its content (the app's blocks
are shared by its sessions, a session's by its turns); a prompt's last, partial block is its
own. So a turn reuses every full block of the turn before.

    .venv/bin/python bench/agent_trace.py --sessions 300 --out agent.jsonl   # Mooncake's format
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from simulator.traces import MOONCAKE_BLOCK, TraceRequest  # noqa: E402

APPS = 6
SESSIONS_PER_WORKER = 37.5  # 300 sessions for 8 prefill workers, 2,400 for 64
TURNS = (8, 40)
APP_PROMPT = (6_000, 24_000)
TASK = (500, 4_000)
CALL = (30, 400)
RESULT_MEDIAN, RESULT_SIGMA, RESULT_MAX = 2_000, 0.9, 16_000
GAP_S = (1.0, 8.0)  # decode of the call + the tool's run
SESSIONS_PER_S = 2.5  # mean session arrival rate (the load is set by the replay's speed)


def agent_trace(sessions: int, seed: int = 0, block: int = MOONCAKE_BLOCK) -> list[TraceRequest]:
    rng = random.Random(seed)
    apps = [rng.randint(*APP_PROMPT) for _ in range(APPS)]
    out: list[TraceRequest] = []
    t = 0.0
    for s in range(sessions):
        # Poisson starts at a rate swelling and ebbing over a period of about 2 minutes.
        rate = SESSIONS_PER_S * (1 + 0.6 * math.sin(2 * math.pi * t / 120))
        t += rng.expovariate(rate)
        app = rng.randrange(APPS)
        shared = apps[app] // block  # blocks wholly inside the app's prompt
        length = apps[app] + rng.randint(*TASK)
        at = t
        for turn in range(rng.randint(*TURNS)):
            full = length // block
            hashes = [f"a{app}b{j}" if j < shared else f"s{s}b{j}" for j in range(full)]
            if length % block:
                hashes.append(f"s{s}t{turn}")  # the partial last block: this turn's own
            call = rng.randint(*CALL)
            out.append(TraceRequest(at, length, call, hashes, "agent"))
            result = min(RESULT_MAX, int(rng.lognormvariate(math.log(RESULT_MEDIAN), RESULT_SIGMA)))
            length += call + result
            at += rng.uniform(*GAP_S)
    out.sort(key=lambda r: r.t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="a jsonl file in Mooncake's format")
    args = ap.parse_args()
    requests = agent_trace(args.sessions, args.seed)
    ids: dict[str, int] = {}
    with open(args.out, "w") as f:
        for r in requests:
            line = {
                "timestamp": round(r.t * 1000),
                "input_length": r.n_in,
                "output_length": r.n_out,
                "hash_ids": [ids.setdefault(h, len(ids)) for h in r.hashes],
                "class": r.retention,
            }
            f.write(json.dumps(line) + "\n")
    print(f"{len(requests)} requests in {args.sessions} sessions written to {args.out}")


if __name__ == "__main__":
    main()

"""Routing benchmark: every policy on Mooncake's synthetic trace through `kvmesh sim`, with 8
and 64 prefill workers at 80% utilisation (memory tiers sized to hold only part of the trace's
blocks), a 10K-request / 1M-block-reference replay timed, and the router's decision latency
(hashing + index lookup + scoring) for a 77K-token request with 64 workers and 1M indexed
blocks.

Prints tables; the last line is one JSON object: per policy and size ttft_mean_s, ttft_p99_s,
hit_ratio; infinite_cache_hit_ratio; decision_p99_ms.

    .venv/bin/python bench/routing.py [--trace ../shared/traces/synthetic_trace.jsonl]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.cachemeta.index import BlockIndex  # noqa: E402
from services.router.policies import POLICIES, RouteRequest  # noqa: E402
from services.router.tokens import PrefixHashes  # noqa: E402
from shared.kvstore.hashing import block_hashes, pack_tokens, packed_block_hashes  # noqa: E402
from shared.messages.kvevents import STORE, KvEvent, memory_location  # noqa: E402
from simulator.replay import (  # noqa: E402
    SimConfig,
    infinite_cache_hit_ratio,
    progress_bar,
    simulate,
    speed_for_utilization,
)
from simulator.traces import TraceRequest, read_trace  # noqa: E402

TRACE = (
    Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "synthetic_trace.jsonl"
)


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def policies_at(requests: list[TraceRequest], bs: int, n: int) -> dict:
    unique = len({h for r in requests for h in r.hashes})
    # Memory tiers together hold 30% of the trace's distinct blocks: they cannot keep it all.
    cfg = SimConfig(prefill=n, decode=n, memory_blocks=max(50, int(unique * 0.3 / n)))
    cfg = replace(cfg, speed=speed_for_utilization(requests, bs, cfg, 0.8))
    say(f"{n} prefill workers, memory tier {cfg.memory_blocks} blocks each, speed {cfg.speed:.1f}x")
    return {
        name: simulate(requests, bs, cfg, name, progress_bar(f"{name}@{n}")).summary(n)
        for name in POLICIES
    }


def synthetic_trace(n_requests: int, blocks_per_request: int, seed: int = 0) -> list[TraceRequest]:
    """Conversations whose turns grow their shared prefix, arriving interleaved."""
    rng = random.Random(seed)
    out, convs = [], []
    t = 0.0
    for i in range(n_requests):
        if not convs or rng.random() < 0.15:
            convs.append([f"c{i}s{j}" for j in range(rng.randint(4, blocks_per_request))])
        conv = rng.choice(convs)
        conv.extend(f"c{i}t{j}" for j in range(rng.randint(1, 8)))
        hashes = conv[-blocks_per_request * 2 :] if len(conv) > 2 * blocks_per_request else conv
        t += rng.expovariate(20.0)
        out.append(TraceRequest(t, len(hashes) * 512, rng.randint(50, 500), list(hashes)))
    return out


def decision_latency(n_workers: int = 64, n_blocks: int = 1_000_000, rounds: int = 300) -> dict:
    """Hashing a 77K-token prompt, looking it up in a 1M-block index, ranking 64 workers."""
    index = BlockIndex({"chat": 1e9, "agent": 1e9})
    per = 1200
    say(f"indexing {n_blocks:,} blocks for the decision-latency test")
    tokens = [[(c * 7919 + i) % 40000 for i in range(per * 64)] for c in range(n_blocks // per)]
    chains = []
    for c, toks in enumerate(tokens):
        hashes = block_hashes(toks, 64, "fingerprint")
        chains.append(hashes)
        index.apply(KvEvent(kind="stored", location=STORE, hashes=hashes, sizes=[1] * per, at=0))
        index.apply(
            KvEvent(
                kind="stored",
                location=memory_location(f"p{c % n_workers}"),
                hashes=hashes[: per // 2],
                sizes=[1] * (per // 2),
                at=0,
            )
        )
    workers = [f"p{i}" for i in range(n_workers)]
    policy = POLICIES["ttft"]()
    # The index lives in cachemeta, not in the router: its million objects are left out of
    # this process's garbage collections, which would otherwise pause the timed decisions.
    gc.collect()
    gc.freeze()
    times, parts = [], {"hash": [], "lookup": [], "rank": []}
    # Tokenizing packs each segment's ids as hashing reads them (services/router/tokens.py).
    packed = [pack_tokens(toks) for toks in tokens]
    for r in range(rounds):
        toks = tokens[(r * 37) % len(tokens)]
        t0 = time.perf_counter()
        hashes = packed_block_hashes(packed[(r * 37) % len(tokens)], 64, "fingerprint")
        t1 = time.perf_counter()
        counts = index.lookup(hashes, 1.0, touch=False)
        t2 = time.perf_counter()
        route = RouteRequest(str(r), len(toks), 64, hashes, counts)
        best = policy.rank(route, workers)[0].service_id
        t3 = time.perf_counter()
        policy.dispatched(best, route)
        policy.prefilled(best, route)
        times.append((t3 - t0) * 1e3)
        for k, v in zip(("hash", "lookup", "rank"), (t1 - t0, t2 - t1, t3 - t2), strict=True):
            parts[k].append(v * 1e3)
    times.sort()
    # The usual 77K-token request is the next turn of a conversation the router has seen:
    # its tokens were cached by segment, and its leading blocks' hashes are reused.
    cache = PrefixHashes()
    warm = []
    for r in range(rounds):
        c = (r * 37) % len(tokens)
        old = tokens[c][: per * 64 - 64]
        # As a chat's: special tokens and the opening messages first, then the long history.
        segments = (
            *((f"c{c} opening {j}", pack_tokens(old[j : j + 1])) for j in range(5)),
            (f"c{c} body", pack_tokens(old[5:])),
        )
        cache.hashes(segments, 64, "fingerprint", "")
        turn = [(r * 31 + i) % 40000 for i in range(64)]
        toks = old + turn
        t0 = time.perf_counter()
        hashes = cache.hashes((*segments, (f"turn {r}", pack_tokens(turn))), 64, "fingerprint", "")
        counts = index.lookup(hashes, 1.0, touch=False)
        route = RouteRequest(f"w{r}", len(toks), 64, hashes, counts)
        best = policy.rank(route, workers)[0].service_id
        warm.append((time.perf_counter() - t0) * 1e3)
        policy.dispatched(best, route)
        policy.prefilled(best, route)
    warm.sort()
    return {
        "decision_p50_ms": statistics.median(times),
        "decision_p99_ms": times[int(0.99 * len(times)) - 1],
        "warm_p50_ms": statistics.median(warm),
        "warm_p99_ms": warm[int(0.99 * len(warm)) - 1],
        **{f"{k}_p50_ms": statistics.median(v) for k, v in parts.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    requests, bs = read_trace(args.trace)
    infinite = infinite_cache_hit_ratio(requests, bs)
    sizes = {n: policies_at(requests, bs, n) for n in (8, 64)}

    say("replaying a 10K-request synthetic trace (ttft policy, 64 workers)")
    big = synthetic_trace(10_000, 120)
    refs = sum(len(r.hashes) for r in big)
    cfg = SimConfig(prefill=64, decode=64, memory_blocks=5000)
    cfg = replace(cfg, speed=speed_for_utilization(big, 512, cfg, 0.8))
    t = time.perf_counter()
    simulate(big, 512, cfg, "ttft", progress_bar("10K replay"))
    replay_s = time.perf_counter() - t

    decision = decision_latency()

    print(
        f"Mooncake synthetic trace: {len(requests)} requests; "
        f"infinite-cache hit ratio {infinite:.4f}"
    )
    for n, summaries in sizes.items():
        print(f"\n{n} prefill + {n} decode workers, 80% utilisation")
        print(
            f"{'policy':<14}{'hit':>7}{'hit/inf':>9}{'TTFT mean':>11}{'p50':>9}{'p99':>9}"
            f"{'load max/mean':>15}{'util':>7}"
        )
        for name, s in summaries.items():
            print(
                f"{name:<14}{s['hit_ratio']:>7.3f}{s['hit_ratio'] / infinite:>9.3f}"
                f"{s['ttft_mean_s']:>10.3f}s{s['ttft_p50_s']:>8.3f}s{s['ttft_p99_s']:>8.3f}s"
                f"{s['load_max_over_mean']:>15.2f}{s['utilization']:>7.2f}"
            )
    print(
        f"\n10K-request replay: {len(big):,} requests, {refs:,} block references, {replay_s:.1f} s"
    )
    print(
        "decision (77K tokens, 64 workers, 1M indexed blocks): "
        f"p50 {decision['decision_p50_ms']:.2f} ms, p99 {decision['decision_p99_ms']:.2f} ms "
        f"(hash {decision['hash_p50_ms']:.2f}, lookup {decision['lookup_p50_ms']:.2f}, "
        f"rank {decision['rank_p50_ms']:.2f} ms at p50)"
    )
    out = {
        f"{name}@{n}": {
            "ttft_mean_s": round(s["ttft_mean_s"], 6),
            "ttft_p99_s": round(s["ttft_p99_s"], 6),
            "hit_ratio": round(s["hit_ratio"], 6),
        }
        for n, summaries in sizes.items()
        for name, s in summaries.items()
    }
    out["infinite_cache_hit_ratio"] = round(infinite, 6)
    out["decision_p99_ms"] = round(decision["decision_p99_ms"], 3)
    out["decision_next_turn_p99_ms"] = round(decision["warm_p99_ms"], 3)
    out["replay_10k_s"] = round(replay_s, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

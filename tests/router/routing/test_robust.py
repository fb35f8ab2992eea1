"""The default policy where the plain estimate loses: a worker whose reports are noisy does not
draw work on a lucky streak, a truly slow one is its own; a worker that also decodes is slowed
by its answers, and the estimate learns by how much as that load changes; routers with the same
view do not all pick the same worker."""

from __future__ import annotations

import random

from services.router.routing.estimate import Fitted, Shape
from services.router.routing.policies import POLICIES
from services.router.routing.route import RouteRequest

RATES = (1000.0, 10_000.0)


def truth(r: Shape, slow: float = 1.0) -> float:
    """A 2 ms pass, 800 tok/s, and each pass also steps the answers decoding there: 10 ms a
    sequence and their KV read at 100K tok/s (a CPU worker's decode steps are dear)."""
    compute = 0.002 + r.uncached / 800
    decode = r.passes * (0.01 * r.decoding + r.decoding_tokens / 100_000) if r.decoding else 0
    return slow * compute + decode + r.loaded / 10_000


def shape(rng: random.Random, decoding: int = 0) -> Shape:
    seqs = rng.randint(0, decoding) if decoding else 0
    return Shape(
        rng.choice((64, 256, 1024, 2048, 4096)),
        rng.choice((0, 0, 1024)),
        0,
        0.0,
        seqs,
        seqs * rng.randint(200, 2000),
        chunk=1024,
    )


def test_a_noisy_worker_stays_its_pools_and_a_slow_one_is_its_own() -> None:
    rng = random.Random(0)
    pool = Fitted(*RATES)
    steady, noisy, slow = (Fitted(*RATES, pool=pool) for _ in range(3))
    for _ in range(200):
        for w, factor, noise in ((steady, 1.0, 0.02), (noisy, 1.0, 0.3), (slow, 2.0, 0.02)):
            r = shape(rng)
            measured = truth(r, factor) * max(0.2, rng.gauss(1.0, noise))
            w.observe(r, measured - r.loaded / 10_000, r.loaded / 10_000)
    # its reports' luck is not speed: it is ranked as its pool (the mean of the three)
    assert noisy.factors == (1.0, 1.0)
    assert 1.7 < slow.factors[0] / steady.factors[0] < 2.3
    r = Shape(2048)
    assert slow.service_s(r) > 1.5 * noisy.service_s(r) > 1.5 * 0.9 * steady.service_s(r)
    # a noisy worker on a lucky streak still costs what its pool does
    for _ in range(5):
        r = shape(rng)
        noisy.observe(r, 0.8 * truth(r) - r.loaded / 10_000, r.loaded / 10_000)
    assert noisy.factors == (1.0, 1.0)


def test_the_answers_a_worker_decodes_count_and_are_learned_as_their_load_changes() -> None:
    rng = random.Random(1)
    pool = Fitted(*RATES)
    worker = Fitted(*RATES, pool=pool)

    def error(decoding: int) -> float:
        cases = [shape(random.Random(7), decoding) for _ in range(100)]
        return sum(abs(worker.service_s(r) / truth(r) - 1) for r in cases) / len(cases)

    for _ in range(300):  # a few answers decoding meanwhile
        r = shape(rng, decoding=4)
        worker.observe(r, truth(r) - r.loaded / 10_000, r.loaded / 10_000)
    assert error(4) < 0.05
    terms = worker.terms()
    assert terms["decoding"] + terms["decoding_context"] > 0.05
    busy = Shape(4096, chunk=1024, decoding=32, decoding_tokens=32 * 2000)
    assert worker.service_s(busy) > 1.2 * worker.service_s(Shape(4096, chunk=1024))
    for _ in range(300):  # then many: the same terms hold
        r = shape(rng, decoding=48)
        worker.observe(r, truth(r) - r.loaded / 10_000, r.loaded / 10_000)
    assert error(48) < 0.05


def test_what_workers_decode_sets_the_estimates_level_and_queues_decide() -> None:
    """Two aggregated workers alike: once the fit has seen what decoding costs a pass, a
    prompt's estimate rises with the answers the pool decodes; between the two, their queues
    decide, not the snapshot of what each decodes (which every answer moves, and the prompt's
    own answer joins: chasing it lost the tail in the aggregated grid)."""
    policy = POLICIES["ttft"]()
    rng = random.Random(2)
    t = 0.0
    for i in range(200):
        w = ("a", "b")[i % 2]
        seqs = rng.randint(0, 40)
        policy.reported(w, 0, seqs, seqs * 1500)
        req = RouteRequest(f"r{i}", 2048, 64, [], {}, t)
        policy.dispatched(w, req)
        r = Shape(2048, decoding=seqs, decoding_tokens=seqs * 1500)
        policy.prefilled(w, req, t + truth(r), 2048, 0, truth(r), 0.0)
        t += 10.0

    def estimates(a: int, b: int) -> dict[str, float]:
        policy.reported("a", 0, a, a * 1500)
        policy.reported("b", 0, b, b * 1500)
        ranked = policy.rank(RouteRequest("x", 2048, 64, [], {}, t), ["a", "b"])
        return {r.service_id: r.terms["ttft_s"] for r in ranked}

    idle, busy = estimates(0, 0), estimates(30, 2)
    assert busy["a"] == busy["b"] > 1.1 * idle["a"]
    policy.dispatched("b", RouteRequest("queued", 2048, 64, [], {}, t))
    ranked = policy.rank(RouteRequest("y", 2048, 64, [], {}, t), ["a", "b"])
    assert ranked[0].service_id == "a" and ranked[0].terms["decoding"] == 30


def test_routers_with_the_same_view_spread_their_picks() -> None:
    """Two routers route a request each at the same moment to the same idle workers: each
    orders its ties its own way (its id), so they seldom pick the same worker; with no id they
    always would. A burst through one router spreads over the pool."""
    workers = [f"p{i}" for i in range(8)]
    req = RouteRequest("r", 2048, 64, [], {}, 0.0)

    def first(salt: str) -> str:
        return POLICIES["ttft"](salt=salt).rank(req, workers)[0].service_id

    same = sum(first(f"router-{i}a") == first(f"router-{i}b") for i in range(40))
    assert same <= 12  # 1 in 8 expected by chance
    assert all(first("") == first("") for _ in range(3))
    one = POLICIES["ttft"](salt="router-x")
    picks = []
    for i in range(8):
        burst = RouteRequest(f"b{i}", 2048, 64, [], {}, 0.0)
        picks.append(one.rank(burst, workers)[0].service_id)
        one.dispatched(picks[-1], burst)
    assert sorted(picks) == workers


def test_a_shared_prompt_being_computed_is_waited_for_when_that_is_cheaper() -> None:
    """Two sessions open with the same 8K-token system prompt. The second comes 6 s into the
    first's prefill (1K tok/s): waiting behind it on its worker (2.3 s left, then its own 256
    tokens) beats computing the prompt again on an idle one (8.3 s); arriving at once, it does
    not (the idle worker is as quick, and the pool's work is the same)."""
    from services.router.routing.ttft import CostDefaults

    system = [f"sys{i}" for i in range(128)]  # 128 × 64 = 8,192 tokens

    def opening(name: str, at: float) -> RouteRequest:
        return RouteRequest(name, 8192 + 256, 64, [*system, f"{name}-own"], {}, at)

    for arrives, expected in ((6.0, "p0"), (0.0, "p1")):
        policy = POLICIES["ttft"](CostDefaults(prefill_tok_s=1000.0, load_tok_s=10_000.0))
        first = opening("a", 0.0)
        policy.dispatched(policy.rank(first, ["p0", "p1"])[0].service_id, first)
        ranked = policy.rank(opening("b", arrives), ["p0", "p1"])
        assert ranked[0].service_id == expected, ranked[0].terms
        if expected == "p0":
            assert ranked[0].terms["memory_tokens"] == 8192  # brought there by the first


def test_what_the_estimate_cannot_tell_apart_load_decides() -> None:
    """p1's estimate is a little better (its request has run 0.3 s), p0 holds fewer tokens
    to compute. While the estimate has been right, it decides (p1); once it has been a third
    off, the two are within its error, and the fewer tokens in flight win (p0), saying so."""
    from services.router.routing.ttft import CostDefaults
    from shared.messages.kvevents import memory_location

    def pick(misses: float) -> tuple[str, dict]:
        policy = POLICIES["ttft"](CostDefaults(prefill_tok_s=1000.0, load_tok_s=10_000.0))
        t = 0.0
        for i in range(60):  # reports whose TTFT is the estimate × (1 + misses)
            req = RouteRequest(f"w{i}", 500, 64, [], {}, t)
            policy.dispatched("p2", req)
            took = 0.5 * (1 + misses)
            policy.prefilled("p2", req, t + took, 500, 0, 0.5, 0.0)
            t += 10.0
        policy.dispatched("p1", RouteRequest("long", 1200, 64, [], {}, t - 0.3))
        policy.dispatched("p0", RouteRequest("short", 1000, 64, [], {}, t))
        # (both hold the prompt's first block: not a cold prompt, which tokens place)
        held = {memory_location("p0"): 1, memory_location("p1"): 1}
        x = RouteRequest("x", 640, 64, [f"x{k}" for k in range(10)], held, t)
        best = policy.rank(x, ["p0", "p1"])[0]
        return best.service_id, best.terms

    assert pick(0.0)[0] == "p1"
    chosen, terms = pick(0.5)
    assert chosen == "p0" and terms["ranked_by_load"]


def test_a_prompt_nothing_cached_favors_goes_by_tokens_then_with_its_own_size() -> None:
    """Nothing of these prompts is cached anywhere: the default places them by the tokens to
    compute in flight, as the balancers do, not by the estimate, and says so. Between counts
    within a quarter of the least, a short prompt goes where short ones queue, a long one
    where long ones do."""
    policy = POLICIES["ttft"](salt="r")
    policy.dispatched("long", RouteRequest("l0", 4000, 64, [], {}, 0.0))
    for i in range(10):  # 10 × 400 tokens: as many as the one long prompt
        policy.dispatched("short", RouteRequest(f"s{i}", 400, 64, [], {}, 0.0))
    policy.dispatched("busy", RouteRequest("b0", 9000, 64, [], {}, 0.0))
    workers = ["busy", "long", "short"]
    short = policy.rank(RouteRequest("x", 300, 64, [], {}, 0.0), workers)
    assert [r.service_id for r in short][0] == "short" and short[0].terms["ranked_by_tokens"]
    assert short[-1].service_id == "busy"
    long = policy.rank(RouteRequest("y", 3000, 64, [], {}, 0.0), workers)
    assert long[0].service_id == "long"
    # beyond the quarter, tokens decide whatever the sizes
    policy.dispatched("short", RouteRequest("s10", 2000, 64, [], {}, 0.0))
    assert policy.rank(RouteRequest("z", 300, 64, [], {}, 0.0), workers)[0].service_id == "long"


def test_new_conversations_one_at_a_time_spread_over_idle_workers() -> None:
    """Each prompt is computed before the next comes: every worker is idle each time, and
    the next goes to the one whose memory tier has been given the least."""
    policy = POLICIES["ttft"](salt="r")
    workers = ["p0", "p1", "p2"]
    chosen = []
    for i in range(6):
        req = RouteRequest(f"c{i}", 1024, 64, [f"c{i}/{k}" for k in range(16)], {}, float(i))
        chosen.append(policy.rank(req, workers)[0].service_id)
        policy.dispatched(chosen[-1], req)
        policy.prefilled(chosen[-1], req, i + 0.5, 1024, 0, 0.5, 0.0)
    assert sorted(chosen) == sorted(workers * 2)


def test_prompts_of_mixed_sizes_with_nothing_shared_wait_less_than_the_balancers_make_them() -> (
    None
):
    """A trace that shares nothing, 80% short prompts and 20% long ones, on 4 workers of the
    profiled world at 80% and 90% load, 3 seeds: the default's mean TTFT is below the best
    balancer's (Dynamo's token cost, least loaded) in every run, and its p99 is theirs, over
    the runs (a run's p99, the 15th longest of 1,500, moves by ±15% either way)."""
    from dataclasses import replace as changed

    from simulator.replay import SimConfig, simulate, speed_for_utilization
    from simulator.traces import TraceRequest
    from simulator.world import WorldSettings

    def figures(policy: str, cfg: SimConfig) -> tuple[float, float]:
        summary = simulate(trace, 64, cfg, policy).summary(cfg.prefill)
        return summary["ttft_mean_s"], summary["ttft_p99_s"]

    p99_ratios = []
    for seed in range(3):
        rng, t, trace = random.Random(seed), 0.0, []
        for i in range(1500):
            t += rng.expovariate(1.0)
            n = rng.randint(64, 512) if rng.random() < 0.8 else rng.randint(4096, 8192)
            trace.append(TraceRequest(t, n, 16, [f"r{i}/{k}" for k in range(n // 64)]))
        world = changed(WorldSettings.named("profiled"), seed=seed)
        for load in (0.8, 0.9):
            cfg = SimConfig(prefill=4, decode=2, world=world)
            cfg = changed(cfg, speed=speed_for_utilization(trace, 64, cfg, load))
            ours = figures("ttft", cfg)
            others = [figures(p, cfg) for p in ("dynamo", "least_loaded")]
            assert ours[0] < min(b[0] for b in others), (seed, load, ours, others)
            p99_ratios.append(ours[1] / min(b[1] for b in others))
    assert sum(p99_ratios) / len(p99_ratios) <= 1.0, p99_ratios

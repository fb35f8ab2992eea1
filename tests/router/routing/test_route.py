"""The routing decision as a whole: decode workers by room and load, a short uncached prompt
prefilled on decode, a long one ranked by the policy, every prefill paired with the best
decode worker."""

from __future__ import annotations

from services.router.routing.policies import POLICIES
from services.router.routing.route import DecodeScore, RouteRequest, rank_decode, route

BS = 64
HASHES = [f"h{i}" for i in range(10)]  # a 640-token prefix


def request(n_prompt: int, counts: dict[str, int] | None = None, answer: int = 16) -> RouteRequest:
    blocks = HASHES[: n_prompt // BS]
    return RouteRequest("r", n_prompt, BS, blocks, counts or {}, 0.0, answer_tokens=answer)


def test_decode_workers_with_room_for_the_whole_answer_first_then_the_least_active() -> None:
    scores = [DecodeScore("d0", 100, 5), DecodeScore("d1", 100, 2), DecodeScore("d2", 3, 0)]
    assert [s.service_id for s in rank_decode(scores, 10)] == ["d1", "d0", "d2"]
    assert [s.service_id for s in rank_decode(scores, 2)] == ["d2", "d1", "d0"]
    # None has room for it all: the least active of those with any room, still tried.
    assert [s.service_id for s in rank_decode(scores, 500)] == ["d2", "d1", "d0"]
    assert rank_decode([DecodeScore("full", 0, 0)], 1) == []


def test_a_short_uncached_prompt_is_prefilled_on_the_best_decode_worker() -> None:
    policy = POLICIES["ttft"]()
    decodes = [DecodeScore("d0", 100, 3), DecodeScore("d1", 100, 1)]
    chosen = route(policy, request(40), {"p0": 0, "p1": 0}, decodes, local_max_tokens=64)
    assert chosen.on_decode and chosen.pairs == [("d1", "d1"), ("d0", "d0")]
    assert chosen.decision == {"prefill": "on decode", "uncached_tokens": 40}
    assert not policy.workers, "the prefill policy was not consulted"


def test_what_the_decode_worker_can_load_itself_does_not_count_as_uncached() -> None:
    """600 tokens, 9 blocks of them in the storage tier: 24 left to compute."""
    policy = POLICIES["ttft"]()
    req = request(600, {"store": 9})
    chosen = route(policy, req, {"p0": 0}, [DecodeScore("d0", 100, 0)], local_max_tokens=64)
    assert chosen.on_decode and chosen.decision["uncached_tokens"] == 600 - 9 * BS
    # The same blocks in another decode worker's memory do not help d0.
    req = request(600, {"mem:d9": 9})
    chosen = route(policy, req, {"p0": 0}, [DecodeScore("d0", 100, 0)], local_max_tokens=64)
    assert not chosen.on_decode


def test_a_prompt_a_decode_worker_holds_is_prefilled_there_though_another_is_less_busy() -> None:
    """600 tokens, 9 blocks held in d0's memory (another candidate of the same prompt decoding
    there): prefilled on d0 (24 tokens to compute), not on the less active d1 (all 600); with
    room for the answer first, though: a full d0 is passed over."""
    policy = POLICIES["ttft"]()
    req = request(600, {"mem:d0": 9})
    decodes = [DecodeScore("d0", 100, 3), DecodeScore("d1", 100, 1)]
    chosen = route(policy, req, {"p0": 0}, decodes, local_max_tokens=64)
    assert chosen.on_decode and chosen.pairs == [("d0", "d0"), ("d1", "d1")]
    assert chosen.decision["uncached_tokens"] == 600 - 9 * BS
    decodes = [DecodeScore("d0", 2, 3), DecodeScore("d1", 100, 1)]
    chosen = route(policy, req, {"p0": 0}, decodes, local_max_tokens=64)
    assert not chosen.on_decode and chosen.pairs[0] == ("p0", "d1")


def test_a_long_prompt_goes_to_the_policys_prefill_ranking_each_with_the_best_decode() -> None:
    policy = POLICIES["ttft"]()
    req = request(640, {"mem:p1": 9})  # p1 holds the prefix in memory
    decodes = [DecodeScore("d0", 100, 0), DecodeScore("d1", 100, 4)]
    chosen = route(policy, req, {"p0": 0, "p1": 0, "p2": 0}, decodes, local_max_tokens=64)
    assert not chosen.on_decode
    assert chosen.pairs[0] == ("p1", "d0") and {p for p, _ in chosen.pairs} == {"p0", "p1", "p2"}
    assert all(d == "d0" for _, d in chosen.pairs)
    assert chosen.decision["policy"] == "ttft"
    assert [r.service_id for r in chosen.decision["candidates"]][0] == "p1"


def test_what_a_prefill_worker_reports_queued_is_seen_by_the_policy() -> None:
    policy = POLICIES["ttft"]()
    req = request(640)
    queued = {"p0": 40_000, "p1": 0}  # p0: work sent by other routers waits there
    chosen = route(policy, req, queued, [DecodeScore("d0", 100, 0)], local_max_tokens=0)
    assert chosen.pairs[0][0] == "p1"
    assert policy.state("p0").reported_tokens == 40_000


def test_no_pair_when_no_decode_worker_has_room_or_no_prefill_worker_is_left() -> None:
    policy = POLICIES["ttft"]()
    assert route(policy, request(640), {"p0": 0}, [DecodeScore("d0", 0, 0)], 64).pairs == []
    assert route(policy, request(640), {}, [DecodeScore("d0", 100, 0)], 64).pairs == []


# -- workers whose engine owns its KV (whole: vLLM) ---------------------------------------------


def whole(service_id: str, active: int = 0, queued_tokens: int = 0) -> DecodeScore:
    return DecodeScore(service_id, 100, active, whole=True, queued_tokens=queued_tokens)


def test_with_no_prefill_worker_the_policy_ranks_whole_workers_by_what_their_caches_hold() -> None:
    policy = POLICIES["ttft"]()
    req = request(640, {"mem:v1": 9})  # v1's own cache holds the prefix
    chosen = route(policy, req, {}, [whole("v0"), whole("v1", active=3)], local_max_tokens=64)
    assert chosen.on_decode and chosen.ranked
    assert chosen.pairs == [("v1", "v1"), ("v0", "v0")]  # despite v1's load
    assert chosen.decision["policy"] == "ttft"
    assert set(policy.workers) == {"v0", "v1"}  # the policy follows what it sends them


def test_round_robin_takes_whole_workers_in_turn_whatever_they_hold() -> None:
    policy = POLICIES["round_robin"]()
    req = request(640, {"mem:v1": 9})
    firsts = [route(policy, req, {}, [whole("v0"), whole("v1")], 64).pairs[0][0] for _ in range(4)]
    assert firsts == ["v0", "v1", "v0", "v1"]


def test_what_a_whole_worker_reports_queued_is_seen_by_the_policy() -> None:
    policy = POLICIES["ttft"]()
    decodes = [whole("v0", queued_tokens=40_000), whole("v1")]
    assert route(policy, request(640), {}, decodes, 64).pairs[0][0] == "v1"


def test_with_whole_prefill_workers_a_long_prompt_goes_pd_and_a_short_one_stays() -> None:
    policy = POLICIES["ttft"]()
    decodes = [whole("v0", active=2), whole("v1")]
    long = route(policy, request(640), {"vp0": 0}, decodes, local_max_tokens=64)
    assert not long.on_decode and long.pairs == [("vp0", "v1")] and long.ranked
    short = route(policy, request(40), {"vp0": 0}, decodes, local_max_tokens=64)
    assert short.on_decode and short.pairs[0] == ("v1", "v1") and not short.ranked


def test_a_whole_worker_counts_the_answers_it_decodes_not_those_it_prefills() -> None:
    """Whole workers say how many sequences they hold and their KV: those past their first
    token are the answers it steps in every pass of the next prompt (the estimate's terms);
    those still prefilling are already in the policy's queue."""
    policy = POLICIES["ttft"]()
    first = request(640)
    route(policy, first, {}, [whole("v0"), whole("v1")], 64)
    policy.dispatched("v0", first)  # prefilling there, as far as the router knows
    decodes = [
        DecodeScore("v0", 100, 5, whole=True, used_tokens=4000),
        DecodeScore("v1", 100, 2, whole=True, used_tokens=900),
    ]
    chosen = route(policy, request(640), {}, decodes, 64)
    assert policy.workers["v0"].decoding == 4 and policy.workers["v0"].decoding_tokens == 4000
    assert policy.workers["v1"].decoding == 2 and policy.workers["v1"].decoding_tokens == 900
    terms = {r.service_id: r.terms for r in chosen.decision["candidates"]}
    assert terms["v0"]["decoding"] == 4 and terms["v1"]["decoding"] == 2

"""Logit bias, presence/frequency penalties, top_p at its edge and log-probabilities, in the
engine."""

from __future__ import annotations

import math

import torch

from shared.engine.sampling import SamplingParams
from shared.engine.torch.sampler import adjusted, sample
from tests.engine.conftest import make_engine
from tests.engine.test_prefix_reuse import prompt


def answer(model, params: SamplingParams, ids: list[int] | None = None) -> list:
    engine = make_engine(model)
    outs = [engine.prefill("s", ids or prompt(20), params)]
    while engine.running:
        outs += engine.step()
    return outs


def test_logit_bias_forces_and_bans_tokens(tiny_models) -> None:
    model = tiny_models["tiny"]
    free = [o.token_id for o in answer(model, SamplingParams(max_tokens=6, temperature=0))]
    forced = SamplingParams(max_tokens=6, temperature=0, logit_bias=((77, 100.0),))
    assert [o.token_id for o in answer(model, forced)] == [77] * 6
    banned = SamplingParams(max_tokens=6, temperature=0, logit_bias=((free[0], -100.0),))
    assert answer(model, banned)[0].token_id != free[0]


def test_frequency_penalty_steers_away_from_tokens_already_in_the_answer(tiny_models) -> None:
    model = tiny_models["tiny"]
    both = ((77, 100.0), (78, 100.0))  # two tokens far above the rest; the model prefers 77

    def count(**penalty) -> int:
        params = SamplingParams(max_tokens=30, temperature=0, logit_bias=both, **penalty)
        return [o.token_id for o in answer(model, params)].count(77)

    assert count() >= 25
    assert 8 <= count(frequency_penalty=2.0) <= 22  # each use of 77 makes the next less likely


def test_penalties_count_a_resumed_answers_earlier_tokens(tiny_models) -> None:
    """A request resumed elsewhere carries its earlier answer at the end of its prompt
    (answer_offset tokens): the penalties count those too."""
    model = tiny_models["tiny"]
    both = ((77, 100.0), (78, 100.0))
    ids = prompt(20) + [77] * 10

    def first(offset: int) -> int:
        params = SamplingParams(
            max_tokens=1,
            temperature=0,
            logit_bias=both,
            frequency_penalty=2.0,
            answer_offset=offset,
        )
        return answer(model, params, ids)[0].token_id

    assert first(0) == 77  # the ten 77s are prompt: no penalty
    assert first(10) == 78  # they are the answer so far: penalised 20


def test_frequency_penalty_grows_with_the_count_presence_does_not() -> None:
    logits = torch.zeros(5)
    both = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = adjusted(logits, both, [1, 1, 1, 3])
    assert out.tolist() == [0.0, -1.25, 0.0, -0.75, 0.0]


def test_the_smallest_top_p_keeps_the_most_likely_token() -> None:
    """5e-324 is a valid top_p (in (0, 1]) that fp32 rounds to 0: the fuzzer's find; it
    made every token "outside" and the sampler raise."""
    logits = torch.tensor([0.1, 3.0, -2.0, 1.0])
    for top_p in (5e-324, 1e-30, 0.01):
        assert sample(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=3), 0) == 1


def test_logprobs_are_the_models_and_name_the_most_likely(tiny_models) -> None:
    model = tiny_models["tiny"]
    outs = answer(model, SamplingParams(max_tokens=5, temperature=0, logprobs=3))
    for o in outs:
        lp = o.logprobs
        assert lp is not None and len(lp.top) == 3
        ids, values = zip(*lp.top, strict=True)
        assert ids[0] == o.token_id and math.isclose(values[0], lp.logprob)  # greedy: the best
        assert list(values) == sorted(values, reverse=True) and values[0] <= 0
        assert sum(math.exp(v) for v in values) <= 1 + 1e-5
    sampled = answer(model, SamplingParams(max_tokens=5, temperature=1.5, seed=3, logprobs=0))
    assert all(o.logprobs.top == () and o.logprobs.logprob <= 0 for o in sampled)
    assert answer(model, SamplingParams(max_tokens=2))[0].logprobs is None

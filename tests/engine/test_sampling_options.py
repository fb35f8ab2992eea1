"""Logit bias, presence, frequency and repetition penalties, min-p, top_p at its edge, the
answer's least length and ignore_eos, and log-probabilities, in the engine."""

from __future__ import annotations

import math

import pytest
import torch

from shared.engine.torch.sampler import adjusted, distribution, sample
from shared.messages.sampling import SamplingParams
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


def reference_distribution(logits: list[float], temperature: float, min_p: float) -> list[float]:
    """min-p as vLLM defines it, written out: softmax at the temperature, tokens below min_p ×
    the likeliest's probability dropped, the rest renormalized."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept = [p if p >= min_p * max(probs) else 0.0 for p in probs]
    return [p / sum(kept) for p in kept]


def test_min_p_drops_unlikely_tokens_as_the_reference_does() -> None:
    logits = [2.0, 1.5, 0.0, -1.0, 3.0, -4.0]
    for temperature, min_p in ((1.0, 0.1), (0.7, 0.3), (1.5, 0.05), (1.0, 0.0)):
        got = distribution(
            torch.tensor(logits), SamplingParams(temperature=temperature, min_p=min_p)
        )
        want = reference_distribution(logits, temperature, min_p)
        assert got.tolist() == pytest.approx(want, abs=1e-6)
    params = SamplingParams(temperature=1.0, min_p=0.3, seed=1)
    drawn = {sample(torch.tensor(logits), params, i) for i in range(200)}
    assert drawn == {0, 4}  # only tokens at least 0.3 as likely as the likeliest (e^-1)


def test_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones() -> None:
    """vLLM's and Hugging Face's definition: every token of the prompt or the answer, once
    however often it occurs."""
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0])
    params = SamplingParams(repetition_penalty=2.0)
    out = adjusted(logits, params, answer=[1], seen=[0, 1, 1, 1, 4])
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, -4.0]
    assert adjusted(logits, SamplingParams(repetition_penalty=0.5), [], [3]).tolist()[3] == 6.0
    # Greedy: the penalty turns the choice away from a token already there.
    assert sample(logits, SamplingParams(temperature=0), 0) == 3
    hit = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, hit, 0, seen=[3]) == 0


def test_ignore_eos_and_min_tokens_hold_the_end_of_the_answer_back(tiny_models) -> None:
    """With every token steered to the end-of-answer token: it ends the answer at once; with
    ignore_eos the answer runs to max_tokens; with min_tokens it ends right after them."""
    model = tiny_models["tiny"]
    eos = model.config.eos_ids[0]
    to_end = ((eos, 100.0),)

    def run(**asked) -> list:
        params = SamplingParams(max_tokens=12, temperature=0, logit_bias=to_end, **asked)
        return answer(model, params)

    ended = run()
    assert [o.token_id for o in ended] == [eos] and ended[-1].finish_reason == "stop"
    held = run(ignore_eos=True)
    assert len(held) == 12 and held[-1].finish_reason == "length"
    least = run(min_tokens=5)
    assert [o.token_id == eos for o in least] == [False] * 5 + [True]
    assert least[-1].finish_reason == "stop"
    sampled = answer(model, SamplingParams(max_tokens=12, seed=3, logit_bias=to_end, min_tokens=7))
    assert len(sampled) == 8 and sampled[-1].token_id == eos

"""Speculative decoding in the engine: drafted tokens verified in the decode pass give token
for token what plain decode gives (greedy, and seeded sampling: its randomness is per
position), in batches mixing speculating and plain sequences, with the pool intact."""

from __future__ import annotations

import pytest

from shared.engine.torch.speculate import CostCurve
from shared.messages.sampling import SamplingParams
from tests.engine.conftest import make_engine
from tests.engine.test_prefix_reuse import prompt


def repetitive(n: int, seed: int) -> list[int]:
    """A prompt that repeats itself (so n-gram drafts find matches)."""
    base = prompt(12, seed=seed)
    return (base * (n // len(base) + 1))[:n]


# A pass costs the same whatever its length: adaptive speculation then drafts wherever a draft
# may be accepted (what it chooses on a real curve depends on this machine's timing).
FLAT = CostCurve({1: 0.01, 512: 0.01})


def decode(model, prompts: list[list[int]], params: list[SamplingParams], **options):
    engine = make_engine(model, kv_cache_tokens=16384, **options)
    if options.get("speculative") == "adaptive":
        engine._base_cost = FLAT
    outs = [
        [engine.prefill(f"s{i}", p, q).token_id]
        for i, (p, q) in enumerate(zip(prompts, params, strict=False))
    ]
    while engine.running:
        for o in engine.step():
            outs[int(o.seq_id[1:])].append(o.token_id)
        engine.check_integrity()
    for i in range(len(prompts)):
        engine.free(f"s{i}")
    assert engine.pool.used_blocks == 0
    return outs, engine


@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-moe"])
@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_speculation_gives_plain_decodes_tokens(tiny_models, name: str, mode: str) -> None:
    model = tiny_models[name]
    prompts = [repetitive(60, s) for s in range(3)] + [prompt(30, seed=9)]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=5, ignore_eos=True)
    # Random weights never repeat themselves; pulled to two tokens, an answer does, and its
    # drafts are accepted.
    pulled = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, logit_bias=((77, 30.0), (78, 30.0))
    )
    params = [greedy, sampled, pulled, sampled]
    plain, _ = decode(model, prompts, params)
    spec, engine = decode(model, prompts, params, speculative=mode, max_draft=6, fixed_draft=4)
    assert spec == plain
    stats = engine.stats()
    assert 0 < stats.accepted_tokens <= stats.draft_tokens  # drafts made, and kept


def test_a_stop_string_and_max_tokens_end_a_speculating_answer_where_plain_ends(
    tiny_models,
) -> None:
    model = tiny_models["tiny"]
    ids = repetitive(60, 3)
    free, _ = decode(model, [ids], [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)])
    stop = model.tokenizer.decode(free[0][10:12])
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, stop=(stop,))
    plain, _ = decode(model, [ids], [params])
    spec, _ = decode(model, [ids], [params], speculative="fixed", fixed_draft=8, max_draft=8)
    assert spec == plain and len(plain[0]) < 30
    short = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    spec, _ = decode(model, [ids], [short], speculative="fixed", fixed_draft=8, max_draft=8)
    assert len(spec[0]) == 7


def test_adaptive_speculation_starts_on_a_pool_smaller_than_its_measuring(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], kv_cache_tokens=16, speculative="adaptive")
    assert engine.pool.used_blocks == 0 and engine.stats().kv_blocks_total == 2


def test_a_constrained_answer_speculates_to_the_same_tokens(tiny_models) -> None:
    """The grammar masks each verified position in order, so drafts the grammar forbids are
    rejected like any other."""
    from shared.model.grammar import json_grammar

    model = tiny_models["tiny"]
    schema = {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["ab", "ab ab"]}, "maxItems": 6}
        },
        "required": ["tags"],
    }
    params = SamplingParams(max_tokens=60, temperature=0, grammar=json_grammar(schema))
    ids = repetitive(40, 2)
    plain, _ = decode(model, [ids], [params])
    spec, engine = decode(model, [ids], [params], speculative="fixed", fixed_draft=4)
    assert spec == plain and engine.stats().draft_tokens > 0


def test_sampled_answers_follow_plain_decodes_distribution(tiny_models) -> None:
    """Independent samples (other seeds) with and without speculation: per position, the
    tokens' frequencies agree within what sampling noise allows, while drafts were both
    accepted and rejected (a biased acceptance would pull the drafted tokens' frequency up).
    (Adaptive verifies drafts the same way; it only chooses how many.)"""
    model = tiny_models["tiny"]
    n, length = 128, 6
    ids = repetitive(24, seed=4)

    def frequencies(first_seed: int, **options) -> tuple[list[dict[int, float]], object]:
        params = [
            SamplingParams(
                max_tokens=length,
                temperature=1.0,
                seed=first_seed + i,
                ignore_eos=True,
                logit_bias=((77, 30.0), (78, 30.0), (79, 30.0)),
            )
            for i in range(n)
        ]
        outs, engine = decode(model, [ids] * n, params, max_running=n, **options)
        counts = [{} for _ in range(length)]
        for out in outs:
            for pos, token in enumerate(out):
                counts[pos][token] = counts[pos].get(token, 0) + 1 / n
        return counts, engine

    plain, _ = frequencies(0)
    spec, engine = frequencies(10_000, speculative="fixed", max_draft=4, fixed_draft=3)
    stats = engine.stats()
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # some taken, some refused
    for pos in range(length):
        tokens = set(plain[pos]) | set(spec[pos])
        distance = sum(abs(plain[pos].get(t, 0) - spec[pos].get(t, 0)) for t in tokens) / 2
        assert distance < 0.2, (pos, plain[pos], spec[pos])  # (noise: ~0.06 at 128 each)

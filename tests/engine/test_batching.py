"""Continuous batching: sequences join and leave between steps; a sequence's greedy output in
a batch equals its output alone; the pool refuses work it cannot hold, clearly."""

from __future__ import annotations

import pytest

from shared.engine.interface import PoolExhausted, PrefillRequest
from shared.engine.torch.blocks import BlockPool
from shared.messages.sampling import SamplingParams
from tests.engine.conftest import make_engine
from tests.engine.test_prefix_reuse import prompt


def run_alone(model, ids: list[int], params: SamplingParams) -> list[int]:
    engine = make_engine(model)
    out = [engine.prefill("s", ids, params).token_id]
    while engine.running:
        out += [o.token_id for o in engine.step()]
    return out


def run_staggered(model, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Sequence i joins before step i; each leaves when done."""
    engine = make_engine(model)
    outs: list[list[int]] = [[] for _ in prompts]
    pending = list(range(len(prompts)))
    while pending or engine.running:
        if pending:
            i = pending.pop(0)
            outs[i].append(engine.prefill(f"s{i}", prompts[i], params[i]).token_id)
        for o in engine.step():
            outs[int(o.seq_id[1:])].append(o.token_id)
        engine.check_integrity()
    return outs


@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-moe"])
def test_batched_greedy_equals_alone(tiny_models, name: str) -> None:
    model = tiny_models[name]
    prompts = [prompt(n, seed=n) for n in (5, 37, 64, 90)]
    params = [SamplingParams(max_tokens=m, temperature=0) for m in (12, 3, 20, 8)]
    together = run_staggered(model, prompts, params)
    assert together == [run_alone(model, p, sp) for p, sp in zip(prompts, params, strict=True)]
    assert [len(o) for o in together] == [12, 3, 20, 8]


def test_real_model_batched_equals_alone(real_model) -> None:
    tok, template = real_model.tokenizer, real_model.chat_template
    questions = ["What is 2+2?", "Name a color.", "Write a haiku about the sea."]
    prompts = [tok.encode(template.render([{"role": "user", "content": q}])).ids for q in questions]
    params = [SamplingParams(max_tokens=10, temperature=0)] * 3
    assert run_staggered(real_model, prompts, params) == [
        run_alone(real_model, p, sp) for p, sp in zip(prompts, params, strict=True)
    ]


def test_seeded_sampling_is_reproducible(tiny_models) -> None:
    model = tiny_models["tiny"]
    ids = prompt(20)
    sampled = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    assert run_alone(model, ids, sampled) == run_alone(model, ids, sampled)
    other = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=8)
    assert run_alone(model, ids, sampled) != run_alone(model, ids, other)
    top1 = SamplingParams(max_tokens=12, temperature=1.0, top_k=1, seed=3)
    assert run_alone(model, ids, top1) == run_alone(model, ids, SamplingParams(12, 0.0))


def test_stop_token_and_stop_string(tiny_models) -> None:
    model = tiny_models["tiny"]
    ids = prompt(20)
    free_run = run_alone(model, ids, SamplingParams(max_tokens=10, temperature=0))
    engine = make_engine(model)
    stop_at = SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(free_run[3],))
    first = engine.prefill("a", ids, stop_at)
    outs = [first] + [o for _ in range(10) for o in engine.step()]
    assert [o.token_id for o in outs] == free_run[: free_run.index(free_run[3]) + 1]
    assert outs[-1].finish_reason == "stop"

    text = model.tokenizer.decode(free_run)
    needle = text[len(model.tokenizer.decode(free_run[:5])) - 2 :][:4]  # spans tokens 4 and 5
    engine = make_engine(model)
    first = engine.prefill("b", ids, SamplingParams(max_tokens=10, temperature=0, stop=(needle,)))
    outs = [first] + [o for _ in range(10) for o in engine.step()]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_string == needle
    assert needle in model.tokenizer.decode([o.token_id for o in outs])
    assert len(outs) < 10


def test_max_tokens_gives_length(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"])
    first = engine.prefill("a", prompt(10), SamplingParams(max_tokens=1, temperature=0))
    assert first.finish_reason == "length"
    assert engine.running == []


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("max_tokens", 0, "at least 1"),
        ("temperature", -1.0, "between 0 and 2"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_k", -5, "0 (no limit)"),
    ],
)
def test_bad_sampling_params_name_the_field(field: str, value, says: str) -> None:
    with pytest.raises(ValueError, match=rf"{field} .*{__import__('re').escape(says)}"):
        SamplingParams(**{field: value})


def test_prompt_beyond_context_is_refused(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], kv_cache_tokens=16384)
    with pytest.raises(ValueError, match="exceeds the model's context of 4096 tokens"):
        engine.prefill("a", prompt(4000), SamplingParams(max_tokens=200))


def test_full_pool_refuses_then_admits_after_free(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], kv_cache_tokens=128)  # 16 blocks of 8
    params = SamplingParams(max_tokens=8, temperature=0)
    engine.prefill("a", prompt(50), params)  # 58 tokens reserved: 8 blocks
    assert engine.can_admit(50, params)
    engine.prefill("b", prompt(50, seed=1), params)
    assert not engine.can_admit(50, params)
    with pytest.raises(PoolExhausted, match=r"8 blocks of 8 tokens needed, 0 of 16 free"):
        engine.prefill("c", prompt(50, seed=2), params)
    engine.check_integrity()
    while engine.running:  # the running sequences are unharmed
        engine.step()
    engine.free("a")
    assert engine.can_admit(50, params)
    engine.prefill("c", prompt(50, seed=2), params)
    engine.check_integrity()


def test_block_pool_sharing_and_integrity() -> None:
    pool = BlockPool(4, 16)
    a = pool.allocate(2)
    pool.share(a)
    pool.free(a)
    assert pool.free_blocks == 2  # still held once
    pool.free(a)
    assert pool.free_blocks == 4
    pool.check_integrity()
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(a)


def test_moe_counts_tokens_per_expert(tiny_models) -> None:
    model = tiny_models["tiny-moe"]
    engine = make_engine(model, prefill_chunk=64)
    engine.prefill("a", prompt(30), SamplingParams(max_tokens=2))
    counts = engine.model.expert_counts
    moe = model.config.moe
    assert counts.shape == (len(moe.layers), moe.n_experts)
    assert counts.sum(dim=1).tolist() == [30 * moe.top_k] * len(moe.layers)
    engine.step()
    assert counts.sum(dim=1).tolist() == [moe.top_k] * len(moe.layers)


@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-moe"])
def test_batched_prefill_equals_one_at_a_time(tiny_models, name: str) -> None:
    model = tiny_models[name]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [prompt(n, seed=n) for n in (3, 17, 40)]
    engine = make_engine(model)
    reqs = [PrefillRequest(f"s{i}", ids, params) for i, ids in enumerate(prompts)]
    reqs.insert(1, PrefillRequest("too-long", prompt(9000), params))  # refused alone
    firsts = engine.prefill_batch(reqs)
    assert isinstance(firsts[1], ValueError) and "context" in str(firsts[1])
    outs = {f"s{i}": [firsts[j].token_id] for i, j in ((0, 0), (1, 2), (2, 3))}
    while engine.running:
        for o in engine.step():
            outs[o.seq_id].append(o.token_id)
    engine.check_integrity()
    for i, ids in enumerate(prompts):
        assert outs[f"s{i}"] == run_alone(model, ids, params)

"""Expert placement in the engine (tiny-moe): the MoE layers follow any placement with the same
numbers, deal an expert's tokens evenly over its replicas, and the engine counts load, replans
on schedule and records load files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shared.eplb.placement import Placement
from shared.eplb.stats import read_load
from shared.messages.sampling import SamplingParams
from tests.engine.conftest import make_engine
from tests.engine.test_prefix_reuse import prompt


def random_placement(rng: np.random.Generator, layers: int, experts: int, slots: int):
    rows = []
    for _ in range(layers):
        extra = rng.integers(0, experts, slots - experts)
        rows.append(rng.permutation(np.concatenate([np.arange(experts), extra])))
    return np.stack(rows)


def hidden(engine, ids: list[int]) -> torch.Tensor:
    """The final hidden states of a fresh forward pass over ``ids`` (scratch blocks)."""
    from shared.engine.torch.model import Segment
    from shared.engine.torch.sequence import Sequence

    blocks = engine.pool.allocate(engine.pool.blocks_for(len(ids)))
    try:
        seq = Sequence("", list(ids), SamplingParams(), block_table=blocks)
        seg = Segment(0, len(ids), seq.slots(engine.block_size, len(ids)))
        return engine.model.forward(
            torch.tensor(ids), torch.arange(len(ids)), [seg], engine.cache
        ).clone()
    finally:
        engine.pool.free(blocks)


def test_logits_are_identical_under_any_placement_and_replica_split(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny-moe"])
    moe = engine.config.moe
    ids = prompt(57, seed=3)
    before = hidden(engine, ids)
    rng = np.random.default_rng(0)
    for slots in (4, 6, 8, 12):
        placement = random_placement(rng, len(moe.layers), moe.n_experts, slots)
        engine.model.place(placement)
        assert torch.equal(hidden(engine, ids), before)
        counts = engine.model.slot_counts.numpy()
        experts = engine.model.expert_counts.numpy()
        assert (counts.sum(1) == len(ids) * moe.top_k).all()
        for layer, row in enumerate(placement):
            for e in range(moe.n_experts):
                share = counts[layer, row == e]  # what each replica of e computed
                assert share.sum() == experts[layer, e]
                assert share.max() - share.min() <= 1  # dealt evenly


def test_the_engine_counts_load_replans_on_schedule_and_decodes_the_same(
    tiny_models, tmp_path
) -> None:
    model = tiny_models["tiny-moe"]
    record = tmp_path / "load.npz"
    params = SamplingParams(max_tokens=31, temperature=0, ignore_eos=True)

    def run(**options) -> tuple[list[list[int]], object]:
        engine = make_engine(model, **options)
        outs = [[engine.prefill(f"s{i}", prompt(20, seed=i), params).token_id] for i in range(3)]
        while engine.running:
            for o in engine.step():
                outs[int(o.seq_id[1:])].append(o.token_id)
        engine.cleanup()
        return outs, engine

    plain, _ = run()
    placed, engine = run(
        eplb_cards=2,
        eplb_slots=6,
        eplb_window_steps=5,
        eplb_replan_steps=10,
        eplb_move_cost=0.0,  # (any gain pays: a plan is taken)
        eplb_record=str(record),
    )
    assert placed == plain
    stats = engine.stats().eplb
    assert stats.steps == 30 and stats.replans == 3  # at steps 10, 20, 30
    assert stats.last_plan_s is not None and stats.last_plan_s < 5
    assert stats.measured >= 1.0 and len(stats.measured_cards) == 2
    assert sum(stats.measured_cards) == pytest.approx(1.0)
    # Three sequences on 4 experts over 2 cards are uneven: with moves free a plan was taken,
    # its prediction known per card.
    assert stats.moves > 0, stats
    assert stats.predicted >= 1.0 and sum(stats.predicted_cards) == pytest.approx(1.0)
    engine.balancer.placement.check_integrity()
    counts = read_load(record)
    moe = model.config.moe
    assert counts.shape == (30, len(moe.layers), moe.n_experts)
    assert (counts.sum(-1) == 3 * moe.top_k).all()  # three sequences a step, top-k each


def test_a_placement_that_cannot_hold_the_experts_is_refused(tiny_models) -> None:
    with pytest.raises(ValueError, match="eplb_slots: a multiple of eplb_cards"):
        make_engine(tiny_models["tiny-moe"], eplb_cards=4, eplb_slots=6)
    with pytest.raises(ValueError, match="eplb_slots: at least the 4 experts"):
        make_engine(tiny_models["tiny-moe"], eplb_cards=1, eplb_slots=3)
    with pytest.raises(ValueError, match="eplb_replan_steps: a multiple"):
        make_engine(
            tiny_models["tiny-moe"], eplb_cards=2, eplb_window_steps=3, eplb_replan_steps=10
        )
    assert make_engine(tiny_models["tiny"], eplb_cards=2).balancer is None  # not MoE: off


def test_a_taken_plan_is_what_the_layers_follow(tiny_models) -> None:
    engine = make_engine(
        tiny_models["tiny-moe"],
        eplb_cards=2,
        eplb_slots=8,
        eplb_window_steps=4,
        eplb_replan_steps=4,
    )
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i in range(4):
        engine.prefill(f"s{i}", prompt(16, seed=10 + i), params)
    for _ in range(12):
        engine.step()
        follows = Placement(engine.balancer.placement.slot_expert, 4, 2)
        dispatched = engine.model.slot_counts.numpy()
        assert dispatched.shape == follows.slot_expert.shape
    assert engine.balancer.replans == 3
    row = engine.balancer.placement.slot_expert[0]
    counts = engine.model.slot_counts.numpy()[0]
    experts = engine.model.expert_counts.numpy()[0]
    for e in range(4):  # the last step's dispatch matches the balancer's placement
        assert counts[row == e].sum() == experts[e]

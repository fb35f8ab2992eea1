"""The expert placement planner: its invariants (every expert placed, equal slots per card,
moves counted right), its balance against the greedy baseline, forecasts that follow what the
history shows, and load files that round-trip."""

from __future__ import annotations

import numpy as np
import pytest

from shared.eplb.placement import Placement, contiguous, gamma, moves, relabel_cards
from shared.eplb.planner import Planner, forecast, greedy_plan, pack, packed_plan, replicate
from shared.eplb.stats import LoadWindows, Window, read_load, write_load


def zipf_load(layers: int, experts: int, alpha: float, seed: int, total: float = 1e5):
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(experts) for _ in range(layers)])
    share = (1.0 + ranks) ** -alpha
    return total * share / share.sum(-1, keepdims=True)


def steps_of(mean: np.ndarray, steps: int, spread: float, seed: int) -> np.ndarray:
    """Per-step counts [steps, layers, experts] around ``mean`` with lognormal noise."""
    rng = np.random.default_rng(seed)
    return mean[None] * rng.lognormal(0, spread, (steps, *mean.shape))


def test_replicas_go_to_the_most_load_per_replica() -> None:
    counts = replicate(np.array([100.0, 10, 40, 1]), 8)
    assert counts.sum() == 8 and (counts >= 1).all()
    assert counts.tolist() == [4, 1, 2, 1]  # 25, 10, 20, 1 per replica: no move lowers the max


def test_packing_fills_every_card_equally_and_balances() -> None:
    weight = np.array([9.0, 8, 7, 6, 5, 4, 3, 2])
    card = pack(weight, 4)
    assert np.bincount(card).tolist() == [2, 2, 2, 2]
    loads = np.bincount(card, weights=weight)
    assert loads.max() - loads.min() <= 1


@pytest.mark.parametrize("alpha", [0.8, 1.2])
def test_every_plan_places_every_expert_with_equal_slots_per_card(alpha: float) -> None:
    load = zipf_load(3, 48, alpha, seed=1)
    windows = [Window.of(steps_of(load, 50, 0.05, seed=s)) for s in range(4)]
    current = contiguous(3, 48, 8, 56)
    planner = Planner(8, 56, replan_steps=200, window_steps=50)
    for p in (greedy_plan(load, 8, 56), planner.plan(windows, current).placement):
        p.check_integrity()
        assert p.slot_expert.shape == (3, 56) and p.per_card == 7
        assert (p.replicas().sum(1) == 56).all()
        share = p.card_share()
        assert np.allclose(share.sum(-1), 1.0)  # every expert's tokens served, once
    ours = planner.plan(windows, current).placement
    # No expert has more replicas than cards, so no card holds one twice.
    assert (ours.replicas() <= 8).all()
    per_card = ours.slot_expert.reshape(3, 8, 7)
    assert all(len(set(c.tolist())) == 7 for layer in per_card for c in layer)
    assert packed_plan(load, 8).slots == 48


def test_replicas_of_the_busiest_expert_bring_the_busiest_card_near_the_mean() -> None:
    load = zipf_load(2, 64, 1.2, seed=2)
    without = gamma(contiguous(2, 64, 8).card_loads(load)).max()
    with_replicas = gamma(greedy_plan(load, 8, 80).card_loads(load)).max()
    assert without > 2.0 and with_replicas < 1.1


def test_moves_count_the_experts_a_card_newly_holds() -> None:
    old = Placement(np.array([[0, 1, 2, 3, 4, 5]]), 6, 3)  # cards {0,1} {2,3} {4,5}
    same_cards_other_order = Placement(np.array([[1, 0, 3, 2, 5, 4]]), 6, 3)
    assert moves(old, same_cards_other_order) == 0
    one_swap = Placement(np.array([[0, 2, 1, 3, 4, 5]]), 6, 3)
    assert moves(old, one_swap) == 2  # card 0 loads 2, card 1 loads 1
    replica = Placement(np.array([[0, 1, 2, 3, 4, 0]]), 6, 3)
    assert moves(old, replica) == 1  # card 2 loads a copy of 0


def test_renumbering_cards_keeps_the_balance_and_moves_fewer_experts() -> None:
    load = zipf_load(2, 48, 1.0, seed=3)
    old = greedy_plan(load, 8, 56)
    # The same plan with its cards in another order moves every expert unless renumbered.
    shuffled = Placement(
        np.stack([row.reshape(8, 7)[::-1].ravel() for row in old.slot_expert]), 48, 8
    )
    assert moves(old, shuffled) > 0
    renumbered = relabel_cards(old, shuffled)
    assert moves(old, renumbered) == 0
    assert np.allclose(
        np.sort(renumbered.card_loads(load), -1), np.sort(shuffled.card_loads(load), -1)
    )


def test_a_plan_that_does_not_pay_for_its_moves_is_not_taken() -> None:
    load = zipf_load(2, 48, 1.0, seed=4)
    windows = [Window.of(steps_of(load, 100, 0.02, seed=s)) for s in range(3)]
    planner = Planner(8, 56, replan_steps=300, window_steps=100)
    first = planner.plan(windows, contiguous(2, 48, 8, 56))
    assert first.taken and first.predicted < first.current and first.moves > 0
    assert first.gain == pytest.approx((first.current - first.predicted) * 300)
    # Planned again on the same load, from its own plan: nothing left to gain.
    again = planner.plan(windows, first.placement)
    assert again.moves == 0 or not again.taken
    assert again.placement is first.placement or moves(first.placement, again.placement) == 0
    dear = Planner(8, 56, replan_steps=300, window_steps=100, move_cost=1e9)
    assert not dear.plan(windows, contiguous(2, 48, 8, 56)).taken


def test_the_plan_beats_greedy_on_the_next_window_when_load_trends() -> None:
    """Load moving steadily from some experts to others: greedy plans on the last window, the
    planner on where the trend leads; both are scored on the windows after."""
    layers, experts, cards, slots = 2, 64, 8, 80
    start = zipf_load(layers, experts, 1.0, seed=5)
    rng = np.random.default_rng(6)
    velocity = rng.normal(0, 0.15, start.shape)  # log-load per window
    means = [start * np.exp(velocity * w) for w in range(14)]
    windows = [Window.of(steps_of(m, 40, 0.05, seed=w)) for w, m in enumerate(means)]
    planner = Planner(cards, slots, replan_steps=160, window_steps=40)
    plan = planner.plan(windows[:10], contiguous(layers, experts, cards, slots))
    greedy = greedy_plan(windows[9].mean, cards, slots)
    future = np.concatenate([steps_of(m, 40, 0.05, seed=100 + i) for i, m in enumerate(means[10:])])
    ours = gamma(plan.placement.card_loads(future)).mean()
    theirs = gamma(greedy.card_loads(future)).mean()
    assert ours < theirs


def test_the_forecast_follows_a_trend_and_smooths_noise() -> None:
    base = zipf_load(1, 32, 1.0, seed=7)
    rising = [Window.of(steps_of(base * 1.1**w, 50, 0.02, seed=w)) for w in range(12)]
    f = forecast(rising, horizon=4)
    assert (f.mean > rising[-1].mean).mean() > 0.8  # it expects the rise to go on
    rng = np.random.default_rng(8)
    wobbling = [Window.of(base[None] * rng.lognormal(0, 0.3, (1, *base.shape))) for _ in range(24)]
    f = forecast(wobbling, horizon=4)
    assert not f.model.startswith("the last window")  # alone, not the best guess of noise
    assert np.abs(f.mean - base).sum() < np.abs(wobbling[-1].mean - base).sum()


def test_windows_close_every_window_steps_and_keep_the_last_few() -> None:
    windows = LoadWindows(layers=2, experts=3, window_steps=4, keep=2)
    closed = [windows.add(np.array([[1, 2, 3], [4, 5, 6]])) for _ in range(12)]
    assert closed == [False, False, False, True] * 3
    assert len(windows.windows) == 2 and windows.steps == 12
    w = windows.last()
    assert w.steps == 4 and w.total.tolist() == [[4, 8, 12], [16, 20, 24]]
    assert np.allclose(w.var, 0) and w.peak.tolist() == [[1, 2, 3], [4, 5, 6]]


@pytest.mark.parametrize("suffix", [".npz", ".json"])
def test_a_load_file_round_trips(tmp_path, suffix: str) -> None:
    counts = np.random.default_rng(9).integers(0, 50, (30, 2, 6))
    path = tmp_path / f"load{suffix}"
    write_load(path, counts)
    assert np.array_equal(read_load(path), counts)


def test_a_bad_load_file_is_refused_naming_its_shape(tmp_path) -> None:
    path = tmp_path / "load.json"
    path.write_text('{"counts": [1, 2, 3]}')
    with pytest.raises(ValueError, match=r"\[steps, layers, experts\].*\[3\]"):
        read_load(path)
    path.write_text('{"counts": [[1, -2]]}')
    with pytest.raises(ValueError, match="negative"):
        read_load(path)


@pytest.mark.parametrize("cards", [1, 2])
def test_a_plan_on_one_or_two_cards(cards: int) -> None:
    load = zipf_load(2, 4, 1.0, seed=10)
    windows = [Window.of(steps_of(load, 20, 0.1, seed=s)) for s in range(3)]
    planner = Planner(cards, 6 if cards == 2 else 5, replan_steps=40, window_steps=20)
    plan = planner.plan(windows, contiguous(2, 4, cards, planner.slots))
    plan.placement.check_integrity()
    if cards == 1:  # one card holds everything: no plan is better, none is taken
        assert plan.predicted == pytest.approx(plan.current) == pytest.approx(1.0)
        assert not plan.taken and plan.moves == 0
    else:  # the busiest expert of each layer replicated, the cards nearer even
        assert plan.taken and plan.predicted < plan.current - 0.05
        busiest = load.argmax(-1)
        assert (plan.placement.replicas()[np.arange(2), busiest] >= 2).all()

"""Speculation's model-free parts: n-gram drafts, acceptance estimates, the cost curve and
the choice of each sequence's verification length."""

from __future__ import annotations

import pytest

from shared.engine.torch.speculate import (
    Acceptance,
    AcceptanceTable,
    CostCurve,
    NgramIndex,
    choose_lengths,
)


def test_a_draft_continues_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    index = NgramIndex(max_n=3)
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    draft = index.draft(tokens, 4)
    assert draft.match == 2  # "2 3": last seen followed by 7 8 5 2
    assert draft.tokens == [7, 8, 5, 2]
    tokens += [7, 8]  # extended token by token, the index follows
    assert index.draft(tokens, 2).tokens == [5, 2] and index.draft(tokens, 2).match == 3
    assert NgramIndex(max_n=3).draft([4, 5, 6], 4).tokens == []  # nothing repeats


def test_the_engine_table_starts_at_the_prior_and_learns_by_match_and_position() -> None:
    table = AcceptanceTable()
    assert table.chance(0, match=1) == pytest.approx(0.5)
    assert table.chance(0, match=4) > table.chance(0, match=1)  # a longer match predicts better
    for _ in range(50):  # long matches are right twice, short ones never
        table.record(match=4, verified=3, accepted=2)
        table.record(match=1, verified=2, accepted=0)
    assert table.chance(0, 4) > 0.9 and table.chance(1, 4) > 0.9 and table.chance(2, 4) < 0.1
    assert table.chance(0, 1) < 0.1
    # A position after a rejected one was never tried: still the prior (the chances are each
    # given the ones before, so their product is the chance of the prefix).
    assert table.chance(1, 1) == pytest.approx(0.5)
    assert table.chance(0, 2) == pytest.approx(0.58)  # a match length not seen: still the prior


def test_a_sequence_starts_at_the_engine_figure_and_learns_its_own() -> None:
    acc = Acceptance()
    assert acc.chance(0, prior=0.8) == pytest.approx(0.8)
    for _ in range(30):
        acc.record(verified=3, accepted=1)  # the first is right, the second never
    assert acc.chance(0, prior=0.2) > 0.8 and acc.chance(1, prior=0.8) < 0.2
    assert acc.chance(2, prior=0.8) == pytest.approx(0.8)  # after the rejected one: untried


def test_the_cost_curve_goes_through_its_points_and_follows_what_it_sees() -> None:
    curve = CostCurve({1: 0.030, 2: 0.033, 3: 0.050, 4: 0.040, 8: 0.080})
    assert curve(3) > curve(4)  # a kernel's step is kept: four rows cheaper than three
    assert curve(6) == pytest.approx(0.060)  # between points: the straight line
    assert curve(10) == pytest.approx(0.100)  # beyond: the last segment's slope
    assert curve(0) == 0.0
    one, eight = curve(1), curve(8)
    for _ in range(200):  # plain steps (one token) are slower than measured: all sizes follow
        curve.observe(1, one * 1.5)
    assert curve(1) == pytest.approx(one * 1.5, rel=0.01)
    assert curve(8) == pytest.approx(eight * 1.5, rel=0.01)


def test_a_size_measured_badly_at_start_is_corrected_by_the_passes_that_use_it() -> None:
    curve = CostCurve({1: 0.030, 2: 0.060, 3: 0.050, 4: 0.040})  # 2: a busy moment at start
    for _ in range(40):
        curve.observe(1, 0.030)
        curve.observe(2, 0.032)
    assert curve(2) == pytest.approx(0.032, rel=0.02)
    assert curve(1) == pytest.approx(0.030, rel=0.02)
    assert curve(3) > curve(4)  # sizes not seen keep the measured shape


def test_lengths_follow_the_chances_and_the_cost() -> None:
    flat = CostCurve({1: 0.030, 64: 0.031})  # memory-bound: more tokens cost little
    steep = CostCurve({1: 0.030, 2: 0.060, 3: 0.090})  # compute-bound: each token, a pass
    sure = ([0.95, 0.95, 0.95, 0.95], 4)
    unsure = ([0.1, 0.1], 2)
    assert choose_lengths([sure, unsure], flat) == [4, 2]  # cheap: verify everything
    assert choose_lengths([sure, unsure], steep) == [0, 0]  # a draft costs more than it gives
    mid = CostCurve({1: 0.030, 4: 0.036, 16: 0.080})
    lengths = choose_lengths([sure, unsure], mid)
    assert lengths[0] >= 2 and lengths[1] == 0  # the sure draft first, the unsure not at all
    assert choose_lengths([([], 0)], flat) == [0]


def test_a_dear_step_on_the_way_does_not_stop_a_length_that_pays_overall() -> None:
    """Sure drafts: even if the second token looks dear next to the first, eight pay."""
    curve = CostCurve({1: 0.030, 2: 0.040, 8: 0.046})
    sure = ([0.95] * 8, 8)
    assert choose_lengths([sure], curve) == [8]


def test_a_cheap_length_past_a_dear_one_is_found() -> None:
    """Four rows cheaper than three (a BLAS kernel's step): a sure draft takes three tokens
    (four in the pass), not two."""
    curve = CostCurve({1: 0.030, 2: 0.033, 3: 0.050, 4: 0.040, 5: 0.070, 6: 0.072})
    sure = ([0.9] * 5, 5)
    assert choose_lengths([sure], curve) == [3]

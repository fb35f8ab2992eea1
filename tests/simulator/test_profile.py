"""The engine profile the simulator will run on (simulator/profile.py): exact at the measured
points, linear between them, extended past them by the last segment's growth, scaled to a
card's rate with its shape kept, and read back from its JSON file."""

from __future__ import annotations

from pathlib import Path

import pytest

from simulator.profile import EngineProfile

CACHED = (0, 1024, 4096)
UNCACHED = (64, 512, 2048)


def cost(cached: int, uncached: int) -> float:
    """A made-up engine: a fixed cost per pass, per token, and attention over the context."""
    return 0.01 + uncached * 1e-3 + uncached * cached * 1e-7


def measured() -> EngineProfile:
    return EngineProfile(
        engine="torch",
        model="test",
        machine="test",
        cached=CACHED,
        uncached=UNCACHED,
        seconds=tuple(tuple(cost(c, u) for u in UNCACHED) for c in CACHED),
        spread=0.03,
        batch_tokens=64,
        batch=((1, 0.08), (4, 0.2), (8, 0.35)),
    )


def test_the_measured_points_come_back_and_between_them_it_is_linear() -> None:
    p = measured()
    p.check_integrity()
    for c in CACHED:
        for u in UNCACHED:
            assert p.prefill_s(c, u) == pytest.approx(cost(c, u))
    # cost() is linear in each axis alone: the interpolation is exact along a grid line
    assert p.prefill_s(0, 1000) == pytest.approx(cost(0, 1000))
    assert p.prefill_s(2000, 512) == pytest.approx(cost(2000, 512))
    assert p.batch_s(6) == pytest.approx(0.275)


def test_a_longer_context_costs_more_per_token_also_past_the_grid() -> None:
    p = measured()
    per_token = [p.prefill_s(c, 512) / 512 for c in (0, 1024, 4096, 16384)]
    assert per_token == sorted(per_token) and per_token[-1] > per_token[-2]
    assert p.prefill_s(16384, 512) == pytest.approx(cost(16384, 512))  # the growth kept
    assert p.prefill_s(0, 8192) == pytest.approx(cost(0, 8192))


def test_scaled_to_a_card_keeps_the_shape() -> None:
    p = measured()
    card = p.scaled(60_000)
    assert card.tok_s(0, 1024) == pytest.approx(60_000)
    ratio = card.prefill_s(4096, 512) / card.prefill_s(0, 512)
    assert ratio == pytest.approx(p.prefill_s(4096, 512) / p.prefill_s(0, 512))
    assert card.batch_s(4) / card.batch_s(1) == pytest.approx(p.batch_s(4) / p.batch_s(1))


def test_a_profile_file_round_trips_and_a_bad_one_is_named(tmp_path: Path) -> None:
    p = measured()
    path = tmp_path / "profile.json"
    path.write_text(p.to_json())
    assert EngineProfile.read(path) == p
    path.write_text(p.to_json().replace('"uncached": [\n  64', '"uncached": [\n  4096'))
    with pytest.raises(ValueError, match="profile.json: not an engine profile .*not ascending"):
        EngineProfile.read(path)

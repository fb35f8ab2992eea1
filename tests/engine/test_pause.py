"""A prefill paused between chunks (for more urgent work) goes on where it stopped: the same
first token and KV as one never paused, and nothing computed twice."""

from __future__ import annotations

import pytest

from shared.engine.interface import Paused
from shared.messages.sampling import SamplingParams
from tests.engine.conftest import make_engine

GREEDY = SamplingParams(max_tokens=4, temperature=0)


def test_a_paused_prefill_goes_on_to_the_same_first_token(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], prefill_chunk=32)
    prompt = [(i * 131) % 900 + 5 for i in range(150)]  # five chunks
    whole = engine.prefill("whole", prompt, GREEDY, handoff=True)
    kv_whole = engine.export_kv("whole", partial=True)
    engine.free("whole")

    def pause() -> bool:
        return True  # something more urgent is always waiting

    for turn in range(1, 5):
        with pytest.raises(Paused) as paused:
            engine.prefill("paused", prompt, GREEDY, handoff=True, pause=pause)
        assert paused.value.n_cached == 32 * turn  # one chunk a turn, none computed twice
    out = engine.prefill("paused", prompt, GREEDY, handoff=True, pause=pause)
    assert out.token_id == whole.token_id
    assert engine.export_kv("paused", partial=True) == kv_whole
    engine.free("paused")
    assert engine.stats().kv_blocks_used == 0


def test_a_paused_prefill_that_is_cancelled_gives_its_blocks_back(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], prefill_chunk=32)
    prompt = list(range(10, 110))
    with pytest.raises(Paused):
        engine.prefill("p", prompt, GREEDY, handoff=True, pause=lambda: True)
    assert engine.holds("p") and engine.stats().kv_blocks_used > 0
    engine.free("p")
    assert not engine.holds("p") and engine.stats().kv_blocks_used == 0

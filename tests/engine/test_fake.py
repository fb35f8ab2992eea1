"""The fake-paced engine (for benchmarks of the mesh): real prefill, a paced fixed token."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shared.engine.interface import EngineOptions, PrefillRequest
from shared.engine.registry import load_engine
from shared.messages.sampling import SamplingParams


def test_it_prefills_for_real_and_decodes_a_fixed_token_at_its_pace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVMESH_FAKE_STEP_MS", "30")
    engine = load_engine("fake-paced", "tiny", tmp_path, EngineOptions(kv_cache_tokens=1024))
    engine.start()
    real = load_engine("torch", "tiny", tmp_path, EngineOptions(kv_cache_tokens=1024))
    real.start()
    params = SamplingParams(max_tokens=4, temperature=0)
    prompt = list(range(10, 80))
    first = engine.prefill("s", prompt, params)
    assert first.token_id == real.prefill("s", prompt, params).token_id  # the model's own
    steps, started = [], time.perf_counter()
    while engine.running:
        steps.append(engine.step())
    took = time.perf_counter() - started
    tokens = [o.token_id for step in steps for o in step]
    assert len(set(tokens)) == 1 and len(tokens) == 3  # one fixed token a step, to max_tokens
    assert steps[-1][0].finish_reason == "length"
    assert took >= 2 * 0.030  # paced: no step sooner than its interval after the one before
    engine.free("s")
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0


def test_with_a_fake_prefill_nothing_is_computed_and_the_kv_still_moves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVMESH_FAKE_PREFILL", "1")
    monkeypatch.setenv("KVMESH_FAKE_STEP_MS", "1")
    engine = load_engine("fake-paced", "tiny", tmp_path, EngineOptions(kv_cache_tokens=1024))
    engine.start()

    def no_forward_pass(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the fake prefill ran the model")

    monkeypatch.setattr(engine.model, "forward", no_forward_pass)
    params = SamplingParams(max_tokens=3, temperature=0)
    prompt = list(range(10, 200))
    first = engine.prefill("h", prompt, params, handoff=True)  # prefill-worker style
    (batched,) = engine.prefill_batch([PrefillRequest("b", prompt, params, None, False, ())])
    assert first.token_id == batched.token_id == engine.token
    assert "h" not in engine.running and "b" in engine.running
    kv = engine.export_kv("h")  # a handoff ships the prompt's (uncomputed) KV as usual
    assert len(kv) > 0 and engine.sequence("h").n_cached == len(prompt)
    while engine.running:
        engine.step()
    assert engine.sequence("b").finish_reason == "length"
    for seq_id in ("h", "b"):
        engine.free(seq_id)
    engine.check_integrity()
    assert engine.stats().kv_blocks_used == 0

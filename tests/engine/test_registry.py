"""Engines by name: the registry loads a backend behind the interface, or names the choices."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from shared.engine.interface import Engine, EngineOptions, OwningEngine
from shared.engine.registry import ENGINES, OWNING, engine_class, load_engine
from shared.messages.sampling import SamplingParams


def test_every_registered_backend_implements_the_whole_interface() -> None:
    for name in ENGINES:
        cls = engine_class(name)
        assert issubclass(cls, OwningEngine if name in OWNING else Engine), name
        assert not inspect.isabstract(cls), f"{name} leaves {cls.__abstractmethods__} out"


def test_an_unknown_engine_is_named_with_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown engine 'trtllm'; one of torch"):
        engine_class("trtllm")


def test_load_engine_serves_a_model_through_the_interface(tmp_path: Path) -> None:
    """What a worker does: load by name, then only interface calls."""
    engine: Engine = load_engine("torch", "tiny", tmp_path, EngineOptions(kv_cache_tokens=1024))
    engine.start()
    stats = engine.stats()
    assert (stats.kv_blocks_used, stats.kv_blocks_total, stats.block_size) == (0, 16, 64)
    params = SamplingParams(max_tokens=3, temperature=0)
    out = engine.prefill("s", list(range(10, 80)), params)
    assert engine.holds("s") and engine.running == ["s"]
    tokens = [out.token_id] + [o.token_id for o in engine.step() + engine.step()]
    seq = engine.sequence("s")
    assert seq.output_ids == tokens and seq.finish_reason == "length"
    assert seq.n_cached == 72  # prompt and the tokens fed back; the last one's KV is not computed
    assert engine.stats().kv_blocks_used == 2
    blobs = engine.export_blocks("s", 0, 1)
    engine.free("s")
    assert not engine.holds("s") and engine.stats().kv_blocks_used == 0
    prefix = engine.import_blocks(blobs)
    assert prefix.n_tokens == 64 and engine.stats().kv_blocks_used == 1
    engine.release(prefix)
    engine.cleanup()

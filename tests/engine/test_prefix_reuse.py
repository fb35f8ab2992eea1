"""Prefill over a cached prefix gives the logits of a full recompute; KV survives export and
import, and a sliding-window layer's import reads only the blocks inside its window."""

from __future__ import annotations

import io

import pytest
import torch

from shared.engine.interface import BadBlock, KVFormatError
from shared.engine.torch.loader import LoadedModel
from shared.messages.sampling import SamplingParams
from tests.engine.conftest import make_engine

GREEDY = SamplingParams(max_tokens=4, temperature=0)


class CountingReader(io.BytesIO):
    """Counts the bytes a reader actually reads."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.bytes_read = 0

    def read(self, size: int = -1) -> bytes:
        chunk = super().read(size)
        self.bytes_read += len(chunk)
        return chunk


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def prefix_vs_full(model: LoadedModel, ids: list[int], cut_blocks: int, block_size: int):
    """(logits with a cached prefix of cut_blocks blocks, full logits, outputs, bytes read)."""
    engine = make_engine(model, block_size=block_size)
    # Another sequence first, so freed blocks hold stale KV that must never be read.
    engine.prefill("noise", prompt(len(ids), seed=9), GREEDY)
    engine.free("noise")
    full = engine.prefill("full", ids, GREEDY)
    full_out = [full.token_id] + [o.token_id for _ in range(3) for o in engine.step()]
    full_logits = engine.sequence("full").last_logits
    # The prefix source: a sequence holding exactly the first cut_blocks blocks.
    engine.prefill("src", ids[: cut_blocks * block_size + 1], SamplingParams(max_tokens=1))
    blob = engine.export_kv("src")
    engine.free("src")
    engine.free("full")
    reader = CountingReader(blob)
    prefix = engine.import_kv(reader)
    assert prefix.n_tokens == cut_blocks * block_size
    hit = engine.prefill("hit", ids, GREEDY, prefix=prefix)
    engine.release(prefix)
    hit_out = [hit.token_id] + [o.token_id for _ in range(3) for o in engine.step()]
    engine.check_integrity()
    return engine.sequence("hit").last_logits, full_logits, (hit_out, full_out), reader, blob


@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-moe"])
@pytest.mark.parametrize("cut_blocks", [1, 7, 11])
def test_tiny_prefix_logits_equal_full_recompute(tiny_models, name: str, cut_blocks: int) -> None:
    hit, full, (hit_out, full_out), _, _ = prefix_vs_full(
        tiny_models[name], prompt(100), cut_blocks, block_size=8
    )
    assert (hit - full).abs().max().item() <= 1e-4
    assert hit_out == full_out


def test_real_model_prefix_logits_equal_full_recompute(real_model) -> None:
    hit, full, (hit_out, full_out), _, _ = prefix_vs_full(
        real_model, prompt(300), cut_blocks=4, block_size=64
    )
    assert (hit - full).abs().max().item() <= 1e-4
    assert hit_out == full_out


def test_window_layers_read_only_blocks_in_window(tiny_models) -> None:
    model = tiny_models["tiny-swa"]  # window 24 tokens on layers 0 and 2 of 4
    hit, full, _, reader, blob = prefix_vs_full(model, prompt(120), cut_blocks=12, block_size=8)
    assert (hit - full).abs().max().item() <= 1e-4
    # 12 blocks of 8 = 96 tokens; a window of 24 needs the blocks holding tokens 73..95:
    # blocks 9, 10, 11. Two full layers read 12 cells, two window layers 3 each.
    cell = model_cell_bytes(model, 8)
    header_bytes = len(blob) - 4 * 12 * cell
    assert reader.bytes_read == header_bytes + (12 + 12 + 3 + 3) * cell


def model_cell_bytes(model: LoadedModel, block_size: int) -> int:
    c = model.config
    return 2 * block_size * c.n_kv_heads * c.head_dim * 4


def test_export_import_round_trip_is_exact(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"])
    engine.prefill("a", prompt(41), SamplingParams(max_tokens=1))
    blob = engine.export_kv("a")
    prefix = engine.import_kv(blob)
    assert prefix.n_tokens == 40  # only full blocks travel
    engine.prefill("b", prompt(41), SamplingParams(max_tokens=1), prefix=prefix)
    assert engine.export_kv("b") == blob


def test_bf16_export_halves_bytes_and_imports(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"])
    engine.prefill("a", prompt(64), SamplingParams(max_tokens=1))
    f32, bf16 = engine.export_kv("a"), engine.export_kv("a", dtype="bfloat16")
    assert len(bf16) < 0.55 * len(f32)
    prefix = engine.import_kv(bf16)
    assert prefix.n_tokens == 64


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:-10], "truncated"),
        (lambda b: b[:-100] + bytes([b[-100] ^ 0xFF]) + b[-99:], "checksum mismatch"),
        (lambda b: b"garbage" + b, "bad magic"),
    ],
)
def test_damaged_kv_is_rejected_and_leaks_no_blocks(tiny_models, damage, message) -> None:
    engine = make_engine(tiny_models["tiny"])
    engine.prefill("a", prompt(64), SamplingParams(max_tokens=1))
    blob = engine.export_kv("a")
    free_before = engine.pool.free_blocks
    with pytest.raises(KVFormatError, match=message):
        engine.import_kv(damage(blob))
    assert engine.pool.free_blocks == free_before
    engine.check_integrity()


def test_kv_of_another_model_is_rejected(tiny_models) -> None:
    blob_engine = make_engine(tiny_models["tiny"])
    blob_engine.prefill("a", prompt(64), SamplingParams(max_tokens=1))
    other = make_engine(tiny_models["tiny-moe"])
    with pytest.raises(KVFormatError, match="fingerprint"):
        other.import_kv(blob_engine.export_kv("a"))


@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-moe"])
def test_prefix_from_single_block_blobs_equals_full_recompute(tiny_models, name: str) -> None:
    """The storage tiers keep one blob per block: a prefix rebuilt from them is exact."""
    model = tiny_models[name]
    ids = prompt(70)
    src, dst = make_engine(model), make_engine(model)
    src.prefill("s", ids, SamplingParams(max_tokens=1))
    blobs = src.export_blocks("s", 0, 6)  # 6 blocks of 8 tokens
    prefix = dst.import_blocks(blobs)
    assert prefix.n_tokens == 48
    dst.prefill("d", ids, SamplingParams(max_tokens=1), prefix=prefix)
    dst.release(prefix)
    ref = make_engine(model)
    ref.prefill("r", ids, SamplingParams(max_tokens=1))
    diff = (dst.sequence("d").last_logits - ref.sequence("r").last_logits).abs().max()
    assert diff <= 1e-4


def test_a_damaged_block_is_named_and_nothing_is_held(tiny_models) -> None:
    model = tiny_models["tiny"]
    src, dst = make_engine(model), make_engine(model)
    src.prefill("s", prompt(40), SamplingParams(max_tokens=1))
    blobs = src.export_blocks("s", 0, 4)
    damaged = bytearray(blobs[2])
    damaged[-5] ^= 0xFF
    with pytest.raises(BadBlock) as err:
        dst.import_blocks([blobs[0], blobs[1], bytes(damaged), blobs[3]])
    assert err.value.index == 2 and "checksum" in str(err.value)
    assert dst.pool.used_blocks == 0


def test_a_running_sequences_prompt_blocks_are_shared_not_copied(tiny_models) -> None:
    """Another candidate of a prompt (``n``) admitted on a running sequence's blocks: it
    takes only blocks for its own last, partial block and answer, decodes token for token as
    it would alone, and the blocks stay with it after the first sequence is freed."""
    engine = make_engine(tiny_models["tiny"], block_size=8)
    ids = prompt(61)  # 7 full blocks and 5 tokens
    alone = engine.prefill("alone", ids, GREEDY)
    expected = [alone.token_id] + [o.token_id for _ in range(3) for o in engine.step()]
    engine.free("alone")
    engine.prefill("first", ids, GREEDY)
    assert engine.share_prefix("nobody", 7) is None
    free = engine.pool.free_blocks
    assert engine.can_admit(len(ids), GREEDY, held_blocks=7)
    prefix = engine.share_prefix("first", 7)
    assert prefix is not None and prefix.n_tokens == 56
    second = engine.prefill("second", ids, GREEDY, prefix=prefix)
    engine.release(prefix)
    # 61 prompt + 4 answer tokens need 9 blocks; 7 are the first's.
    assert free - engine.pool.free_blocks == 2
    assert engine.sequence("second").block_table[:7] == engine.sequence("first").block_table[:7]
    engine.free("first")
    got = [second.token_id] + [o.token_id for _ in range(3) for o in engine.step()]
    assert got == expected
    engine.check_integrity()
    engine.free("second")
    assert engine.pool.used_blocks == 0


def test_a_sequence_whose_kv_is_still_coming_is_not_shared(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], block_size=8)
    engine.reserve("handed", prompt(40), GREEDY)  # blocks taken, its KV not yet written
    assert engine.share_prefix("handed", 4) is None

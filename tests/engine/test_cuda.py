"""The torch engine on a GPU: the same tokens as on the CPU (fp32 both: prefill, decode steps
replayed as CUDA graphs, batches of several sizes), KV handed off and loaded from the tiers
through pinned staging, a window model and a MoE model on their own paths. They run where
torch sees a GPU (the lent machine: bench/gpu.py's device call) and skip elsewhere, saying so;
what a machine without one can check (the device setting refused clearly, the memory tier's
trusted blocks) runs everywhere."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from shared.engine.interface import BadBlock
from shared.engine.torch.engine import compute_device
from shared.engine.torch.graphs import DecodeGraphs
from shared.messages.sampling import SamplingParams
from shared.worker import WorkerSettings
from tests.engine.conftest import make_engine

cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no GPU here (torch sees no CUDA device): the torch engine's CUDA path is tested on "
    "a machine with one (bench/gpu.py runs these figures there)",
)
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(n)]


def answers(engine, prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt's greedy answer, all decoding together."""
    out = {f"s{i}": [engine.prefill(f"s{i}", p, GREEDY).token_id] for i, p in enumerate(prompts)}
    while engine.running:
        for o in engine.step():
            out[o.seq_id].append(o.token_id)
    for sid in out:
        engine.free(sid)
    return list(out.values())


@cuda
@pytest.mark.parametrize("name", ["tiny", "tiny-swa", "tiny-moe"])
def test_the_gpu_answers_as_the_cpu_does(tiny_models, name) -> None:
    prompts = [prompt(n, s) for s, n in enumerate((5, 40, 77, 130, 9))]
    on_cpu = answers(make_engine(tiny_models[name]), prompts)
    gpu = make_engine(tiny_models[name], device="cuda", dtype="float32")
    assert answers(gpu, prompts) == on_cpu  # (five at once: a graph of batch 8, padded)
    assert answers(gpu, prompts[:1]) == on_cpu[:1]  # (batch 1: another graph)
    if name != "tiny-moe":
        assert gpu.graphs is not None and gpu.graphs.graphs


@cuda
def test_kv_crosses_between_the_gpu_and_the_tiers_whole(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"], device="cuda", dtype="float32")
    ids = prompt(100, 3)
    expected = answers(engine, [ids])[0]
    engine.prefill("a", ids, GREEDY, handoff=True)
    handoff = engine.export_kv("a", partial=True)
    blocks = engine.export_blocks("a", 0, len(ids) // engine.block_size)
    engine.free("a")
    for trusted in (0, len(blocks)):  # (checked, and the memory tier's own)
        prefix = engine.import_blocks(blocks, trusted)
        first = engine.prefill("b", ids, GREEDY, prefix)
        engine.release(prefix)
        got = [first.token_id]
        while engine.running:
            got += [o.token_id for o in engine.step()]
        engine.free("b")
        assert got == expected
    decoder = make_engine(tiny_models["tiny"], device="cuda", dtype="float32")
    decoder.reserve("c", ids, GREEDY)
    decoder.write_kv("c", handoff)
    decoder.join("c", expected[0])
    got = expected[:1]
    while decoder.running:
        got += [o.token_id for o in decoder.step()]
    assert got == expected


@pytest.mark.parametrize("name", ["tiny", "tiny-swa"])
def test_the_graphs_padded_step_answers_as_plain_decode(tiny_models, name) -> None:
    """What a CUDA graph replays (a batch padded to its size, contexts to a power of two,
    padded rows on a scratch block), run as it is where there is no GPU: the same tokens."""
    prompts = [prompt(n, s) for s, n in enumerate((5, 40, 77))]
    plain = make_engine(tiny_models[name])
    expected = answers(plain, prompts)
    scratch = plain.pool.allocate(1)[0] * plain.block_size
    plain.graphs = DecodeGraphs(plain.model, plain.cache, scratch)
    assert answers(plain, prompts) == expected


def test_a_damaged_block_past_the_trusted_ones_is_still_caught(tiny_models) -> None:
    engine = make_engine(tiny_models["tiny"])
    ids = prompt(64, 5)
    engine.prefill("a", ids, GREEDY, handoff=True)
    blocks = engine.export_blocks("a", 0, 4)
    engine.free("a")
    damaged = bytearray(blocks[3])
    damaged[-5] ^= 0xFF
    with pytest.raises(BadBlock) as caught:
        engine.import_blocks([*blocks[:3], bytes(damaged)], trusted=3)
    assert caught.value.index == 3
    assert engine.pool.used_blocks == 0  # (nothing held)
    prefix = engine.import_blocks(blocks, trusted=2)
    assert prefix.n_tokens == 4 * engine.block_size
    engine.release(prefix)


def test_a_gpu_asked_for_where_there_is_none_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="device"):
        WorkerSettings(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: cuda asked, but torch .* sees no GPU"):
            compute_device("cuda")
    with pytest.raises(ValueError, match="device: cpu, cuda or cuda:N"):
        compute_device("mps")

"""LoRA adapters in the torch engine: what it computes under an adapter is what PEFT computes
from the same files; sequences of different adapters (and none) computed in one batch each get
what they get alone; adapters kept resident up to the bound, the rest read when needed; bad
adapters refused, naming the file and what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shared.engine.interface import PoolExhausted
from shared.engine.torch.loader import LoadedModel, load_model
from shared.messages.sampling import SamplingParams
from shared.model.catalog import ModelSource
from shared.model.lora import AdapterSpec, LoraError, digest_of, read_adapter
from tests.checkpoints import hf_checkpoint
from tests.engine.conftest import make_engine
from tests.engine.lora_adapters import peft_adapter

PROMPT = torch.randint(3, 49000, (37,), generator=torch.Generator().manual_seed(7)).tolist()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, LoadedModel, Path]:
    """A tiny Llama checkpoint: the transformers model, kvmesh's, and where it is."""
    root = tmp_path_factory.mktemp("lora-base")
    reference = hf_checkpoint(root / "hf", "llama")
    ours = load_model(ModelSource("mine", "hf", root / "hf"), root / "state")
    return reference, ours, root


@pytest.fixture(scope="module")
def adapters(base: tuple) -> dict[str, tuple[AdapterSpec, object]]:
    """Three adapters: all seven modules at rank 4; attention only at rank 8 under rsLoRA;
    the MLP with one module's rank changed (rank_pattern)."""
    reference, _, root = base
    made = {}
    for name, kw in {
        "all": {"seed": 1},
        "attn": {"seed": 2, "r": 8, "targets": ["q_proj", "v_proj", "o_proj"], "rslora": True},
        "mlp": {
            "seed": 3,
            "targets": ["gate_proj", "up_proj", "down_proj"],
            "rank_pattern": {"down_proj": 2},
        },
    }.items():
        path = root / name
        model = peft_adapter(reference, path, **kw)
        made[name] = (AdapterSpec(name, "mine", str(path), digest_of(path)), model)
    return made


def engine_with(ours: LoadedModel, adapters: dict, **options):  # noqa: ANN003, ANN201
    engine = make_engine(ours, **options)
    for spec, _ in adapters.values():
        engine.register_adapter(spec)
    return engine


def greedy(engine, seq_id: str, ids: list[int], n: int, adapter: str = "") -> list[int]:  # noqa: ANN001
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, adapter=adapter)
    out = [engine.prefill(seq_id, ids, params).token_id]
    while len(out) < n:
        out += [o.token_id for o in engine.step() if o.seq_id == seq_id]
    engine.free(seq_id)
    return out


def test_an_adapter_computes_what_peft_computes(base: tuple, adapters: dict) -> None:
    _, ours, _ = base
    engine = engine_with(ours, adapters)
    for name, (_, model) in adapters.items():
        with torch.no_grad():
            expected = model(torch.tensor([PROMPT])).logits[0, -1]
            made = model.generate(
                torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None
            )[0, len(PROMPT) :].tolist()
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, adapter=name)
        engine.prefill(name, PROMPT, params)
        got = engine.sequence(name).last_logits
        diff = (got - expected).abs().max().item()
        assert diff < 1e-4, f"{name}: max |logit difference| {diff}"
        engine.free(name)
        assert greedy(engine, name, PROMPT, 8, adapter=name) == made, name
    engine.check_integrity()


@pytest.mark.parametrize("fused", [True, False], ids=["fused (a CPU)", "apart (a GPU)"])
def test_one_batch_of_several_adapters_gives_each_what_it_gets_alone(
    base: tuple, adapters: dict, fused: bool
) -> None:
    _, ours, _ = base
    alone_engine = engine_with(ours, adapters)
    names = ["all", "", "attn", "mlp", "all"]
    prompts = [PROMPT[: 20 + 3 * i] for i in range(len(names))]
    alone = [
        greedy(alone_engine, f"a{i}", p, 10, adapter=a)
        for i, (p, a) in enumerate(zip(prompts, names, strict=True))
    ]
    assert len({tuple(a) for a in alone[:4]}) == 4, "adapters that change nothing prove nothing"
    engine = engine_with(ours, adapters)
    if not fused:  # (the base weights left as they are, the adapters' products added after)
        engine.adapters.weights = None
    out: dict[str, list[int]] = {}
    for i, (p, a) in enumerate(zip(prompts, names, strict=True)):
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, adapter=a)
        out[f"s{i}"] = [engine.prefill(f"s{i}", p, params).token_id]
    while engine.running:  # every step decodes all five, adapters mixed in one pass
        for o in engine.step():
            out[o.seq_id].append(o.token_id)
    assert [out[f"s{i}"] for i in range(len(names))] == alone
    # ... and several prompts of different adapters prefilled in one pass
    from shared.engine.interface import PrefillRequest

    batch = engine.prefill_batch(
        [
            PrefillRequest(f"b{i}", p, SamplingParams(max_tokens=1, temperature=0, adapter=a))
            for i, (p, a) in enumerate(zip(prompts, names, strict=True))
        ]
    )
    assert [r.token_id for r in batch] == [a[0] for a in alone]
    for i in range(len(names)):
        engine.free(f"b{i}")
    engine.check_integrity()


def test_adapters_beyond_the_resident_bound_are_read_when_needed(
    base: tuple, adapters: dict
) -> None:
    _, ours, _ = base
    engine = engine_with(ours, adapters, max_loras=2)
    reference = {n: greedy(engine_with(ours, adapters), "r", PROMPT, 4, n) for n in adapters}
    for n in ["all", "attn", "mlp", "all", "mlp"]:  # three adapters, two slots: some evicted
        assert greedy(engine, n, PROMPT, 4, n) == reference[n]
    stats = engine.stats()
    assert stats.adapter_loads == 4 and len(stats.adapters) == 2  # (mlp's second use was a hit)
    assert engine.adapters.reads == 3  # (all's second load came from the host copy)
    # While both slots compute, a third adapter waits: admission says so, nothing breaks.
    for n in ("all", "attn"):
        engine.prefill(n, PROMPT, SamplingParams(max_tokens=50, adapter=n))
    with pytest.raises(PoolExhausted, match="adapter slots"):
        engine.prefill("m", PROMPT, SamplingParams(max_tokens=5, adapter="mlp"))
    engine.check_integrity()
    engine.free("all")
    assert greedy(engine, "m", PROMPT, 4, "mlp") == reference["mlp"]
    engine.free("attn")
    engine.check_integrity()


def test_an_adapter_unregistered_while_in_use_finishes_its_sequences(
    base: tuple, adapters: dict
) -> None:
    _, ours, _ = base
    engine = engine_with(ours, adapters)
    reference = greedy(engine, "r", PROMPT, 6, "attn")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, adapter="attn")
    out = [engine.prefill("s", PROMPT, params).token_id]
    engine.unregister_adapter("attn")
    while engine.running:
        out += [o.token_id for o in engine.step()]
    assert out == reference
    engine.free("s")
    assert "attn" not in engine.stats().adapters
    with pytest.raises(ValueError, match="no such adapter"):
        engine.prefill("t", PROMPT, params)
    engine.check_integrity()


def write_config(directory: Path, **changes: object) -> None:
    path = directory / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, **changes}))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no weights", "adapter_model.safetensors: missing"),
        ("pickled", "a pickled adapter is never read"),
        ("rank mismatch", "layer 0 q_proj: lora_A (3, 64) and lora_B (64, 4) do not fit"),
        ("wrong module", "target_modules: embed_tokens not supported"),
        ("too wide", "do not fit mine's q_proj"),
        ("dora", "use_dora: DoRA adapters are not supported"),
        ("rank over the bound", "rank 4 is over the worker's max_lora_rank of 2"),
    ],
)
def test_a_bad_adapter_is_refused_naming_the_file_and_the_mismatch(
    base: tuple, damage: str, message: str, tmp_path: Path
) -> None:
    reference, ours, _ = base
    path = tmp_path / "bad"
    peft_adapter(reference, path, seed=4)
    weights = path / "adapter_model.safetensors"
    max_rank = 0
    if damage in ("no weights", "pickled"):
        weights.unlink()
        if damage == "pickled":
            (path / "adapter_model.bin").write_bytes(b"\x80\x04N.")
    elif damage in ("rank mismatch", "too wide"):
        from safetensors.torch import load_file, save_file

        tensors = load_file(weights)
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        tensors[key] = tensors[key][:3] if damage == "rank mismatch" else torch.zeros(4, 65)
        save_file(tensors, weights)
    elif damage == "wrong module":
        write_config(path, target_modules=["q_proj", "embed_tokens"])
    elif damage == "dora":
        write_config(path, use_dora=True)
    else:
        max_rank = 2
    with pytest.raises(LoraError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        read_adapter(path, ours.config, max_rank)
    assert str(path) in str(err.value)
    # ... and by the engine, when it is registered: refused, and the engine serves on.
    engine = make_engine(ours, max_lora_rank=max_rank or 64)
    with pytest.raises(LoraError, match=message.replace("(", r"\(").replace(")", r"\)")):
        engine.register_adapter(AdapterSpec("bad", "mine", str(path)))
    with pytest.raises(ValueError, match="no such adapter"):
        engine.prefill("s", PROMPT, SamplingParams(max_tokens=2, adapter="bad"))
    assert greedy(engine, "t", PROMPT, 2) and not engine.seqs
    engine.check_integrity()

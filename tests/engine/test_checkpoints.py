"""A team's own checkpoints, made here in the real formats (a Hugging Face directory, a GGUF
file): every architecture kvmesh serves computes what transformers computes from the same
checkpoint (its logits on a fixed prompt, within fp32 tolerance; its greedy continuation,
token for token), and a GGUF file of the same weights computes the same."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shared.engine.torch.loader import LoadedModel, load_model
from shared.engine.torch.model import KVCache, Segment, Transformer
from shared.messages.sampling import SamplingParams
from shared.model.catalog import ModelSource
from tests.checkpoints import ARCHS, gguf_checkpoint, hf_checkpoint
from tests.engine.conftest import make_engine

PROMPT = torch.randint(3, 49000, (40,), generator=torch.Generator().manual_seed(5)).tolist()


def logits(model: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Every position's logits, one forward pass over the prompt."""
    t = Transformer(model.config, {k: v.float() for k, v in model.weights.items()})
    cache = KVCache(model.config, len(ids), torch.float32)
    n = len(ids)
    hidden = t.forward(torch.tensor(ids), torch.arange(n), [Segment(0, n, torch.arange(n))], cache)
    return t.logits(hidden)


def greedy(model: LoadedModel, ids: list[int], n: int) -> list[int]:
    engine = make_engine(model)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    out = [engine.prefill("s", ids, params)]
    while len(out) < n:
        out += engine.step()
    return [o.token_id for o in out]


@pytest.mark.parametrize("arch", list(ARCHS))
def test_a_checkpoint_computes_what_transformers_does(arch: str, tmp_path: Path) -> None:
    reference = hf_checkpoint(tmp_path / "hf", arch)
    ours = load_model(ModelSource("mine", "hf", tmp_path / "hf"), tmp_path / "state")
    assert (
        ours.config.arch
        == ARCHS[arch][1].removesuffix("ForCausalLM").lower()[:7].replace("llama", "llama")
        or ours.config.arch
    )
    with torch.no_grad():
        expected = reference(torch.tensor([PROMPT])).logits[0]
        made = reference.generate(
            torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )[0, len(PROMPT) :].tolist()
    got = logits(ours, PROMPT)
    diff = (got - expected).abs().max().item()
    assert diff < 1e-4, f"{arch}: max |logit difference| {diff}"
    assert greedy(ours, PROMPT, 12) == made


# (F16 and BF16: the Hugging Face checkpoint in the same precision, so both files hold the very
# same weights; Q8_0 against fp32, within what its rounding costs)
@pytest.mark.parametrize(
    ("arch", "qtype", "hf_dtype", "most"),
    [
        ("llama", "F32", "float32", 1e-4),
        ("mistral", "F16", "float16", 1e-4),
        ("qwen2", "Q8_0", "float32", 0.15),
        ("qwen3", "BF16", "bfloat16", 1e-4),
        ("llama3-rope", "F32", "float32", 1e-4),
    ],
)
def test_a_gguf_file_of_the_same_weights_computes_the_same(
    arch: str, qtype: str, hf_dtype: str, most: float, tmp_path: Path
) -> None:
    reference = hf_checkpoint(tmp_path / "hf", arch, dtype=hf_dtype)
    path = gguf_checkpoint(tmp_path / f"model-{qtype}.gguf", reference, arch, qtype)
    from_hf = load_model(ModelSource("mine", "hf", tmp_path / "hf"), tmp_path / "state")
    from_gguf = load_model(ModelSource("mine", "gguf", path), tmp_path / "state")
    c, g = from_hf.config, from_gguf.config
    same = ("arch", "qkv_bias", "qk_norm", "head_dim", "sliding_window", "tie_embeddings")
    assert {k: getattr(g, k) for k in same} == {k: getattr(c, k) for k in same}
    diff = (logits(from_gguf, PROMPT) - logits(from_hf, PROMPT)).abs().max().item()
    assert diff < most, f"{arch} {qtype}: max |logit difference| {diff}"
    assert g.fingerprint != c.fingerprint, "other weights (files): other KV"

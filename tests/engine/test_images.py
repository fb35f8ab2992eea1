"""Image embeddings spliced into prefill: in place of their placeholders, across chunks, in a
batch, and past a cached prefix."""

from __future__ import annotations

import pytest
import torch

from shared.engine.interface import PrefillRequest
from shared.messages.sampling import SamplingParams
from tests.engine.conftest import make_engine

GREEDY = SamplingParams(max_tokens=1, temperature=0)
PLACEHOLDER = 0


def prompt_with_image(n_before: int, n_image: int, n_after: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    text = torch.randint(100, 400, (n_before + n_after,), generator=g).tolist()
    return text[:n_before] + [PLACEHOLDER] * n_image + text[n_before:]


def image(n: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed)) * 0.05


def logits(engine, rid: str) -> torch.Tensor:
    return engine.sequence(rid).last_logits


def test_an_image_changes_the_result_and_its_own_tokens_leave_it_unchanged(tiny_models) -> None:
    model = tiny_models["tiny"]
    engine = make_engine(model)
    ids = prompt_with_image(10, 40, 7)  # the image spans two 32-token chunks
    engine.prefill("plain", ids, GREEDY)
    as_tokens = (10, model.weights["tok_emb"][torch.tensor(ids[10:50])])
    engine.prefill("same", ids, GREEDY, images=(as_tokens,))
    engine.prefill("a", ids, GREEDY, images=((10, image(40, model.config.dim, 1)),))
    engine.prefill("b", ids, GREEDY, images=((10, image(40, model.config.dim, 2)),))
    torch.testing.assert_close(logits(engine, "same"), logits(engine, "plain"))
    assert not torch.allclose(logits(engine, "a"), logits(engine, "plain"))
    assert not torch.allclose(logits(engine, "a"), logits(engine, "b"))


def test_a_batch_with_images_equals_each_prompt_alone(tiny_models) -> None:
    model = tiny_models["tiny"]
    dim = model.config.dim
    one, two = prompt_with_image(3, 8, 4), prompt_with_image(0, 5, 9)
    imgs = {"one": ((3, image(8, dim, 3)),), "two": ((0, image(5, dim, 4)),), "text": ()}
    prompts = {"one": one, "two": two, "text": [5, 6, 7, 8]}
    alone = make_engine(model)
    for rid, ids in prompts.items():
        alone.prefill(rid, ids, GREEDY, images=imgs[rid])
    batched = make_engine(model)
    batched.prefill_batch(
        [PrefillRequest(rid, ids, GREEDY, images=imgs[rid]) for rid, ids in prompts.items()]
    )
    for rid in prompts:
        torch.testing.assert_close(logits(batched, rid), logits(alone, rid), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("cached_blocks", [1, 3])  # the image cut by the prefix, or past it
def test_past_a_cached_prefix_only_the_rest_of_the_image_is_spliced(
    tiny_models, cached_blocks: int
) -> None:
    model = tiny_models["tiny"]
    engine = make_engine(model)  # 8-token blocks
    ids = prompt_with_image(4, 12, 20)  # image at positions 4..15
    img = ((4, image(12, model.config.dim, 5)),)
    engine.prefill("full", ids, GREEDY, images=img)
    blob = engine.export_blocks("full", 0, cached_blocks)
    prefix = engine.import_blocks(blob)
    engine.prefill("hit", ids, GREEDY, prefix=prefix, images=img)
    torch.testing.assert_close(logits(engine, "hit"), logits(engine, "full"), atol=1e-5, rtol=1e-4)

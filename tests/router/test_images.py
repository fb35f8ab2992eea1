"""A prompt with images: its prefix hashes, reused or not, are the workers' block hashes."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router.images import PLACEHOLDER_ID, ImageInput, join_prompt
from services.router.tokens import PrefixHashes, PromptTokenizer
from shared.engine.loader import load_text_model
from shared.kvstore.hashing import block_hashes


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    model = load_text_model("smollm2-135m-instruct", Path(tmp_path_factory.mktemp("state")))
    return PromptTokenizer(model.tokenizer)


def picture(name: str, tokens: int) -> ImageInput:
    return ImageInput(f"messages[0].content[{name}]", b"", name * 32, tokens)


def test_joined_prompts_hash_as_the_workers_do(tokenizer: PromptTokenizer) -> None:
    cache = PrefixHashes()
    text = "<|im_start|>user\\nLook at these " * 20
    a, b = picture("a", 77), picture("b", 77)
    for images in ((a,), (a,), (b,), (a, b)):
        parts: list = [tokenizer.encode_segments(text)]
        for img in images:
            parts += [img, tokenizer.encode_segments(" and then " * 30)]
        ids, segments, refs = join_prompt(parts)
        assert [r.tokens for r in refs] == [77] * len(images)
        assert all(ids[r.start : r.start + r.tokens] == [PLACEHOLDER_ID] * 77 for r in refs)
        got = cache.hashes(segments, 64, "fp", "")  # reused from the prompt before, or not
        assert got == block_hashes(ids, 64, "fp", images=refs)
    first_a = join_prompt([tokenizer.encode_segments(text), a])
    first_b = join_prompt([tokenizer.encode_segments(text), b])
    start = first_a[2][0].start
    ha = block_hashes(first_a[0], 64, "fp", images=first_a[2])
    hb = block_hashes(first_b[0], 64, "fp", images=first_b[2])
    same = start // 64
    assert ha[:same] == hb[:same] and ha[same] != hb[same]

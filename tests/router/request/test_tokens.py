"""The segment-cached prompt tokenizer gives exactly the tokenizer's ids."""

from __future__ import annotations

import pytest

from services.router.request.render import PromptTokenizer
from shared.model.text import TextModel


@pytest.fixture(scope="module")
def model(real_text: TextModel) -> TextModel:
    return real_text


CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief.  Use   spaces\n\nand lines."},
        {"role": "user", "content": "héllo <|im_end|> wörld 日本語 🎉"},
        {"role": "assistant", "content": " leading space and trailing "},
        {"role": "user", "content": "def f(x):\n    return x * 2  # code"},
    ],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": "<|endoftext|>"}],
]


@pytest.mark.parametrize("chat", CHATS)
def test_same_ids_as_the_tokenizer(model, chat) -> None:
    text = model.chat_template.render(chat)
    fast = PromptTokenizer(model.tokenizer)
    expected = model.tokenizer.encode(text, add_special_tokens=False).ids
    assert fast.encode(text) == expected
    assert fast.encode(text) == expected  # and again, from the cache


def test_a_next_turn_tokenizes_only_what_is_new(model) -> None:
    fast = PromptTokenizer(model.tokenizer)
    turn1 = [{"role": "user", "content": "a long question " * 200}]
    fast.encode(model.chat_template.render(turn1))
    misses = fast.misses
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "more"},
    ]
    text = model.chat_template.render(turn2)
    assert fast.encode(text) == model.tokenizer.encode(text, add_special_tokens=False).ids
    assert fast.misses - misses <= 3  # the new messages' segments, not the long one


def test_the_cache_stays_within_its_token_budget(model) -> None:
    fast = PromptTokenizer(model.tokenizer, cache_tokens=50)
    for i in range(20):
        fast.encode(f"<|im_start|>user\nmessage number {i} with some words<|im_end|>")
    assert fast._cached_tokens <= 50


def test_a_next_turn_reuses_the_hashes_of_its_shared_blocks(model) -> None:
    from services.router.dispatch.plan import PrefixHashes
    from shared.kvstore.hashing import block_hashes

    fast, cache = PromptTokenizer(model.tokenizer), PrefixHashes()
    turn1 = [{"role": "user", "content": "a long question " * 300}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "?"},
    ]
    reused = []
    for chat, salt in ((turn1, ""), (turn2, ""), (turn2, "other tenant")):
        ids, segments = fast.encode_segments(model.chat_template.render(chat))
        before = cache.reused_blocks
        got = cache.hashes(segments, 64, "fp", salt)
        assert got == block_hashes(ids, 64, "fp", salt)  # reused or not, always exact
        reused.append(cache.reused_blocks - before)
    n1 = len(block_hashes(fast.encode_segments(model.chat_template.render(turn1))[0], 64, "fp"))
    # Turn 2 takes every full block of turn 1 (the first message it shares holds them all);
    # another tenant's salt makes other hashes: nothing to take.
    assert reused == [0, n1, 0] and n1 >= 10
    # A different first message shares nothing, and still hashes right.
    other = [{"role": "user", "content": "another question " * 300}]
    ids, segments = fast.encode_segments(model.chat_template.render(other))
    before = cache.reused_blocks
    assert cache.hashes(segments, 64, "fp", "") == block_hashes(ids, 64, "fp", "")
    assert cache.reused_blocks == before


def test_the_hashes_of_at_most_so_many_conversations_are_kept(model) -> None:
    """KVMESH_ROUTER_PREFIX_PROMPTS: past it, the oldest conversation is forgotten (its next
    turn is hashed whole, and still exactly)."""
    from services.router.dispatch.plan import PrefixHashes

    fast, cache = PromptTokenizer(model.tokenizer), PrefixHashes(2)
    openings = [
        model.chat_template.render([{"role": "user", "content": f"{i} " * 200}]) for i in range(3)
    ]
    for text in openings:
        cache.hashes(fast.encode_segments(text)[1], 64, "fp", "")
    assert len(cache) == 2
    before = cache.reused_blocks
    cache.hashes(fast.encode_segments(openings[0])[1], 64, "fp", "")  # forgotten: none reused
    assert cache.reused_blocks == before
    cache.hashes(fast.encode_segments(openings[2])[1], 64, "fp", "")  # kept: all reused
    assert cache.reused_blocks > before

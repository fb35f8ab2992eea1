"""The segment-cached prompt tokenizer gives exactly the tokenizer's ids."""

from __future__ import annotations

import tracemalloc

import pytest

from services.router.request.render import PromptTokenizer
from shared.kvstore.hashing import pack_tokens
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
    message = "<|im_start|>user\nmessage number {} with some words<|im_end|>".format
    for i in range(20):
        fast.encode(message(i))
    assert 0 < fast.cached_tokens <= 50
    # What it kept is the latest: the last message is found again, the first tokenized anew.
    misses = fast.misses
    fast.encode(message(19))
    assert fast.misses == misses
    fast.encode(message(0))
    assert fast.misses == misses + 1


def test_conversations_and_segments_stay_within_one_budget(model) -> None:
    """The conversations kept and the segments kept share the budget: the two together stay
    within it (the soak found them each within it, so twice it together)."""
    fast = PromptTokenizer(model.tokenizer, cache_tokens=2000)
    for c in range(30):
        chat = [
            {"role": "system", "content": f"Harbour {c} keeps its own books. " * 5},
            {"role": "user", "content": f"Which berth is free at dawn in harbour {c}? " * 3},
            {"role": "assistant", "content": "Berth four, until noon. " * 3},
            {"role": "user", "content": "Book it."},
        ]
        fast.encode_segments(model.chat_template.render(chat))
        assert fast.cached_tokens <= 2000
    assert fast.cached_tokens > 1000  # (both filled, not left empty)


def test_a_kept_token_costs_a_few_bytes(model) -> None:
    """Conversations kept to the budget hold their tokens packed: a few bytes a token, not
    a list's int objects (~27 bytes a token, measured on a router at 4M tokens)."""
    fast = PromptTokenizer(model.tokenizer, cache_tokens=400_000)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for c in range(60):
            chat = [{"role": "system", "content": f"Harbour {c} keeps its own books. " * 40}]
            for turn in range(4):
                chat.append({"role": "user", "content": f"Berth {turn} at dawn in {c}? " * 60})
                fast.encode_segments(model.chat_template.render(chat))
                chat.append({"role": "assistant", "content": f"Berth {turn} is free. " * 80})
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert fast.cached_tokens > 300_000
    assert held / fast.cached_tokens < 8


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


def test_a_conversations_turns_edits_and_branches_all_tokenize_exactly(model) -> None:
    """A conversation's next turn takes its ids through the last special token it shares with
    the one before, and tokenizes the rest; whatever the turn does to the history (goes on,
    edits an earlier message, grows the last one without a special token, branches off),
    the ids are the tokenizer's own."""
    import random

    rng = random.Random(5)
    words = ["the", "héllo", "<|im_end|>", "日本", " ", "\n\n", "x" * 40, "def f():", "🎉", "a"]

    def text(n: int) -> str:
        return "".join(rng.choice(words) + rng.choice(["", " "]) for _ in range(n))

    fast = PromptTokenizer(model.tokenizer, cache_tokens=100_000)
    system = {"role": "system", "content": text(30)}
    history = [
        system,
        {"role": "user", "content": text(20)},
        {"role": "assistant", "content": "ok"},
    ]
    kept = []
    for turn in range(40):
        move = rng.choice(["go on", "go on", "edit", "grow", "branch", "other"])
        if move == "go on":
            history = [*history, {"role": "user", "content": text(20)}]
            history += [{"role": "assistant", "content": text(30)}]
        elif move == "edit" and len(history) > 3:
            at = rng.randrange(1, len(history))
            history = [*history[:at], {**history[at], "content": text(10)}, *history[at + 1 :]]
        elif move == "grow":
            history = [*history[:-1], {**history[-1], "content": history[-1]["content"] + text(5)}]
        elif move == "branch" and kept:
            history = rng.choice(kept)
        elif move == "other":
            history = [system, {"role": "user", "content": text(20)}]
        kept.append(history)
        prompt = model.chat_template.render([*history, {"role": "user", "content": text(8)}])
        ids, segments = fast.encode_segments(prompt)
        assert ids.tolist() == model.tokenizer.encode(prompt, add_special_tokens=False).ids, (
            turn,
            move,
        )
        assert "".join(t for t, _ in segments) == prompt
        assert b"".join(p for _, p in segments) == pack_tokens(ids)
    assert fast.turn_hits >= 20 and fast.reused_tokens > 0


def test_the_conversations_kept_stay_within_the_token_budget(model) -> None:
    fast = PromptTokenizer(model.tokenizer, cache_tokens=400)
    for i in range(30):
        chat = [{"role": "user", "content": f"conversation {i} " * 20}]
        fast.encode(model.chat_template.render([*chat, {"role": "assistant", "content": "a"}]))
    assert 0 < fast._turn_tokens <= 400 and fast.cached_tokens <= 800


def test_the_prefix_hashes_stay_within_their_bytes(model) -> None:
    """Each kept conversation holds its texts, packed ids and hashes: long ones are dropped,
    oldest first, to stay within the bytes, whatever the count allows."""
    from services.router.dispatch.plan import PrefixHashes

    fast, cache = PromptTokenizer(model.tokenizer), PrefixHashes(max_prompts=4096, max_bytes=60_000)
    for c in range(20):
        chat = [{"role": "user", "content": f"conversation {c}: " + "a long question " * 300}]
        _, segments = fast.encode_segments(model.chat_template.render(chat))
        cache.hashes(segments, 64, "fp", "")
        assert 0 < cache.bytes <= 60_000
    assert 1 <= len(cache) < 20  # (each ~15 KB: the oldest dropped)

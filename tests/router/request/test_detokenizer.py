"""Incremental detokenizing: multi-byte characters, stop strings across token boundaries."""

from __future__ import annotations

import random

import pytest

from services.router.request.answer import Detokenizer
from shared.model.text import TextModel


@pytest.fixture(scope="module")
def tokenizer(real_text: TextModel):
    return real_text.tokenizer


def stream(
    tokenizer, text: str, stop: list[str], min_tokens: int = 0, at_once: int = 1
) -> tuple[list[str], str]:
    """Feed the text's tokens ``at_once`` at a time; returns the pieces sent and the whole."""
    detok = Detokenizer(tokenizer, stop, min_tokens)
    pieces = []
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    for i in range(0, len(ids), at_once):
        pieces.append(detok.add(ids[i : i + at_once]))
        if detok.stopped:
            break
    else:
        pieces.append(detok.finish())
    return pieces, "".join(pieces)


@pytest.mark.parametrize(
    "text", ["Héllo wörld, naïve café", "日本語のテキスト", "emoji 🎉🚀 ok", "plain"]
)
def test_streamed_pieces_join_to_the_text_and_never_split_a_character(tokenizer, text) -> None:
    pieces, whole = stream(tokenizer, text, [])
    assert whole == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_across_tokens_is_cut_and_never_sent(tokenizer) -> None:
    pieces, whole = stream(tokenizer, "The answer is forty-two. END of story", ["END"])
    assert whole == "The answer is forty-two. "
    assert not any("E" in p for p in pieces)


def test_text_that_only_looks_like_a_stop_is_released_at_the_end(tokenizer) -> None:
    pieces, whole = stream(tokenizer, "and then EN", ["END"])
    assert whole == "and then EN"
    assert pieces[-1].endswith("EN")  # held back until the answer ended


def test_earliest_of_several_stops_wins(tokenizer) -> None:
    _, whole = stream(tokenizer, "one two three four", ["four", "two"])
    assert whole == "one "


@pytest.mark.parametrize("at_once", [1, 3, 100])
def test_a_stop_string_counts_only_once_it_ends_at_or_past_the_least_length(
    tokenizer, at_once: int
) -> None:
    """As the engines count it: a stop string ending in the text of the answer's
    min_tokens-th token or later ends the answer; one that ended before does not."""
    text = "stop here, then go on, stop again and more"
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    first_stop = next(i for i in range(len(ids)) if "stop" in tokenizer.decode(ids[: i + 1]))
    _, whole = stream(tokenizer, text, ["stop"], first_stop + 1, at_once)
    assert whole == ""  # its min_tokens-th token completes the first "stop": it counts
    _, whole = stream(tokenizer, text, ["stop"], first_stop + 2, at_once)
    assert whole == "stop here, then go on, "  # the first ended too early; the second ends it
    _, whole = stream(tokenizer, text, ["stop"], len(ids) + 5, at_once)
    assert whole == text  # the answer ended before its least length: nothing cut


def test_streamed_text_is_the_tokenizers_own_decode_of_any_tokens(tokenizer) -> None:
    """Whatever ids come (special tokens, characters split between tokens, bytes that are no
    UTF-8 at all), the pieces join to what the tokenizer decodes from them all."""
    rng = random.Random(7)
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    text = "naïve 日本語 🎉 <|im_end|> code: x = [1, 2]\n"
    for trial in range(200):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        ids = ids[rng.randrange(len(ids)) :] + [rng.randrange(vocab) for _ in range(trial % 9)]
        if trial % 3 == 0:
            rng.shuffle(ids)
        detok = Detokenizer(tokenizer)
        pieces = [detok.add([t]) for t in ids] + [detok.finish()]
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids

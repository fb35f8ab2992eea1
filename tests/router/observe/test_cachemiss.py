"""Cache-miss explanations, in the router's memory: which earlier prompt a new one is
measured against, what kind of break it is, where, and that memory stays within its budget."""

from __future__ import annotations

import asyncio

import pytest

from services.router.observe.cachemiss import HASH_CHARS, CacheMisses, Prompt, PromptParts
from services.router.request.conversation import Conversation, Message, Text
from services.router.request.render import Renderer
from shared.kvstore.hashing import block_hashes
from shared.model.text import TextModel

BS = 64


def chat(*texts: str, system: str = "You keep the harbour's books. " * 10) -> Conversation:
    roles = ["user", "assistant"] * len(texts)
    messages = (Message("system", (Text(system),)),) + tuple(
        Message(r, (Text(t),)) for r, t in zip(roles, texts, strict=False)
    )
    return Conversation("tiny", messages)


class Served:
    """Prompts as the frontend hands them over: rendered for real, their blocks hashed as the
    router hashes them (``template`` stands in for the model's fingerprint)."""

    def __init__(self, model: TextModel) -> None:
        self.model = model
        self.renderer = Renderer(100_000)
        self.renderer.add("tiny", model)
        self.n = 0

    def __call__(self, conv: Conversation, tenant: str = "t", template: str = ""):
        rendered = asyncio.run(self.renderer.render(conv, self.model, []))
        ids = rendered.ids
        hashes = block_hashes(ids, BS, f"tiny{template}", salt=tenant)
        seen = PromptParts.of(tenant, conv, [])
        self.n += 1
        prompt = Prompt(f"r{self.n}", "tiny", seen.parts, len(ids), BS, "".join(hashes))
        return prompt, seen, rendered.segments


@pytest.fixture(scope="module")
def served(real_text: TextModel) -> Served:
    return Served(real_text)


def explain(misses: CacheMisses, served: Served, conv: Conversation, cached: int, **kw):
    prompt, seen, segments = served(conv, **kw)
    tokenizer = served.model.tokenizer
    out = misses.explain(seen.tenant, prompt, seen.texts, cached, conv, segments, tokenizer)
    return out, prompt, seen


TURN_1 = ("Which berth is free at dawn? " * 12, "Berth four, until noon. " * 12)


def test_a_continued_conversation_replaces_its_earlier_turn(served: Served) -> None:
    misses = CacheMisses(10**7)
    prompt, seen, _ = served(chat(*TURN_1))
    misses.remember("t", prompt, seen.texts)
    out, prompt2, seen2 = explain(misses, served, chat(*TURN_1, "Book it."), prompt.blocks * BS)
    assert out is None  # everything the first turn allowed was cached
    misses.remember("t", prompt2, seen2.texts)
    assert len(misses) == 1  # the second turn holds all the first did


def test_evicted_blocks_are_located_in_the_message_they_start_in(served: Served) -> None:
    misses = CacheMisses(10**7)
    prompt, seen, _ = served(chat(*TURN_1))
    misses.remember("t", prompt, seen.texts)
    out, _, _ = explain(misses, served, chat(*TURN_1, "Book it."), 2 * BS)
    assert out["kind"] == "evicted_or_expired" and out["first_uncached_block"] == 2
    assert out["allowed_tokens"] == prompt.blocks * BS
    # Block 2 starts at token 128: inside the first user message (system ≈ 70 tokens).
    assert out["message"] == 1 and out["part"] == 0 and 0 < out["char"] < len(TURN_1[0])
    assert misses.explain("other", prompt, seen.texts, 0, chat(*TURN_1), (), None) is None


def test_the_same_contents_rendered_otherwise_is_a_template_change(served: Served) -> None:
    misses = CacheMisses(10**7)
    prompt, seen, _ = served(chat(*TURN_1))
    misses.remember("t", prompt, seen.texts)
    out, _, _ = explain(misses, served, chat(*TURN_1, "Book it."), 0, template="other")
    assert out["kind"] == "template_changed" and out["first_uncached_block"] == 0
    assert (out["message"], out["part"], out["char"]) == (0, 0, 0)


def test_a_new_conversation_with_the_same_system_prompt_is_not_a_break(served: Served) -> None:
    misses = CacheMisses(10**7)
    prompt, seen, _ = served(chat(*TURN_1))
    misses.remember("t", prompt, seen.texts)
    out, _, _ = explain(misses, served, chat("Something else entirely. " * 10), BS)
    assert out is None


def test_a_system_prompt_edited_before_the_same_question_is_explained(served: Served) -> None:
    """The commonest shape: a system prompt and one question; the system prompt edited and
    the question asked again (two parts, one shared: the question)."""
    misses = CacheMisses(10**7)
    question = "Which berth is free at dawn? " * 4
    before = "You keep the harbour's books. " * 10
    prompt, seen, _ = served(chat(question, system=before))
    misses.remember("t", prompt, seen.texts)
    after = before.replace("books", "ledger", 1)
    cached = before.index("books") // 8 // BS * BS  # (about where the edit's block starts)
    out, _, _ = explain(misses, served, chat(question, system=after), cached)
    assert out is not None and out["kind"] == "system_changed"
    assert (out["message"], out["char"]) == (0, before.index("books"))
    assert out["earlier_request_id"] == prompt.request_id


def test_a_system_prompt_edited_after_a_longer_conversation_is_explained_against_it(
    served: Served,
) -> None:
    """A conversation (system prompt, question, answer, question) is remembered as its last
    turn; then its system prompt is edited and the first question asked again. The new prompt
    shares little of that turn, but all it says after its system prompt is in it: the
    explanation is against that conversation."""
    misses = CacheMisses(10**7)
    before = "You keep the harbour's books. " * 10
    for turn in (TURN_1[:1], (*TURN_1, "And at dusk?")):
        prompt, seen, _ = served(chat(*turn, system=before))
        misses.remember("t", prompt, seen.texts)
    assert len(misses) == 1  # (the second turn replaced the first)
    after = before.replace("books", "ledger", 1)
    cached = before.index("books") // 8 // BS * BS
    out, _, _ = explain(misses, served, chat(TURN_1[0], system=after), cached)
    assert out is not None and out["kind"] == "system_changed"
    assert (out["message"], out["char"]) == (0, before.index("books"))
    assert out["earlier_request_id"] == prompt.request_id


def test_a_raw_prompt_edited_is_located_by_character(served: Served) -> None:
    misses = CacheMisses(10**7)
    text = "Manifest line, checked and signed. " * 40
    raw = Conversation("tiny", prompt=text)
    prompt, seen, _ = served(raw)
    misses.remember("t", prompt, seen.texts)
    changed = Conversation("tiny", prompt=text[:1000] + "X" + text[1001:] + " More.")
    out, _, _ = explain(misses, served, changed, BS)
    assert (out["kind"], out["message"], out["part"], out["char"]) == ("message_edited", 0, 0, 1000)
    # Sharing less than half of the earlier text: another prompt with the same preamble (a
    # few-shot prompt asked something else), not a break.
    other = Conversation("tiny", prompt=text[:300] + "Another question entirely.")
    assert explain(misses, served, other, 0)[0] is None


def test_memory_stays_within_its_budget_and_frees_what_it_forgets(served: Served) -> None:
    budget = 60_000
    misses = CacheMisses(budget)
    for i in range(60):
        prompt, seen, _ = served(chat(f"Conversation {i}: " + "cargo and tides. " * 40))
        misses.remember("t", prompt, seen.texts)
        assert misses.bytes <= budget
    assert 0 < len(misses) < 60  # the oldest were dropped
    # The shared system prompt's text is held once, however many prompts hold it.
    system = misses._texts[seen.parts[0].digest]
    assert system[1] == len(misses)
    misses.max_bytes = 0
    prompt, seen, _ = served(chat("last"))
    misses.remember("t", prompt, seen.texts)
    assert len(misses) == 0 and misses.bytes == 0 and not misses._texts
    assert HASH_CHARS == 32

"""The real SmolLM2: tokenizer parity with transformers, template, a sensible greedy answer,
and logits equal to transformers' own implementation of the same GGUF."""

from __future__ import annotations

import pytest
import torch

from shared.engine.interface import PrefillRequest
from shared.messages.sampling import SamplingParams
from shared.model.gguf import find_gguf
from tests.engine.conftest import make_engine

TEXTS = [
    "Hello world!",
    "What is the capital of France?",
    "  two leading spaces and trailing  ",
    "emoji 🤖 and ünïcödé, naïve café",
    "<|im_start|>user\nhi<|im_end|>\n",
    "numbers 1234567 and 3.14159, dates 2026-11-29",
    "tabs\tand\nnewlines\r\n\n\nend",
    "中文字符测试 日本語のテキスト 한국어",
    "def f(x):\n    return x**2  # a comment",
    "URLs: https://example.com/a?b=c&d=e#f",
    "",
    "'quotes' \"double\" `back` — dashes … ellipsis",
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = find_gguf()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(real_model, hf_tokenizer, text: str) -> None:
    ours = real_model.tokenizer.encode(text).ids
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert real_model.tokenizer.decode(ours, skip_special_tokens=False) == text


def test_chat_template_is_chatml(real_model) -> None:
    text = real_model.chat_template.render([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_greedy_answer_names_paris(real_model) -> None:
    engine = make_engine(real_model, block_size=64)
    text = real_model.chat_template.render(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ids = real_model.tokenizer.encode(text).ids
    out = [engine.prefill("q", ids, SamplingParams(max_tokens=24, temperature=0)).token_id]
    while engine.running:
        out += [o.token_id for o in engine.step()]
    answer = real_model.tokenizer.decode(out)
    assert "Paris" in answer
    assert engine.sequence("q").finish_reason == "stop"  # it ended with <|im_end|>


@pytest.fixture(scope="module")
def hf():
    """transformers' own implementation of the same GGUF (loaded once: it takes a while)."""
    from transformers import AutoModelForCausalLM

    path = find_gguf()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )


def test_logits_match_transformers(real_model, hf) -> None:
    ids = real_model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 6).ids
    engine = make_engine(real_model, block_size=64)
    engine.prefill("x", ids, SamplingParams(max_tokens=1))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    assert (engine.sequence("x").last_logits - ref).abs().max().item() < 1e-3


SPEC_PROMPTS = [
    "```python\ndef area(width, height):\n    return width * height\n\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n```\n"
    "Rename width to w in both functions and show them again.",
    "Write two sentences about the sea.",
    "Repeat after me exactly: the quick brown fox jumps over the lazy dog, "
    "the quick brown fox jumps over the lazy dog.",
]


def spec_answers(real_model, real_text, **options) -> tuple[list[list[int]], int]:  # noqa: ANN001
    """The engine's greedy answers to SPEC_PROMPTS (with ``options``), and the drafted tokens
    it accepted."""
    engine = make_engine(real_model, block_size=64, kv_cache_tokens=4096, **options)
    outs = []
    for i, text in enumerate(SPEC_PROMPTS):
        rendered = real_text.chat_template.render([{"role": "user", "content": text}])
        ids = real_model.tokenizer.encode(rendered, add_special_tokens=False).ids
        params = SamplingParams(max_tokens=48, temperature=0)
        out = [engine.prefill(f"q{i}", ids, params).token_id]
        while engine.running:
            out += [o.token_id for o in engine.step()]
        engine.free(f"q{i}")
        outs.append(out)
    engine.check_integrity()
    return outs, engine.stats().accepted_tokens


@pytest.fixture(scope="module")
def plain_answers(real_model, real_text) -> list[list[int]]:  # noqa: ANN001
    """The answers without speculation (once for both modes)."""
    return spec_answers(real_model, real_text)[0]


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_speculation_gives_the_real_models_greedy_answer_token_for_token(
    real_model, real_text, plain_answers: list[list[int]], mode: str
) -> None:
    spec, accepted = spec_answers(real_model, real_text, speculative=mode, fixed_draft=4)
    assert spec == plain_answers
    assert accepted > 10  # the copying prompts' drafts were taken


def test_prompt_logprobs_are_transformers_log_softmax_chunked_and_batched(real_model, hf) -> None:
    """Each prompt token's log-probability under the tokens before it, with the two most
    likely: transformers' log-softmax of its own logits, whether the prompt is computed in
    chunks or in a batch with another."""
    ids = real_model.tokenizer.encode("Ships dock at the quay; cranes unload them. " * 5).ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    want = ref.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    chunked = make_engine(real_model, block_size=16, prefill_chunk=16)
    out = chunked.prefill("x", ids, params)
    batched = make_engine(real_model, block_size=16)
    other = PrefillRequest("y", ids[:9], SamplingParams(max_tokens=1))
    first, _ = batched.prefill_batch([PrefillRequest("x", ids, params), other])
    for got in (out.prompt_logprobs, first.prompt_logprobs):
        assert len(got) == len(ids) - 1
        assert torch.tensor([g.logprob for g in got]) == pytest.approx(want, abs=1e-3)
        tops = ref.topk(2)
        assert [[t for t, _ in g.top] for g in got] == tops.indices.tolist()
    assert batched.prefill("z", ids, SamplingParams(max_tokens=1)).prompt_logprobs is None

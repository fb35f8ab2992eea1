"""Per-request sampling parameters: greedy, temperature, top-k, top-p, min-p, seed, stop tokens
and strings, a least answer length, logit bias, presence, frequency and repetition penalties,
log-probabilities asked for. Plain
values, checked here, so they travel as they are: one object from the API's adapter (the
router's ``Conversation``) through the task on the wire (``shared/messages/generate.py``,
checked again as it is read) to the engine's sampler. A new parameter is a field here and its
use in the sampler (and, for an API that takes it, the body's field of the same name: the
adapters carry those over by name)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

MAX_TOP_LOGPROBS = 20
MAX_REPETITION = 10.0
SEED_STEP = 0x9E3779B97F4A7C15  # candidate j's seed: the request's + j × this (mod 2^63)


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log-probability under the model, and the most likely tokens' (id,
    log-probability), most likely first."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no limit
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # The answer's least length: no end-of-answer token, stop token or stop string ends it
    # before this many tokens (vLLM's ``min_tokens``).
    min_tokens: int = 0
    min_p: float = 0.0  # tokens less likely than this share of the likeliest are not drawn
    # Answer tokens produced before this engine's first (a request resumed on another worker
    # after a failure): its first token is answer token #answer_offset for the seeded sampler.
    answer_offset: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    presence_penalty: float = 0.0  # subtracted from a token's logit once it is in the answer
    frequency_penalty: float = 0.0  # ... times the number of times it is in the answer
    # A token already in the prompt or the answer: its logit divided by this when positive,
    # multiplied when negative (vLLM's and Hugging Face's ``repetition_penalty``; 1 for none).
    repetition_penalty: float = 1.0
    # Log-probabilities with each token: None for none, else the chosen token's and this
    # many of the most likely ones (0 to MAX_TOP_LOGPROBS).
    logprobs: int | None = None
    # The prompt's tokens' log-probabilities too (each but the first, under the tokens before
    # it), with this many of the most likely: None for none. A cached prefix has no logits:
    # a request asking for these computes its whole prompt (as vLLM's does).
    prompt_logprobs: int | None = None
    # What the answer must match (shared/model/grammar.py: llguidance's grammar text), or None.
    grammar: str | None = None
    # The LoRA adapter that computes the sequence (the model name it is served as; "": the
    # base model). Not a sampling choice, but it goes wherever the sampling goes: to every
    # engine call that admits a sequence (shared/model/lora.py).
    adapter: str = ""

    def __post_init__(self) -> None:
        checks = [
            ("max_tokens", self.max_tokens >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be 0 (no limit) or more"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be between 0 and 1"),
            ("min_tokens", self.min_tokens >= 0, "must be 0 or more"),
            ("stop", len(self.stop) <= 4 and all(self.stop), "at most 4 non-empty strings"),
            ("answer_offset", self.answer_offset >= 0, "must be 0 or more"),
            ("logit_bias", all(-100 <= b <= 100 for _, b in self.logit_bias), "in [-100, 100]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= MAX_REPETITION, "in (0, 10]"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"None or 0 to {MAX_TOP_LOGPROBS}",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
                f"None or 0 to {MAX_TOP_LOGPROBS}",
            ),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule} (got {getattr(self, name)!r})")

    @property
    def penalized(self) -> bool:
        """Presence or frequency penalties: they count the answer's tokens."""
        return bool(self.presence_penalty or self.frequency_penalty)

    @property
    def reshaped(self) -> bool:
        """Whether the logits are changed before a token is chosen (not only the greedy
        token's argmax): a bias or a penalty."""
        return bool(self.logit_bias) or self.penalized or self.repetition_penalty != 1.0

    def candidate(self, j: int) -> SamplingParams:
        """Candidate ``j`` of several answers to one prompt (``n``, ``best_of``): its own seed,
        from the request's (the first keeps it)."""
        if self.seed is None or not j:
            return self
        return replace(self, seed=(self.seed + j * SEED_STEP) % (1 << 63))

    def resumed(self, sent: int) -> SamplingParams:
        """The sampling of the rest of the answer once ``sent`` of its tokens are out (they
        end the prompt where it goes on): the lengths left, the sampler at the next position,
        the prompt's scores not again (they went with the first token)."""
        return replace(
            self,
            max_tokens=self.max_tokens - sent,
            min_tokens=max(0, self.min_tokens - sent),
            answer_offset=self.answer_offset + sent,
            prompt_logprobs=None,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def continues_as_prompt(self) -> bool:
        """Whether an engine given the answer's first tokens as part of the prompt goes on
        with the answer this request would have had (one that keeps no per-request sampler
        state across the split: vLLM's): greedy or unseeded sampling, no penalty that counts
        the answer's tokens, no grammar over the whole answer."""
        return (self.greedy or self.seed is None) and not self.penalized and self.grammar is None


def stop_string_hit(
    decode: Callable[[list[int]], str], output_ids: list[int], stops: Sequence[str]
) -> str | None:
    """A stop string that ends in the newest token's text, just added (a stop may span
    several tokens; one that ends earlier was checked before, or came before the answer's
    least length). ``decode``: the model's tokenizer's, token ids to text."""
    longest = max(len(s) for s in stops)
    tail = decode(output_ids[-(longest + 4) :])
    new = decode(output_ids[-1:])
    recent = tail[-(longest + len(new)) :]
    old = len(recent) - len(new)  # characters before the newest text
    return next((s for s in stops if recent.find(s, max(0, old - len(s) + 1)) >= 0), None)

"""The prompt as an OpenAI answer shows it back: Completions' ``echo`` (the prompt's text
before the answer's and, with ``logprobs``, its tokens scored in the same lists, the first
token with none) and vLLM's ``prompt_logprobs`` (per choice: ``None`` for the first token,
then each token's ``{id: {logprob, decoded_token}}`` with the likeliest ranked).

Pure: the prepared request's prompts and a delta's scores in, the body's parts out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.router.request.prepare import Prepared
from shared.messages.generate import Logprobs
from shared.model.tokenizer import token_pieces

Names = Callable[[int], tuple[str, list[int]]]  # a token id → its text and bytes


class PromptScores:
    def __init__(self, p: Prepared, names: Names) -> None:
        self.names = names
        self.per_prompt = p.conversation.n  # choices of each prompt, in order
        self.heads = [c for c in (p, *p.siblings) if not c.candidate]
        self._pieces: list[bytes] | None = None
        self.tokenizer = p.text.tokenizer

    def ids(self, index: int) -> Sequence[int]:
        return self.heads[index // self.per_prompt].job.prompt_ids

    def text(self, index: int) -> str:
        """Choice ``index``'s prompt as the request gave it (token ids: their text)."""
        prompt = self.heads[index // self.per_prompt].conversation.prompt
        if isinstance(prompt, str):
            return prompt
        if self._pieces is None:
            self._pieces = token_pieces(self.tokenizer)
        raw = b"".join(self._pieces[t] for t in self.ids(index) if 0 <= t < len(self._pieces))
        return raw.decode("utf-8", errors="replace")

    def completion_logprobs(self, index: int, scores: list[Logprobs] | None) -> dict:
        """Completions' logprobs lists for the prompt's tokens (the first has no score; with
        no scores at all, none has)."""
        ids = self.ids(index)
        given = list(scores or [])
        values: list[float | None] = [None] * (len(ids) - len(given)) + [s.logprob for s in given]
        tops: list[dict | None] = [None] * (len(ids) - len(given)) + [
            {self.names(t)[0]: v for t, v in zip(s.top_ids, s.top_logprobs, strict=True)}
            for s in given
        ]
        return {
            "tokens": [self.names(t)[0] for t in ids],
            "token_logprobs": values,
            "top_logprobs": tops,
        }

    def vllm(self, index: int, scores: list[Logprobs] | None) -> list[dict | None]:
        """vLLM's prompt_logprobs: None for the first token, then per token its own score and
        the likeliest tokens' (ranked from 1), by token id."""
        ids, out = self.ids(index), [None]
        for token, s in zip(ids[1:], scores or [], strict=False):
            entry = {
                str(t): {"logprob": v, "rank": r, "decoded_token": self.names(t)[0]}
                for r, (t, v) in enumerate(zip(s.top_ids, s.top_logprobs, strict=True), 1)
            }
            if str(token) not in entry:
                entry = {
                    str(token): {"logprob": s.logprob, "decoded_token": self.names(token)[0]},
                    **entry,
                }
            out.append(entry)
        return out

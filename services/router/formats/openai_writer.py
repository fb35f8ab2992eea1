"""The OpenAI formats' writer: the answer as a Chat Completions or Completions body, or as
their chunks (``data:`` lines ending with ``[DONE]``), with log-probabilities when asked; and
OpenAI's error body.

Pure: deltas in, bytes (or the body's dict) out.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from tokenizers import Tokenizer

from services.router.errors import ApiError
from services.router.formats import wire
from services.router.formats.prompt_scores import PromptScores
from services.router.request.answer import Delta
from services.router.request.prepare import Prepared, Usage
from services.router.request.toolcalls import calls_of
from shared.httperrors import error_body as openai_error
from shared.messages.generate import Logprobs
from shared.model.tokenizer import token_bytes


def error_body(err: ApiError) -> dict:
    """OpenAI's error body: message, type (from the status), the field, the code."""
    return openai_error(err.status, err.message, err.param, err.code)


def usage_body(u: Usage) -> dict:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


def response_id(p: Prepared) -> str:
    """The answer's id: ``chatcmpl-<request id>``, or ``cmpl-...`` for a completion."""
    prefix = "chatcmpl" if p.conversation.chat else "cmpl"
    return f"{prefix}-{p.job.request_id}"


class TokenNames:
    """A token id as OpenAI's logprobs name it: its text, and its bytes (a token may hold
    part of a character, whose text then has U+FFFD)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._seen: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        if token_id not in self._seen:
            raw = token_bytes(self.tokenizer, token_id)
            self._seen[token_id] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._seen[token_id]


class OpenAIWriter:
    """The answer as a Chat Completions or Completions body, or as their chunks; an answer
    of several choices (n, best_of, several prompts) numbered by each delta's index."""

    def __init__(self, p: Prepared) -> None:
        self.p, self.kvmesh = p, p.kvmesh
        self.bodies = ResponseBodies(
            p.conversation.chat, response_id(p), p.job.model, service_tier=p.job.priority
        )
        conv = p.conversation
        self.usage_field = conv.include_usage  # chunks then carry "usage": null
        self.usage_always = conv.include_usage and conv.usage_every_chunk  # ... or the usage
        self.with_logprobs = conv.sampling.logprobs is not None  # (as asked: not to rank)
        self.names = TokenNames(p.text.tokenizer)
        self.choices = p.choices
        self.open = self.choices  # choices not yet ended
        # Per choice: Completions' text_offset (characters of answer before a token); whether
        # it made a tool call (its finish is then "tool_calls").
        self.text_offset = [0] * self.choices
        self.called = [False] * self.choices
        self._around_text: dict[int, tuple[bytes, bytes]] = {}  # a text chunk's bytes, but text
        # The prompt shown back (echo, prompt_logprobs), once per choice, before its answer.
        self.echo, self.show_scores = conv.echo, conv.prompt_scores
        self.prompts = PromptScores(p, self.names) if self.echo or self.show_scores else None
        self.opened = [self.prompts is None] * self.choices

    def whole(self, answers: list[Delta]) -> dict:
        choices = [self._whole_choice(a) for a in answers]
        return self.bodies.response(choices, self.p.answer_usage(), self.kvmesh())

    def _whole_choice(self, answer: Delta) -> dict:
        calls = [
            {
                "id": f"call_{c.id}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls_of(answer.calls)
        ]
        self.called[answer.index] = bool(calls)
        finish = self._finish(answer.finish_reason or "stop", answer.index)
        echoed, scored, extra = self._prompt_parts(answer)
        logprobs = _joined(scored, self._logprobs(answer))
        text = echoed + answer.text if answer.text or echoed or not calls else None
        return self.bodies.choice(answer.index, text, finish, logprobs, calls or None, extra)

    def _prompt_parts(self, delta: Delta) -> tuple[str, dict | None, dict]:
        """What a choice shows of its prompt before its answer, once: the echo's text, its
        tokens' logprobs (Completions' lists), vLLM's prompt_logprobs field."""
        i = delta.index
        if self.opened[i]:
            return "", None, {}
        self.opened[i] = True
        assert self.prompts is not None
        text, scored, extra = "", None, {}
        if self.echo:
            text = self.prompts.text(i)
            if self.with_logprobs:
                scored = self.prompts.completion_logprobs(i, delta.prompt_logprobs)
                scored["text_offset"] = offsets = []
                for token in scored["tokens"]:
                    offsets.append(self.text_offset[i])
                    self.text_offset[i] += len(token)
        if self.show_scores:
            extra["prompt_logprobs"] = self.prompts.vllm(i, delta.prompt_logprobs)
        return text, scored, extra

    def _opening(self, delta: Delta) -> list[bytes]:
        """A stream's chunk of the prompt shown back, before the choice's first text."""
        if self.opened[delta.index]:
            return []
        text, scored, extra = self._prompt_parts(delta)
        return [wire.data(self._chunk(delta.index, text, logprobs=scored, extra=extra))]

    def _finish(self, finish: str, index: int) -> str:
        return "tool_calls" if self.called[index] and finish == "stop" else finish

    def start(self) -> list[bytes]:
        if not self.bodies.chat:
            return []
        return [wire.data(self._chunk(i, "", first=True)) for i in range(self.choices)]

    def text(self, delta: Delta) -> list[bytes]:
        out, i = self._opening(delta), delta.index
        if delta.text and not self.with_logprobs:
            out.append(self._text_chunk(i, delta.text))
        elif delta.text:
            out.append(wire.data(self._chunk(i, delta.text, logprobs=self._logprobs(delta))))
        for e in delta.calls:
            self.called[i] = True
            piece: dict = {"index": e.index}
            if e.name:  # a call's first piece: its id, type and name
                piece.update(id=f"call_{e.id}", type="function")
                piece["function"] = {"name": e.name, "arguments": e.arguments}
            elif e.arguments:
                piece["function"] = {"arguments": e.arguments}
            else:
                continue  # its end: nothing to say in this format
            out.append(wire.data(self._chunk(i, None, tool_calls=[piece])))
        return out

    def _text_chunk(self, index: int, text: str) -> bytes:
        """The chunk of a text alone (most of a stream's): its bytes around the text are
        made once, from the chunk of a marker text, and only the text is encoded each time
        (unless each chunk says the usage so far)."""
        if self.usage_always:
            return wire.data(self._chunk(index, text))
        if index not in self._around_text:
            marker = "\x00text\x00"
            whole = wire.data(self._chunk(index, marker))
            head, tail = whole.split(json.dumps(marker).encode())
            self._around_text[index] = (head, tail)
        head, tail = self._around_text[index]
        return b"".join((head, json.dumps(text).encode(), tail))

    def end(self, last: Delta) -> list[bytes]:
        """A choice's end; after the last choice's, the stream's."""
        # The last delta's text went out already (text() is called before end()); a token
        # that came with it but made no text of its own (end of answer) goes here.
        opening = self._opening(last)  # (a prompt scored alone: max_tokens 0)
        logprobs = self._logprobs(last) if not last.text else None
        finish = self._finish(last.finish_reason or "stop", last.index)
        self.open -= 1
        chunk = wire.data(self._chunk(last.index, None, finish, logprobs=logprobs))
        return [*opening, chunk, *self._closing()] if not self.open else [*opening, chunk]

    def _chunk(self, index: int, text: str | None, finish: str | None = None, **parts) -> dict:  # noqa: ANN003
        """A chunk of choice ``index``, with the usage field as asked: none, null, or the
        usage so far."""
        usage = usage_body(self.p.answer_usage()) if self.usage_always else None
        return self.bodies.chunk(
            text, finish, with_usage_field=self.usage_field, usage=usage, index=index, **parts
        )

    def ping(self) -> bytes:
        return wire.COMMENT_PING

    def error(self, err: ApiError) -> list[bytes]:
        """The error mid-stream, in the body a plain HTTP error would have had (its type by
        status: a 429's is rate_limit_error, as it is before the stream opened)."""
        return [wire.data(error_body(err)), *self._closing()]

    def _closing(self) -> list[bytes]:
        out = []
        if self.usage_field:
            usage = self.bodies.usage_chunk(self.p.answer_usage(), self.kvmesh())
            out.append(wire.data(usage))
        return [*out, wire.data("[DONE]")]

    def _logprobs(self, delta: Delta) -> dict | None:
        """The logprobs object of a delta's tokens, in the endpoint's shape."""
        if not self.with_logprobs:
            return None
        if self.bodies.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in delta.logprobs]}
        tokens, offsets = [], []
        for t, _ in delta.logprobs:
            text = self.names(t)[0]
            tokens.append(text)
            offsets.append(self.text_offset[delta.index])
            self.text_offset[delta.index] += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for _, lp in delta.logprobs],
            "top_logprobs": [
                {self.names(t)[0]: v for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
                for _, lp in delta.logprobs
            ],
            "text_offset": offsets,
        }

    def _chat_entry(self, token_id: int, lp: Logprobs) -> dict:
        text, raw = self.names(token_id)
        top = []
        for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            top_text, top_raw = self.names(t)
            top.append({"token": top_text, "logprob": v, "bytes": top_raw})
        return {"token": text, "logprob": lp.logprob, "bytes": raw, "top_logprobs": top}


@dataclass
class ResponseBodies:
    """One answer's bodies, whole and in chunks, with its ids and object names: a chat's or a
    completion's."""

    chat: bool
    response_id: str
    model: str
    created: int = 0
    service_tier: str = "default"  # the class the request ran at

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def _envelope(self, chunk: bool) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {
            "id": self.response_id,
            "object": f"{kind}.chunk" if chunk and self.chat else kind,
            "created": self.created,
            "model": self.model,
            "service_tier": self.service_tier,
        }

    def _choice(
        self,
        index: int,
        text: str | None,
        finish: str | None,
        chunk: bool,
        first: bool,
        logprobs: dict | None,
        tool_calls: list[dict] | None = None,
        extra: dict | None = None,
    ) -> dict:
        end = {"logprobs": logprobs, "finish_reason": finish, **(extra or {})}
        if not self.chat:
            return {"index": index, "text": text or "", **end}
        if chunk:
            delta: dict = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": index, "delta": delta, **end}
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": index, "message": message, **end}

    def choice(
        self,
        index: int,
        text: str | None,
        finish: str,
        logprobs: dict | None = None,
        tool_calls: list[dict] | None = None,
        extra: dict | None = None,
    ) -> dict:
        """A whole answer's choice (``extra``: fields of kvmesh's own, vLLM's)."""
        return self._choice(index, text, finish, False, False, logprobs, tool_calls, extra)

    def response(self, choices: list[dict], usage: Usage, timing: dict) -> dict:
        return {
            **self._envelope(chunk=False),
            "choices": choices,
            "usage": usage_body(usage),
            "kvmesh": timing,
        }

    def chunk(
        self,
        text: str | None,
        finish: str | None = None,
        first: bool = False,
        with_usage_field: bool = False,
        logprobs: dict | None = None,
        tool_calls: list[dict] | None = None,
        usage: dict | None = None,
        index: int = 0,
        extra: dict | None = None,
    ) -> dict:
        choice = self._choice(index, text, finish, True, first, logprobs, tool_calls, extra)
        out = {**self._envelope(chunk=True), "choices": [choice]}
        if with_usage_field:  # with include_usage, every chunk carries "usage": null (or,
            out["usage"] = usage  # with continuous_usage_stats, the usage so far)
        return out

    def usage_chunk(self, usage: Usage, timing: dict) -> dict:
        return {
            **self._envelope(chunk=True),
            "choices": [],
            "usage": usage_body(usage),
            "kvmesh": timing,
        }


def _joined(first: dict | None, then: dict | None) -> dict | None:
    """Two Completions logprobs objects as one (each list the first's, then the other's)."""
    if first is None or then is None:
        return then if first is None else first
    return {key: first[key] + then[key] for key in first}

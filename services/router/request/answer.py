"""A prepared request's answer as text deltas (``Answers``): the dispatcher's token events
detokenized, stop strings cut, tool calls parsed out of the text, the request's usage and
timing filled in as they come. Shared by every API: a format's writer (``Writer``) turns the
deltas into its bytes.

Detokenizing is incremental, safe for multi-byte UTF-8, and honours stop strings. The
vocabulary is byte-level BPE (shared/model/tokenizer.py): a token stands for bytes, and an
answer's text is its tokens' bytes decoded as UTF-8, special tokens skipped, which is what the
tokenizer's own decode gives. So each token costs a table lookup and an incremental UTF-8
decode (a character split over two tokens is released once its last byte arrives), not a
decode of the answer's tail through the tokenizer. Text that could be the start of a stop
string is held back until it is known not to be one; a stop string and what follows it are
never sent.
"""

from __future__ import annotations

import asyncio
import codecs
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Protocol

from tokenizers import Tokenizer

from services.router.dispatch.dispatcher import Dispatcher
from services.router.errors import ApiError
from services.router.request.prepare import Prepared
from services.router.request.toolcalls import CallEvent, call_parser
from shared.messages.generate import Logprobs, TokenEvent
from shared.model.tokenizer import token_pieces
from shared.telemetry.tracing import mark_span

# A prompt's other candidates wait this long at most, once its first ended before a decode
# worker held it, for the prompt's blocks to be in the index (so each computes only the
# prompt's last block); a worker that publishes no KV events (a server without them) costs
# them this wait.
PROMPT_STORED_S = 1.0


@dataclass
class FirstCandidate:
    """A prompt's first candidate, as its others wait for it: ``held`` is set once a decode
    worker holds its KV in a running sequence (``decode``: its token after the first came
    from there), or once it ended without (``decode`` empty)."""

    held: asyncio.Event = field(default_factory=asyncio.Event)
    decode: str = ""

    def seen(self, event: TokenEvent) -> None:
        if self.held.is_set() or not event.token_ids:
            return
        if event.finish_reason:
            self.held.set()
        elif event.index >= 1:
            self.decode = event.worker_id
            self.held.set()


class Writer(Protocol):
    """How a format writes an answer back: a whole body, or its stream as server-sent events
    (what comes before the first text, each text, the end, an error mid-stream)."""

    def whole(self, answers: list[Delta]) -> dict:
        """The body of the whole answer: each choice's deltas in one, in index order."""
        ...

    def start(self) -> list[bytes]: ...

    def text(self, delta: Delta) -> list[bytes]: ...

    def end(self, last: Delta) -> list[bytes]: ...

    def ping(self) -> bytes:
        """A keep-alive while the first token is long in coming."""
        ...

    def error(self, err: ApiError) -> list[bytes]: ...


@dataclass
class Delta:
    text: str
    finish_reason: str | None = None  # on the last: "stop" or "length"
    stop_sequence: str | None = None  # on the last, when a stop string ended the answer
    # When asked for: (token id, its log-probabilities) of the tokens this text came from.
    logprobs: list[tuple[int, Logprobs]] = field(default_factory=list)
    calls: list[CallEvent] = field(default_factory=list)  # tool calls' pieces (toolcalls.py)
    index: int = 0  # the choice it belongs to (an answer of several: ``request/prepare.py``)
    # On the first delta, when asked for: the prompt's tokens' (each but the first).
    prompt_logprobs: list[Logprobs] | None = None

    @classmethod
    def joined(cls, deltas: list[Delta]) -> Delta:
        """A whole answer as one delta: every text and token, the last one's ending."""
        last = deltas[-1]
        return cls(
            "".join(d.text for d in deltas),
            last.finish_reason,
            last.stop_sequence,
            [lp for d in deltas for lp in d.logprobs],
            [c for d in deltas for c in d.calls],
            last.index,
            next((d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None), None),
        )

    @property
    def logprob(self) -> float:
        """Its tokens' cumulative log-probability."""
        return sum(lp.logprob for _, lp in self.logprobs)


class Answers:
    """Prepared requests' answers as text deltas. ``on_last``: called with the request as its
    last delta goes out (what it says is in that delta's response: a cache-miss explanation)."""

    def __init__(
        self, dispatcher: Dispatcher, on_last: Callable[[Prepared], None] | None = None
    ) -> None:
        self.dispatcher = dispatcher
        self.on_last = on_last

    def deltas(self, p: Prepared) -> AsyncIterator[Delta]:
        """The answer's deltas; each choice's last has finish_reason. Closing them early
        cancels the request on its workers."""
        return self._choices(p) if p.siblings else self._answer(p)

    async def _choices(self, p: Prepared) -> AsyncIterator[Delta]:
        """An answer of several choices (``request/prepare.py``): every candidate's deltas as
        they come, each with its choice's index; a prompt's other candidates start once a
        decode worker holds its first's KV, and go there to share it (the prompt's blocks are
        not computed again, nor copied), or, when it ended before, once its blocks are
        stored. Ranked candidates (best_of) are all read first, and the likeliest of each
        prompt's given. Any candidate's error is the answer's."""
        every, queue = [p, *p.siblings], asyncio.Queue()
        firsts: dict[int, FirstCandidate] = {}  # per candidate: its prompt's first
        for i, c in enumerate(every):
            firsts[i] = firsts[i - 1] if c.candidate else FirstCandidate()

        async def run(index: int, c: Prepared) -> None:
            first = firsts[index]
            try:
                if c.candidate:  # its prompt's first candidate's blocks: reused, not computed
                    await first.held.wait()
                    if first.decode:
                        c.job = replace(c.job, near=first.decode)
                    else:
                        await self.dispatcher.cached(c.job, PROMPT_STORED_S)
                async for delta in self._answer(c, None if c.candidate else first):
                    queue.put_nowait(replace(delta, index=index))
            except Exception as err:  # (the answer's: the first error ends it)
                queue.put_nowait(err)
            finally:
                first.held.set()
                queue.put_nowait(None)

        tasks = [asyncio.create_task(run(i, c)) for i, c in enumerate(every)]
        ranked: dict[int, list[Delta]] | None = (
            {} if p.conversation.best_of > p.conversation.n else None
        )
        try:
            for _ in tasks:
                while (item := await queue.get()) is not None:
                    if isinstance(item, Exception):
                        raise item
                    if ranked is None:
                        yield item
                    else:
                        ranked.setdefault(item.index, []).append(item)
            for delta in likeliest(p, ranked or {}):
                yield delta
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _answer(
        self, p: Prepared, first: FirstCandidate | None = None
    ) -> AsyncIterator[Delta]:
        """One candidate's deltas (``first``: told of its events, when it is its prompt's
        first of several)."""
        inner = self.text(p, first)
        conv = p.conversation
        calls = None
        if conv.calls_tools:  # forced calls stream as they come
            calls = call_parser(p.text.chat_template.tool_syntax, bool(conv.forced_tools))
        try:
            async for delta in inner:
                if calls is not None:
                    text, events = calls.feed(delta.text)
                    if delta.finish_reason:
                        rest, more = calls.finish()
                        text, events = text + rest, events + more
                    if not (text or events or delta.finish_reason or delta.prompt_logprobs):
                        continue
                    delta = replace(delta, text=text, calls=events)
                if delta.finish_reason and self.on_last is not None and not p.candidate:
                    self.on_last(p)
                yield delta
        finally:
            await inner.aclose()

    async def text(self, p: Prepared, first: FirstCandidate | None = None) -> AsyncIterator[Delta]:
        """Text deltas of the answer; the last has finish_reason. ``p.usage`` and
        ``p.timing`` are filled in as events arrive (complete once the last delta is out).
        With images, the answer starts only once every image is encoded, and a failed encode
        ends it."""
        job, usage, timing, encodes = p.job, p.usage, p.timing, p.encodes
        detok = Detokenizer(p.text.tokenizer, job.sampling.stop, job.sampling.min_tokens)
        logprobs: list[tuple[int, Logprobs]] = []  # the tokens' not yet sent with a text
        scored: list[Logprobs] | None = None  # the prompt's, until they go with a delta
        events = self.dispatcher.generate(job, timing.route)
        if encodes is not None:
            events = encodes.guard(events)
        try:
            async for event in events:
                if encodes is not None and not timing.images:
                    timing.images = encodes.report()
                if event.cached_tokens is not None:
                    usage.cached_tokens = event.cached_tokens
                timing.add(event)
                if first is not None:
                    first.seen(event)
                if event.index == 0 and event.token_ids:
                    mark_span("first_token")
                scored = event.prompt_logprobs if event.prompt_logprobs is not None else scored
                if p.conversation.scores_only and event.token_ids:  # the prompt's scores alone
                    yield Delta("", "length", prompt_logprobs=scored)
                    return
                usage.completion_tokens += len(event.token_ids)
                if event.logprobs:
                    logprobs += zip(event.token_ids, event.logprobs, strict=True)
                text = detok.add(event.token_ids)
                if detok.stopped:  # the answer ends here (its events are closed below)
                    yield Delta(text, "stop", detok.stop_hit, logprobs, prompt_logprobs=scored)
                    return
                if event.finish_reason == "abort":
                    if time.time() >= job.deadline:  # decode stops a request at its deadline
                        raise ApiError(504, "request deadline passed", code="timeout")
                    raise ApiError(503, "the worker stopped this request", code="aborted")
                if event.finish_reason:
                    text += detok.finish()
                    finish = "stop" if event.finish_reason == "stop" else "length"
                    stop = detok.stop_hit or event.stop_string
                    yield Delta(text, finish, stop, logprobs, prompt_logprobs=scored)
                    return
                if text or scored is not None:
                    yield Delta(text, logprobs=logprobs, prompt_logprobs=scored)
                    logprobs, scored = [], None
        finally:
            await events.aclose()  # a stop string: the rest is cancelled on the workers now


def likeliest(p: Prepared, candidates: dict[int, list[Delta]]) -> Iterator[Delta]:
    """Each prompt's ``n`` candidates of the highest cumulative log-probability, numbered in
    that order, prompt by prompt (``candidates``: each candidate's deltas, by its place);
    their log-probabilities only where the request asked for them."""
    n, best_of = p.conversation.n, p.conversation.best_of
    asked = p.conversation.sampling.logprobs is not None
    for k in range(len(candidates) // best_of):
        answers = [Delta.joined(candidates[k * best_of + j]) for j in range(best_of)]
        best = sorted(answers, key=lambda a: -a.logprob)[:n]
        for rank, answer in enumerate(best):
            yield replace(answer, index=k * n + rank, logprobs=answer.logprobs if asked else [])


class Detokenizer:
    """An answer's tokens as text released as it becomes safe to send. ``min_tokens``: a stop
    string counts only once it ends in the text of the answer's ``min_tokens``-th token or a
    later one (as the engines count it)."""

    def __init__(
        self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = (), min_tokens: int = 0
    ) -> None:
        self.pieces = token_pieces(tokenizer)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = list(stop)
        self.text = ""
        self.sent = 0  # characters of self.text released so far
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the answer
        self.tokens = 0
        self.min_tokens = min_tokens
        # A stop string counts once it ends past this many characters (None: not yet known).
        self.floor: int | None = 0 if min_tokens <= 1 else None

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; returns the text that is now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        pieces, n = self.pieces, len(self.pieces)
        if self.floor is None:  # the text before the least length's last token is known
            early = token_ids[: self.min_tokens - 1 - self.tokens]
            self.text += self.utf8.decode(b"".join([pieces[t] for t in early if 0 <= t < n]))
            self.tokens += len(early)
            token_ids = token_ids[len(early) :]
            if self.tokens == self.min_tokens - 1:
                self.floor = len(self.text)
        raw = b"".join([pieces[t] for t in token_ids if 0 <= t < n])
        self.text += self.utf8.decode(raw)
        self.tokens += len(token_ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The end of the answer: everything not yet sent (up to a stop string)."""
        if not self.stopped:
            self.text += self.utf8.decode(b"", final=True)  # a cut-off character: U+FFFD
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stop:
            out = self.text[self.sent :]
            self.sent = len(self.text)
            return out
        cut = self._stop_at()
        if cut is not None:
            cut, self.stop_hit = cut
            self.text = self.text[:cut]
            self.stopped = True
            end = len(self.text)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._held_back()
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return out

    def _stop_at(self) -> tuple[int, str] | None:
        """Where the earliest stop string begins in the text, and which, if one does."""
        if self.floor is None:
            return None  # (the answer ended before its least length: no stop counts)
        hits = [
            (i, s)
            for s in self.stop
            if (i := self.text.find(s, max(0, self.sent - len(s), self.floor - len(s) + 1))) >= 0
        ]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest text suffix that is the beginning of some stop string."""
        held = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held

"""Token ids → text, incrementally: safe for multi-byte UTF-8, honouring stop strings.

A character split over two byte-level tokens decodes to U+FFFD until its last byte arrives, so
text is released only once it decodes cleanly. Text that could be the start of a stop string is
held back until it is known not to be one; a stop string and what follows it are never sent.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.ids: list[int] = []
        # Decode from prefix_offset so the tokenizer sees context (leading spaces and merged
        # bytes decode right); ids before read_offset are already in self.text.
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.sent = 0  # characters of self.text released so far
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the answer

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; returns the text that is now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.text += after[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The end of the answer: everything not yet sent (up to a stop string)."""
        if not self.stopped:
            rest = self._decode(self.ids[self.prefix_offset :])
            before = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += rest[len(before) :]
            self.read_offset = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
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
        hits = [
            (i, s) for s in self.stop if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0
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

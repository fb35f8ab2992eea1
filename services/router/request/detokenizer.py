"""Token ids → text, incrementally: safe for multi-byte UTF-8, honouring stop strings.

The vocabulary is byte-level BPE (shared/model/tokenizer.py): a token stands for bytes, and an
answer's text is its tokens' bytes decoded as UTF-8, special tokens skipped, which is what the
tokenizer's own decode gives. So each token costs a table lookup and an incremental UTF-8
decode (a character split over two tokens is released once its last byte arrives), not a
decode of the answer's tail through the tokenizer. Text that could be the start of a stop
string is held back until it is known not to be one; a stop string and what follows it are
never sent.
"""

from __future__ import annotations

import codecs

from tokenizers import Tokenizer, decoders

from shared.model.tokenizer import token_bytes

_PIECES: dict[int, tuple[Tokenizer, list[bytes]]] = {}  # id(tokenizer) → it, its table


def token_pieces(tokenizer: Tokenizer) -> list[bytes]:
    """Each token id's bytes (a special token's: none), built once per tokenizer."""
    if id(tokenizer) not in _PIECES:
        if not isinstance(tokenizer.decoder, decoders.ByteLevel):
            raise ValueError("the detokenizer needs a byte-level BPE tokenizer")
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        pieces = [token_bytes(tokenizer, i) for i in range(n)]
        for i, added in tokenizer.get_added_tokens_decoder().items():
            pieces[i] = b"" if added.special else added.content.encode()
        _PIECES[id(tokenizer)] = (tokenizer, pieces)
    return _PIECES[id(tokenizer)][1]


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | tuple[str, ...] = ()) -> None:
        self.pieces = token_pieces(tokenizer)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.stop = list(stop)
        self.text = ""
        self.sent = 0  # characters of self.text released so far
        self.stopped = False
        self.stop_hit: str | None = None  # the stop string that ended the answer

    def add(self, token_ids: list[int]) -> str:
        """Take new tokens; returns the text that is now safe to send (maybe empty)."""
        if self.stopped:
            return ""
        pieces, n = self.pieces, len(self.pieces)
        raw = b"".join([pieces[t] for t in token_ids if 0 <= t < n])
        self.text += self.utf8.decode(raw)
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

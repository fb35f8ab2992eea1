"""Prompt tokenization with a cache of segments.

A tokenizer splits its input at special tokens before anything else, so a prompt's ids are
the ids of each text segment between special tokens, joined by the special tokens' own ids.
A chat prompt's segments are its messages: the next turn of a conversation repeats all but
the newest, and only those get tokenized again. (Tokenizing a 77K-token conversation takes
over 100 ms here; a cached turn takes about a millisecond.) Each segment also keeps its ids
packed as block hashing reads them, so hashing a long prompt does not pack it again.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict

from tokenizers import Tokenizer

from services.router.dispatch.job import Segments
from shared.kvstore.hashing import pack_tokens


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer, cache_tokens: int = 4_000_000) -> None:
        self.tokenizer = tokenizer
        specials = {
            t.content: i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special
        }
        self.special_ids = specials
        self._special_packed = {t: pack_tokens([i]) for t, i in specials.items()}
        self._split = (
            re.compile(
                "(" + "|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)) + ")"
            )
            if specials
            else None
        )
        self.cache_tokens = cache_tokens
        self._cache: OrderedDict[str, tuple[list[int], bytes]] = OrderedDict()
        self._cached_tokens = 0
        self.hits = self.misses = 0
        self._lock = threading.Lock()  # encode may run on several threads

    def encode(self, text: str) -> list[int]:
        """The same ids as ``tokenizer.encode(text, add_special_tokens=False).ids``."""
        return self.encode_segments(text)[0]

    def encode_segments(self, text: str) -> tuple[list[int], Segments]:
        """The ids, and the segments they came from: (text, its ids packed) in order."""
        if self._split is None:
            ids, packed = self._segment(text)
            return list(ids), ((text, packed),)
        ids: list[int] = []
        segments = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                ids.append(self.special_ids[part])
                segments.append((part, self._special_packed[part]))
            elif part:
                seg, packed = self._segment(part)
                ids.extend(seg)
                segments.append((part, packed))
        return ids, tuple(segments)

    def _segment(self, text: str) -> tuple[list[int], bytes]:
        with self._lock:
            entry = self._cache.get(text)
            if entry is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return entry
            self.misses += 1
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids  # the GIL is let go
        entry = (ids, pack_tokens(ids))
        with self._lock:
            if len(ids) <= self.cache_tokens and text not in self._cache:
                self._cache[text] = entry
                self._cached_tokens += len(ids)
                while self._cached_tokens > self.cache_tokens:
                    _, (gone, _) = self._cache.popitem(last=False)
                    self._cached_tokens -= len(gone)
        return entry

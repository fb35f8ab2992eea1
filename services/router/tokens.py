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

from shared.kvstore.hashing import pack_tokens, packed_block_hashes

# (text, its ids packed by pack_tokens) in prompt order
Segments = tuple[tuple[str, bytes], ...]


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


KEY_SEGMENTS = 6


class PrefixHashes:
    """Block hashes of recent prompts, remembered with their segments: a prompt that starts
    with the same segments as an earlier one (the next turn of a conversation) has the same
    tokens there, so the hashes of the full blocks inside them are reused and only the new
    blocks are hashed."""

    def __init__(self, max_prompts: int = 4096) -> None:
        self.max_prompts = max_prompts
        self._recent: OrderedDict[tuple, tuple[Segments, list[str]]] = OrderedDict()
        self.reused_blocks = 0  # hashes taken from an earlier prompt
        self.hashed_blocks = 0  # hashes computed

    def hashes(self, segments: Segments, block_size: int, fingerprint: str, salt: str) -> list[str]:
        """The block hashes of the prompt made of ``segments``."""
        # A conversation is known by its opening: through its first user message in a chat
        # (system prompt, then the user's first words), the whole text otherwise.
        key = (fingerprint, block_size, salt, segments[:KEY_SEGMENTS])
        known: list[str] = []
        entry = self._recent.get(key)
        if entry is not None:
            old_segments, old_hashes = entry
            shared = 0
            for new, old in zip(segments, old_segments, strict=False):
                if new != old:  # text compared by content
                    break
                shared += len(new[1])
            known = old_hashes[: min(len(old_hashes), shared // (4 * block_size))]
        packed = b"".join(p for _, p in segments)
        hashes = packed_block_hashes(packed, block_size, fingerprint, salt, known=known)
        self.reused_blocks += len(known)
        self.hashed_blocks += len(hashes) - len(known)
        self._recent[key] = (segments, hashes)
        self._recent.move_to_end(key)
        while len(self._recent) > self.max_prompts:
            self._recent.popitem(last=False)
        return hashes

"""Why a prompt missed the cache, said in the response.

DeepInfer's hit ratio rests on the client's discipline: a fixed prefix, a stable history, one
template. When a prompt gets fewer cached tokens than the same tenant's earlier prompt of the
same conversation allowed (all that prompt's full blocks), the response says where the new
prompt broke from it and how: the first uncached block, the message, content part and
character where the break is (and that part's place in the request, as the request named it:
``messages[2].content[1]``, ``system``), and its kind:

- ``system_changed``: the system prompt differs (at that character);
- ``message_edited``: an earlier message differs (at that character);
- ``messages_reordered``: an earlier message moved;
- ``message_removed``: an earlier message is gone;
- ``image_changed``: an image differs;
- ``template_changed``: the same contents rendered to other tokens (another chat template,
  other joins of system blocks, a raw prompt where a chat was);
- ``evicted_or_expired``: the prompt continues the earlier one, but its blocks are gone from
  every tier (evicted for room, or expired by their retention class).

"The same conversation": among the tenant's recent prompts for the model that share one of
the new prompt's first messages after the system prompt, the one sharing the most content
parts with it, when that is more than half of its own parts, or of those after its system
prompt, or of the new prompt's after its system prompt (a system prompt edited before the
same question is a break, also after the conversation went on; a new conversation that only
repeats a system prompt is not); for raw prompts, the one whose text the new one shares at
least half of from the start. Memory is bounded: a conversation is kept as its
latest prompt (a turn replaces the one it continues), as its parts' digests, its texts (each
distinct text once, however many prompts hold it) and its full blocks' hashes, the least
recently seen dropped first beyond a byte budget.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import xxhash
from prometheus_client import Gauge
from tokenizers import Tokenizer

from services.router.dispatch.job import Job, Segments
from services.router.request.conversation import Conversation, Image
from services.router.request.messages import part_text
from services.router.request.prepare import Prepared
from services.router.request.render import locate

KINDS = (
    "system_changed",
    "message_edited",
    "messages_reordered",
    "message_removed",
    "image_changed",
    "template_changed",
    "evicted_or_expired",
)
HASH_CHARS = 32  # a block hash in hex (shared/kvstore/hashing.py)
PER_PROMPT_BYTES = 256  # a prompt's bookkeeping besides its texts and hashes, about
ANCHORS = 3  # a prompt is found by its first parts after the system prompt
PER_ANCHOR = 16  # prompts found by one anchor at most (the most recent)
RAW_ANCHOR_CHARS = 256  # a raw prompt is found by its opening


@dataclass(frozen=True)
class Part:
    """One content part of a prompt: where it is, whose it is, and what (by digest)."""

    message: int
    part: int
    role: str
    image: bool
    digest: bytes  # of role and content (an image: of its salted content hash)


@dataclass
class Prompt:
    """A prompt as remembered: its parts, its length, its full blocks' hashes."""

    request_id: str
    model: str
    parts: tuple[Part, ...]
    tokens: int
    block_size: int
    hashes: str  # the full blocks' hashes joined, HASH_CHARS each, in order
    seen_at: float = 0.0

    @property
    def blocks(self) -> int:
        return len(self.hashes) // HASH_CHARS

    def cost(self) -> int:
        return len(self.hashes) + PER_PROMPT_BYTES + 64 * len(self.parts)

    @property
    def raw(self) -> bool:
        return len(self.parts) == 1 and self.parts[0].role == "prompt"

    def anchors(self, texts: list[str]) -> list[bytes]:
        if self.raw:
            return [_digest("prompt", texts[0][:RAW_ANCHOR_CHARS])]
        return [p.digest for p in self.parts if p.role != "system"][:ANCHORS]


@dataclass(frozen=True)
class PromptParts:
    """A request's prompt as its explanation needs it: the conversation's parts and their
    texts ("" for an image), in prompt order (a raw text prompt is one part)."""

    tenant: str
    parts: tuple[Part, ...]
    texts: list[str]

    @classmethod
    def of(cls, tenant: str, conv: Conversation, image_hashes: list[str]) -> PromptParts:
        """``image_hashes``: the conversation's images' content hashes, in order."""
        if not conv.chat:
            text = conv.prompt if isinstance(conv.prompt, str) else ""
            return cls(tenant, (Part(0, 0, "prompt", False, _digest("prompt", text)),), [text])
        parts, texts, k = [], [], 0
        for i, m in enumerate(conv.messages):
            for j, p in enumerate(m.parts):
                if isinstance(p, Image):
                    content, image = image_hashes[k] if k < len(image_hashes) else p.url, True
                    k += 1
                    texts.append("")
                else:
                    content, image = part_text(p), False
                    texts.append(content)
                parts.append(Part(i, j, m.role, image, _digest(m.role, content)))
        return cls(tenant, tuple(parts), texts)


def _digest(role: str, content: str) -> bytes:
    return xxhash.xxh3_128_digest(f"{role}\x00{content}".encode("utf-8", "surrogatepass"))


EXPLAIN_BYTES = Gauge(
    "kvmesh_router_cache_explain_bytes",
    "what the cache-miss explanations hold (recent conversations' parts and block hashes), "
    "by its own count (at most KVMESH_ROUTER_CACHE_EXPLAIN_BYTES)",
)


class CacheMisses:
    """Recent conversations per tenant, and the explanation of a new prompt's misses."""

    def __init__(self, max_bytes: int) -> None:
        EXPLAIN_BYTES.set_function(lambda: self.bytes)
        self.max_bytes = max_bytes
        self._prompts: OrderedDict[tuple[str, str], Prompt] = OrderedDict()  # (tenant, rid)
        # (tenant, anchor digest) → the request ids of prompts with that anchor, oldest first
        self._anchored: dict[tuple[str, bytes], OrderedDict[str, None]] = {}
        self._anchors: dict[tuple[str, str], list[bytes]] = {}
        self._texts: dict[bytes, tuple[str, int]] = {}  # digest → (text, prompts holding it)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._prompts)

    # -- remembering ---------------------------------------------------------------------

    def remember(self, tenant: str, prompt: Prompt, texts: list[str]) -> None:
        """A prompt that was served (its blocks are stored by now); it replaces the earlier
        prompt it continues."""
        old = self.earlier(tenant, prompt, texts)
        if old is not None and self._continues(prompt, texts, old):
            self._forget((tenant, old.request_id))
        key = (tenant, prompt.request_id)
        if key in self._prompts:
            self._forget(key)
        prompt.seen_at = prompt.seen_at or time.time()
        self._prompts[key] = prompt
        self.bytes += prompt.cost()
        for part, text in zip(prompt.parts, texts, strict=True):
            held, n = self._texts.get(part.digest, (text, 0))
            if n == 0:
                self.bytes += len(held)
            self._texts[part.digest] = (held, n + 1)
        anchors = self._anchors[key] = prompt.anchors(texts)
        for anchor in anchors:
            ids = self._anchored.setdefault((tenant, anchor), OrderedDict())
            ids[prompt.request_id] = None
            if len(ids) > PER_ANCHOR:
                ids.popitem(last=False)
        while self.bytes > self.max_bytes and self._prompts:
            self._forget(next(iter(self._prompts)))

    def _continues(self, new: Prompt, texts: list[str], old: Prompt) -> bool:
        if new.raw:
            return texts[0].startswith(self._text(old.parts[0].digest))
        n = len(old.parts)
        return len(new.parts) >= n and all(
            a.digest == b.digest for a, b in zip(new.parts[:n], old.parts, strict=True)
        )

    def _forget(self, key: tuple[str, str]) -> None:
        prompt = self._prompts.pop(key)
        self.bytes -= prompt.cost()
        for anchor in self._anchors.pop(key):
            ids = self._anchored.get((key[0], anchor))
            if ids is not None:
                ids.pop(key[1], None)
                if not ids:
                    del self._anchored[(key[0], anchor)]
        for part in prompt.parts:
            text, n = self._texts[part.digest]
            if n == 1:
                del self._texts[part.digest]
                self.bytes -= len(text)
            else:
                self._texts[part.digest] = (text, n - 1)

    # -- explaining ----------------------------------------------------------------------

    def earlier(self, tenant: str, prompt: Prompt, texts: list[str]) -> Prompt | None:
        """The tenant's recent prompt of the same conversation as ``prompt``, if any."""
        ids: set[str] = set()
        for anchor in prompt.anchors(texts):
            ids.update(self._anchored.get((tenant, anchor), ()))
        mine = {p.digest for p in prompt.parts}
        mine_said = [p.digest for p in prompt.parts if p.role != "system"]
        best, best_key = None, (0, 0.0)
        for rid in ids:
            old = self._prompts.get((tenant, rid))
            if old is None or old.model != prompt.model or rid == prompt.request_id:
                continue
            if prompt.raw:
                was = self._text(old.parts[0].digest)
                shared = _common_prefix(was, texts[0])
                related = 2 * shared >= len(was)
            else:  # over all its parts, or its parts after the system prompt (which may be
                # the very thing that changed), or the new prompt's after its system prompt
                # (a later turn of that conversation was kept: the new prompt branches off
                # it earlier, say with the system prompt edited before its first question)
                shared = sum(p.digest in mine for p in old.parts)
                said = [p for p in old.parts if p.role != "system"]
                shared_said = sum(p.digest in mine for p in said)
                theirs = {p.digest for p in old.parts}
                ours_in_it = sum(d in theirs for d in mine_said)
                related = (
                    2 * shared > len(old.parts)
                    or 2 * shared_said > len(said)
                    or 2 * ours_in_it > len(mine_said)
                )
            key = (shared, old.seen_at)
            if related and key > best_key:
                best, best_key = old, key
        return best

    def explain(
        self,
        tenant: str,
        prompt: Prompt,
        texts: list[str],
        cached_tokens: int,
        conv: Conversation,
        segments: Segments,
        tokenizer: Tokenizer,
    ) -> dict | None:
        """Where and why ``prompt`` got fewer cached tokens than its conversation's earlier
        prompt allowed; None when it got them all (or there is no earlier prompt)."""
        old = self.earlier(tenant, prompt, texts)
        if old is None or old.block_size != prompt.block_size:
            return None
        bs = prompt.block_size
        allowed = min(old.blocks, prompt.blocks) * bs
        if cached_tokens >= allowed:
            return None
        out: dict = {
            "kind": "",
            "first_uncached_block": cached_tokens // bs,
            "cached_tokens": cached_tokens,
            "allowed_tokens": allowed,
            "earlier_request_id": old.request_id,
            "earlier_age_s": round(time.time() - old.seen_at, 3),
        }
        broken = self._break(prompt, texts, old)
        if broken is not None:
            kind, part, char = broken
            at = {"message": part.message, "part": part.part, "char": char}
            return {**out, "kind": kind, **at, "field": conv.where(part.message, part.part)}
        # Every part of the earlier prompt is where it was: either the tokens differ (the
        # same contents rendered otherwise), or the blocks are gone.
        differ = next(
            (
                b
                for b in range(min(old.blocks, prompt.blocks))
                if old.hashes[b * HASH_CHARS : (b + 1) * HASH_CHARS]
                != prompt.hashes[b * HASH_CHARS : (b + 1) * HASH_CHARS]
            ),
            None,
        )
        if differ is not None and differ * bs < cached_tokens:
            differ = None  # (cannot be: what was served from the cache has its hashes)
        kind = "evicted_or_expired" if differ is None else "template_changed"
        position = cached_tokens if differ is None else differ * bs
        at = locate(conv, segments, tokenizer, position)
        return {**out, "kind": kind, **at, "field": conv.where(at["message"], at["part"])}

    def _break(self, new: Prompt, texts: list[str], old: Prompt) -> tuple[str, Part, int] | None:
        """The first part where ``new`` departs from ``old``: its kind, the new prompt's
        part there, and the character in it; None where ``new`` continues ``old``."""
        if new.raw:
            was = self._text(old.parts[0].digest)
            shared = _common_prefix(was, texts[0])
            return None if shared == len(was) else ("message_edited", new.parts[0], shared)
        new_digests = {p.digest for p in new.parts}
        old_digests = {p.digest for p in old.parts}
        for k, (was, now) in enumerate(zip(old.parts, new.parts, strict=False)):
            if now.digest == was.digest:
                continue
            if was.image or now.image:
                return "image_changed", now, 0
            if was.digest in new_digests and now.digest in old_digests:
                return "messages_reordered", now, 0
            later = {p.digest for p in old.parts[k + 1 :]}
            if was.digest not in new_digests and now.digest in later:
                return "message_removed", now, 0
            char = _common_prefix(self._text(was.digest), texts[k])
            kind = "system_changed" if was.role == now.role == "system" else "message_edited"
            return kind, now, char
        return None

    def _text(self, digest: bytes) -> str:
        return self._texts.get(digest, ("", 0))[0]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    lo, hi = 0, n  # the longest equal prefix, by halving (C-speed compares)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Explainer:
    """A request's cache misses explained as its last delta goes out (``Answers.on_last``),
    then its prompt remembered for the next turn's. ``hashes``: a job's block size and the
    hashes of its prompt's full blocks (the dispatcher's)."""

    def __init__(self, misses: CacheMisses, hashes: Callable[[Job], tuple[int, list[str]]]):
        self.misses = misses
        self.hashes = hashes

    def __call__(self, p: Prepared) -> None:
        job = p.job
        bs, hashes = self.hashes(job)
        if not bs:
            return
        images = [i.image_hash for i in p.encodes.images] if p.encodes else []
        parts = PromptParts.of(p.tenant, p.conversation, images)
        prompt = Prompt(
            job.request_id, job.model, parts.parts, len(job.prompt_ids), bs, "".join(hashes)
        )
        p.timing.cache_miss = self.misses.explain(
            parts.tenant,
            prompt,
            parts.texts,
            p.usage.cached_tokens,
            p.conversation,
            job.segments,
            p.text.tokenizer,
        )
        self.misses.remember(parts.tenant, prompt, parts.texts)

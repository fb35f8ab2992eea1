"""The one renderer: a conversation to the token ids the workers see.

Messages go through the model's chat template (images as unguessable markers, then each as
its placeholder tokens, hashed by content); a raw prompt is tokenized as it is, or taken as
token ids. The same conversation gives the same ids whichever API format carried it.

Tokenizing keeps a cache of segments. A tokenizer splits its input at special tokens before
anything else, so a prompt's ids are the ids of each text segment between special tokens,
joined by the special tokens' own ids. A chat prompt's segments are its messages: the next
turn of a conversation repeats all but the newest, and only those get tokenized again
(tokenizing a 77K-token conversation takes over 100 ms here; a cached turn takes about a
millisecond). Each segment also keeps its ids packed as block hashing reads them, so hashing
a long prompt does not pack it again.
"""

from __future__ import annotations

import array
import asyncio
import re
import struct
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from prometheus_client import Gauge
from tokenizers import Tokenizer

from services.router.dispatch.encodes import ImageInput
from services.router.dispatch.job import Segments
from services.router.errors import ApiError
from services.router.request.conversation import Conversation, Image
from services.router.request.messages import chat_messages, part_text, template_messages, tool_spec
from shared.kvstore.hashing import image_stream, pack_tokens
from shared.messages.generate import ImageRef, TokenIds, unpack_ids
from shared.model.grammar import vocabulary
from shared.model.text import TextModel, load_text_model, model_names
from shared.model.tokenizer import ChatTemplateError, token_pieces
from shared.service import keep_for_good
from shared.telemetry.tracing import tracer

LONG_TEXT_CHARS = 8192  # above this, tokenizing takes milliseconds: off the event loop
PLACEHOLDER_ID = 0  # the token id under an image's positions (its embeddings replace it)


@dataclass(frozen=True)
class Rendered:
    ids: TokenIds
    segments: Segments  # what the ids were tokenized from (a next turn reuses their hashes)
    images: tuple[ImageRef, ...] = ()  # each image's placeholder tokens


TOKEN_CACHE = Gauge(
    "kvmesh_router_token_cache_tokens",
    "prompt tokens the router's tokenizer cache holds, by model (at most "
    "KVMESH_ROUTER_TOKEN_CACHE_TOKENS each)",
    ["model"],
)


class Renderer:
    def __init__(
        self,
        token_cache_tokens: int,
        state_dir: Path | None = None,
        models: Mapping[str, str] | None = None,
        base: Callable[[str], str] = str,
    ) -> None:
        self.token_cache_tokens = token_cache_tokens
        self.state_dir = state_dir  # where models' text sides are cached (shared/model/text)
        self.models = dict(models or {})  # a team's own: name → path (KVMESH_MODELS)
        self.names = frozenset(model_names(self.models))  # every base model the mesh can serve
        self.base = base  # the model a name is rendered as (a LoRA adapter's: its base's)
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._models: dict[str, TextModel] = {}
        self._loading = asyncio.Lock()

    def add(self, name: str, model: TextModel) -> None:
        """Render for the model ``name`` from now on (its tokenizer, with a cache of
        segments)."""
        tokenizer = PromptTokenizer(model.tokenizer, self.token_cache_tokens)
        self._tokenizers[name] = tokenizer
        TOKEN_CACHE.labels(name).set_function(lambda: tokenizer.cached_tokens)

    async def text_model(self, name: str) -> TextModel:
        """A model's text side (config, tokenizer, chat template), loaded once, off the loop,
        with the tables built from it (the vocabulary grammars are checked against, each
        token's bytes for the detokenizer); rendered for from then on. An adapter's: its
        base model's."""
        name = self.base(name)
        if name not in self._models:
            async with self._loading:
                if name not in self._models:
                    loop = asyncio.get_running_loop()
                    model = await loop.run_in_executor(
                        None, partial(load_text_model, name, self.state_dir, models=self.models)
                    )
                    eos = tuple(model.config.eos_ids)
                    await loop.run_in_executor(None, vocabulary, model.tokenizer, eos)  # 0.2 s
                    await loop.run_in_executor(None, token_pieces, model.tokenizer)  # 0.1 s
                    self.add(name, model)
                    self._models[name] = model
                    keep_for_good()  # the model's tables live as long as the router
        return self._models[name]

    async def render(
        self, conv: Conversation, model: TextModel, images: list[ImageInput]
    ) -> Rendered:
        """``images``: the conversation's, read and checked, in order."""
        if conv.chat:
            nonce = uuid.uuid4().hex  # a client cannot forge a marker it cannot guess
            marker = f"\x00kvmesh-image-{nonce}-"
            template = model.chat_template
            try:
                if template.tool_syntax.native:
                    tools = [tool_spec(t) for t in conv.tools]
                    text = template.render(template_messages(conv, marker), tools=tools)
                else:
                    text = template.render(chat_messages(conv, marker))
            except ChatTemplateError as err:
                raise ApiError(
                    400,
                    f"messages: the model's chat template refused them: {err}",
                    param="messages",
                ) from None
            return await self._with_images(self.base(conv.model), text, marker, images)
        if isinstance(conv.prompt, str):
            return Rendered(*await self.encode(self.base(conv.model), conv.prompt))
        assert conv.prompt is not None
        vocab = model.config.vocab_size
        bad = next((t for t in conv.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"prompt: token id {bad} is outside the vocabulary", param="prompt")
        return Rendered(array.array("i", conv.prompt), ())

    async def encode(self, model: str, text: str) -> tuple[TokenIds, Segments]:
        """Token ids and their segments; a long text is tokenized on a thread, so other
        requests keep moving."""
        with tracer.start_as_current_span("tokenize") as span:
            tokenizer = self._tokenizers[model]
            if len(text) < LONG_TEXT_CHARS:
                ids, segments = tokenizer.encode_segments(text)
            else:
                loop = asyncio.get_running_loop()
                ids, segments = await loop.run_in_executor(None, tokenizer.encode_segments, text)
            span.set_attributes({"chars": len(text), "tokens": len(ids)})
        return ids, segments

    async def _with_images(
        self, model: str, rendered: str, marker: str, images: list[ImageInput]
    ) -> Rendered:
        """Token ids of a rendered chat whose images are markers: the text between them
        tokenized, each image as its placeholder tokens (hashed by its content)."""
        if not images:
            return Rendered(*await self.encode(model, rendered))
        pieces = re.split(re.escape(marker) + r"(\d+)\x00", rendered)
        order = [int(k) for k in pieces[1::2]]
        if order != list(range(len(images))):
            raise ApiError(500, "the chat template lost or reordered images", code="internal")
        parts: list = []
        for n, piece in enumerate(pieces):
            if n % 2:
                parts.append(images[int(piece)])
            elif piece:
                parts.append(await self.encode(model, piece))
        return Rendered(*join_prompt(parts))


def join_prompt(
    parts: list[tuple[TokenIds, Segments] | ImageInput],
) -> tuple[TokenIds, Segments, tuple[ImageRef, ...]]:
    """A prompt from its tokenized text pieces and its images, in order: the ids (an image as
    its placeholder tokens), the segments (an image as its content's hash stream, so prefix
    hashes built from segments equal ``block_hashes(ids, images=refs)``) and the image refs."""
    ids = array.array("i")
    segments: list[tuple[str, bytes]] = []
    refs = []
    for part in parts:
        if isinstance(part, ImageInput):
            refs.append(part.ref(len(ids)))
            ids += array.array("i", [PLACEHOLDER_ID]) * part.tokens
            stream = image_stream(part.image_hash, part.tokens)
            segments.append((f"\x00image {part.image_hash}", stream))
        else:
            ids += part[0]
            segments += part[1]
    return ids, tuple(segments), tuple(refs)


KEY_SPECIALS = 6  # a conversation is known by its text through its sixth special token


@dataclass(frozen=True)
class _Turn:
    """A prompt as tokenized: its segments, and how many tokens they come to."""

    segments: Segments
    tokens: int


class PromptTokenizer:
    """Token ids the same as the model's tokenizer gives, at a fraction of the work for text
    seen before, kept by tokens (``cache_tokens`` in all, half each way):

    - each segment (the text between two special tokens: in a chat, a message) is tokenized
      once and kept;
    - each conversation's last prompt is kept as its segments, so that its next turn takes
      everything up to the last special token they share at once, and tokenizes only the
      rest (at 77K tokens, looking up each message again was a millisecond a turn; this is a
      walk over the messages' texts).

    What is kept is the segments' ids packed (int32: 4M tokens kept took 10 MB, as lists of
    ids 99 MB), and a prompt's ids are made from its segments' in one copy (``TokenIds``): a
    list of a 77K-token history's ids took ~0.5 ms to copy, touching each int object.
    """

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
        # One budget, half for the segments, half for the conversations (the two hold some of
        # the same tokens; each is bounded on its own so that the whole is).
        self.cache_tokens = cache_tokens
        self._segment_budget = cache_tokens // 2
        self._turn_budget = cache_tokens - self._segment_budget
        self._cache: OrderedDict[str, bytes] = OrderedDict()  # text → its ids packed
        self._cached_tokens = 0
        self._turns: OrderedDict[str, _Turn] = OrderedDict()  # by conversation (``_key``)
        self._turn_tokens = 0
        self.hits = self.misses = 0
        self.turn_hits = self.reused_tokens = 0  # prompts that continued a kept one; their ids
        self._lock = threading.Lock()  # encode may run on several threads

    @property
    def cached_tokens(self) -> int:
        """Tokens kept: the segments', and the conversations' (each counted once)."""
        return self._cached_tokens + self._turn_tokens

    def encode(self, text: str) -> list[int]:
        """The same ids as ``tokenizer.encode(text, add_special_tokens=False).ids``."""
        return self.encode_segments(text)[0].tolist()

    def encode_segments(self, text: str) -> tuple[TokenIds, Segments]:
        """The ids, and the segments they came from: (text, its ids packed) in order."""
        if self._split is None:
            segments = ((text, self._segment(text)),)
            return _ids(segments), segments
        key = self._key(text)
        with self._lock:
            turn = self._turns.get(key) if key else None
        if turn is None:
            segments = self._encode_split(text)
        else:
            # What this prompt shares with the conversation's last, through a special token:
            # a tokenizer splits at those first, so the ids up to there are the same.
            at = tokens = shared = 0
            good = (0, 0, 0)
            for seg, packed in turn.segments:
                if not text.startswith(seg, at):
                    break
                at, tokens, shared = at + len(seg), tokens + len(packed) // 4, shared + 1
                if seg in self.special_ids:
                    good = (at, tokens, shared)
            at, tokens, shared = good
            segments = turn.segments[:shared] + self._encode_split(text[at:])
            self.turn_hits += 1
            self.reused_tokens += tokens
        ids = _ids(segments)
        if key:
            self._keep(key, _Turn(segments, len(ids)))
        return ids, segments

    def _key(self, text: str) -> str:
        """A conversation's opening: its text through its ``KEY_SPECIALS``-th special token
        (in a chat, the system prompt and the first user message); "" for a prompt with
        fewer."""
        assert self._split is not None
        for n, match in enumerate(self._split.finditer(text), 1):
            if n == KEY_SPECIALS:
                return text[: match.end()]
        return ""

    def _keep(self, key: str, turn: _Turn) -> None:
        with self._lock:
            old = self._turns.pop(key, None)
            if old is not None:
                self._turn_tokens -= old.tokens
            if turn.tokens > self._turn_budget:
                return
            self._turns[key] = turn
            self._turn_tokens += turn.tokens
            while self._turn_tokens > self._turn_budget:
                _, gone = self._turns.popitem(last=False)
                self._turn_tokens -= gone.tokens

    def _encode_split(self, text: str) -> Segments:
        assert self._split is not None
        segments = []
        for i, part in enumerate(self._split.split(text)):
            if i % 2:
                segments.append((part, self._special_packed[part]))
            elif part:
                segments.append((part, self._segment(part)))
        return tuple(segments)

    def _segment(self, text: str) -> bytes:
        """The text's ids, packed."""
        with self._lock:
            packed = self._cache.get(text)
            if packed is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return packed
            self.misses += 1
        # (the "fast" encode makes no offsets, a third of a short text's cost; it lets the
        # GIL go)
        encoded = self.tokenizer.encode_batch_fast([text], add_special_tokens=False)[0]
        packed = pack_tokens(encoded.ids)
        tokens = len(packed) // 4
        with self._lock:
            if tokens <= self._segment_budget and text not in self._cache:
                self._cache[text] = packed
                self._cached_tokens += tokens
                while self._cached_tokens > self._segment_budget:
                    _, gone = self._cache.popitem(last=False)
                    self._cached_tokens -= len(gone) // 4
        return packed


def _ids(segments: Segments) -> TokenIds:
    return unpack_ids(b"".join(packed for _, packed in segments))


def locate(conv: Conversation, segments: Segments, tokenizer: Tokenizer, position: int) -> dict:
    """The message, content part and character of the prompt's token ``position``: from the
    segments it was tokenized from (an image's segment is its placeholder tokens). A
    position in the template's own text (a role header) is given as its next part's start."""
    tokens = chars = 0
    pieces: list[str] = []
    target_char = target_image = None
    images = 0
    for text, packed in segments:
        n = len(packed) // 4
        image = n > 0 and struct.unpack_from("<i", packed)[0] < 0  # image streams: high bit
        if target_char is None and target_image is None and position < tokens + n:
            if image:
                target_image = images
            else:
                ids = struct.unpack_from(f"<{position - tokens}i", packed)
                target_char = chars + len(tokenizer.decode(list(ids), skip_special_tokens=False))
        if image:
            images += 1
        else:
            pieces.append(text)
            chars += len(text)
        tokens += n
    if not conv.chat:
        return {"message": 0, "part": 0, "char": target_char or 0}
    rendered, cursor, k = "".join(pieces), 0, 0
    for i, m in enumerate(conv.messages):
        for j, p in enumerate(m.parts):
            if isinstance(p, Image):
                if target_image == k:
                    return {"message": i, "part": j, "char": 0}
                k += 1
                continue
            text = part_text(p)
            at = rendered.find(text, cursor)
            if at < 0:
                continue
            if target_char is not None and target_char < at + max(1, len(text)):
                return {"message": i, "part": j, "char": max(0, target_char - at)}
            cursor = at + len(text)
    return {"message": None, "part": None, "char": None}  # past every part: the template's end

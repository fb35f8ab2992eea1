"""From a request body to a running generation: checks, chat template, tokens, limits.

Shared by the HTTP and the gRPC API, which only differ in how bytes come and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.router.auth import ANONYMOUS, Caller, KeyLimiter, KeyRing
from services.router.dispatch import Dispatcher, Job
from services.router.generation import Delta, Prepared, Timing, stream_text
from services.router.images import (
    Encodes,
    ImageInput,
    ImageLimits,
    check_encoders,
    join_prompt,
    read_image,
)
from services.router.openai_api import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    Shape,
    Usage,
    chat_messages,
    completion_prompt,
    parse,
)
from services.router.recorder import RequestRecorder
from services.router.settings import RouterSettings
from services.router.stats import RollingStats
from services.router.tokens import PromptTokenizer, Segments
from shared.messages.generate import ImageRef, Sampling
from shared.messages.kvevents import RETENTIONS
from shared.model.text import MODEL_NAMES, TextModel, load_text_model
from shared.security.salt import SALT_SECRET, tenant_salt
from shared.security.secret import load_or_create
from shared.telemetry.tracing import tracer

LONG_TEXT_CHARS = 8192  # above this, tokenizing takes milliseconds: off the event loop
_SAFE_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


RETENTION_HEADER = "x-kvmesh-retention"
TENANT_HEADER = "x-kvmesh-tenant"
EXPLAIN_HEADER = "x-kvmesh-explain"


@dataclass(frozen=True)
class KvOptions:
    """How a request's KV blocks are kept: retention class and tenant (salt of the hashes)."""

    retention: str = "chat"
    tenant: str = ""
    explain: bool = False  # every candidate's routing terms in the response, not the best few

    @classmethod
    def from_headers(cls, headers: Mapping[str, str], caller: Caller = ANONYMOUS) -> KvOptions:
        """With auth on, the tenant is the key's (a tenant header is ignored)."""
        retention = headers.get(RETENTION_HEADER, "chat") or "chat"
        if retention not in RETENTIONS:
            raise ApiError(
                400,
                f"{RETENTION_HEADER}: one of {', '.join(RETENTIONS)} (got {retention!r})",
                param=RETENTION_HEADER,
            )
        if caller.key is not None:
            tenant = caller.tenant
        else:
            tenant = headers.get(TENANT_HEADER, "")
            if len(tenant) > 256:
                raise ApiError(400, f"{TENANT_HEADER}: at most 256 characters", param=TENANT_HEADER)
        return cls(retention, tenant, headers.get(EXPLAIN_HEADER, "") == "all")


def request_id(header: str | None) -> str:
    """The client's X-Request-Id when it is a safe token, else a fresh one."""
    if header and _SAFE_ID.match(header):
        return header
    return uuid.uuid4().hex


class Frontend:
    def __init__(
        self,
        settings: RouterSettings,
        dispatcher: Dispatcher,
        state_dir: Path,
        image_limits: ImageLimits,
        stats: RollingStats,
        secrets_dir: Path,
    ) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.state_dir = state_dir
        self.image_limits = image_limits
        self.recorder = RequestRecorder(stats)
        self.keys = KeyRing(settings.keys_file) if settings.keys_file else None
        self.salt_secret = load_or_create(secrets_dir, SALT_SECRET)
        self.limiter = KeyLimiter()
        self.inflight = 0
        self._models: dict[str, TextModel] = {}
        self._tokenizers: dict[str, PromptTokenizer] = {}
        self._model_lock = asyncio.Lock()

    def identify(self, headers: Mapping[str, str], role: str = "user") -> Caller:
        """Who sent the request (401 without a valid key when auth is on; 403 when the
        endpoint needs the admin role)."""
        if self.keys is None:
            return ANONYMOUS
        caller = self.keys.identify(headers)
        assert caller.key is not None
        if role == "admin" and caller.key.role != "admin":
            raise ApiError(403, f"this needs an admin key ({caller.key.id} is a user key)")
        return caller

    @contextlib.contextmanager
    def admitted(self, caller: Caller = ANONYMOUS) -> Iterator[None]:
        """Count a request in progress; 429 when there are already max_inflight, or when
        the caller's key is over one of its limits."""
        if self.inflight >= self.settings.max_inflight:
            raise ApiError(
                429,
                f"too many requests in progress ({self.settings.max_inflight}); retry shortly",
                code="overloaded",
                retry_after_s=1,
            )
        with self.limiter.admitted(caller):
            self.inflight += 1
            try:
                yield
            finally:
                self.inflight -= 1

    async def text_model(self, name: str) -> TextModel:
        if name not in self._models:
            async with self._model_lock:
                if name not in self._models:
                    loop = asyncio.get_running_loop()
                    model = await loop.run_in_executor(None, load_text_model, name, self.state_dir)
                    self._tokenizers[name] = PromptTokenizer(
                        model.tokenizer, self.settings.token_cache_tokens
                    )
                    self._models[name] = model
        return self._models[name]

    async def _encode(self, model: str, text: str) -> tuple[list[int], Segments]:
        """Token ids and their segments; a long text is tokenized on a thread, so other
        requests keep moving."""
        with tracer.start_as_current_span("tokenize") as span:
            ids, segments = await self._encode_text(model, text)
            span.set_attributes({"chars": len(text), "tokens": len(ids)})
        return ids, segments

    async def _encode_text(self, model: str, text: str) -> tuple[list[int], Segments]:
        tokenizer = self._tokenizers[model]
        if len(text) < LONG_TEXT_CHARS:
            return tokenizer.encode_segments(text)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(None, tokenizer.encode_segments, text)

    async def prepare(
        self,
        body: bytes,
        chat: bool,
        rid: str,
        kv: KvOptions = KvOptions(),
        caller: Caller = ANONYMOUS,
    ) -> Prepared:
        req = parse(body, ChatRequest if chat else CompletionRequest)
        if req.model not in MODEL_NAMES:
            raise ApiError(
                404, f"model {req.model!r} does not exist", param="model", code="model_not_found"
            )
        self.dispatcher.check_servable(req.model)
        salt = tenant_salt(self.salt_secret, kv.tenant)
        images = await self._read_images(req, salt) if isinstance(req, ChatRequest) else []
        encodes: Encodes | None = None
        if images:
            check_encoders(self.dispatcher.registry, req.model)
            encodes = Encodes(images)
            if self.settings.encode_ahead:  # encoding overlaps everything that follows
                encodes.start(self.dispatcher.bus, req.model, self.image_limits.encode_timeout_s)
        try:
            return await self._prepare(req, chat, rid, kv, salt, caller, encodes)
        except BaseException:
            if encodes is not None:
                encodes.cancel()
            raise

    async def _prepare(
        self,
        req: ChatRequest | CompletionRequest,
        chat: bool,
        rid: str,
        kv: KvOptions,
        salt: str,
        caller: Caller,
        encodes: Encodes | None,
    ) -> Prepared:
        text = await self.text_model(req.model)
        config = text.config
        refs: tuple[ImageRef, ...] = ()
        if isinstance(req, ChatRequest):
            images = encodes.images if encodes else []
            nonce = uuid.uuid4().hex  # a client cannot forge a marker it cannot guess
            marker = f"\x00kvmesh-image-{nonce}-"
            rendered = text.chat_template.render(chat_messages(req, lambda k: f"{marker}{k}\x00"))
            ids, segments, refs = await self._encode_with_images(
                req.model, rendered, marker, images
            )
            if encodes is not None:
                encodes.starts = [r.start for r in refs]
            prompt_field = "messages"
            max_tokens = req.max_completion_tokens or req.max_tokens
            max_field = "max_completion_tokens" if req.max_completion_tokens else "max_tokens"
        else:
            prompt = completion_prompt(req)
            if isinstance(prompt, str):
                ids, segments = await self._encode(req.model, prompt)
            else:
                bad = next((t for t in prompt if not 0 <= t < config.vocab_size), None)
                if bad is not None:
                    raise ApiError(
                        400, f"prompt: token id {bad} is outside the vocabulary", param="prompt"
                    )
                ids, segments = list(prompt), ()
            prompt_field, max_tokens, max_field = "prompt", req.max_tokens, "max_tokens"
        if not ids:
            raise ApiError(400, f"{prompt_field}: the prompt is empty", param=prompt_field)
        self.limiter.charge_tokens(caller, len(ids))
        room = config.max_context - len(ids)
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, room)
        if room < 1 or len(ids) + max_tokens > config.max_context:
            raise ApiError(
                400,
                f"{prompt_field} ({len(ids)} tokens) plus {max_field} ({max_tokens}) exceeds the "
                f"model's context of {config.max_context} tokens",
                param=max_field if room >= 1 else prompt_field,
                code="context_length_exceeded",
            )
        if encodes is not None and not self.settings.encode_ahead:
            # Head start off (for comparison): encode now, and only then route.
            encodes.start(self.dispatcher.bus, req.model, self.image_limits.encode_timeout_s)
            await encodes.wait()
        stop = req.stop_list()
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=stop,
        )
        job = Job(
            request_id=rid,
            model=req.model,
            prompt_ids=ids,
            sampling=sampling,
            deadline=time.time() + self.settings.request_timeout_s,
            retention=kv.retention,
            salt=salt,
            fingerprint=config.fingerprint,
            segments=segments,
            images=refs,
        )
        prefix = "chatcmpl" if chat else "cmpl"
        return Prepared(
            job=job,
            shape=Shape(chat=chat, response_id=f"{prefix}-{rid}", model=req.model),
            text=text,
            stop=stop,
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            usage=Usage(prompt_tokens=len(ids)),
            timing=Timing(explain_all=kv.explain),
            encodes=encodes,
        )

    async def _read_images(self, req: ChatRequest, salt: str) -> list[ImageInput]:
        """The request's images, each checked (400 naming its part), in order."""
        parts = [(i, j, part) for i, m in enumerate(req.messages) for j, part in m.image_parts()]
        limits = self.image_limits
        if len(parts) > limits.per_request:
            raise ApiError(
                400,
                f"messages: at most {limits.per_request} images per request (got {len(parts)})",
                param="messages",
            )
        images = []
        for i, j, part in parts:
            param = f"messages[{i}].content[{j}].image_url"
            if req.messages[i].role != "user":
                raise ApiError(
                    400, f"{param}: images are accepted in user messages only", param=param
                )
            max_payload = self.dispatcher.bus.nc.max_payload
            images.append(await read_image(part.image_url.url, param, limits, max_payload, salt))
        return images

    async def _encode_with_images(
        self, model: str, rendered: str, marker: str, images: list[ImageInput]
    ) -> tuple[list[int], Segments, tuple[ImageRef, ...]]:
        """Token ids of a rendered chat whose images are markers: the text between them
        tokenized, each image as its placeholder tokens (hashed by its content)."""
        if not images:
            ids, segments = await self._encode(model, rendered)
            return ids, segments, ()
        pieces = re.split(re.escape(marker) + r"(\d+)\x00", rendered)
        order = [int(k) for k in pieces[1::2]]
        if order != list(range(len(images))):
            raise ApiError(500, "the chat template lost or reordered images", code="internal")
        parts: list = []
        for n, piece in enumerate(pieces):
            if n % 2:
                parts.append(images[int(piece)])
            elif piece:
                parts.append(await self._encode(model, piece))
        return join_prompt(parts)

    def deltas(self, p: Prepared) -> AsyncIterator[Delta]:
        return stream_text(
            self.dispatcher, p.job, p.text.tokenizer, p.stop, p.usage, p.timing, p.encodes
        )

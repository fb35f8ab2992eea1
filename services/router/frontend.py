"""From a conversation to a running generation: images, rendering, limits, the job.

The request path is a straight line: a format's adapter (``openai_api.conversation``) turns
the body into a ``Conversation``; ``Frontend.prepare`` reads its images, renders it
(``render.Renderer``), checks it against the model's context and the caller's limits and
makes the job; ``deltas`` runs it (``generation.stream_text``); the adapter writes the answer
back in its format. Shared by the HTTP and the gRPC API, which only differ in how bytes come
and go.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from services.router.auth import ANONYMOUS, Caller, KeyLimiter, KeyRing
from services.router.cachemiss import CacheMisses, Prompt, Seen
from services.router.conversation import Conversation, ToolError
from services.router.detokenizer import token_pieces
from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.encodes import Encodes, ImageInput, check_encoders
from services.router.dispatch.job import Job
from services.router.dispatch.workers import LoopLag
from services.router.generation import Delta, Prepared, Timing, stream_text
from services.router.images import ImageLimits, read_image
from services.router.openai_api import (
    ApiError,
    Shape,
    Usage,
)
from services.router.recorder import RequestRecorder
from services.router.render import Renderer
from services.router.settings import RouterSettings
from services.router.stats import RollingStats
from services.router.toolcalls import CallParser
from shared.messages.generate import Priority, Sampling
from shared.messages.kvevents import RETENTIONS
from shared.model.grammar import (
    ANY_OBJECT,
    GrammarError,
    check,
    json_grammar,
    tool_call_grammar,
    vocabulary,
)
from shared.model.text import MODEL_NAMES, TextModel, load_text_model
from shared.security.salt import SALT_SECRET, tenant_salt
from shared.security.secret import load_or_create
from shared.service import keep_for_good

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


_CHECKED_SCHEMAS: set[str] = set()  # tool schemas the library compiled (agents resend them)


def check_tools(conv: Conversation) -> None:
    try:
        conv.check_tools()
    except ToolError as err:
        raise ApiError(400, str(err), param=err.param) from None


def answer_grammar(conv: Conversation, text: TextModel) -> str | None:
    """The grammar the answer must match (a forced tool call, or JSON), checked against the
    model's vocabulary: a 400 naming the field whose schema the library cannot use. None for
    a free answer."""
    vocab = vocabulary(text.tokenizer, tuple(text.config.eos_ids))
    for tool in conv.tools:  # every tool's schema, forced or not: a bad one is the client's
        key = json.dumps(tool.parameters, sort_keys=True)
        if key not in _CHECKED_SCHEMAS:
            _checked(lambda t=tool: json_grammar(t.parameters), vocab, tool.param)
            if len(_CHECKED_SCHEMAS) >= 4096:
                _CHECKED_SCHEMAS.clear()
            _CHECKED_SCHEMAS.add(key)
    forced = conv.forced_tools
    if forced:
        return tool_call_grammar([(t.name, t.parameters) for t in forced])
    wanted = conv.asked.json
    if wanted is None:
        return None
    schema = wanted.schema if wanted.schema is not None else ANY_OBJECT
    return _checked(lambda: json_grammar(schema), vocab, wanted.param)


def _checked(make, vocab, param: str) -> str:  # noqa: ANN001 (a grammar maker, a vocabulary)
    try:
        grammar = make()
        check(grammar, vocab)
    except GrammarError as err:
        raise ApiError(400, f"{param}: this schema cannot be used: {err}", param=param) from None
    return grammar


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
        lag: LoopLag | None = None,
    ) -> None:
        self.settings = settings
        self.lag = lag or LoopLag()
        self.dispatcher = dispatcher
        self.state_dir = state_dir
        self.image_limits = image_limits
        self.recorder = RequestRecorder(stats)
        self.keys = KeyRing(settings.keys_file) if settings.keys_file else None
        self.salt_secret = load_or_create(secrets_dir, SALT_SECRET)
        self.limiter = KeyLimiter()
        self.inflight = 0
        self._models: dict[str, TextModel] = {}
        self.renderer = Renderer(settings.token_cache_tokens)
        self.misses = CacheMisses(settings.cache_explain_bytes)
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
        """Count a request in progress; 429 when there are already max_inflight, when the
        router's loop runs more than max_loop_lag_s behind, or when the caller's key is over
        one of its limits."""
        if self.inflight >= self.settings.max_inflight:
            raise ApiError(
                429,
                f"too many requests in progress ({self.settings.max_inflight}); retry shortly",
                code="overloaded",
                retry_after_s=1,
            )
        if self.lag.seconds > self.settings.max_loop_lag_s:  # its answers already wait
            raise ApiError(
                429,
                f"this router runs {self.lag.seconds:.2f} s behind "
                f"(KVMESH_ROUTER_MAX_LOOP_LAG_S {self.settings.max_loop_lag_s:g}); retry shortly",
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
                    # Grammars are checked against the vocabulary (built once: 0.2 s), and
                    # answers are detokenized from each token's bytes (0.1 s): off the loop.
                    eos = tuple(model.config.eos_ids)
                    await loop.run_in_executor(None, vocabulary, model.tokenizer, eos)
                    await loop.run_in_executor(None, token_pieces, model.tokenizer)
                    self.renderer.add(name, model)
                    self._models[name] = model
                    keep_for_good()  # the model's tables live as long as the router
        return self._models[name]

    async def prepare(
        self,
        conv: Conversation,
        rid: str,
        kv: KvOptions = KvOptions(),
        caller: Caller = ANONYMOUS,
        priority: Priority = "online",
    ) -> Prepared:
        """A conversation (from any format's adapter) checked, rendered and ready to run
        (``priority``: batch work waits for online requests in the workers' queues)."""
        if conv.model not in MODEL_NAMES:
            raise ApiError(
                404, f"model {conv.model!r} does not exist", param="model", code="model_not_found"
            )
        check_tools(conv)
        self.dispatcher.check_servable(conv.model)
        salt = tenant_salt(self.salt_secret, kv.tenant)
        images = await self._read_images(conv, salt)
        encodes: Encodes | None = None
        if images:
            check_encoders(self.dispatcher.registry, conv.model)
            encodes = Encodes(images)
            if self.settings.encode_ahead:  # encoding overlaps everything that follows
                encodes.start(self.dispatcher.bus, conv.model, self.image_limits.encode_timeout_s)
        try:
            return await self._prepare(conv, rid, kv, salt, caller, encodes, priority)
        except BaseException:
            if encodes is not None:
                encodes.cancel()
            raise

    async def count(self, conv: Conversation, kv: KvOptions = KvOptions()) -> int:
        """The prompt's tokens, exactly as ``prepare`` renders them (images read and
        measured, not encoded; no worker involved)."""
        if conv.model not in MODEL_NAMES:
            raise ApiError(
                404, f"model {conv.model!r} does not exist", param="model", code="model_not_found"
            )
        check_tools(conv)
        images = await self._read_images(conv, tenant_salt(self.salt_secret, kv.tenant))
        text = await self.text_model(conv.model)
        return len((await self.renderer.render(conv, text, images)).ids)

    async def _prepare(
        self,
        conv: Conversation,
        rid: str,
        kv: KvOptions,
        salt: str,
        caller: Caller,
        encodes: Encodes | None,
        priority: Priority = "online",
    ) -> Prepared:
        text = await self.text_model(conv.model)
        config = text.config
        rendered = await self.renderer.render(conv, text, encodes.images if encodes else [])
        ids = rendered.ids
        if encodes is not None:
            encodes.starts = [r.start for r in rendered.images]
        prompt_field = conv.prompt_field
        if not ids:
            raise ApiError(400, f"{prompt_field}: the prompt is empty", param=prompt_field)
        self.limiter.charge_tokens(caller, len(ids))
        room = config.max_context - len(ids)
        asked = conv.asked
        max_tokens, max_field = asked.max_tokens, asked.max_field
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
            encodes.start(self.dispatcher.bus, conv.model, self.image_limits.encode_timeout_s)
            await encodes.wait()
        bad = next((t for t, _ in asked.logit_bias if not 0 <= t < config.vocab_size), None)
        if bad is not None:
            why = f"logit_bias: token id {bad} is outside the vocabulary ({config.vocab_size})"
            raise ApiError(400, why, param="logit_bias")
        grammar = answer_grammar(conv, text)
        sampling = Sampling(
            max_tokens=max_tokens,
            temperature=1.0 if asked.temperature is None else asked.temperature,
            top_p=1.0 if asked.top_p is None else asked.top_p,
            top_k=asked.top_k or 0,
            seed=asked.seed,
            stop=list(asked.stop),
            logit_bias=list(asked.logit_bias),
            presence_penalty=asked.presence_penalty,
            frequency_penalty=asked.frequency_penalty,
            logprobs=asked.logprobs,
            grammar=grammar,
        )
        job = Job(
            request_id=rid,
            model=conv.model,
            prompt_ids=ids,
            sampling=sampling,
            deadline=time.time() + self.settings.request_timeout_s,
            retention=kv.retention,
            salt=salt,
            fingerprint=config.fingerprint,
            segments=rendered.segments,
            images=rendered.images,
            priority=priority,
        )
        prefix = "chatcmpl" if conv.chat else "cmpl"
        return Prepared(
            job=job,
            shape=Shape(chat=conv.chat, response_id=f"{prefix}-{rid}", model=conv.model),
            text=text,
            stop=list(asked.stop),
            stream=conv.stream,
            include_usage=conv.include_usage,
            usage=Usage(prompt_tokens=len(ids)),
            timing=Timing(explain_all=kv.explain),
            encodes=encodes,
            tenant=kv.tenant,
            conversation=conv,
            seen=(
                Seen.of(kv.tenant, conv, [i.image_hash for i in encodes.images] if encodes else [])
                if self.settings.cache_explain_bytes
                else None
            ),
        )

    async def _read_images(self, conv: Conversation, salt: str) -> list[ImageInput]:
        """The conversation's images, each checked (400 naming its part), in order."""
        found = conv.images()
        limits = self.image_limits
        if len(found) > limits.per_request:
            raise ApiError(
                400,
                f"messages: at most {limits.per_request} images per request (got {len(found)})",
                param="messages",
            )
        images = []
        for role, image in found:
            if role != "user":
                why = f"{image.param}: images are accepted in user messages only"
                raise ApiError(400, why, param=image.param)
            max_payload = self.dispatcher.bus.nc.max_payload
            images.append(await read_image(image.url, image.param, limits, max_payload, salt))
        return images

    async def deltas(self, p: Prepared) -> AsyncIterator[Delta]:
        """The answer's deltas; before the last, why the prompt missed the cache (if it did
        and it can be told), and the prompt is remembered for the next turn's."""
        inner = stream_text(
            self.dispatcher, p.job, p.text.tokenizer, p.stop, p.usage, p.timing, p.encodes
        )
        conv = p.conversation
        calls = None
        if conv is not None and conv.calls_tools:  # forced calls stream as they come
            calls = CallParser(streamed=bool(conv.forced_tools))
        try:
            async for delta in inner:
                if calls is not None:
                    text, events = calls.feed(delta.text)
                    if delta.finish_reason:
                        rest, more = calls.finish()
                        text, events = text + rest, events + more
                    if not (text or events or delta.finish_reason):
                        continue
                    delta = replace(delta, text=text, calls=events)
                if delta.finish_reason and p.seen is not None:
                    self._explain(p, p.seen)
                yield delta
        finally:
            await inner.aclose()  # closing these deltas cancels the request on its workers

    def _explain(self, p: Prepared, seen: Seen) -> None:
        bs, hashes = self.dispatcher.prompt_hashes(p.job)
        if not bs or p.conversation is None:
            return
        job = p.job
        prompt = Prompt(
            job.request_id, job.model, seen.parts, len(job.prompt_ids), bs, "".join(hashes)
        )
        p.timing.cache_miss = self.misses.explain(
            seen.tenant,
            prompt,
            seen.texts,
            p.usage.cached_tokens,
            p.conversation,
            job.segments,
            p.text.tokenizer,
        )
        self.misses.remember(seen.tenant, prompt, seen.texts)

"""From a conversation to a prepared request: its model, tools and images checked, rendered to
token ids, held to the model's context and the caller's limits, and made into the job that is
dispatched.

Images are read first (a 400 names a bad one before anything else is done) and, unless
KVMESH_ROUTER_ENCODE_AHEAD is off, sent to the encoders at once, so encoding overlaps the
rendering and routing that follow. A tool's schema, or a JSON answer's, is checked against
the model's vocabulary here: a 400 names the field whose schema cannot be used.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.encodes import Encodes, check_encoders
from services.router.dispatch.job import Job
from services.router.errors import ApiError
from services.router.request.answer import Prepared, Timing, Usage
from services.router.request.conversation import Conversation, ToolError
from services.router.request.detokenizer import token_pieces
from services.router.request.images import ImageReader
from services.router.request.render import Renderer
from services.router.settings import RequestSettings
from services.router.tenancy.admission import PLAIN, KvOptions, Tenancy
from services.router.tenancy.keys import ANONYMOUS, Caller
from shared.engine.sampling import SamplingParams
from shared.messages.generate import Priority
from shared.model.grammar import (
    ANY_OBJECT,
    GrammarError,
    check,
    json_grammar,
    tool_call_grammar,
    vocabulary,
)
from shared.model.text import MODEL_NAMES, TextModel, load_text_model
from shared.service import keep_for_good

_CHECKED_SCHEMAS: set[str] = set()  # tool schemas the library compiled (agents resend them)


class Preparer:
    def __init__(
        self,
        settings: RequestSettings,
        images: ImageReader,
        dispatcher: Dispatcher,
        tenancy: Tenancy,
        state_dir: Path,
    ) -> None:
        self.settings = settings
        self.images = images
        self.dispatcher = dispatcher
        self.tenancy = tenancy
        self.state_dir = state_dir
        self.renderer = Renderer(settings.token_cache_tokens)
        self._models: dict[str, TextModel] = {}
        self._model_lock = asyncio.Lock()

    async def prepare(
        self,
        conv: Conversation,
        rid: str,
        kv: KvOptions = PLAIN,
        caller: Caller = ANONYMOUS,
        priority: Priority = "online",
    ) -> Prepared:
        """A conversation (from any format's adapter) checked, rendered and ready to run
        (``priority``: batch work waits for online requests in the workers' queues)."""
        check_model(conv)
        self.dispatcher.check_servable(conv.model)
        salt = self.tenancy.salt(kv.tenant)
        images = await self.images.read_all(conv, salt, self.dispatcher.bus.nc.max_payload)
        encodes: Encodes | None = None
        if images:
            check_encoders(self.dispatcher.registry, conv.model)
            encodes = Encodes(images)
            if self.images.settings.encode_ahead:  # encoding overlaps everything that follows
                self._encode(encodes, conv.model)
        try:
            return await self._prepare(conv, rid, kv, salt, caller, encodes, priority)
        except BaseException:
            if encodes is not None:
                encodes.cancel()
            raise

    async def count(self, conv: Conversation, kv: KvOptions = PLAIN) -> int:
        """The prompt's tokens, exactly as ``prepare`` renders them (images read and
        measured, not encoded; no worker involved)."""
        check_model(conv)
        max_payload = self.dispatcher.bus.nc.max_payload
        images = await self.images.read_all(conv, self.tenancy.salt(kv.tenant), max_payload)
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
        priority: Priority,
    ) -> Prepared:
        text = await self.text_model(conv.model)
        rendered = await self.renderer.render(conv, text, encodes.images if encodes else [])
        ids = rendered.ids
        if encodes is not None:
            encodes.starts = [r.start for r in rendered.images]
        if not ids:
            field = conv.prompt_field
            raise ApiError(400, f"{field}: the prompt is empty", param=field)
        self.tenancy.charge_tokens(caller, len(ids))
        max_tokens = self._answer_length(conv, len(ids), text.config.max_context)
        if encodes is not None and not self.images.settings.encode_ahead:
            self._encode(encodes, conv.model)  # head start off (for comparison): encode now,
            await encodes.wait()  # and only then route
        job = Job(
            request_id=rid,
            model=conv.model,
            prompt_ids=ids,
            sampling=sampling_for(conv, text, max_tokens),
            deadline=time.time() + self.settings.request_timeout_s,
            retention=kv.retention,
            salt=salt,
            fingerprint=text.config.fingerprint,
            segments=rendered.segments,
            images=rendered.images,
            priority=priority,
        )
        return Prepared(
            job=job,
            conversation=conv,
            text=text,
            usage=Usage(prompt_tokens=len(ids)),
            timing=Timing(explain_all=kv.explain),
            encodes=encodes,
            block_size=self.dispatcher.block_size(conv.model),
            tenant=kv.tenant,
        )

    def _answer_length(self, conv: Conversation, n_prompt: int, context: int) -> int:
        """The answer's most tokens: what the request asked for, or the router's default
        within the context; 400 when the prompt and the answer exceed the context."""
        room = context - n_prompt
        max_tokens = conv.max_tokens
        if max_tokens is None:
            max_tokens = min(self.settings.default_max_tokens, room)
        if room < 1 or n_prompt + max_tokens > context:
            prompt_field, max_field = conv.prompt_field, conv.max_tokens_field
            raise ApiError(
                400,
                f"{prompt_field} ({n_prompt} tokens) plus {max_field} ({max_tokens}) exceeds "
                f"the model's context of {context} tokens",
                param=max_field if room >= 1 else prompt_field,
                code="context_length_exceeded",
            )
        return max_tokens

    def _encode(self, encodes: Encodes, model: str) -> None:
        encodes.start(self.dispatcher.bus, model, self.images.settings.encode_timeout_s)

    async def text_model(self, name: str) -> TextModel:
        """A model's text side (config, tokenizer, chat template), loaded once, off the loop,
        with the tables built from it (the vocabulary grammars are checked against, each
        token's bytes for the detokenizer)."""
        if name not in self._models:
            async with self._model_lock:
                if name not in self._models:
                    loop = asyncio.get_running_loop()
                    model = await loop.run_in_executor(None, load_text_model, name, self.state_dir)
                    eos = tuple(model.config.eos_ids)
                    await loop.run_in_executor(None, vocabulary, model.tokenizer, eos)  # 0.2 s
                    await loop.run_in_executor(None, token_pieces, model.tokenizer)  # 0.1 s
                    self.renderer.add(name, model)
                    self._models[name] = model
                    keep_for_good()  # the model's tables live as long as the router
        return self._models[name]


def check_model(conv: Conversation) -> None:
    """404 for a model this mesh does not know; 400 for tools that do not fit together."""
    if conv.model not in MODEL_NAMES:
        raise ApiError(
            404, f"model {conv.model!r} does not exist", param="model", code="model_not_found"
        )
    try:
        conv.check_tools()
    except ToolError as err:
        raise ApiError(400, str(err), param=err.param) from None


def sampling_for(conv: Conversation, text: TextModel, max_tokens: int) -> SamplingParams:
    """The conversation's sampling with the answer's length and the grammar its answer must
    match; 400 for a logit bias outside the vocabulary."""
    vocab_size = text.config.vocab_size
    bad = next((t for t, _ in conv.sampling.logit_bias if not 0 <= t < vocab_size), None)
    if bad is not None:
        why = f"logit_bias: token id {bad} is outside the vocabulary ({vocab_size})"
        raise ApiError(400, why, param="logit_bias")
    grammar = answer_grammar(conv, text)
    return replace(conv.sampling, max_tokens=max_tokens, grammar=grammar)


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
    wanted = conv.json
    if wanted is None:
        return None
    schema = wanted.schema if wanted.schema is not None else ANY_OBJECT
    return _checked(lambda: json_grammar(schema), vocab, wanted.param)


def _checked(make: Callable[[], str], vocab: object, param: str) -> str:
    try:
        grammar = make()
        check(grammar, vocab)
    except GrammarError as err:
        raise ApiError(400, f"{param}: this schema cannot be used: {err}", param=param) from None
    return grammar

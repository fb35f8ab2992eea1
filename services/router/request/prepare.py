"""From a conversation to a prepared request: its model, tools and images checked, rendered to
token ids, held to the model's context and the caller's limits, and made into the job that is
dispatched; and what a prepared request carries to its last byte (``Prepared``: the job, the
conversation, its usage and timing as they fill in).

Images are read first (a 400 names a bad one before anything else is done) and, unless
KVMESH_ROUTER_ENCODE_AHEAD is off, sent to the encoders at once, so encoding overlaps the
rendering and routing that follow. The conversation's checks are ``checks.py``'s.

An answer of several choices (``n`` answers to a prompt, the ``n`` likeliest of ``best_of``
candidates, a Completions request's prompts) is a request per candidate through the mesh
(routed, cached and retried as any), each with its own id and seed from the request's; the
first of each prompt is prepared (rendered, charged) once and the others are its copies
(``fan_out``). The first candidate of the answer is its ``Prepared``, every other its
sibling, in choice order. A prompt is prefilled once: its first candidate goes first, the
others once a decode worker holds it (``answer.Answers``), to that worker, where they share
its prompt's blocks (copy on write: each computes only the prompt's last, partial block and
writes only its own answer's), as SGLang's server does its own ``n``: the prompt first, then
the copies. Greedy candidates are the same answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from services.router.dispatch.dispatcher import Dispatcher
from services.router.dispatch.encodes import Encodes, ImageInput, check_encoders
from services.router.dispatch.job import Job
from services.router.errors import ApiError
from services.router.request.checks import (
    ServedModels,
    answer_length,
    check_choices,
    check_model,
    check_prompt_scores,
    checked,
    service_class,
)
from services.router.request.conversation import Conversation
from services.router.request.image_reader import ImageReader
from services.router.request.render import Renderer
from services.router.settings import RequestSettings
from services.router.tenancy.admission import PLAIN, KvOptions, Tenancy
from shared.messages.generate import Priority, TokenEvent
from shared.model.text import TextModel

EXPLAINED = 4  # candidates listed in a response (all with the header x-kvmesh-explain: all)


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0


UNTRAINED = (
    "the vision tower that encoded this request's images has random weights (no trained "
    "weights for this model): the answer does not see the images"
)


@dataclass
class Timing:
    """Where a request's time went, in the workers (ms); the rest is the mesh's."""

    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    kv_bytes: int = 0
    kv_transfer_ms: float = 0.0
    workers: list[str] = field(default_factory=list)
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    route: dict = field(default_factory=dict)  # the routing decision, with each candidate's terms
    images: list[dict] = field(default_factory=list)  # per image: tokens, cached, encode_ms
    first_token_at: float = 0.0  # perf_counter when the first token came, and the last
    last_token_at: float = 0.0
    explain_all: bool = False  # else only the best EXPLAINED candidates are listed
    cache_miss: dict | None = None  # why the prompt missed the cache (observe/cachemiss.py)

    def add(self, event: TokenEvent) -> None:
        """What an event says of the workers' time and the tiers' hits."""
        if event.cached_by_tier is not None:
            self.cached_tokens_by_tier = event.cached_by_tier
        if event.token_ids:
            self.last_token_at = time.perf_counter()
            self.first_token_at = self.first_token_at or self.last_token_at
        self.prefill_ms += (event.prefill_s or 0.0) * 1e3
        self.decode_ms += (event.decode_s or 0.0) * 1e3
        self.kv_bytes += event.kv_bytes or 0
        self.kv_transfer_ms += (event.kv_transfer_s or 0.0) * 1e3
        if event.worker_id and event.worker_id not in self.workers:
            self.workers.append(event.worker_id)

    @property
    def engine_ms(self) -> float:
        return self.prefill_ms + self.decode_ms

    def to_dict(self) -> dict:
        return {
            "engine_ms": round(self.engine_ms, 3),
            "prefill_ms": round(self.prefill_ms, 3),
            "decode_ms": round(self.decode_ms, 3),
            "kv_bytes": self.kv_bytes,
            "kv_transfer_ms": round(self.kv_transfer_ms, 3),
            "workers": self.workers,
            "cached_tokens_by_tier": self.cached_tokens_by_tier,
            "route": self.decision(),
            **({"images": self.images} if self.images else {}),
            **(
                {"warnings": [UNTRAINED]}
                if any("untrained_tower" in i for i in self.images)
                else {}
            ),
            **({"cache_miss": self.cache_miss} if self.cache_miss else {}),
        }

    def decision(self, every: bool = False) -> dict:
        """The routing decision with its candidates' terms (the best EXPLAINED of them
        unless ``every`` or the request asked for all)."""
        ranked = self.route.get("candidates")
        if ranked is None:
            return self.route
        shown = ranked if every or self.explain_all else ranked[:EXPLAINED]
        out = {**self.route, "candidates": [{"worker": r.service_id, **r.terms} for r in shown]}
        if len(shown) < len(ranked):
            out["others"] = len(ranked) - len(shown)
        return out


@dataclass
class Prepared:
    """A request checked, tokenized and ready to dispatch: what its answer's stream needs."""

    job: Job
    conversation: Conversation
    text: TextModel
    usage: Usage
    timing: Timing = field(default_factory=Timing)
    received_at: float = field(default_factory=time.perf_counter)
    encodes: Encodes | None = None  # the images' encode requests, in flight
    block_size: int = 0  # the model's KV block size (0 while no worker has said)
    tenant: str = ""  # whose request (the key's tenant, or the tenant header with auth off)
    tenant_is_key: bool = False  # its tenant is an API key's (a label on /metrics)
    delivered: bool = False  # a stream's last event written (the client has the answer)
    # An answer of several choices (``choices.py``): the first's siblings, in choice order;
    # a candidate's place among its prompt's (0: the first, which the prompt is counted by).
    siblings: list[Prepared] = field(default_factory=list)
    candidate: int = 0

    def sibling(self, job: Job, candidate: int) -> Prepared:
        """Another candidate of this prompt's answers (``job``: its own id and sampling), its
        usage and timing its own."""
        return replace(
            self,
            job=job,
            usage=Usage(self.usage.prompt_tokens),
            timing=Timing(explain_all=self.timing.explain_all),
            received_at=self.received_at,
            candidate=candidate,
        )

    @property
    def choices(self) -> int:
        """The answer's choices: ``n`` per prompt."""
        conv = self.conversation
        return (1 + len(self.siblings)) // conv.best_of * conv.n

    def answer_usage(self) -> Usage:
        """The whole answer's usage: each prompt's tokens and cached tokens once (its first
        candidate's), every candidate's answer tokens (all were computed)."""
        if not self.siblings:
            return self.usage
        every = [self, *self.siblings]
        heads = [c for c in every if not c.candidate]
        return Usage(
            prompt_tokens=sum(h.usage.prompt_tokens for h in heads),
            completion_tokens=sum(c.usage.completion_tokens for c in every),
            cached_tokens=sum(h.usage.cached_tokens for h in heads),
        )

    def kvmesh(self) -> dict:
        """The `kvmesh` extension of a response: where the time went, and the prompt's cache
        hits and misses as DeepSeek's API names them."""
        return {
            **self.timing.to_dict(),
            "router_ms": round((time.perf_counter() - self.received_at) * 1e3, 3),
            "prompt_cache_hit_tokens": self.usage.cached_tokens,
            "prompt_cache_miss_tokens": self.usage.prompt_tokens - self.usage.cached_tokens,
        }


class Preparer:
    def __init__(
        self,
        settings: RequestSettings,
        images: ImageReader,
        dispatcher: Dispatcher,
        tenancy: Tenancy,
        state_dir: Path,
        models: Mapping[str, str],
        loras: Mapping[str, str] | None = None,
    ) -> None:
        """``models``: a team's own (KVMESH_MODELS); ``loras``: the settings' LoRA adapters
        (KVMESH_LORAS; more come at run time)."""
        self.settings = settings
        self.images = images
        self.dispatcher = dispatcher
        self.tenancy = tenancy
        self.renderer = Renderer(settings.token_cache_tokens, state_dir, models)
        self.served = ServedModels.of(dispatcher.bus, self.renderer.names, loras or {})
        self.renderer.base = self.served.base

    async def prepare(
        self,
        conv: Conversation,
        rid: str,
        kv: KvOptions = PLAIN,
        priority: Priority | None = None,
    ) -> Prepared:
        """A conversation (from any format's adapter) checked, rendered and ready to run
        (``kv``: whose it is and how its blocks are kept; ``priority``: its class, when not
        what it asks for: batch work's). Several prompts or answers: each prompt prepared
        once, every candidate the first's sibling (``choices.fan_out``)."""
        settings = self.settings
        check_choices(conv, kv, settings.max_choices, settings.max_prompts)
        priority = priority or service_class(conv, kv)
        self.tenancy.admit_class(priority)
        self.dispatcher.check_spare(conv.model, priority)
        if self.dispatcher.queues_full(conv.model):
            self.tenancy.check_share(kv.caller, priority)
        heads = [
            await self._prompt(c, f"{rid}-p{k}" if k else rid, kv, priority)
            for k, c in enumerate(conv.prompts())
        ]
        if len(heads) == 1 and conv.best_of == 1:
            return heads[0]
        return fan_out(heads, conv.best_of)

    async def _prompt(
        self, conv: Conversation, rid: str, kv: KvOptions, priority: Priority
    ) -> Prepared:
        check_model(conv, self.served.names, self.dispatcher.registry.models_served)
        self.dispatcher.check_servable(conv.model)
        salt = self.tenancy.salt(kv.tenant)
        images = await self._images(conv, salt)
        encodes: Encodes | None = None
        if images:
            check_encoders(self.dispatcher.registry, conv.model)
            encodes = Encodes(images)
            if self.images.settings.encode_ahead:  # encoding overlaps everything that follows
                self._encode(encodes, conv.model)
        try:
            return await self._prepare(conv, rid, kv, salt, encodes, priority)
        except BaseException:
            if encodes is not None:
                encodes.cancel()
            raise

    async def count(self, conv: Conversation, kv: KvOptions = PLAIN) -> int:
        """The prompt's tokens, exactly as ``prepare`` renders them (images read and
        measured, not encoded; no worker involved)."""
        check_model(conv, self.served.names, self.dispatcher.registry.models_served)
        images = await self._images(conv, self.tenancy.salt(kv.tenant))
        text = await self.renderer.text_model(conv.model)
        return len((await self.renderer.render(conv, text, images)).ids)

    async def _prepare(
        self,
        conv: Conversation,
        rid: str,
        kv: KvOptions,
        salt: str,
        encodes: Encodes | None,
        priority: Priority,
    ) -> Prepared:
        text = await self.renderer.text_model(conv.model)
        rendered = await self.renderer.render(conv, text, encodes.images if encodes else [])
        ids = rendered.ids
        if encodes is not None:
            encodes.starts = [r.start for r in rendered.images]
        if not ids:
            field = conv.prompt_field
            raise ApiError(400, f"{field}: the prompt is empty", param=field)
        check_prompt_scores(conv, len(ids), self.dispatcher.bus.nc.max_payload)
        self.tenancy.charge_tokens(kv.caller, len(ids))
        max_tokens = answer_length(
            conv, len(ids), text.config.max_context, self.settings.default_max_tokens
        )
        if conv.scores_only:
            max_tokens = 1  # (a token is computed with the prompt's scores; none is answered)
        if encodes is not None and not self.images.settings.encode_ahead:
            self._encode(encodes, conv.model)  # head start off (for comparison): encode now,
            await encodes.wait()  # and only then route
        adapter, fingerprint = self.served.identity(conv.model, text.config.fingerprint)
        sampling = replace(conv.sampling, max_tokens=max_tokens, adapter=adapter)
        job = Job(
            request_id=rid,
            model=conv.model,
            prompt_ids=ids,
            sampling=replace(sampling, grammar=checked(conv, text, max_tokens)),
            deadline=time.time() + self.settings.request_timeout_s,
            retention=kv.retention,
            salt=salt,
            fingerprint=fingerprint,
            segments=rendered.segments,
            images=rendered.images,
            priority=priority,
            weight=(kv.caller.key.weight if kv.caller.key else 0) or 1,
            ttft_first_by=time.time() + kv.ttft_deadline_ms / 1e3 if kv.ttft_deadline_ms else 0.0,
            expected_tokens=kv.expected_tokens,
        )
        if kv.cache_ttl_s:
            job = self._pinned(job, kv, text)
        return Prepared(
            job=job,
            conversation=conv,
            text=text,
            usage=Usage(prompt_tokens=len(ids)),
            timing=Timing(explain_all=kv.explain),
            encodes=encodes,
            block_size=self.dispatcher.kv_format(conv.model)[0],
            tenant=kv.tenant,
            tenant_is_key=kv.caller.key is not None,
        )

    def _pinned(self, job: Job, kv: KvOptions, text: TextModel) -> Job:
        """The job with its KV pinned as the request asked (tenancy/pins.py; its bytes
        counted at float32, the most a token's KV can take)."""
        size, hashes = self.dispatcher.prompt_hashes(job)
        per_token = text.config.kv_bytes_per_token()
        answer = job.sampling.max_tokens * per_token
        until = self.tenancy.pin(kv, hashes, size * per_token, answer)
        return replace(job, pinned_until=until)

    def _encode(self, encodes: Encodes, model: str) -> None:
        encodes.start(self.dispatcher.bus, model, self.images.settings.encode_timeout_s)

    async def _images(self, conv: Conversation, salt: str) -> list[ImageInput]:
        """The conversation's images, read and checked (none for a text request)."""
        if not conv.images():
            return []
        return await self.images.read_all(conv, salt, self.dispatcher.bus.nc.max_payload)


def fan_out(heads: list[Prepared], best_of: int) -> Prepared:
    """Each prompt's candidates (``heads``: each prompt prepared once, in order); the answer's
    first, with every other as its siblings."""
    ranked = best_of > heads[0].conversation.n
    every: list[Prepared] = []
    for head in heads:
        rid = head.job.request_id
        for j in range(best_of):
            sampling = head.job.sampling.candidate(j)
            if ranked and sampling.logprobs is None:  # (ranked by them)
                sampling = replace(sampling, logprobs=0)
            job = replace(head.job, request_id=f"{rid}-{j}" if j else rid, sampling=sampling)
            if j:
                every.append(head.sibling(job, j))
            else:
                head.job = job
                every.append(head)
    first = every[0]
    first.siblings = every[1:]
    return first

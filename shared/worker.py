"""What prefill and decode workers share: engine settings, the engine on its own thread,
publishing token events, and listening for cancels."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode
from pydantic import Field, field_validator

from shared.bus import Bus, subjects
from shared.bus.adapters import Adapters, from_settings
from shared.bus.tokens import TokenLinks
from shared.engine import ops
from shared.engine.interface import (
    KV_DTYPES,
    BadBlock,
    Engine,
    EngineOptions,
    EngineStats,
    ImageEmbeds,
    PoolExhausted,
    Prefix,
    StepOutput,
)
from shared.engine.registry import BENCH_ONLY, ENGINES, load_engine
from shared.hosting.process import ProcessRunner
from shared.hosting.runner import EngineRunner
from shared.kvindex.publisher import KvEventPublisher
from shared.kvstore.backend import FileStore
from shared.kvstore.hashing import block_hashes, pack_tokens
from shared.kvstore.tiers import CachedPrefix, KvTiers
from shared.messages.encode import EMBEDS_SHAPE_HEADER
from shared.messages.generate import (
    Cancel,
    GenerateTask,
    ImageRef,
    Logprobs,
    TaskAck,
    TokenEvent,
    TokenEvents,
)
from shared.messages.heartbeat import Load
from shared.messages.kvevents import MEMORY, STORAGE, ResyncRequest
from shared.model.catalog import ModelError, resolve
from shared.model.lora import AdapterSpec, LoraError, kv_fingerprint
from shared.model.text import check_model
from shared.security import tls
from shared.service import Service, ServiceSettings
from shared.settings import CommonSettings, SettingsError, env_name
from shared.telemetry.metrics import BYTES, ENGINE_FAILURES, LORA, PREFILL_TOKENS
from shared.telemetry.tracing import REQUEST_ID, mark_span, tracer

log = logging.getLogger(__name__)

T = TypeVar("T")

TAKEN_KEPT_S = 60.0  # a task asked again within this after it was taken is not taken twice


class Tasks:
    """A worker's task subject, served so that a task asked twice is taken once: a router
    asks again when the ack is late (``Bus.ask``: the first ask or its ack may be lost with a
    NATS node), and a task already taken is acked again, not run again. Asks are answered
    one at a time (a second is read after the first's answer); a refused task is not
    remembered (asked again, it may be taken)."""

    def __init__(
        self,
        on_task: Callable[[GenerateTask], Awaitable[TaskAck]],
        seen: Callable[[GenerateTask], None] = lambda _: None,
    ) -> None:
        self.on_task = on_task
        self.seen = seen  # each task asked (the worker learns its router's token link)
        self.taken: dict[str, float] = {}  # request id -> when (oldest first)

    async def serve(self, bus: Bus, subject: str) -> None:
        await bus.serve(subject, GenerateTask, self.ask)

    async def ask(self, task: GenerateTask) -> TaskAck:
        now = time.monotonic()
        while self.taken and next(iter(self.taken.values())) < now - TAKEN_KEPT_S:
            del self.taken[next(iter(self.taken))]
        if task.request_id in self.taken:
            return TaskAck(accepted=True, again=True)
        self.seen(task)
        ack = await self.on_task(task)
        if ack.accepted:
            self.taken[task.request_id] = now
        return ack


class ImagesMissing(Exception):
    """A prompt's image embeddings did not come (no encoder made them in time)."""


# SGLang's KV transfer backends (its DISAGG_TRANSFER_BACKEND_CHOICES)
PD_TRANSFERS = ("mooncake", "nixl", "mooncake_tcp", "mori", "ascend", "fake")


class WorkerSettings(ServiceSettings):
    """Engine settings of a worker role (prefill and decode each subclass it)."""

    engine: str = Field(default="torch", description="compute engine backend (by name)")
    model: str = Field(default="smollm2-135m-instruct", min_length=1, description="model served")
    block_size: int = Field(default=64, ge=1, le=4096, description="tokens per KV block")
    kv_cache_tokens: int = Field(
        default=16384, ge=64, description="KV pool size in tokens (whole blocks)"
    )
    device: str = Field(
        default="cpu",
        pattern=r"^(cpu|cuda(:\d+)?)$",
        description="where the torch engine computes: cpu, cuda or cuda:N",
    )
    dtype: str = Field(
        default="",
        description="the torch engine's weights and KV cache: float32, bfloat16 or float16; "
        "empty: float32 on a CPU, bfloat16 on a GPU",
    )
    threads: int = Field(default=0, ge=0, le=1024, description="torch threads; 0: all cores")
    cpu_cores: str = Field(
        default="",
        pattern=r"^(\d+(-\d+)?(,\d+(-\d+)?)*)?$",
        description="CPU cores a vLLM engine's threads are bound to (e.g. 1 or 0-3,8); empty: "
        "vLLM's own choice, which binds every engine on a host to the same first cores "
        "(`kvmesh up` splits the host's among the vLLM workers it starts)",
    )
    prefill_chunk: int = Field(default=512, ge=1, description="tokens per prefill forward pass")
    max_running: int = Field(default=64, ge=1, description="sequences held at once")
    max_loras: int = Field(
        default=4,
        ge=1,
        le=256,
        description="LoRA adapters resident at once (the torch engine); others are read when a "
        "request needs one, the least recently used out",
    )
    max_lora_rank: int = Field(default=64, ge=1, le=1024, description="LoRA adapters' most rank")
    enable_lora: bool = Field(
        default=False,
        description="vLLM workers: serve LoRA adapters (vLLM's LoRA layers, which every step "
        "of its base model pays for; the torch engine serves them always)",
    )
    memory_tier_bytes: int = Field(
        default=1 << 30, ge=0, description="host-memory KV tier of this worker (LRU), bytes"
    )
    kv_store: bool = Field(default=True, description="read and write the shared storage tier")
    write_queue_bytes: int = Field(
        default=2 << 30,
        ge=0,
        description="KV blocks waiting to be stored, bytes; beyond it they are skipped (a "
        "32K-token prompt of a 1B model is 1 GiB of bf16 KV)",
    )
    store_retry_s: float = Field(
        default=30.0,
        gt=0,
        description="after a write to the storage tier fails (full, read-only, I/O error), "
        "how long its blocks stay in the memory tier only before one write is tried again",
    )
    store_dtype: str = Field(
        default="",
        description="dtype of stored blocks (float32, bfloat16, float16); empty: the engine's",
    )
    embeds_wait_s: float = Field(
        default=30.0, gt=0, description="how long a prompt waits for its images' embeddings"
    )
    max_engine_failures: int = Field(
        default=3,
        ge=1,
        description="engine calls (decode steps, prefills) failing in a row before the worker "
        "calls itself failing and takes no more work (each failure fails the requests it "
        "held, which move on)",
    )

    pd_transfer: str = Field(
        default="",
        description="SGLang workers: P/D by SGLang's own KV transfer (its backend: mooncake, "
        "nixl, mooncake_tcp, mori, ascend; fake moves nothing, for tests), the prefill "
        "worker's engine handing each prompt's KV to the decode worker's; empty: SGLang "
        "workers hand over through the storage tier, as vLLM's do",
    )
    bootstrap_port: int = Field(
        default=8998,
        ge=1,
        le=65535,
        description="SGLang prefill workers with pd_transfer: the port of its engine's "
        "bootstrap server (where decode engines ask for a request's KV)",
    )

    @field_validator("pd_transfer")
    @classmethod
    def _known_transfer(cls, name: str) -> str:
        if name and name not in PD_TRANSFERS:
            raise ValueError(f"empty or one of {', '.join(PD_TRANSFERS)}")
        return name

    @field_validator("store_dtype", "dtype")
    @classmethod
    def _known_dtype(cls, name: str) -> str:
        if name and name not in KV_DTYPES:
            raise ValueError(f"empty or one of {', '.join(KV_DTYPES)}")
        return name

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        if name not in ENGINES:
            raise ValueError(f"one of {', '.join(ENGINES)}")
        return name

    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            block_size=self.block_size,
            kv_cache_tokens=self.kv_cache_tokens,
            dtype=self.dtype,
            device=self.device,
            threads=self.threads,
            cpu_cores=self.cpu_cores,
            prefill_chunk=self.prefill_chunk,
            max_running=self.max_running,
            max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
            enable_lora=self.enable_lora,
        )


class WorkerService(Service):
    """A prefill or decode worker: loads its engine, then takes tasks and cancels."""

    @classmethod
    def check(cls, common: CommonSettings, settings: ServiceSettings) -> None:
        """The model named is there and servable (its files read once: later starts find
        its text side cached)."""
        assert isinstance(settings, WorkerSettings)
        if settings.engine in BENCH_ONLY and not common.bench_engines:
            setting = env_name(type(settings), "engine")
            raise SettingsError(
                f"{setting}={settings.engine}: a benchmark-only engine (its answers are not "
                "the model's); set KVMESH_BENCH_ENGINES=true to run it for a benchmark"
            )
        try:
            check_model(settings.model, Path(common.state_dir), common.models)
        except ModelError as err:
            setting = env_name(type(settings), "model")
            raise SettingsError(f"{setting}={settings.model}: {err}") from None
        try:
            from_settings(common.loras)
        except LoraError as err:
            raise SettingsError(f"KVMESH_LORAS: {err}") from None

    def __init__(self, common: CommonSettings, settings: WorkerSettings) -> None:
        super().__init__(common, settings)
        self.worker_settings = settings
        self.bus: Bus | None = None
        self.runner: EngineRunner | ProcessRunner | None = None
        self.tiers: KvTiers | None = None
        self.kv_events: KvEventPublisher | None = None
        self.spans: dict[str, Span] = {}  # each request's span here, open until it leaves
        self.engine_failures = 0  # in a row: past settings.max_engine_failures it is failing
        self._failed_prompts: set[bytes] = set()  # the prompts those failures held
        # Token events straight to their routers where they listen (else on NATS).
        self.links = TokenLinks(self.service_id, tls.mesh_client_context(common))
        self.adapters: dict[str, AdapterSpec] = {}  # LoRA adapters its engine serves

    async def serve_tasks(
        self, bus: Bus, subject: str, on_task: Callable[[GenerateTask], Awaitable[TaskAck]]
    ) -> None:
        """Take tasks on ``subject`` (``Tasks``), each router's token link learnt from them."""
        await Tasks(on_task, self.links.learn).serve(bus, subject)

    # -- an engine that raises --------------------------------------------------------------

    def engine_failed(self, what: str, why: str, prompts: Iterable[Sequence[int]]) -> None:
        """An engine call raised (``what``: decode_step, prefill) on ``prompts``; the caller
        fails the requests it held with "engine" (the router moves them at once, and fails a
        request that the engine fails on a second worker too). An engine that keeps failing
        makes the worker "failing": it takes no more work, and its heartbeats and /health say
        so until it is restarted. A failure on a prompt that already failed here since the
        last call that worked is that prompt's, not the engine's: it is not counted again
        (a client resending a request that breaks engines does not take workers down)."""
        ENGINE_FAILURES.labels(what).inc()
        keys = {prompt_key(ids) for ids in prompts}
        if keys and not keys.isdisjoint(self._failed_prompts):
            log.warning("the engine failed again on a prompt it failed on (%s: %s)", what, why)
            return
        self._failed_prompts |= keys
        self.engine_failures += 1
        limit = self.worker_settings.max_engine_failures
        if self.engine_failures >= limit and self.status == "ready":
            self.status = "failing"
            log.error(
                "%d engine calls failed in a row (the last, %s: %s): this worker takes no "
                "more work",
                self.engine_failures,
                what,
                why,
            )

    def engine_worked(self) -> None:
        self.engine_failures = 0
        self._failed_prompts.clear()

    # -- a request's span here (its steps are its children) ---------------------------------

    def open_span(self, rid: str, name: str, **attributes: object) -> None:
        """The request's span in this worker, a child of the sender's (the current context)."""
        attrs = {REQUEST_ID: rid, "worker": self.service_id, **attributes}
        self.spans[rid] = tracer.start_span(name, kind=SpanKind.SERVER, attributes=attrs)

    def mark(self, rid: str, name: str, at_ns: int | None = None) -> None:
        """A point on the request's path here (an event of its span: ``tracing.mark``;
        ``at_ns``: when it happened, if not now)."""
        span = self.spans.get(rid)
        if span is not None:
            mark_span(name, span, at_ns)

    def span_context(self, rid: str) -> otel_context.Context:
        span = self.spans.get(rid)
        return trace.set_span_in_context(span) if span else otel_context.get_current()

    def computed(
        self, task: GenerateTask, reused: int, start_ns: int, end_ns: int, batch: int
    ) -> None:
        """A prompt was computed here (``reused`` tokens came from the tiers): its
        "prefill.compute" span, and the prefill tokens counted."""
        computed = len(task.token_ids) - reused
        PREFILL_TOKENS.labels("computed").inc(computed)
        PREFILL_TOKENS.labels("reused").inc(reused)
        span = tracer.start_span(
            "prefill.compute",
            context=self.span_context(task.request_id),
            start_time=start_ns,
            attributes={
                "tokens_computed": computed,
                "tokens_reused": reused,
                "batch": batch,
                "images": len(task.images),
            },
        )
        span.end(end_time=end_ns)

    def close_span(self, rid: str, error: str = "", **attributes: object) -> None:
        span = self.spans.pop(rid, None)
        if span is None:
            return
        span.set_attributes(attributes)  # type: ignore[arg-type]
        if error:
            span.set_status(StatusCode.ERROR, error)
        span.end()

    @property
    def engine(self) -> Engine:
        assert self.runner is not None
        return self.runner.engine

    async def start_engine(
        self, stack: AsyncExitStack, bus: Bus, own_process: bool = False
    ) -> None:
        """Load the model (seconds: on a thread, or in the engine's own process when
        ``own_process``), subscribe to cancels."""
        self.bus = bus
        s = self.worker_settings
        started = time.monotonic()
        source = resolve(s.model, self.common.models)
        state_dir, options = Path(self.common.state_dir), s.engine_options()
        if own_process:
            runner = await ProcessRunner.start(s.engine, source, state_dir, options)
            self.runner = runner
        else:

            def build() -> Engine:
                engine = load_engine(s.engine, source, state_dir, options)
                engine.start()
                return engine

            engine = await asyncio.get_running_loop().run_in_executor(None, build)
            self.runner = runner = EngineRunner(engine)
        stack.push_async_callback(runner.close)
        self.say_ready(started, runner.engine.stats())
        store = FileStore(self.common.resolved_kv_store_dir) if s.kv_store else None
        events = await self.start_kv_events(stack, bus)
        self.tiers = KvTiers(
            bus, events, s.memory_tier_bytes, store, s.write_queue_bytes, s.store_retry_s
        )
        await self.tiers.start(stack)
        await bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        await Adapters(bus, self.common.loras, self.adapter_changed).start()

    def adapter_changed(self, spec: AdapterSpec, served: bool) -> None:
        """An adapter of the mesh's came or went: served by this worker's engine when it
        adapts this worker's model (the engine reads it when a request first needs it)."""
        if spec.base != self.worker_settings.model:
            return
        if served:
            self.register_adapter(spec)
        else:
            self.adapters.pop(spec.name, None)
            self.unregister_adapter(spec.name)
            self.beat_now.set()

    def register_adapter(self, spec: AdapterSpec) -> None:
        """The engine told (on its thread or in its process), then ``adapter_served``."""
        assert self.runner is not None

        def registered(done: asyncio.Future) -> None:
            if done.cancelled() or done.exception() is not None:
                self.adapter_served(spec, "cancelled" if done.cancelled() else done.exception())
            else:
                self.adapter_served(spec)

        self.runner.call(ops.register_adapter, spec).add_done_callback(registered)

    def unregister_adapter(self, name: str) -> None:
        assert self.runner is not None
        self.runner.call(ops.unregister_adapter, name)

    def adapter_served(self, spec: AdapterSpec, error: object = None) -> None:
        """The engine took the adapter (listed in heartbeats from now), or ``error``."""
        if error is not None:
            log.warning("LoRA adapter %s is not served here: %s", spec.name, error)
            return
        self.adapters[spec.name] = spec
        log.info("LoRA adapter %s served (%s, from %s)", spec.name, spec.digest, spec.path)
        self.beat_now.set()

    async def start_kv_events(self, stack: AsyncExitStack, bus: Bus) -> KvEventPublisher:
        """This worker's KV events, and resyncs of them when a holder of the index asks."""
        events = self.kv_events = KvEventPublisher(
            bus,
            self.role,
            self.service_id,
            self.started_at,
            self.memory_blocks,
            bound_s=self.common.kv_feed_bound_s,
        )
        stack.push_async_callback(events.stop)

        async def on_resync(req: ResyncRequest) -> None:
            events.resync(self.memory_blocks(), f"asked by {req.by}: {req.why}")

        await bus.subscribe(subjects.kv_resync(self.service_id), ResyncRequest, on_resync)
        return events

    def memory_blocks(self) -> list[tuple[str, int]]:
        """What this worker's memory tier holds: each block's hash and bytes."""
        return self.tiers.held() if self.tiers is not None else []

    def say_ready(self, started: float, stats: EngineStats, what: str = "") -> None:
        """The engine is ready (``started``: the monotonic clock when its loading began)."""
        s = self.worker_settings
        log.info(
            "%s engine ready in %.1f s: %s on %s%s, %d KV blocks of %d tokens",
            self.role,
            time.monotonic() - started,
            s.model,
            s.engine,
            what,
            stats.kv_blocks_total,
            stats.block_size,
        )

    def kv_event_figures(self) -> dict[str, float]:
        """What heartbeats say of this worker's KV events (``shared/kvindex/feeds.py``)."""
        events = self.kv_events
        if events is None:
            return {}
        return {"kv_events": events.made, "kv_unannounced_s": round(events.unannounced_s(), 3)}

    ROOM_LOW = 0.125  # less of the KV pool free than this: "full" to routers

    def room_changed(self, done: asyncio.Future | None = None) -> None:
        """The next heartbeat goes now when the KV pool crossed the "full" line either way
        since the last one (``done``: an engine call that freed blocks): routers would
        otherwise refuse work on room that is back, or send work to a pool that is full,
        for the rest of an interval."""
        if done is not None and (done.cancelled() or done.exception() is not None):
            if not done.cancelled():
                log.debug("freeing a request's blocks failed: %s", done.exception())
            return
        beat = self.last_beat
        if beat is None or not beat.load.kv_blocks_total or self.runner is None:
            return
        stats = self.engine.stats()

        def full(used: int, total: int) -> bool:
            return total - used < self.ROOM_LOW * total

        was = full(beat.load.kv_blocks_used, beat.load.kv_blocks_total)
        if was != full(stats.kv_blocks_used, stats.kv_blocks_total):
            self.beat_now.set()

    def worker_load(self, **figures: int) -> Load:
        """Load with the engine's and the tiers' figures filled in."""
        if self.runner is None or self.tiers is None:
            return Load(**figures)
        stats = self.engine.stats()
        return Load(
            **self.kv_event_figures(),
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            kv_block_size=stats.block_size,
            kv_write_skips=self.tiers.skipped_blocks,
            kv_store_error=self.tiers.store_error,
            memory_tier_bytes=self.tiers.memory.used_bytes,
            memory_tier_capacity=self.tiers.memory.capacity_bytes,
            **adapter_figures(stats),
            **figures,
        )

    async def fetch_images(self, task: GenerateTask) -> tuple[ImageEmbeds, ...]:
        """The embeddings of the task's images, from the embeddings stream (the encoder puts
        them there; they may still be on their way). Raises ImagesMissing."""
        assert self.bus is not None
        wait = min(self.worker_settings.embeds_wait_s, max(0.0, task.deadline - time.time()))
        with tracer.start_as_current_span(
            "embeds.wait",
            context=self.span_context(task.request_id),
            attributes={"images": len(task.images)},
        ) as span:
            images = await self._fetch_images(task, wait)
            span.set_attribute("bytes", sum(e.numel() * 4 for _, e in images))
        return images

    async def _fetch_images(self, task: GenerateTask, wait: float) -> tuple[ImageEmbeds, ...]:
        assert self.bus is not None
        dim = self.engine.config.dim

        async def one(i: int, ref: ImageRef) -> ImageEmbeds:
            subject = subjects.embeds(task.model, ref.image_hash)
            try:
                data, headers = await self.bus.wait_last(subjects.EMBEDS_STREAM, subject, wait)
            except Exception as err:  # BusError, or no stream at all: no encoder ever ran
                raise ImagesMissing(
                    f"image {i}'s embeddings did not come within {wait:g} s "
                    f"(is an encoder running?): {err}"
                ) from None
            tokens, hidden = (int(v) for v in headers[EMBEDS_SHAPE_HEADER].split(","))
            if (tokens, hidden) != (ref.tokens, dim):
                raise ImagesMissing(
                    f"image {i}'s embeddings are {tokens}×{hidden}, the prompt needs "
                    f"{ref.tokens}×{dim}"
                )
            import torch  # (here: a worker whose engine has its own process needs none else)

            rows = torch.frombuffer(bytearray(data), dtype=torch.float32).view(tokens, hidden)
            BYTES.labels("embeds", "in").inc(len(data))
            return ref.start, rows

        return tuple(await asyncio.gather(*(one(i, r) for i, r in enumerate(task.images))))

    async def read_prefix(self, task: GenerateTask) -> CachedPrefix:
        """The blobs of the prompt's longest cached prefix (memory tier, then files); nothing
        is held in the engine yet."""
        assert self.tiers is not None
        limit = (len(task.token_ids) - 1) // self.engine.block_size  # leave a token to compute
        if task.sampling.prompt_logprobs is not None:
            limit = 0  # (its prompt's logits are wanted: a cached block has none)
        return await self.tiers.read_prefix(task.block_hashes[:limit])

    async def load_prefix(
        self, task: GenerateTask, read: CachedPrefix | None = None
    ) -> tuple[Prefix | None, CachedPrefix]:
        """The longest cached prefix of the prompt, loaded into engine blocks (held: release
        after prefill). A block failing its checksums is dropped from its tier and reported;
        the prefix then ends before it. ``read``: its blobs, when ``read_prefix`` already
        fetched them (while the prompt waited for its images)."""
        with tracer.start_as_current_span(
            "kv.load", context=self.span_context(task.request_id)
        ) as span:
            prefix, cached = await self._load_prefix(task, read)
            blocks = cached.tokens_by_tier(1)  # tier → blocks
            span.set_attributes(
                {
                    "memory_blocks": blocks[MEMORY],
                    "storage_blocks": blocks[STORAGE],
                    "bytes": sum(len(b) for b in cached.blobs),
                    "block_size": self.engine.block_size,
                }
            )
        return prefix, cached

    async def _load_prefix(
        self, task: GenerateTask, read: CachedPrefix | None
    ) -> tuple[Prefix | None, CachedPrefix]:
        assert self.tiers is not None
        cached = read if read is not None else await self.read_prefix(task)
        while cached.blobs:
            try:
                trusted = cached.tiers.count(MEMORY)  # (a leading run: memory, then storage)
                prefix = await self.runner.call(
                    ops.import_blocks, cached.blobs, trusted, priority=task.priority
                )
            except BadBlock as bad:
                await self.tiers.discard(
                    cached.hashes[bad.index], cached.tiers[bad.index], str(bad)
                )
                cached.truncate(bad.index)
                continue
            except PoolExhausted:
                cached.truncate(0)  # no room to hold it: compute everything
                break
            await self.tiers.remember(cached, task.retention, task.pinned_until)
            return prefix, cached
        return None, cached

    def store_blocks(
        self,
        task: GenerateTask,
        first: int,
        blobs: list[bytes],
        token_ids: list[int],
        context: otel_context.Context | None = None,
        known: list[str] | None = None,
    ) -> list[str]:
        """Blocks ``first`` .. of ``token_ids`` computed here: to both tiers, behind the path
        (their span goes under the request's). ``known``: hashes of leading blocks already
        computed. Returns the hashes known after it (those of ``token_ids``' full blocks when
        it stored any)."""
        if not blobs or self.tiers is None:
            return list(known or [])
        if len(token_ids) == len(task.token_ids) and task.block_hashes:
            hashes = task.block_hashes
        else:
            hashes = block_hashes(
                token_ids,
                self.engine.block_size,
                self.kv_fingerprint(task),
                task.salt,
                known=known or task.block_hashes,
                images=task.images,
            )
        self.tiers.write_behind(
            hashes[first : first + len(blobs)],
            blobs,
            task.retention,
            context or self.span_context(task.request_id),
            task.pinned_until,
        )
        return hashes

    def kv_fingerprint(self, task: GenerateTask) -> str:
        """The fingerprint of the KV the task computes: the model's, and its adapter's."""
        fingerprint = self.engine.config.fingerprint
        adapter = task.sampling.adapter
        if not adapter:
            return fingerprint
        spec = self.adapters.get(adapter)
        assert spec is not None, f"a task of adapter {adapter} taken where it is not served"
        return kv_fingerprint(fingerprint, spec.digest)

    @property
    def store_dtype(self) -> str | None:
        return self.worker_settings.store_dtype or None

    async def on_cancel(self, cancel: Cancel) -> None:
        """Drop the request if this worker holds it."""

    def first_token_event(
        self, rid: str, out: StepOutput, cached: CachedPrefix, prefill_s: float
    ) -> TokenEvent:
        """The event of a prompt's first token, with the reuse and compute figures."""
        bs = self.engine.block_size
        return TokenEvent(
            request_id=rid,
            index=0,
            token_ids=[out.token_id],
            logprobs=None if out.logprobs is None else [Logprobs.of(out.logprobs)],
            prompt_logprobs=(
                None if out.prompt_logprobs is None else list(map(Logprobs.of, out.prompt_logprobs))
            ),
            finish_reason=out.finish_reason,
            stop_string=out.stop_string,
            cached_tokens=len(cached.blobs) * bs,
            cached_by_tier=cached.tokens_by_tier(bs),
            prefill_s=prefill_s,
            worker_id=self.service_id,
        )

    def error_event(
        self, rid: str, message: str, code: str, index: int = 0, at_fault: str = ""
    ) -> TokenEvent:
        """A request failed here, before its first token or after ``index`` tokens (``code``
        tells the router whether another worker may try; ``at_fault``: the worker it leaves
        out, when not this one)."""
        worker = at_fault or self.service_id
        return TokenEvent(
            request_id=rid, index=index, error=message, error_code=code, worker_id=worker
        )

    async def send(self, subject: str, *events: TokenEvent) -> None:
        """Events to a router's reply subject, in one message."""
        await self.send_encoded(subject, [TokenEvents.encoded(e) for e in events])

    async def send_encoded(self, subject: str, events: list[bytes]) -> None:
        """Events already JSON (``TokenEvents.encoded``, ``PlainTokens``), in one message: on
        the router's token link when it is up, else on NATS."""
        assert self.bus is not None
        message = TokenEvents.joined(events, time.time_ns())
        try:
            if not await self.links.send(subject, message):
                await self.bus.publish_bytes(subject, message)
        except Exception as err:  # the router notices the silence and retries or fails
            log.warning("could not send %d token events to %s: %s", len(events), subject, err)

    def models(self) -> list[str]:
        return [self.worker_settings.model, *sorted(self.adapters)]

    def serves(self, task: GenerateTask) -> bool:
        """Whether this worker computes the task's model: its own, or one of the adapters of
        it that it serves (then the task's adapter is the model it names)."""
        adapter = task.sampling.adapter
        if adapter:
            return task.model == adapter and adapter in self.adapters
        return task.model == self.worker_settings.model


def prompt_key(token_ids: Sequence[int]) -> bytes:
    """A prompt's identity among the engine's failures (its tokens' digest)."""
    return hashlib.blake2b(pack_tokens(token_ids), digest_size=16).digest()


def adapter_figures(stats: EngineStats) -> dict:
    """A heartbeat's LoRA figures (and the metric's): the adapters resident, a load's mean
    seconds."""
    LORA.labels("resident").set(len(stats.adapters))
    LORA.labels("loads").set(stats.adapter_loads)
    LORA.labels("load_seconds").set(stats.adapter_load_s)
    mean = stats.adapter_load_s / max(1, stats.adapter_loads)
    return {"adapters": list(stats.adapters), "adapter_load_s": round(mean, 4)}

"""What a prefill or decode worker does when its engine owns its KV (vLLM:
``shared.engine.interface.OwningEngine``): the engine loaded and started on the worker's loop,
its cache's block events published as kvmesh KV events, its load in heartbeats, tasks admitted
and each answered by a task of its own (``answer``: the role's), cancels, drain.

The roles differ only in what an answer is: ``services/decode/whole.py`` streams a whole
answer (or the rest of one a prefill worker started); ``services/prefill/whole.py`` computes
the prompt, publishes the first token and hands the request to a decode worker."""

from __future__ import annotations

import asyncio
import logging
import time
from abc import abstractmethod
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

from shared.bus import Bus, subjects
from shared.bus.adapters import Adapters
from shared.engine.interface import EngineOptions, OwningEngine
from shared.engine.registry import engine_class, load_owning_engine
from shared.messages.generate import Cancel, GenerateTask, TaskAck
from shared.messages.heartbeat import Load
from shared.messages.kvevents import MEMORY, STORE, memory_location
from shared.model.catalog import resolve
from shared.model.lora import AdapterSpec
from shared.service import ServiceSettings
from shared.settings import CommonSettings, SettingsError, env_name
from shared.worker import WorkerService, WorkerSettings, adapter_figures

log = logging.getLogger(__name__)


class OwningWorker(WorkerService):
    whole = True  # its engine computes whole prompts and keeps their KV itself

    @classmethod
    def check(cls, common: CommonSettings, settings: ServiceSettings) -> None:
        """The model, and engine options the engine can take (exit 2 naming the settings)."""
        assert isinstance(settings, WorkerSettings)
        if settings.pd_transfer and settings.engine != "sglang":
            raise SettingsError(
                f"{env_name(type(settings), 'pd_transfer')}={settings.pd_transfer} with "
                f"{env_name(type(settings), 'engine')}={settings.engine}: only SGLang moves KV "
                "by its own transfer; vLLM's P/D goes through the storage tier"
            )
        super().check(common, settings)
        refusal = engine_class(settings.engine).refusal(settings.engine_options())
        if refusal:
            block = env_name(type(settings), "block_size")
            engine = env_name(type(settings), "engine")
            raise SettingsError(
                f"{engine}={settings.engine} with {block}={settings.block_size}: {refusal}"
            )

    def __init__(self, common: CommonSettings, settings: WorkerSettings) -> None:
        super().__init__(common, settings)
        self.owning: OwningEngine | None = None
        self.answers: dict[str, asyncio.Task] = {}  # request id → its answer being made

    @property
    def max_queued(self) -> int:
        return getattr(self.worker_settings, "max_queued", 0)

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        self.bus = bus
        s = self.worker_settings
        started = time.monotonic()
        source = resolve(s.model, self.common.models)
        loop = asyncio.get_running_loop()
        engine = await loop.run_in_executor(
            None,
            load_owning_engine,
            s.engine,
            source,
            Path(self.common.state_dir),
            self.engine_options(),
        )
        self.owning = engine  # (its cache's events may come as it starts)
        await self.start_kv_events(stack, bus)
        await engine.start(self.blocks)
        stack.push_async_callback(engine.stop)
        self.say_ready(started, engine.stats(), " (it owns its KV)")
        await bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        await Adapters(bus, self.common.loras, self.adapter_changed).start()
        await self.serve_tasks(bus, subjects.tasks(self.role, self.service_id), self.on_task)

    def register_adapter(self, spec: AdapterSpec) -> None:
        assert self.owning is not None
        try:
            self.owning.register_adapter(spec)
        except (ValueError, OSError) as err:
            self.adapter_served(spec, err)
        else:
            self.adapter_served(spec)

    def unregister_adapter(self, name: str) -> None:
        assert self.owning is not None
        self.owning.unregister_adapter(name)

    def engine_options(self) -> EngineOptions:
        """The worker's engine options, with the storage tier the engine reads and writes."""
        s = self.worker_settings
        store = self.common.resolved_kv_store_dir if s.kv_store else ""
        return replace(
            s.engine_options(),
            kv_store_dir=str(store),
            store_dtype=s.store_dtype,
            memory_tier_bytes=s.memory_tier_bytes,
            pd_transfer=s.pd_transfer,
            pd_role=self.role if s.pd_transfer else "",
            bootstrap_host=s.advertised_host(),
            bootstrap_port=s.bootstrap_port,
        )

    async def blocks(
        self, kind: str, hashes: list[str], tier: str, retention: str, block_bytes: int = 0
    ) -> None:
        """The engine's blocks changed: KV events at this worker's memory location (its own
        cache: the router's lookups find what it holds, and its death drops them) or at the
        storage tier (what its storage connector wrote or found damaged)."""
        assert self.kv_events is not None
        if not block_bytes:  # (its own cache's: in memory, at the engine's dtype)
            block_bytes = self.block_bytes()
        sizes = [block_bytes] * len(hashes) if kind == "stored" else []
        location = memory_location(self.service_id) if tier == MEMORY else STORE
        await self.kv_events.publish(kind, location, hashes, sizes, retention)

    def block_bytes(self) -> int:
        """A block of its own cache's: in memory, at the engine's dtype."""
        assert self.owning is not None
        return self.owning.block_size * self.owning.config.kv_bytes_per_token()

    def memory_blocks(self) -> list[tuple[str, int]]:
        if self.owning is None:
            return []
        size = self.block_bytes()
        return [(h, size) for h in self.owning.cached_blocks()]

    def computed(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A prompt computed: its full blocks not found cached are new, each to be announced
        by the engine's cache events (a feed that stops while this counts is flagged). The
        last token is always computed (an engine caches at most the prompt less one token),
        so the block it ends is counted only when it was not cached before."""
        if self.kv_events is not None and self.owning is not None:
            bs = self.owning.block_size
            new = (prompt_tokens - 1) // bs - cached_tokens // bs
            self.kv_events.computed(new, memory_location(self.service_id))

    @property
    def pd_only(self) -> bool:  # type: ignore[override]
        return self.owning is not None and self.owning.pd_only

    def addresses(self) -> dict[str, str]:
        """Its HTTP address, and (an SGLang prefill worker in SGLang's own P/D) where decode
        engines fetch KV from its engine."""
        peer = self.owning.peer_address() if self.owning is not None else ""
        return {**super().addresses(), **({"bootstrap": peer} if peer else {})}

    def load(self) -> Load:
        if self.owning is None:
            return Load()
        stats = self.owning.stats()
        return Load(  # inflight: what this worker accepted (the engine's own count lags a step)
            **self.kv_event_figures(),
            kv_hash=self.owning.hash_scheme,
            inflight=len(self.answers),
            queued=max(0, stats.sequences - stats.running),
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            kv_block_size=stats.block_size,
            **adapter_figures(stats),
        )

    async def drain(self) -> None:
        while self.answers:
            await asyncio.sleep(0.05)

    def refusal(self, task: GenerateTask) -> str:
        """Why the task is not taken ("busy" when full); "" when it is."""
        if self.status != "ready" or self.owning is None:
            return "busy"
        if not self.serves(task):
            return f"this worker serves {', '.join(self.models())}"
        if len(self.answers) >= self.worker_settings.max_running + self.max_queued:
            return "busy"
        return ""

    async def on_task(self, task: GenerateTask) -> TaskAck:
        waiting = len(self.answers)
        why = self.refusal(task)
        if why:
            return TaskAck(accepted=False, reason=why, queued=waiting)
        self.open_span(task.request_id, self.role, prompt_tokens=len(task.token_ids), whole=True)
        answer = asyncio.create_task(self.answer(task))
        self.answers[task.request_id] = answer
        answer.add_done_callback(lambda _: self.answers.pop(task.request_id, None))
        return TaskAck(accepted=True, queued=max(0, waiting - self.worker_settings.max_running))

    async def on_cancel(self, cancel: Cancel) -> None:
        if cancel.request_id in self.answers and self.owning is not None:
            await self.owning.abort(cancel.request_id)

    @abstractmethod
    async def answer(self, task: GenerateTask) -> None:
        """This role's part of the request, start to end: events to its reply subject (an
        error event when it fails), the span closed."""

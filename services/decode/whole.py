"""A decode worker whose engine owns its KV (vLLM: ``shared.engine.interface.OwningEngine``):
it takes whole requests (the router sends every request of its model here, as it does a short
prompt to a worker that prefills it itself), and streams each answer to the request's reply
subject as the engine gives it. Everything above the engine is the worker's as for the torch
engine: heartbeats with the engine's own load, drain, cancels, spans, /metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import replace
from pathlib import Path

from services.decode.settings import DecodeSettings
from shared.bus import Bus, subjects
from shared.engine.interface import EngineOptions, OwningEngine
from shared.engine.registry import load_owning_engine
from shared.kvstore.tiers import MEMORY, publish_kv_event
from shared.messages.generate import Cancel, GenerateTask, Logprobs, TaskAck, TokenEvent
from shared.messages.heartbeat import Load
from shared.messages.kvevents import STORE, memory_location
from shared.model.catalog import resolve
from shared.settings import CommonSettings
from shared.worker import WorkerService

log = logging.getLogger(__name__)


class WholeRequests(WorkerService):
    role = "decode"
    whole = True

    def __init__(self, common: CommonSettings, settings: DecodeSettings) -> None:
        super().__init__(common, settings)
        self.settings: DecodeSettings = settings
        self.owning: OwningEngine | None = None
        self.answers: dict[str, asyncio.Task] = {}  # request id → its answer streaming

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        self.bus = bus
        s = self.settings
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
        await engine.start(self.blocks)
        stack.push_async_callback(engine.stop)
        stats = engine.stats()
        log.info(
            "decode engine ready in %.1f s: %s on %s (whole requests), %d KV blocks of %d tokens",
            time.monotonic() - started,
            s.model,
            s.engine,
            stats.kv_blocks_total,
            stats.block_size,
        )
        await bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel)
        await bus.serve(subjects.tasks(self.role, self.service_id), GenerateTask, self.on_task)

    def engine_options(self) -> EngineOptions:
        """The worker's engine options, with the storage tier the engine reads and writes."""
        s = self.settings
        store = self.common.resolved_kv_store_dir if s.kv_store else ""
        return replace(s.engine_options(), kv_store_dir=str(store), store_dtype=s.store_dtype)

    async def blocks(self, kind: str, hashes: list[str], tier: str, retention: str) -> None:
        """The engine's blocks changed: KV events at this worker's memory location (its own
        cache: the router's lookups find what it holds, and its death drops them) or at the
        storage tier (what its storage connector wrote or found damaged)."""
        assert self.bus is not None and self.owning is not None
        block_bytes = self.owning.block_size * self.owning.config.kv_bytes_per_token()
        sizes = [block_bytes] * len(hashes) if kind == "stored" else []
        location = memory_location(self.service_id) if tier == MEMORY else STORE
        await publish_kv_event(
            self.bus, subjects.kv_events(self.role), kind, location, hashes, sizes, retention
        )

    def load(self) -> Load:
        if self.owning is None:
            return Load()
        stats = self.owning.stats()
        return Load(  # inflight: what this worker accepted (the engine's own count lags a step)
            inflight=len(self.answers),
            queued=max(0, stats.sequences - stats.running),
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_total=stats.kv_blocks_total,
            kv_block_size=stats.block_size,
        )

    async def drain(self) -> None:
        while self.answers:
            await asyncio.sleep(0.05)

    async def on_task(self, task: GenerateTask) -> TaskAck:
        if self.status != "ready" or self.owning is None:
            return TaskAck(accepted=False, reason="busy")
        if task.model != self.settings.model:
            return TaskAck(accepted=False, reason=f"this worker serves {self.settings.model}")
        waiting = len(self.answers)
        if waiting >= self.settings.max_running + self.settings.max_queued:
            return TaskAck(accepted=False, reason="busy", queued=waiting)
        self.open_span(task.request_id, "decode", prompt_tokens=len(task.token_ids), whole=True)
        answer = asyncio.create_task(self.answer(task))
        self.answers[task.request_id] = answer
        answer.add_done_callback(lambda _: self.answers.pop(task.request_id, None))
        return TaskAck(accepted=True, queued=max(0, waiting - self.settings.max_running))

    async def on_cancel(self, cancel: Cancel) -> None:
        if cancel.request_id in self.answers and self.owning is not None:
            await self.owning.abort(cancel.request_id)

    async def answer(self, task: GenerateTask) -> None:
        """Stream the answer: the first event with what the engine's cache had, then each
        piece as it comes; an error before the first token is the router's to retry."""
        assert self.owning is not None
        rid, index, started = task.request_id, 0, time.perf_counter()
        first_at = started
        try:
            pieces = self.owning.generate(
                rid, task.token_ids, task.sampling, task.salt, task.retention
            )
            async for piece in pieces:
                if not piece.token_ids and piece.finish_reason is None:
                    continue
                figures: dict = {}
                if index == 0:
                    first_at = time.perf_counter()
                    figures = dict(
                        cached_tokens=piece.cached_tokens,
                        cached_by_tier={"memory": piece.cached_tokens},
                        prefill_s=first_at - started,
                    )
                if piece.finish_reason is not None:
                    figures["decode_s"] = time.perf_counter() - first_at
                    if piece.cached_by_tier is not None:
                        figures["cached_by_tier"] = piece.cached_by_tier
                event = TokenEvent(
                    request_id=rid,
                    index=index,
                    token_ids=piece.token_ids,
                    logprobs=None
                    if piece.logprobs is None
                    else [Logprobs.of(lp) for lp in piece.logprobs],
                    finish_reason=piece.finish_reason,
                    stop_string=piece.stop_string,
                    worker_id=self.service_id,
                    **figures,
                )
                index += len(piece.token_ids)
                await self.send(task.reply_subject, event)
            self.close_span(rid, tokens=index)
        except ValueError as err:  # what the engine cannot take (the request's, not ours)
            self.close_span(rid, error=str(err))
            await self.send(task.reply_subject, self.error_event(rid, str(err), "internal"))
        except Exception as err:
            log.exception("%s failed", rid)
            self.close_span(rid, error=str(err))
            code = "unavailable" if index == 0 else "internal"
            await self.send(task.reply_subject, self.error_event(rid, str(err), code))

"""What prefill and decode workers share: engine settings, the engine on its own thread,
publishing token events, and listening for cancels."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import TypeVar

from pydantic import Field, field_validator

from shared.bus import Bus, subjects
from shared.engine.engine import EngineOptions, TorchEngine
from shared.engine.loader import MODEL_NAMES, load_model
from shared.messages.generate import Cancel, TokenEvent
from shared.runner import EngineRunner
from shared.service import Service, ServiceSettings
from shared.settings import CommonSettings

log = logging.getLogger(__name__)

T = TypeVar("T")


class WorkerSettings(ServiceSettings):
    """Engine settings of a worker role (prefill and decode each subclass it)."""

    model: str = Field(default="smollm2-135m-instruct", min_length=1, description="model served")
    block_size: int = Field(default=64, ge=1, le=4096, description="tokens per KV block")
    kv_cache_tokens: int = Field(
        default=16384, ge=64, description="KV pool size in tokens (whole blocks)"
    )
    threads: int = Field(default=0, ge=0, le=1024, description="torch threads; 0: all cores")
    prefill_chunk: int = Field(default=512, ge=1, description="tokens per prefill forward pass")
    max_running: int = Field(default=64, ge=1, description="sequences held at once")

    @field_validator("model")
    @classmethod
    def _known_model(cls, name: str) -> str:
        if name not in MODEL_NAMES:
            raise ValueError(f"one of {', '.join(MODEL_NAMES)}")
        return name

    def engine_options(self) -> EngineOptions:
        return EngineOptions(
            block_size=self.block_size,
            kv_cache_tokens=self.kv_cache_tokens,
            threads=self.threads,
            prefill_chunk=self.prefill_chunk,
            max_running=self.max_running,
        )


class WorkerService(Service):
    """A prefill or decode worker: loads its engine, then takes tasks and cancels."""

    def __init__(self, common: CommonSettings, settings: WorkerSettings) -> None:
        super().__init__(common, settings)
        self.worker_settings = settings
        self.bus: Bus | None = None
        self.runner: EngineRunner | None = None

    @property
    def engine(self) -> TorchEngine:
        assert self.runner is not None
        return self.runner.engine

    async def start_engine(self, stack: AsyncExitStack, bus: Bus) -> None:
        """Load the model (seconds, on a thread), subscribe to cancels."""
        self.bus = bus
        s = self.worker_settings
        loop = asyncio.get_running_loop()
        started = time.monotonic()

        def build() -> TorchEngine:
            engine = TorchEngine(
                load_model(s.model, Path(self.common.state_dir)), s.engine_options()
            )
            engine.start()
            return engine

        engine = await loop.run_in_executor(None, build)
        self.runner = EngineRunner(engine)
        stack.callback(self.runner.close)
        log.info(
            "%s engine ready in %.1f s: %s, %d KV blocks of %d tokens",
            self.role,
            time.monotonic() - started,
            s.model,
            engine.pool.n_blocks,
            engine.block_size,
        )
        await bus.subscribe(subjects.CANCEL, Cancel, self.on_cancel)

    async def on_cancel(self, cancel: Cancel) -> None:
        """Drop the request if this worker holds it."""

    async def send(self, subject: str, event: TokenEvent) -> None:
        assert self.bus is not None
        try:
            await self.bus.publish(subject, event)
        except Exception as err:  # the router notices the silence and retries or fails
            log.warning("could not send tokens of %s: %s", event.request_id, err)

    def models(self) -> list[str]:
        return [self.worker_settings.model]

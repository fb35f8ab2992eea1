"""The encoder: images to embeddings, ahead of prefill.

Routers send each image here as soon as a request arrives (a queue group: any encoder takes
it). The image is decoded, resized to its grid and run through the vision tower, batched with
whatever else is waiting; the embeddings go to the embeddings stream, where the prefill worker
computing the request picks them up. Embeddings are kept by content hash (LRU by bytes), so an
image sent again is not encoded again, and one sent twice at once is encoded once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch
from opentelemetry.trace import SpanKind, StatusCode

from services.encoder.pixels import pixels
from services.encoder.settings import EncoderSettings
from services.encoder.tower import TowerConfig, VisionTower
from shared.bus import Bus, subjects
from shared.kvstore.backend import FileStore, MemoryStore
from shared.messages.encode import EMBEDS_SHAPE_HEADER, EncodeReply, EncodeRequest
from shared.messages.heartbeat import Load
from shared.model.catalog import ModelError
from shared.model.text import check_model, load_text_model, model_names
from shared.service import Service, ServiceSettings
from shared.settings import CommonSettings, SettingsError
from shared.telemetry.metrics import BYTES, IMAGES
from shared.telemetry.tracing import tracer
from shared.vision.images import BadImage, content_hash

log = logging.getLogger(__name__)


@dataclass
class _Job:
    model: str
    data: bytes
    tokens: int
    done: asyncio.Future[tuple[bytes, float]] = field(repr=False)  # embeddings, seconds
    ask: str = ""  # the ask that started it (sent again, it joins its own encode)


class EncoderService(Service):
    role = "encoder"

    def __init__(self, common: CommonSettings, settings: EncoderSettings) -> None:
        super().__init__(common, settings)
        self.untrained: set[str] = set()  # models whose tower has random weights
        self.settings: EncoderSettings = settings
        self.towers: dict[str, VisionTower] = {}
        self.cache = MemoryStore(settings.cache_bytes)  # "model:hash" → float32 rows
        self.files = (
            FileStore(common.resolved_kv_store_dir / "embeds") if settings.store_embeds else None
        )
        self.inflight: dict[str, _Job] = {}  # "model:hash" → its encode
        self.queue: asyncio.Queue[_Job] = asyncio.Queue()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tower")
        self.bus: Bus | None = None

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        self.bus = bus
        s = self.settings
        if s.threads:
            torch.set_num_threads(s.threads)
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        self.towers = await loop.run_in_executor(self.executor, self._build_towers)
        stack.callback(self.executor.shutdown, wait=False, cancel_futures=True)
        log.info(
            "vision towers ready in %.1f s for %s",
            time.monotonic() - started,
            ", ".join(self.served),
        )
        await bus.ensure_stream(
            subjects.EMBEDS_STREAM,
            [subjects.EMBEDS_ALL],
            max_age_s=s.embeds_ttl_s,
            max_bytes=s.embeds_stream_bytes,
            memory=True,
            last_per_subject=True,
        )
        batcher = asyncio.create_task(self._batcher())
        stack.callback(batcher.cancel)
        await bus.serve(
            subjects.ENCODE,
            EncodeRequest,
            self.on_encode,
            queue=subjects.ENCODER_QUEUE,
            framed=True,
            concurrent=True,
        )

    @classmethod
    def check(cls, common: CommonSettings, settings: ServiceSettings) -> None:
        """Every model named is one of the mesh's, its files there."""
        assert isinstance(settings, EncoderSettings)
        for model in settings.models:
            try:
                check_model(model, Path(common.state_dir), common.models)
            except ModelError as err:
                raise SettingsError(f"KVMESH_ENCODER_MODELS: {model}: {err}") from None

    @property
    def served(self) -> list[str]:
        """The models it makes embeddings for: those named, or every model of the mesh."""
        return self.settings.models or model_names(self.common.models)

    def _build_towers(self) -> dict[str, VisionTower]:
        s = self.settings
        towers = {}
        for model in self.served:
            text = load_text_model(model, Path(self.common.state_dir), models=self.common.models)
            hidden = text.config.dim
            config = TowerConfig(
                hidden=hidden,
                grid=self.common.vision_grid,
                dim=s.dim,
                layers=s.layers,
                heads=s.heads,
                seed=s.seed,
            )
            tower = VisionTower(config)
            weights = s.weights_dir / f"{model}.safetensors" if s.weights_dir else None
            if weights is not None and weights.is_file():
                tower.load(weights)
                log.info("%s: vision weights from %s", model, weights)
            else:
                log.warning("%s: vision tower has random weights (seed %d)", model, s.seed)
                self.untrained.add(model)
            towers[model] = tower
        return towers

    def models(self) -> list[str]:
        return list(self.towers)

    def load(self) -> Load:
        return Load(inflight=len(self.inflight), queued=self.queue.qsize())

    async def drain(self) -> None:
        while self.inflight:
            await asyncio.sleep(0.05)

    async def on_encode(self, req: EncodeRequest, blob: memoryview) -> EncodeReply:
        attributes = {"image_hash": req.image_hash, "tokens": req.tokens, "bytes": len(blob)}
        with tracer.start_as_current_span(
            "encode", kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            reply = await self._answer(req, blob)
            span.set_attributes(
                {"source": reply.source, "encode_ms": round(reply.encode_s * 1e3, 3)}
            )
            if reply.error:
                span.set_status(StatusCode.ERROR, reply.error)
            else:
                IMAGES.labels(reply.source).inc()
        return reply

    async def _answer(self, req: EncodeRequest, blob: memoryview) -> EncodeReply:
        def failed(error: str, code: str) -> EncodeReply:
            return EncodeReply(
                image_hash=req.image_hash, encoder_id=self.service_id, error=error, error_code=code
            )

        if req.model not in self.towers:
            return failed(f"{self.service_id} does not serve {req.model}", "internal")
        data = bytes(blob)
        if content_hash(data, req.salt) != req.image_hash:
            return failed("the image's bytes do not match its image_hash", "bad_image")
        key = f"{req.model}:{req.image_hash}"
        embeds, took, source = self.cache.get(key), 0.0, "memory"
        if embeds is None:
            embeds = await self._from_files(key)
            source = "storage"
        if embeds is None:
            job = self.inflight.get(key)
            # Another request is encoding it: share (the same ask sent again joins its own).
            source = "shared" if job and (job.ask != req.ask or not req.ask) else "encoded"
            if job is None:
                done = asyncio.get_running_loop().create_future()
                job = self.inflight[key] = _Job(req.model, data, req.tokens, done, req.ask)
                done.add_done_callback(lambda _: self.inflight.pop(key, None))
                self.queue.put_nowait(job)
            try:
                embeds, took = await asyncio.shield(job.done)
            except BadImage as err:
                return failed(str(err), "bad_image")
            except Exception as err:
                log.error("encoding %s failed", req.image_hash, exc_info=err)
                return failed(f"encoding failed: {err}", "internal")
            if source == "encoded":
                self._keep(key, embeds)
        elif source == "storage":
            self.cache.put(key, embeds)
        cached = source != "encoded"
        hidden = self.towers[req.model].config.hidden
        tokens = len(embeds) // (4 * hidden)
        assert self.bus is not None
        # Put on the stream every time: after its max age it is gone there, not here.
        await self.bus.put_last(
            subjects.embeds(req.model, req.image_hash),
            embeds,
            headers={EMBEDS_SHAPE_HEADER: f"{tokens},{hidden}"},
            retry_s=10.0,  # a NATS node lost: the stream's next leader stores them
        )
        BYTES.labels("embeds", "out").inc(len(embeds))
        return EncodeReply(
            image_hash=req.image_hash,
            tokens=tokens,
            encoder_id=self.service_id,
            cached=cached,
            source=source,
            encode_s=took,
            untrained=req.model in self.untrained,
        )

    @staticmethod
    def _file_key(key: str) -> str:
        return content_hash(key.encode())  # hex, for the store's fan-out directories

    async def _from_files(self, key: str) -> bytes | None:
        if self.files is None:
            return None
        loop = asyncio.get_running_loop()
        blob = await loop.run_in_executor(None, self.files.get, self._file_key(key))
        return bytes(blob) if blob is not None else None

    def _keep(self, key: str, embeds: bytes) -> None:
        """In memory now; in the storage tier behind the reply."""
        self.cache.put(key, embeds)
        if self.files is not None:
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, self.files.put, self._file_key(key), embeds)

    async def _batcher(self) -> None:
        """Encode what waits, up to max_batch images per pass of the tower."""
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            for _ in range(3):  # requests that arrived together are on the socket already
                await asyncio.sleep(0)
            while len(batch) < self.settings.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            started = time.perf_counter()
            results = await loop.run_in_executor(self.executor, self._encode, batch)
            took = time.perf_counter() - started
            for job, result in zip(batch, results, strict=True):
                if job.done.done():
                    continue
                if isinstance(result, Exception):
                    job.done.set_exception(result)
                else:
                    job.done.set_result((result, took))

    def _encode(self, batch: list[_Job]) -> list[bytes | Exception]:
        """On the tower thread: decode each image, then one tower pass per model."""
        grid, max_pixels = self.common.vision_grid, self.common.image_max_pixels
        results: list[bytes | Exception] = []
        images: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for i, job in enumerate(batch):
            try:
                x = pixels(job.data, grid, max_pixels)
            except BadImage as err:
                results.append(err)
                continue
            results.append(b"")
            images.setdefault(job.model, []).append((i, x))
        for model, items in images.items():
            out = self.towers[model].encode([x for _, x in items])
            for (i, _), rows in zip(items, out, strict=True):
                if len(rows) != batch[i].tokens:  # router and encoder disagree on the grid
                    results[i] = RuntimeError(
                        f"the image gave {len(rows)} embeddings, the router counted "
                        f"{batch[i].tokens}: KVMESH_IMAGE_* settings differ between them"
                    )
                else:
                    results[i] = rows.contiguous().numpy().tobytes()
        return results

"""The prefill worker: computes prompts, samples the first token, and hands the KV to the
decode worker the router chose, over gRPC."""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from contextlib import AsyncExitStack

import grpc

from services.prefill.settings import PrefillSettings
from shared.bus import Bus, subjects
from shared.engine.blocks import PoolExhausted
from shared.engine.engine import Cancelled
from shared.messages.generate import Cancel, GenerateTask, HandoffDone, TaskAck, TokenEvent
from shared.messages.heartbeat import Load
from shared.proto import kv_pb2, kv_pb2_grpc
from shared.settings import CommonSettings
from shared.worker import WorkerService

log = logging.getLogger(__name__)


class HandoffFailed(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class PrefillService(WorkerService):
    role = "prefill"

    def __init__(self, common: CommonSettings, settings: PrefillSettings) -> None:
        super().__init__(common, settings)
        self.settings: PrefillSettings = settings
        self.queue: asyncio.Queue[GenerateTask] = asyncio.Queue()
        self.cancelled: set[str] = set()  # of requests queued or running here
        self.current: str | None = None
        self.channels: dict[str, grpc.aio.Channel] = {}

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        await self.start_engine(stack, bus)
        await bus.serve(subjects.tasks(self.role, self.service_id), GenerateTask, self.on_task)
        worker = asyncio.create_task(self.work())
        stack.callback(worker.cancel)
        stack.push_async_callback(self._close_channels)

    async def _close_channels(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    def load(self) -> Load:
        if self.runner is None:
            return Load()
        pool = self.engine.pool
        return Load(
            inflight=int(self.current is not None),
            queued=self.queue.qsize(),
            kv_blocks_used=pool.used_blocks,
            kv_blocks_total=pool.n_blocks,
        )

    async def drain(self) -> None:
        while self.current is not None or not self.queue.empty():
            await asyncio.sleep(0.05)

    async def on_task(self, task: GenerateTask) -> TaskAck:
        if self.status != "ready" or self.queue.qsize() >= self.settings.max_queued:
            return TaskAck(accepted=False, reason="busy", queued=self.queue.qsize())
        if task.model != self.settings.model:
            return TaskAck(accepted=False, reason=f"this worker serves {self.settings.model}")
        self.queue.put_nowait(task)
        return TaskAck(accepted=True, queued=self.queue.qsize() - 1)

    async def on_cancel(self, cancel: Cancel) -> None:
        rid = cancel.request_id
        if rid == self.current or any(t.request_id == rid for t in self.queue._queue):  # type: ignore[attr-defined]
            self.cancelled.add(rid)

    async def work(self) -> None:
        while True:
            task = await self.queue.get()
            rid = task.request_id
            if rid in self.cancelled or time.time() > task.deadline:
                self.cancelled.discard(rid)
                continue
            self.current = rid
            try:
                await self.prefill(task)
            except Cancelled:
                log.info("prefill of %s cancelled", rid)
            except PoolExhausted as err:
                await self.send(task.reply_subject, self._error(rid, str(err), "busy"))
            except HandoffFailed as err:
                log.warning("handoff of %s failed: %s", rid, err)
                await self.send(task.reply_subject, self._error(rid, str(err), err.code))
            except Exception as err:
                log.exception("prefill of %s failed", rid)
                await self.send(task.reply_subject, self._error(rid, str(err), "internal"))
            finally:
                self.current = None
                self.cancelled.discard(rid)
                if rid in self.engine.seqs:
                    await self.runner.call(self.engine.free, rid)

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address)
        return self.channels[address]

    async def prefill(self, task: GenerateTask) -> None:
        """Reserve room on decode, compute, publish the first token, ship the KV."""
        rid = task.request_id
        timeout = self.settings.handoff_timeout_s
        call = kv_pb2_grpc.KvHandoffStub(self._channel(task.decode_kv_address)).Handoff()
        try:
            await self._step(call.write(kv_pb2.KvChunk(reserve=task.to_bytes())), timeout)
            reserved = await self._step(call.read(), timeout)
            if not reserved.ok:
                raise HandoffFailed(f"{task.decode_id}: {reserved.error}", reserved.code or "busy")
            started = time.perf_counter()
            out = await self.runner.call(
                self.engine.prefill,
                rid,
                task.token_ids,
                task.sampling.params(),
                handoff=True,
                cancelled=lambda: rid in self.cancelled,
            )
            first = TokenEvent(
                request_id=rid,
                index=0,
                token_ids=[out.token_id],
                finish_reason=out.finish_reason,
                stop_string=out.stop_string,
                cached_tokens=0,
                prefill_s=time.perf_counter() - started,
                worker_id=self.service_id,
            )
            await self.send(task.reply_subject, first)
            if out.finish_reason:
                return  # the answer is one token: decode's reservation goes with the call
            blob, state = await self.runner.call(self._export, rid)
            size = self.settings.kv_chunk_bytes
            for offset in range(0, len(blob), size):  # flow control paces these writes
                chunk = kv_pb2.KvChunk(data=blob[offset : offset + size])
                await self._step(call.write(chunk), timeout)
            done = HandoffDone(first_token=out.token_id, generator_state=state)
            await self._step(call.write(kv_pb2.KvChunk(done=done.to_bytes())), timeout)
            joined = await self._step(call.read(), timeout)
            if not joined.ok:
                raise HandoffFailed(f"{task.decode_id}: {joined.error}", joined.code or "internal")
        except grpc.aio.AioRpcError as err:
            raise HandoffFailed(
                f"{task.decode_id} at {task.decode_kv_address}: {err.details()}", "unavailable"
            ) from None
        finally:
            call.cancel()

    @staticmethod
    async def _step(awaitable, timeout_s: float):  # noqa: ANN001, ANN205
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except TimeoutError:
            msg = f"decode did not answer within {timeout_s:g} s"
            raise HandoffFailed(msg, "unavailable") from None

    def _export(self, rid: str) -> tuple[bytes, str]:
        """On the engine thread: the prompt's KV and the sampler state; then free the blocks."""
        blob = self.engine.export_kv(rid, partial=True)
        state = base64.b64encode(self.engine.sequence(rid).generator_state).decode()
        self.engine.free(rid)
        return blob, state

    def _error(self, rid: str, message: str, code: str) -> TokenEvent:
        return TokenEvent(
            request_id=rid, index=0, error=message, error_code=code, worker_id=self.service_id
        )

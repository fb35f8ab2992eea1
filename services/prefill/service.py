"""The prefill worker: computes prompts, samples the first token, and hands the KV to the
decode worker the router chose, over gRPC."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from contextlib import AsyncExitStack

import grpc
from opentelemetry.trace import SpanKind, StatusCode

from services.prefill.queue import ArrivalQueue, Ticket
from services.prefill.settings import PrefillSettings
from shared.bus import Bus, subjects
from shared.engine import ops
from shared.engine.interface import (
    Cancelled,
    ImageEmbeds,
    Paused,
    PoolExhausted,
    PrefillRequest,
    Prefix,
    StepOutput,
)
from shared.engine.registry import OWNING
from shared.kvstore.tiers import CachedPrefix
from shared.messages.generate import QUEUE_SHARE, Cancel, GenerateTask, HandoffDone, TaskAck
from shared.messages.heartbeat import Load
from shared.proto import kv_pb2, kv_pb2_grpc
from shared.security import tls
from shared.settings import CommonSettings
from shared.telemetry.metrics import BYTES
from shared.telemetry.tracing import inject, tracer
from shared.worker import ImagesMissing, WorkerService

log = logging.getLogger(__name__)


class HandoffFailed(Exception):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class EngineFailed(Exception):
    """The engine raised computing a batch of prompts. They fail with "engine", so the router
    moves each to another worker at once (and fails one that breaks a second engine too)."""


class PrefillService(WorkerService):
    role = "prefill"

    @classmethod
    def implementation(cls, settings) -> type[WorkerService]:  # noqa: ANN001
        """An engine that owns its KV prefills whole prompts: services/prefill/whole.py."""
        if settings.engine in OWNING:
            from services.prefill.whole import WholePrefill

            return WholePrefill
        return cls

    def __init__(self, common: CommonSettings, settings: PrefillSettings) -> None:
        super().__init__(common, settings)
        self.settings: PrefillSettings = settings
        self.queue = ArrivalQueue()
        self.cancelled: set[str] = set()  # of requests queued or running here
        self.current: set[str] = set()  # requests being computed
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.shipping = asyncio.Semaphore(settings.max_transfers)
        self.transfers: set[asyncio.Task] = set()
        # Tasks whose images' embeddings are on their way: they join the queue, at the place
        # they arrived at, once the embeddings are here.
        self.waiting: dict[str, asyncio.Task] = {}
        self.images: dict[str, tuple[ImageEmbeds, ...]] = {}
        self.prefetched: dict[str, CachedPrefix] = {}  # prefixes read while images came
        # Batch prefills paused for online tasks: the engine holds their sequences; their
        # cached prefixes, for when they go on.
        self.paused: dict[str, CachedPrefix] = {}

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        await self.start_engine(stack, bus)
        await self.serve_tasks(bus, subjects.tasks(self.role, self.service_id), self.on_task)
        worker = asyncio.create_task(self.work())
        stack.callback(worker.cancel)
        stack.push_async_callback(self._close_channels)

    async def _close_channels(self) -> None:
        for channel in self.channels.values():
            await channel.close()

    def load(self) -> Load:
        return self.worker_load(
            inflight=len(self.current) + len(self.transfers),
            queued=self.queue.qsize() + len(self.waiting),
            queued_tokens=self.queued_tokens(),
        )

    def queued_tokens(self) -> int:
        """Work waiting here, for routers that did not send it (there may be several): each
        queued prompt less the leading blocks its memory tier holds."""
        if self.runner is None or self.tiers is None:
            return 0
        bs = self.engine.block_size
        memory = self.tiers.memory
        return sum(
            max(0, len(t.token_ids) - memory.leading(t.block_hashes) * bs) for t in self.queue
        )

    async def drain(self) -> None:
        while self.current or not self.queue.empty() or self.transfers or self.waiting:
            await asyncio.sleep(0.05)

    async def on_task(self, task: GenerateTask) -> TaskAck:
        queued = self.queue.qsize() + len(self.waiting)
        # Each class fills its share of the queue: as it fills, the lowest is refused first.
        room = self.settings.max_queued * QUEUE_SHARE[task.priority]
        if self.status != "ready" or queued >= room:
            return TaskAck(accepted=False, reason="busy", queued=queued)
        if not self.serves(task):
            return TaskAck(accepted=False, reason=f"this worker serves {', '.join(self.models())}")
        self.open_span(
            task.request_id, "prefill", prompt_tokens=len(task.token_ids), images=len(task.images)
        )
        if task.images:
            waiter = asyncio.create_task(self._queue_with_images(task, self.queue.ticket(task)))
            self.waiting[task.request_id] = waiter
            waiter.add_done_callback(lambda _: self.waiting.pop(task.request_id, None))
        else:
            self.queue.put(task)
        return TaskAck(accepted=True, queued=queued)

    async def _queue_with_images(self, task: GenerateTask, ticket: Ticket) -> None:
        try:
            # The cached prefix is read meanwhile (files can take a while), not loaded: the
            # engine's blocks are taken only when the prompt's turn comes.
            self.images[task.request_id], self.prefetched[task.request_id] = await asyncio.gather(
                self.fetch_images(task), self.read_prefix(task)
            )
        except ImagesMissing as err:
            log.warning("%s: %s", task.request_id, err)
            self.close_span(task.request_id, error=str(err))
            await self.send(
                task.reply_subject, self.error_event(task.request_id, str(err), "unavailable")
            )
            return
        self.queue.put(task, ticket)

    async def on_cancel(self, cancel: Cancel) -> None:
        rid = cancel.request_id
        waiter = self.waiting.pop(rid, None)
        if waiter is not None:
            waiter.cancel()
            self.close_span(rid, error="cancelled")
            return
        if rid in self.current or any(t.request_id == rid for t in self.queue):
            self.cancelled.add(rid)

    async def work(self) -> None:
        """Prefill tasks in batches; each KV transfer runs on while the next batch computes."""
        while True:
            batch = await self._next_batch()
            self.current = {t.request_id for t in batch}
            ships: list[tuple[GenerateTask, Awaitable[None]]] = []
            try:
                ships = await self.prefill(batch)
            except Exception as err:  # a failure of the whole batch (the engine thread)
                for task in batch:
                    await self._report(task, err)
            finally:
                self.current = set()
                for task in batch:
                    if task.request_id in self.paused:
                        continue  # back in the queue, its sequence held
                    await self._forget(task)
            for task, ship in ships:
                await self.shipping.acquire()  # a bounded number of transfers at once
                transfer = asyncio.create_task(self._ship_and_report(task, ship))
                self.transfers.add(transfer)
                transfer.add_done_callback(self.transfers.discard)

    async def _forget(self, task: GenerateTask) -> None:
        rid = task.request_id
        self.cancelled.discard(rid)
        self.images.pop(rid, None)
        self.prefetched.pop(rid, None)
        self.paused.pop(rid, None)
        # Queued, not waited for (a KV being shipped must not wait on its blocks' export for
        # the tiers, which frees the sequence itself), at the class of the request's own
        # export calls, so it runs after them; calls queued later run after it.
        self.runner.call(ops.free, rid).add_done_callback(_unread)

    async def _next_batch(self) -> list[GenerateTask]:
        """The next task, and those of its class queued behind it while their prompts
        together fit one prefill chunk (short prompts then share one pass over the weights; a
        higher class's never waits for a lower one's compute in its pass)."""
        batch: list[GenerateTask] = []
        budget = self.settings.prefill_chunk
        while not batch or not self.queue.empty():
            head = self.queue.peek()
            if (
                batch
                and head is not None
                and (len(head.token_ids) > budget or head.priority != batch[0].priority)
            ):
                break
            task = await self.queue.get()
            if task.request_id in self.cancelled or time.time() > task.deadline:
                await self._forget(task)
                self.close_span(task.request_id, error="cancelled or past its deadline")
                continue
            batch.append(task)
            budget -= len(task.token_ids)
            if budget <= 0:
                break
            if len(batch) == 1:
                # Tasks a router sent together arrive together: let the loop read the ones
                # already on the socket, so they share this pass (no waiting beyond that).
                for _ in range(3):
                    await asyncio.sleep(0)
        return batch

    async def _ship_and_report(self, task: GenerateTask, ship: Awaitable[None]) -> None:
        try:
            await ship
        except Exception as err:
            await self._report(task, err)
        finally:
            self.shipping.release()
            self.close_span(task.request_id)

    async def _report(self, task: GenerateTask, err: Exception) -> None:
        rid = task.request_id
        self.close_span(rid, error=str(err) or type(err).__name__)
        if isinstance(err, Cancelled) or getattr(err, "code", "") == "cancelled":
            log.info("%s cancelled", rid)
            return
        at_fault = self.service_id
        if isinstance(err, HandoffFailed):  # decode's doing: the router leaves it out, not us
            log.warning("handoff of %s failed: %s", rid, err)
            code, at_fault = err.code, task.decode_id
        elif isinstance(err, PoolExhausted):
            code = "busy"
        elif isinstance(err, EngineFailed):
            log.warning("%s: %s", rid, err)
            code = "engine"
        else:
            log.error("prefill of %s failed", rid, exc_info=err)
            code = "internal"
        await self.send(task.reply_subject, self.error_event(rid, str(err), code, 0, at_fault))

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self.channels:
            self.channels[address] = tls.channel(address, self.common)
        return self.channels[address]

    async def prefill(
        self, tasks: list[GenerateTask]
    ) -> list[tuple[GenerateTask, Awaitable[None]]]:
        """Reserve room on decode while computing, publish the first tokens; returns what
        ships each KV (none for an answer that its first token finished)."""
        timeout = self.settings.handoff_timeout_s
        calls, reserved = {}, {}
        for task in tasks:
            rid = task.request_id
            stub = kv_pb2_grpc.KvHandoffStub(self._channel(task.decode_kv_address))
            # Decode's span for the request is a child of this worker's.
            metadata = tuple(inject(context=self.span_context(rid)).items())
            calls[rid] = stub.Handoff(metadata=metadata)
            reserved[rid] = asyncio.ensure_future(self._reserve(task, calls[rid], timeout))
        shipping: set[str] = set()
        prefixes: dict[str, Prefix | None] = {}
        try:
            cached: dict[str, CachedPrefix] = {}
            for task in tasks:  # the reservations travel meanwhile
                rid = task.request_id
                self.mark(rid, "picked")
                if rid in self.paused:  # its sequence holds its prefix and what it computed
                    prefixes[rid], cached[rid] = None, self.paused.pop(rid)
                    continue
                read = self.prefetched.pop(rid, None)
                prefixes[rid], cached[rid] = await self.load_prefix(task, read)
            started, started_ns = time.perf_counter(), time.time_ns()
            results, exports = await self._compute(tasks, prefixes)
            took = time.perf_counter() - started
            ended_ns = time.time_ns()
            for task in tasks:  # a batch shares one pass
                reused = len(cached[task.request_id].blobs) * self.engine.block_size
                self.computed(task, reused, started_ns, ended_ns, len(tasks))
            ships = []
            for task, out in zip(tasks, results, strict=True):
                rid = task.request_id
                if isinstance(out, Paused):  # an online task came: it goes first
                    self.paused[rid] = cached[rid]
                    self.queue.put_first(task)
                    continue
                try:
                    await reserved[rid]  # decode's answer came while the prompts computed
                except HandoffFailed as err:  # before any token went out: the router retries
                    out = err
                self.mark(rid, "reserved")
                if isinstance(out, Exception):
                    await self._report(task, out)
                    continue
                hit, first = cached[rid], len(cached[rid].blobs)
                handoff = not out.finish_reason  # else a one-token answer: nothing to ship
                await self.send(task.reply_subject, self.first_token_event(rid, out, hit, took))
                self.mark(rid, "first_sent")
                # The KV decode waits for first; the new blocks for the tiers (later turns)
                # after it, while it ships.
                blob = None
                if handoff:  # (exported already, unless a batch prompt's)
                    blob = exports.pop(rid, None) or self.runner.call(
                        ops.export_kv, rid, partial=True
                    )
                keep = self.tiers is not None and self.tiers.keep
                stored = self.runner.call(ops.export_new, rid, first, self.store_dtype, keep)
                if blob is None:
                    self.close_span(rid)
                    self.store_blocks(task, first, await stored, task.token_ids)
                    continue  # decode's reservation goes with the call
                kv = await blob
                self.mark(rid, "exported")
                done = HandoffDone(first_token=out.token_id, sent_ns=time.time_ns())
                ship = self._ship(task, calls[rid], kv, done)
                ships.append((task, self._stored_after(ship, stored, task, first)))
                shipping.add(rid)
            return ships
        finally:
            for rid, call in calls.items():
                if rid not in shipping:
                    reserved[rid].cancel()
                    call.cancel()
            for prefix in prefixes.values():
                if prefix is not None:  # the sequences hold their own share
                    self.runner.submit(ops.release, prefix)

    async def _reserve(
        self, task: GenerateTask, call: grpc.aio.StreamStreamCall, timeout: float
    ) -> None:
        try:
            await self._step(call.write(kv_pb2.KvChunk(reserve=task.to_bytes())), timeout)
            status = await self._step(call.read(), timeout)
        except grpc.aio.AioRpcError as err:
            raise self._rpc_failed(task, err) from None
        if not status.ok:
            raise HandoffFailed(f"{task.decode_id}: {status.error}", status.code or "busy")

    async def _compute(
        self, tasks: list[GenerateTask], prefixes: dict[str, Prefix | None]
    ) -> tuple[list[StepOutput | Exception], dict[str, asyncio.Future]]:
        """The prompts computed: an output, or what stopped one of them; and each online
        prompt's KV for the handoff, exported by the engine right after the pass (queued
        behind it: the export starts without waiting for this loop to ask, while the first
        tokens go out). An engine that raises fails them all with ``EngineFailed`` (they move
        to another worker)."""
        computing = self._engine_compute(tasks, prefixes)
        exports: dict[str, asyncio.Future] = {}
        for task in tasks:
            if task.priority != "batch":  # (a batch prompt may pause midway: asked after)
                export = self.runner.call(ops.export_kv, task.request_id, partial=True)
                export.add_done_callback(_unread)
                exports[task.request_id] = export
        try:
            results = await computing
        except Exception as err:
            why = str(err) or type(err).__name__
            self.engine_failed("prefill", why, [task.token_ids for task in tasks])
            raise EngineFailed(f"{self.service_id}: prefill failed: {why}") from err
        self.engine_worked()
        return results, exports

    def _engine_compute(
        self, tasks: list[GenerateTask], prefixes: dict[str, Prefix | None]
    ) -> Awaitable[list[StepOutput | Exception]]:
        """One prompt: chunked, cancellable between chunks. Several: one batched pass (the
        engine call queued now, its outcome awaited)."""
        if len(tasks) > 1:
            requests = [
                PrefillRequest(
                    t.request_id,
                    t.token_ids,
                    t.sampling,
                    prefix=prefixes[t.request_id],
                    handoff=True,
                    images=self.images.get(t.request_id, ()),
                )
                for t in tasks
            ]
            return self.runner.call(ops.prefill_batch, requests)
        task = tasks[0]
        rid = task.request_id
        computing = self.runner.call(
            ops.prefill,
            rid,
            task.token_ids,
            task.sampling,
            prefix=prefixes[rid],
            images=self.images.get(rid, ()),
            handoff=True,
            cancelled=lambda: rid in self.cancelled,
            # A batch prompt yields to online tasks between two chunks.
            pause=(lambda: self.queue.online_waiting > 0) if task.priority == "batch" else None,
        )

        async def one() -> list[StepOutput | Exception]:
            try:
                return [await computing]
            except (Cancelled, Paused, PoolExhausted, ValueError) as err:
                return [err]

        return one()

    async def _stored_after(
        self,
        ship: Awaitable[None],
        stored: Awaitable[list[bytes]],
        task: GenerateTask,
        first: int,
    ) -> None:
        """The handoff, then the prompt's new blocks to the tiers: the write is for later
        turns, and must not slow the transfer the answer's second token waits on."""
        try:
            await ship
        finally:
            try:
                blobs = await stored
            except Exception:  # the answer is decode's now: this is only a later turn's loss
                log.exception("new blocks of %s not exported", task.request_id)
            else:
                self.store_blocks(task, first, blobs, task.token_ids)

    async def _ship(
        self, task: GenerateTask, call: grpc.aio.StreamStreamCall, blob: bytes, done: HandoffDone
    ) -> None:
        """Stream the KV in chunks (HTTP/2 flow control paces them), the first token with the
        last (a prompt's KV under a chunk goes in one message)."""
        timeout = self.settings.handoff_timeout_s
        size = self.settings.kv_chunk_bytes
        span = tracer.start_span(
            "kv.transfer",
            context=self.span_context(task.request_id),
            kind=SpanKind.CLIENT,
            attributes={"bytes": len(blob), "to": task.decode_id},
        )
        started = time.perf_counter()
        try:
            offsets = range(0, len(blob), size)
            for offset in offsets[:-1]:
                chunk = kv_pb2.KvChunk(data=blob[offset : offset + size])
                await self._step(call.write(chunk), timeout)
            last = blob[offsets[-1] :] if offsets else b""
            await self._step(call.write(kv_pb2.KvChunk(data=last, done=done.to_bytes())), timeout)
            joined = await self._step(call.read(), timeout)
            took = time.perf_counter() - started
            BYTES.labels("handoff", "out").inc(len(blob))
            span.set_attribute("mb_s", round(len(blob) / max(took, 1e-9) / 1e6, 1))
            if joined is grpc.aio.EOF:
                raise HandoffFailed(f"{task.decode_id} closed the handoff", "cancelled")
            if not joined.ok:
                raise HandoffFailed(f"{task.decode_id}: {joined.error}", joined.code or "internal")
            # Ended on both sides, not cancelled: the decode worker's status sent on a call
            # cancelled under it fails, and gRPC then never frees that send's operations
            # (grpc#43360): small leaks, one a hand-over, that keep the heap from shrinking.
            await self._step(call.done_writing(), timeout)
            await self._step(call.code(), timeout)
        except grpc.aio.AioRpcError as err:
            span.set_status(StatusCode.ERROR, err.details() or "")
            raise self._rpc_failed(task, err) from None
        finally:
            span.end()
            call.cancel()  # (one that ended: nothing to do)

    @staticmethod
    def _rpc_failed(task: GenerateTask, err: grpc.aio.AioRpcError) -> HandoffFailed:
        where = f"{task.decode_id} at {task.decode_kv_address}"
        return HandoffFailed(f"{where}: {err.details()}", "unavailable")

    @staticmethod
    async def _step(awaitable, timeout_s: float):  # noqa: ANN001, ANN205
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except TimeoutError:
            msg = f"decode did not answer within {timeout_s:g} s"
            raise HandoffFailed(msg, "unavailable") from None


def _unread(future: asyncio.Future) -> None:
    """An engine call nobody waits for (a free; an export whose answer ended at its first
    token, or whose prompt failed): its outcome read, so that an error is not reported as
    never retrieved."""
    if not future.cancelled():
        future.exception()

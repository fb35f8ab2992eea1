"""The decode worker: receives KV over gRPC (or prefills short prompts itself), runs the
continuous batch, and publishes each new token to the request's reply subject."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from services.decode.settings import DecodeSettings
from shared.bus import Bus, subjects
from shared.engine import ops
from shared.engine.interface import KVFormatError, PoolExhausted, Prefix, StepOutput
from shared.engine.registry import OWNING
from shared.eplb.balancer import BalancerStats
from shared.kvstore.tiers import CachedPrefix
from shared.messages.generate import (
    Cancel,
    GenerateTask,
    HandoffDone,
    Logprobs,
    PlainTokens,
    TaskAck,
    TokenEvent,
    TokenEvents,
)
from shared.messages.heartbeat import Load
from shared.messages.kvevents import MEMORY
from shared.proto import kv_pb2, kv_pb2_grpc
from shared.security.handoff import HANDOFF_SECRET, handoff_refusal
from shared.security.secret import load_or_create
from shared.security.tls import add_port, grpc_server
from shared.settings import CommonSettings, env_name
from shared.telemetry.metrics import (
    BYTES,
    SPEC_TOKENS,
    EplbCollector,
    register_load,
)
from shared.telemetry.tracing import attached, extract, tracer
from shared.worker import ImagesMissing, WorkerService

log = logging.getLogger(__name__)

OUTBOX_MESSAGE_EVENTS = 4096  # token events per message at most (~0.4 MB, under NATS' 1 MB)
# A handed-off prompt's KV larger than this is written beside the steps (a copy of a few
# milliseconds would stall the batch); a smaller one between two, with its join, in one call
# (each call to the engine is a hop, to its process and back: more than such a copy costs).
WRITE_BESIDE_BYTES = 1 << 20


@dataclass
class Active:
    """A request this worker holds: receiving its KV, prefilling it, or decoding it."""

    task: GenerateTask
    plain: PlainTokens  # its events of a token and nothing else, as JSON
    next_index: int  # position in the answer of the next token to publish
    decode_s: float = 0.0
    kv_bytes: int | None = None  # reported once, on the first event after the handoff
    kv_transfer_s: float | None = None
    cancelled: bool = False
    joined_at: float = 0.0  # perf_counter when it joined the batch (for its time per token)
    # Leading full blocks of prompt + answer sent to the tiers (the prompt's by whoever
    # prefilled it; the answer's here, each as it fills), and their hashes so far.
    stored_blocks: int = 0
    hashes: list[str] = field(default_factory=list)
    writing: asyncio.Future | None = None  # its received KV being written (off the engine)

    @classmethod
    def of(cls, task: GenerateTask, block_size: int, worker_id: str) -> Active:
        n = len(task.token_ids) // block_size
        plain = PlainTokens(task.request_id, worker_id)
        return cls(task, plain, 1, stored_blocks=n, hashes=list(task.block_hashes[:n]))


class DecodeService(WorkerService):
    role = "decode"

    @classmethod
    def implementation(cls, settings) -> type[WorkerService]:  # noqa: ANN001
        """An engine that owns its KV takes whole requests: services/decode/whole.py."""
        if settings.engine in OWNING:
            from services.decode.whole import WholeRequests

            return WholeRequests
        return cls

    def __init__(self, common: CommonSettings, settings: DecodeSettings) -> None:
        super().__init__(common, settings)
        self.settings: DecodeSettings = settings
        self.active: dict[str, Active] = {}
        self.pending = 0  # local prefills accepted, not yet computed
        self.prefills: set[asyncio.Task] = set()
        self.kv_address = ""
        # Token events not yet sent, by router reply subject, in step order: one sender sends
        # what has gathered, so a sender that falls behind sends several steps in one message
        # (the loop's work per step stays an append, and no task is made per step).
        self._outbox: dict[str, list[bytes]] = {}
        self._outbox_filled = asyncio.Event()
        self._spec_seen = (0, 0)  # the engine's speculation totals already in /metrics
        self.eplb: BalancerStats | None = None  # expert placement, as of the last step
        self.handoff_secret = load_or_create(common.resolved_secrets_dir, HANDOFF_SECRET)

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        await self.start_engine(stack, bus, own_process=self.settings.engine_process)
        register_load(EplbCollector(lambda: self.eplb))
        server = grpc_server()
        kv_pb2_grpc.add_KvHandoffServicer_to_server(KvReceiver(self), server)
        address = f"{self.settings.http_host}:{self.settings.kv_port}"
        setting = env_name(DecodeSettings, "kv_port")
        port = add_port(server, address, self.common, True, setting)  # only the mesh pushes KV
        await server.start()
        stack.push_async_callback(server.stop, 1.0)
        self.kv_address = f"{self.settings.advertised_host()}:{port}"
        await self.serve_tasks(bus, subjects.tasks(self.role, self.service_id), self.on_task)
        sender = asyncio.create_task(self._send_outbox())
        stack.push_async_callback(self._stop_sending, sender)
        self.runner.start_stepping(self.publish, self.step_failed)

    def addresses(self) -> dict[str, str]:
        return {**super().addresses(), "kv": self.kv_address}

    def load(self) -> Load:
        return self.worker_load(inflight=len(self.active), queued=self.pending)

    async def drain(self) -> None:
        while self.active or self.pending:
            await asyncio.sleep(0.05)

    # -- work arriving -----------------------------------------------------------------------

    async def on_task(self, task: GenerateTask) -> TaskAck:
        """A short prompt to prefill here (no KV moves)."""
        if self.status != "ready" or self.pending >= self.settings.max_queued:
            return TaskAck(accepted=False, reason="busy", queued=self.pending)
        if not self.serves(task):
            return TaskAck(accepted=False, reason=f"this worker serves {', '.join(self.models())}")
        if task.handover is not None:  # (its KV comes over gRPC, with the first token)
            return TaskAck(accepted=False, reason="a hand-over through the storage tier")
        params = task.sampling
        shared = self.sharable(task)[1]
        if not self.has_room(task) or not self.engine.can_admit(
            len(task.token_ids), params, shared
        ):
            return TaskAck(accepted=False, reason="busy", queued=self.pending)
        self.pending += 1
        self.open_span(task.request_id, "decode", prompt_tokens=len(task.token_ids), local=True)
        prefill = asyncio.create_task(self.prefill_here(task))
        self.prefills.add(prefill)
        prefill.add_done_callback(self.prefills.discard)
        return TaskAck(accepted=True, queued=self.pending - 1)

    def has_room(self, task: GenerateTask) -> bool:
        """Requests of the priority and default classes are taken while the engine can hold
        them; flex and batch work only while it leaves a share of the sequences and the KV
        free for those (batch_share)."""
        if task.priority not in ("flex", "batch"):
            return True
        share = self.settings.batch_share
        stats = self.engine.stats()
        return (
            len(self.active) + self.pending < share * self.settings.max_running
            and stats.kv_blocks_used < share * stats.kv_blocks_total
        )

    async def on_cancel(self, cancel: Cancel) -> None:
        rid = cancel.request_id
        active = self.active.get(rid)
        if active is not None:
            active.cancelled = True
            await self.drop(rid)

    async def drop(self, rid: str) -> None:
        """Forget a request and give its KV blocks back."""
        active = self.active.pop(rid, None)
        if active is not None:
            self.close_span(rid, error="dropped (cancelled, or the handoff did not complete)")
            if active.writing is not None:  # its blocks are freed once nothing writes them
                await asyncio.wait([active.writing])
            # Behind the request's own calls still queued (a reservation): same priority.
            await self.runner.call(ops.abort, rid, priority=active.task.priority)
            self.room_changed()
            log.info("dropped %s", rid)

    # -- the batch ---------------------------------------------------------------------------

    async def prefill_here(self, task: GenerateTask) -> None:
        """A short uncached part of a prompt computed here, between two decode steps (its
        cached prefix loaded from the tiers); its first token is published here, the rest by
        the steps (index 1 on)."""
        rid = task.request_id
        self.active[rid] = active = Active.of(task, self.engine.block_size, self.service_id)
        try:
            images = await self.fetch_images(task) if task.images else ()
        except ImagesMissing as err:
            self.pending -= 1
            self.active.pop(rid, None)
            self.close_span(rid, error=str(err))
            await self.send(task.reply_subject, self.error_event(rid, str(err), "unavailable"))
            return
        prefix, cached = await self.shared_or_loaded(task)
        started_ns = time.time_ns()
        try:
            out, took = await self.runner.call(
                ops.timed_prefill,
                rid,
                task.token_ids,
                task.sampling,
                prefix,
                images,
                priority=task.priority,
            )
            self.computed(
                task, len(cached.blobs) * self.engine.block_size, started_ns, time.time_ns(), 1
            )
        except (PoolExhausted, ValueError) as err:
            self.active.pop(rid, None)
            self.close_span(rid, error=str(err))
            code = "busy" if isinstance(err, PoolExhausted) else "internal"
            await self.send(task.reply_subject, self.error_event(rid, str(err), code))
            return
        except Exception as err:  # the engine failed, not the request: it moves on
            self.active.pop(rid, None)
            self.runner.submit(ops.free, rid)
            why = str(err) or type(err).__name__
            self.close_span(rid, error=f"prefill failed: {why}")
            self.engine_failed("prefill", why, [task.token_ids])
            message = f"{self.service_id}: prefill failed: {why}"
            await self.send(task.reply_subject, self.error_event(rid, message, "engine"))
            return
        finally:
            self.pending -= 1
            if prefix is not None:  # the sequence holds its own share
                self.runner.submit(ops.release, prefix)
        if active.cancelled:
            self.close_span(rid, error="cancelled")
            await self.runner.call(ops.abort, rid)
            return
        active.joined_at = time.perf_counter()
        await self.send(task.reply_subject, self.first_token_event(rid, out, cached, took))
        n_full = len(task.token_ids) // self.engine.block_size
        new = await self.runner.call(
            ops.export_blocks,
            rid,
            len(cached.blobs),
            n_full,
            self.store_dtype,
            priority=task.priority,
        )
        self.store_blocks(task, len(cached.blobs), new, task.token_ids)
        if out.finish_reason and self.active.pop(rid, None) is not None:  # one token: done
            self.close_span(rid, tokens=1, finish_reason=out.finish_reason)
            await self.runner.call(ops.free, rid)

    async def shared_or_loaded(self, task: GenerateTask) -> tuple[Prefix | None, CachedPrefix]:
        """The prompt's cached prefix (held: released after prefill): every block of it that
        can be reused, shared from a sequence held here whose prompt begins with the same
        blocks (another candidate of the same prompt: ``n``), not copied; else the longest
        the tiers hold, loaded."""
        holder, wanted = self.sharable(task)
        if holder:
            prefix = await self.runner.call(
                ops.share_prefix, holder, wanted, priority=task.priority
            )
            if prefix is not None:
                attributes = {"blocks": wanted, "from": holder}
                with tracer.start_as_current_span(
                    "kv.share", context=self.span_context(task.request_id), attributes=attributes
                ):
                    hashes = list(task.block_hashes[:wanted])
                    return prefix, CachedPrefix(hashes, [b""] * wanted, [MEMORY] * wanted)
        return await self.load_prefix(task)

    def sharable(self, task: GenerateTask) -> tuple[str, int]:
        """A sequence held here whose KV holds every block of the task's prompt that can be
        reused (all its full blocks but one token's), and how many that is; ("", 0) when
        none does."""
        wanted = (len(task.token_ids) - 1) // self.engine.block_size  # (a token to compute)
        hashes = task.block_hashes[:wanted]
        if not wanted or len(hashes) < wanted or task.sampling.prompt_logprobs is not None:
            return "", 0
        for rid, other in self.active.items():
            if rid != task.request_id and other.joined_at and other.hashes[:wanted] == hashes:
                return rid, wanted
        return "", 0

    def _store_filled(self, rid: str, active: Active) -> None:
        """The answer's blocks that filled in this step, to the tiers now (not only when it
        ends): a request resumed on another worker after this one fails loads them and
        recomputes only the tail."""
        full = (len(active.task.token_ids) + active.next_index - 1) // self.engine.block_size
        if full <= active.stored_blocks or self.tiers is None or not self.tiers.keep:
            return
        first, active.stored_blocks = active.stored_blocks, full
        done = self.runner.call(ops.export_upto, rid, first, full, self.store_dtype, False)
        store = functools.partial(self._store_answer, active, first, self.span_context(rid))
        done.add_done_callback(store)

    def _store_answer(
        self, active: Active, first: int, context: otel_context.Context, done: asyncio.Future
    ) -> None:
        rid = active.task.request_id
        if done.cancelled() or done.exception() is not None:  # dropped meanwhile
            log.debug("answer blocks of %s not stored: %s", rid, done.exception())
            return
        blobs, tokens = done.result()
        active.hashes = self.store_blocks(active.task, first, blobs, tokens, context, active.hashes)

    def _eplb_attributes(self) -> dict[str, float | int]:
        """The expert placement's state for the decode span (none on a dense model)."""
        if self.eplb is None:
            return {}
        return {
            "eplb_measured": round(self.eplb.measured, 4),
            "eplb_predicted": round(self.eplb.predicted, 4),
            "eplb_replans": self.eplb.replans,
        }

    def step_failed(self, held: list[str], why: str) -> None:
        """A step raised: its requests fail here with "engine", behind the tokens they were
        sent (their blocks are freed already)."""
        prompts = [self.active[rid].task.token_ids for rid in held if rid in self.active]
        self.engine_failed("decode_step", why, prompts)
        for rid in held:
            active = self.active.pop(rid, None)
            if active is None:
                continue
            self.close_span(rid, error=f"decode step failed: {why}")
            message = f"{self.service_id}: decode step failed: {why}"
            event = self.error_event(rid, message, "engine", index=active.next_index)
            self._outbox.setdefault(active.task.reply_subject, []).append(
                TokenEvents.encoded(event)
            )
            self._outbox_filled.set()

    def publish(self, outputs: list[StepOutput], took: float) -> None:
        """A step's tokens as events, sent in order behind the previous step's."""
        self.engine_worked()
        now = time.time()
        stats = self.engine.stats()  # speculation's running totals, into /metrics
        SPEC_TOKENS.labels("drafted").inc(stats.draft_tokens - self._spec_seen[0])
        SPEC_TOKENS.labels("accepted").inc(stats.accepted_tokens - self._spec_seen[1])
        self._spec_seen = (stats.draft_tokens, stats.accepted_tokens)
        self.eplb = stats.eplb
        self.room_changed()
        events = []
        # The step's time is each of its sequences' once (speculating, a step gives some of
        # them several tokens).
        for seq_id in {out.seq_id for out in outputs} & self.active.keys():
            self.active[seq_id].decode_s += took
        for out in outputs:
            active = self.active.get(out.seq_id)
            if active is None:  # cancelled during the step
                continue
            finish = out.finish_reason
            if not finish and now > active.task.deadline:
                finish = "abort"
            plain = not finish and out.logprobs is None and out.stop_string is None
            if plain and active.kv_bytes is None and active.kv_transfer_s is None:
                event = active.plain.event(active.next_index, out.token_id)
            else:
                event = TokenEvents.encoded(
                    TokenEvent(
                        request_id=out.seq_id,
                        index=active.next_index,
                        token_ids=[out.token_id],
                        logprobs=None if out.logprobs is None else [Logprobs.of(out.logprobs)],
                        finish_reason=finish,
                        stop_string=out.stop_string,
                        decode_s=active.decode_s if finish else None,
                        kv_bytes=active.kv_bytes,
                        kv_transfer_s=active.kv_transfer_s,
                        worker_id=self.service_id,
                    )
                )
            events.append((active.task.reply_subject, event))
            if active.next_index == 1:
                self.mark(out.seq_id, "first_step")
            active.next_index += 1
            active.kv_bytes = active.kv_transfer_s = None
            if finish:  # freed on the engine thread before its next step; nobody waits
                del self.active[out.seq_id]
                context = self.span_context(out.seq_id)  # for the answer's "kv.store"
                tokens = active.next_index
                per_token = (time.perf_counter() - active.joined_at) / max(1, tokens - 1)
                self.close_span(
                    out.seq_id,
                    error="aborted: past its deadline" if finish == "abort" else "",
                    tokens=tokens,
                    tpot_ms=round(per_token * 1e3, 3),
                    finish_reason=finish,
                    spec_drafted=out.drafted,
                    spec_accepted=out.accepted,
                    **self._eplb_attributes(),
                )
                if finish == "abort":
                    self.runner.call(ops.abort, out.seq_id).add_done_callback(self.room_changed)
                elif self.tiers is None or not self.tiers.keep:
                    self.runner.call(ops.free, out.seq_id).add_done_callback(self.room_changed)
                else:  # the answer's last blocks are kept, so the next turn reuses them too
                    first = active.stored_blocks
                    done = self.runner.call(
                        ops.export_upto, out.seq_id, first, None, self.store_dtype, True
                    )
                    store = functools.partial(self._store_answer, active, first, context)
                    done.add_done_callback(store)
                    done.add_done_callback(self.room_changed)
            else:
                self._store_filled(out.seq_id, active)
        for subject, event in events:
            self._outbox.setdefault(subject, []).append(event)
        if events:
            self._outbox_filled.set()

    async def _send_outbox(self) -> None:
        """One message per router with every event gathered since the last (a step's, or
        several steps' when sending fell behind), each request's in order."""
        while True:
            await self._outbox_filled.wait()
            self._outbox_filled.clear()
            await self._flush_outbox()

    async def _flush_outbox(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for subject, events in outbox.items():
            for start in range(0, len(events), OUTBOX_MESSAGE_EVENTS):
                await self.send_encoded(subject, events[start : start + OUTBOX_MESSAGE_EVENTS])

    async def _stop_sending(self, sender: asyncio.Task) -> None:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        await self._flush_outbox()  # the last steps' events go out before NATS closes


class KvReceiver(kv_pb2_grpc.KvHandoffServicer):
    """The gRPC end of a KV handoff (see shared/proto/kv.proto for the exchange)."""

    def __init__(self, service: DecodeService) -> None:
        self.svc = service

    async def Handoff(self, request_iterator, context):  # noqa: ANN001, ANN201, N802
        # The call's messages come from an async generator of gRPC's that refers to itself:
        # left suspended (this reads up to `done`, not to the stream's end), it would hold the
        # call and its buffers until the garbage collector's next young pass (minutes apart
        # here: ~0.5 MB a hand-over, ~500 MB between passes). Closed at the end, freed then.
        async with (
            contextlib.aclosing(aiter(request_iterator)) as messages,
            contextlib.aclosing(self._handoff(messages, context)) as statuses,
        ):
            async for status in statuses:
                yield status

    async def _handoff(self, messages, context):  # noqa: ANN001, ANN202
        svc = self.svc
        first = await anext(messages, None)
        if first is None or not first.reserve:
            yield kv_pb2.HandoffStatus(ok=False, code="internal", error="no reserve message")
            return
        task = GenerateTask.from_bytes(first.reserve)
        rid = task.request_id
        why = handoff_refusal(
            svc.handoff_secret, task.handoff_token, rid, svc.service_id, time.time()
        )
        if why:
            log.warning("refused a KV push for %s from %s: %s", rid, context.peer(), why)
            yield kv_pb2.HandoffStatus(ok=False, code="unauthorized", error=f"refused: {why}")
            return
        svc.links.learn(task)  # (only from a task its router signed: where its tokens go)
        if svc.status != "ready" or not svc.serves(task) or not svc.has_room(task):
            yield kv_pb2.HandoffStatus(ok=False, code="busy", error=f"{svc.service_id} not taking")
            return
        params = task.sampling
        if not svc.engine.can_admit(len(task.token_ids), params):
            need = len(task.token_ids) + params.max_tokens
            why = f"KV cache full: {svc.service_id} cannot hold {need} tokens of prompt and answer"
            yield kv_pb2.HandoffStatus(ok=False, code="busy", error=why)
            return
        # The answer is given now and the blocks are taken on the engine thread meanwhile: the
        # prompt's first token waits for this answer, and must not wait for a decode step (long
        # with a big batch). Should the blocks be gone by then, the KV push is refused and the
        # router moves the answer on from its first token.
        reserving = svc.runner.call(
            ops.reserve, rid, task.token_ids, params, priority=task.priority
        )
        reserving.add_done_callback(lambda f: f.cancelled() or f.exception())  # (seen below)
        svc.active[rid] = active = Active.of(task, svc.engine.block_size, svc.service_id)
        with attached(extract(dict(context.invocation_metadata() or ()))):
            svc.open_span(rid, "decode", prompt_tokens=len(task.token_ids))
        joined = False
        try:
            yield kv_pb2.HandoffStatus(ok=True)
            pieces: list[bytes] = []
            started: float | None = None
            started_ns = time.time_ns()
            done: HandoffDone | None = None
            async for chunk in messages:
                if chunk.data:
                    if started is None:
                        started, started_ns = time.perf_counter(), time.time_ns()
                    pieces.append(chunk.data)
                if chunk.done:
                    done = HandoffDone.from_bytes(chunk.done)
                    break
            if done is None:
                return  # prefill gave up (its first token finished the answer, or a cancel)
            if active.cancelled:
                yield kv_pb2.HandoffStatus(ok=False, code="cancelled", error="cancelled")
                return
            took = time.perf_counter() - (started or time.perf_counter())
            if done.sent_ns and pieces:  # from when prefill began to send it
                started_ns = min(started_ns, done.sent_ns)
                took = max(took, (time.time_ns() - started_ns) / 1e9)
            data = pieces[0] if len(pieces) == 1 else b"".join(pieces)  # (one: no copy)
            try:
                await reserving
            except (PoolExhausted, ValueError) as err:
                code = "busy" if isinstance(err, PoolExhausted) else "internal"
                yield kv_pb2.HandoffStatus(ok=False, code=code, error=str(err))
                return
            try:
                if svc.engine.running and len(data) > WRITE_BESIDE_BYTES:
                    # Written on a thread of its own while the batch steps on (its blocks are
                    # this request's alone): between two steps only the join waits, not the
                    # copy.
                    active.writing = asyncio.ensure_future(
                        svc.runner.beside(ops.write_kv, rid, data)
                    )
                    await active.writing
                    joined_ns = await svc.runner.call(
                        ops.join, rid, done.first_token, priority=task.priority
                    )
                else:  # written and joined in one call between two steps: one hop less
                    active.writing = svc.runner.call(
                        ops.write_and_join, rid, data, done.first_token
                    )
                    joined_ns = await active.writing
            except KVFormatError as err:
                yield kv_pb2.HandoffStatus(ok=False, code="internal", error=str(err))
                return
            active.kv_bytes, active.kv_transfer_s = len(data), took
            active.joined_at = time.perf_counter()
            svc.mark(rid, "joined", joined_ns)
            BYTES.labels("handoff", "in").inc(len(data))
            mb_s = round(len(data) / max(took, 1e-9) / 1e6, 1)
            span = tracer.start_span(
                "kv.receive",
                context=svc.span_context(rid),
                start_time=started_ns,
                attributes={"bytes": len(data), "mb_s": mb_s},
            )
            span.end(end_time=started_ns + int(took * 1e9))
            joined = True
            log.debug("%s joined: %d KV bytes in %.1f ms", rid, len(data), took * 1e3)
            yield kv_pb2.HandoffStatus(ok=True)
        finally:
            if not joined and rid in svc.active:
                # Not awaited here: this may run while the call is being cancelled.
                asyncio.get_running_loop().create_task(svc.drop(rid))

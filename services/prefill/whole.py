"""A prefill worker whose engine owns its KV (vLLM, SGLang): P/D with such engines on both
sides. (SGLang's own P/D, where the engines move the KV themselves, is ``with_peer``; what
follows is the hand-over through the storage tier, vLLM's and SGLang's otherwise.)

The engine computes the prompt and samples the first token; its storage connector writes the
prompt's full blocks to the storage tier meanwhile (``shared/engine/vllm/connector.py``). The
first token goes to the router at once (time to first token is this worker's); once the
blocks are in the tier, the request goes to the decode worker the router chose, with that
token: the decode engine's own connector loads the prompt's blocks from the tier and computes
only the partial last block and the token, then streams the rest of the answer.

vLLM keeps no sampler state a request could carry across the split, so a request whose answer
depends on it (a seed with temperature, penalties counting the answer's tokens, a grammar
over the whole answer: ``SamplingParams.continues_as_prompt``) has its first token sampled by
decode too: the token computed here only makes the KV, and the client's first token is
decode's (the same answer as decoded in one place, a step later).

The KV travels through the tier, not a stream between the two: the bytes are written once
(into the page cache of the shared file system) and the decode engine reads them straight into
its cache in its own process, where a stream would arrive in the worker's process and still
have to reach the engine's. The tier is therefore required here (``kv_store``). When the
blocks are not all there within ``handoff_timeout_s`` (a write skipped under load), the
request goes on anyway: decode computes what it does not find.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import replace

from opentelemetry.trace import SpanKind

from services.prefill.settings import PrefillSettings
from shared.bus import BusError, subjects
from shared.engine.interface import Generated
from shared.kvstore.backend import FileStore
from shared.messages.generate import (
    RANKS,
    Bootstrap,
    Cancel,
    GenerateTask,
    Handover,
    Logprobs,
    TaskAck,
    TokenEvent,
)
from shared.owning_worker import OwningWorker
from shared.service import ServiceSettings
from shared.settings import CommonSettings, SettingsError, env_name
from shared.telemetry.tracing import tracer

log = logging.getLogger(__name__)

TIER_POLL_S = 0.002  # between looks for the blocks still being written


class WholePrefill(OwningWorker):
    role = "prefill"

    @classmethod
    def check(cls, common: CommonSettings, settings: ServiceSettings) -> None:
        super().check(common, settings)
        assert isinstance(settings, PrefillSettings)
        if not settings.kv_store and not settings.pd_transfer:  # (SGLang's own P/D needs none)
            raise SettingsError(
                f"{env_name(PrefillSettings, 'kv_store')}=false with "
                f"{env_name(PrefillSettings, 'engine')}={settings.engine}: the prompt's KV "
                "reaches the decode worker through the storage tier, which must be on"
            )

    def __init__(self, common: CommonSettings, settings: PrefillSettings) -> None:
        super().__init__(common, settings)
        self.settings: PrefillSettings = settings
        self.store = FileStore(common.resolved_kv_store_dir)
        self.cancelled: set[str] = set()  # of the requests being answered here

    async def on_cancel(self, cancel: Cancel) -> None:
        if cancel.request_id in self.answers:  # (its hand-over, if not yet made, is not)
            self.cancelled.add(cancel.request_id)
        await super().on_cancel(cancel)

    async def answer(self, task: GenerateTask) -> None:
        assert self.owning is not None
        try:
            if self.owning.peer_address():
                await self.with_peer(task, self.owning.peer_address())
            else:
                await self.prefill(task)
        finally:
            self.cancelled.discard(task.request_id)

    async def with_peer(self, task: GenerateTask, address: str) -> None:
        """SGLang's own P/D: the decode worker is handed the request at once, with a room at
        this engine's bootstrap server; the two engines then compute it together, this one
        the prompt (sending its KV as it goes), that one the answer. The reuse figures go to
        the router from here once the prompt is done (an event with no tokens)."""
        assert self.owning is not None
        rid, started = task.request_id, time.perf_counter()
        host, _, port = address.rpartition(":")
        boot = Bootstrap(host=host, port=int(port), room=secrets.randbits(63))
        pieces = self.owning.generate(
            rid, task.token_ids, task.sampling, task.salt, task.retention,
            (boot.host, boot.port, boot.room), RANKS[task.priority],
        )  # fmt: skip
        computing = asyncio.create_task(_all(pieces))
        rest = task.model_copy(update={"handover": Handover(bootstrap=boot)})
        with tracer.start_as_current_span(
            "kv.handoff",
            context=self.span_context(rid),
            kind=SpanKind.CLIENT,
            attributes={"to": task.decode_id, "via": "sglang", "room": boot.room},
        ):
            ack = await self.ask_decode(task, rest)
        if not ack.accepted:
            await self.owning.abort(rid)
            await asyncio.gather(computing, return_exceptions=True)
            await self.decode_refused(task, ack, [])
            return
        try:
            done = await computing
        except Exception as err:
            log.exception("prefill of %s failed", rid)
            self.close_span(rid, error=str(err))
            await self.send(task.reply_subject, self.error_event(rid, str(err), "unavailable"))
            return
        first, last = done[0], done[-1]
        self.computed(len(task.token_ids), first.cached_tokens)
        event = TokenEvent(
            request_id=rid,
            index=0,
            token_ids=[],
            cached_tokens=first.cached_tokens,
            cached_by_tier=last.cached_by_tier,
            prefill_s=time.perf_counter() - started,
            worker_id=self.service_id,
        )
        await self.send(task.reply_subject, event)
        self.close_span(rid, tokens=0)

    async def prefill(self, task: GenerateTask) -> None:
        assert self.owning is not None
        rid, started = task.request_id, time.perf_counter()
        one = replace(task.sampling, max_tokens=1)
        pieces: list[Generated] = []
        try:
            pieces = [
                p
                async for p in self.owning.generate(
                    rid, task.token_ids, one, task.salt, task.retention, rank=RANKS[task.priority]
                )
            ]
        except Exception as err:
            log.exception("prefill of %s failed", rid)
            self.close_span(rid, error=str(err))
            code = "internal" if isinstance(err, ValueError) else "unavailable"
            await self.send(task.reply_subject, self.error_event(rid, str(err), code))
            return
        took = time.perf_counter() - started
        first, last = pieces[0], pieces[-1]
        self.computed(len(task.token_ids), first.cached_tokens)
        if last.finish_reason == "abort" or rid in self.cancelled:  # nobody waits for it
            self.close_span(rid, error="cancelled")
            return
        # The first token goes to the client now when decode can go on after it as if it
        # had sampled it; else decode samples every token (the one here only made the KV).
        keep = task.sampling.continues_as_prompt
        tokens = [t for p in pieces for t in p.token_ids] if keep else []
        ended = keep and (last.finish_reason == "stop" or task.sampling.max_tokens <= len(tokens))
        logprobs = [lp for p in pieces for lp in p.logprobs or ()] if first.logprobs else None
        event = TokenEvent(
            request_id=rid,
            index=0,
            token_ids=tokens,
            logprobs=None if logprobs is None or not keep else [Logprobs.of(lp) for lp in logprobs],
            prompt_logprobs=None
            if first.prompt_logprobs is None
            else [Logprobs.of(lp) for lp in first.prompt_logprobs],
            finish_reason=last.finish_reason if ended else None,
            stop_string=last.stop_string if ended else None,
            cached_tokens=first.cached_tokens,
            cached_by_tier=last.cached_by_tier,
            prefill_s=took,
            worker_id=self.service_id,
        )
        await self.send(task.reply_subject, event)
        if ended:
            self.close_span(rid, tokens=len(tokens))
            return
        await self.hand_over(task, tokens, last.stored)

    async def hand_over(self, task: GenerateTask, sent: list[int], stored: list[str]) -> None:
        """Once the prompt's blocks are in the tier, the rest of the request to decode."""
        rid = task.request_id
        with tracer.start_as_current_span(
            "kv.handoff",
            context=self.span_context(rid),
            kind=SpanKind.CLIENT,
            attributes={"to": task.decode_id, "via": "storage tier", "blocks": len(stored)},
        ) as span:
            waited = await self.in_tier(stored, self.settings.handoff_timeout_s)
            span.set_attribute("tier_wait_s", round(waited, 4))
            if rid in self.cancelled:
                self.close_span(rid, error="cancelled")
                return
            rest = task.model_copy(update={"handover": Handover(answer_ids=sent)})
            ack = await self.ask_decode(task, rest)
        if ack.accepted:
            self.close_span(rid, tokens=len(sent))
            return
        await self.decode_refused(task, ack, sent)

    async def ask_decode(self, task: GenerateTask, rest: GenerateTask) -> TaskAck:
        """The decode worker the router chose asked to take the rest of the request."""
        subject = subjects.handovers(task.decode_id)
        try:
            return await self.bus.ask(subject, rest, TaskAck, self.settings.handoff_timeout_s)
        except BusError as err:
            return TaskAck(accepted=False, reason=f"did not answer: {err}")

    async def decode_refused(self, task: GenerateTask, ack: TaskAck, sent: list[int]) -> None:
        """The router moves the answer on from the tokens it has (the decode worker's fault
        when it did not answer; none when it was busy)."""
        rid = task.request_id
        self.close_span(rid, error=f"{task.decode_id}: {ack.reason}")
        code = "busy" if ack.reason == "busy" else "unavailable"
        failed = TokenEvent(
            request_id=rid,
            index=len(sent),
            error=f"decode {task.decode_id} did not take the request: {ack.reason}",
            error_code=code,
            worker_id=task.decode_id,
        )
        await self.send(task.reply_subject, failed)

    async def in_tier(self, hashes: list[str], timeout_s: float) -> float:
        """Wait until the blocks are in the storage tier (at most ``timeout_s``); returns
        the seconds waited."""
        started = time.monotonic()
        missing = [h for h in hashes if h not in self.store]
        while missing:
            waited = time.monotonic() - started
            if waited >= timeout_s:
                log.warning(
                    "%d of %d blocks not in the storage tier after %.1f s: decode computes them",
                    len(missing),
                    len(hashes),
                    waited,
                )
                break
            await asyncio.sleep(TIER_POLL_S)
            missing = [h for h in missing if h not in self.store]
        return time.monotonic() - started


async def _all(pieces: AsyncIterator[Generated]) -> list[Generated]:
    return [p async for p in pieces]

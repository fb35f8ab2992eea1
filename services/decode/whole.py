"""A decode worker whose engine owns its KV (vLLM, SGLang: ``shared.engine.interface.
OwningEngine``).
It takes whole requests (the router sends a model's short prompts here, and all of them when
the model has no prefill worker) and streams each answer to the request's reply subject as the
engine gives it. It also takes the rest of an answer a prefill worker of the same kind began
(P/D, ``services/prefill/whole.py``): the prompt's KV is in the storage tier by then, where
this engine's storage connector loads it, and the answer goes on after the tokens already
sent; or, in SGLang's own P/D (``Handover.bootstrap``), this engine fetches the KV from the
prefill worker's engine itself. A decode worker in SGLang's own P/D takes nothing else
(``pd_only``). Everything around the engine is ``shared/owning_worker.py``'s."""

from __future__ import annotations

import logging
import time
from contextlib import AsyncExitStack

from services.decode.settings import DecodeSettings
from shared.bus import Bus, subjects
from shared.messages.generate import RANKS, GenerateTask, Logprobs, TaskAck, TokenEvent
from shared.owning_worker import OwningWorker
from shared.security.handoff import HANDOFF_SECRET, handoff_refusal
from shared.security.secret import load_or_create
from shared.settings import CommonSettings

log = logging.getLogger(__name__)


class WholeRequests(OwningWorker):
    role = "decode"

    def __init__(self, common: CommonSettings, settings: DecodeSettings) -> None:
        super().__init__(common, settings)
        # The mesh's: a hand-over is taken only with the token the router made with it.
        self.handoff_secret = load_or_create(common.resolved_secrets_dir, HANDOFF_SECRET)

    async def start(self, stack: AsyncExitStack, bus: Bus) -> None:
        await super().start(stack, bus)
        await self.serve_tasks(bus, subjects.handovers(self.service_id), self.on_handover)

    async def on_handover(self, task: GenerateTask) -> TaskAck:
        if task.handover is None:
            return TaskAck(accepted=False, reason="not a hand-over")
        if self.pd_only != (task.handover.bootstrap is not None):
            why = "its engine takes KV from a prefill engine" if self.pd_only else "no peer"
            return TaskAck(accepted=False, reason=f"not this worker's kind of hand-over ({why})")
        return await self.on_task(task)

    def refusal(self, task: GenerateTask) -> str:
        """A prefill worker's hand-over (on its own subject) comes with the router's token
        for this worker; the router's own tasks have none to carry."""
        if task.handover is not None:
            why = handoff_refusal(
                self.handoff_secret,
                task.handoff_token,
                task.request_id,
                self.service_id,
                time.time(),
            )
            if why:
                log.warning("refused the hand-over of %s: %s", task.request_id, why)
                return f"refused: {why}"
        elif self.pd_only:  # (a router's own task: it cannot prefill alone)
            return "this decode worker takes only hand-overs from SGLang prefill workers"
        return super().refusal(task)

    async def answer(self, task: GenerateTask) -> None:
        """Stream the answer: the first event with what the engine's cache had (a prefill
        worker's hand-over: after the tokens it sent, the reuse figures being its), then each
        piece as it comes; an error before the first token is the router's to retry."""
        assert self.owning is not None
        rid, started = task.request_id, time.perf_counter()
        handover = task.handover
        sent = handover.answer_ids if handover is not None else []
        index, first_at = len(sent), started
        prompt, params = task.token_ids, task.sampling
        if sent:
            prompt = [*task.token_ids, *sent]
            params = params.resumed(len(sent))
        boot = handover.bootstrap if handover is not None else None
        peer = (boot.host, boot.port, boot.room) if boot is not None else None
        try:
            rank = RANKS[task.priority]
            pieces = self.owning.generate(
                rid, prompt, params, task.salt, task.retention, peer, rank
            )
            async for piece in pieces:
                if not piece.token_ids and piece.finish_reason is None:
                    continue
                figures: dict = {}
                if index == len(sent):
                    first_at = time.perf_counter()
                    if handover is not None:  # (the reuse figures are the prefill worker's)
                        figures = dict(kv_transfer_s=first_at - started)
                    else:
                        self.computed(len(prompt), piece.cached_tokens)
                        figures = dict(
                            cached_tokens=piece.cached_tokens,
                            cached_by_tier={"memory": piece.cached_tokens},
                            prefill_s=first_at - started,
                        )
                if piece.finish_reason is not None:
                    figures["decode_s"] = time.perf_counter() - first_at
                    if piece.cached_by_tier is not None and handover is None:
                        figures["cached_by_tier"] = piece.cached_by_tier
                event = TokenEvent(
                    request_id=rid,
                    index=index,
                    token_ids=piece.token_ids,
                    logprobs=None
                    if piece.logprobs is None
                    else [Logprobs.of(lp) for lp in piece.logprobs],
                    prompt_logprobs=None
                    if piece.prompt_logprobs is None
                    else [Logprobs.of(lp) for lp in piece.prompt_logprobs],
                    finish_reason=piece.finish_reason,
                    stop_string=piece.stop_string,
                    worker_id=self.service_id,
                    **figures,
                )
                index += len(piece.token_ids)
                await self.send(task.reply_subject, event)
            self.close_span(rid, tokens=index - len(sent))
        except ValueError as err:  # what the engine cannot take (the request's, not ours)
            self.close_span(rid, error=str(err))
            await self.send(task.reply_subject, self.error_event(rid, str(err), "internal"))
        except Exception as err:
            log.exception("%s failed", rid)
            self.close_span(rid, error=str(err))
            code = "unavailable" if index == len(sent) else "internal"
            await self.send(task.reply_subject, self.error_event(rid, str(err), code))

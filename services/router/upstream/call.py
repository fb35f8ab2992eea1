"""One attempt at a request on a server kvmesh did not start: the prompt's token ids and the
sampling parameters as the server's own API takes them, its streamed answer as token events.

vLLM's server takes them on ``/v1/completions`` with the prompt as token ids; the answer's
token ids come as its log-probabilities' tokens (``logprobs`` with
``return_tokens_as_token_ids``: ``token_id:N``; ``return_token_ids`` would send the whole prompt
back in the first chunk, half a megabyte for a long agent turn), the
tenant's salt as its ``cache_salt`` (its prefix cache keeps tenants apart, and its KV events
carry the salt, so the blocks it reports are the router's hashes) and the retention class in
``vllm_xargs`` (kvmesh's storage connector, where the server runs it, reads it there). The
call's answer comes back through the same path as a worker's token events (``deliver``): the
dispatcher cannot tell an upstream's answer from a worker's.

The task is taken (the worker's ack) when the server answers the request's headers with 200;
429 and 503 are busy (the next server is tried); another 4xx is the client's error, said as the
server said it. A stream that breaks, or ends without a finish, is the server's failure: the
request moves on from the tokens sent. Cancelling the call closes its connection, which aborts
the request on the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from services.router.dispatch.job import Job
from services.router.errors import ApiError
from shared.bus import BusError
from shared.messages.generate import Logprobs, TaskAck, TokenEvent
from shared.model.grammar import lark_of

log = logging.getLogger(__name__)

FINISHES = ("stop", "length", "abort")


def completion_body(job: Job, served: str) -> dict:
    """The request as vLLM's /v1/completions takes it: token ids in, token ids out."""
    p = job.sampling
    body: dict = {
        "model": served,
        "prompt": job.prompt_ids,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": p.logprobs or 0,
        "return_tokens_as_token_ids": True,
        "vllm_xargs": {"kvmesh_retention": job.retention},
    }
    optional = {
        "top_k": p.top_k or None,
        "seed": p.seed,
        "stop_token_ids": list(p.stop_token_ids) or None,
        "stop": list(p.stop) or None,
        "ignore_eos": p.ignore_eos or None,
        "logit_bias": {str(t): b for t, b in p.logit_bias} or None,
        "presence_penalty": p.presence_penalty or None,
        "frequency_penalty": p.frequency_penalty or None,
        "cache_salt": job.salt or None,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if p.grammar is not None:
        body["structured_outputs"] = {"grammar": lark_of(p.grammar)}
    return body


def token_id(key: str) -> int:
    """A token as vLLM's log-probabilities name it with ``return_tokens_as_token_ids``."""
    return int(key.removeprefix("token_id:"))


def tokens_of(choice: dict) -> list[int]:
    """A chunk's new token ids (its log-probabilities' tokens)."""
    return [token_id(t) for t in (choice.get("logprobs") or {}).get("tokens") or ()]


def logprobs_of(choice: dict, wanted: int | None) -> list[Logprobs] | None:
    """Each new token's log-probability and the ``wanted`` most likely, from a chunk's."""
    lp = choice.get("logprobs")
    if wanted is None or not lp:
        return None
    out = []
    pairs = zip(lp.get("token_logprobs") or [], lp.get("top_logprobs") or [], strict=False)
    for chosen, top in pairs:
        ranked = sorted(((token_id(k), v) for k, v in (top or {}).items()), key=lambda x: -x[1])
        ranked = ranked[:wanted]
        out.append(
            Logprobs(
                logprob=chosen, top_ids=[t for t, _ in ranked], top_logprobs=[v for _, v in ranked]
            )
        )
    return out


class Call:
    """The request's attempt on one server, streaming until its last token (a task)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        served: str,
        worker_id: str,
        job: Job,
        deliver: Callable[[list[TokenEvent]], None],
        timeout_s: float,
    ) -> None:
        self.session = session
        self.url = url
        self.served = served
        self.worker_id = worker_id
        self.job = job
        self.deliver = deliver
        self.timeout_s = timeout_s
        self.acked: asyncio.Future[TaskAck] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None
        self.last: TokenEvent | None = None  # the finishing event, held for the usage after it

    async def start(self) -> TaskAck:
        """Send it; the server's answer to it as a worker's ack (BusError: no answer)."""
        self.task = asyncio.create_task(self._run())
        return await self.acked

    def cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def _run(self) -> None:
        rid = self.job.request_id
        sent = time.monotonic()
        try:
            async with self.session.post(
                f"{self.url}/v1/completions",
                json=completion_body(self.job, self.served),
                timeout=aiohttp.ClientTimeout(sock_connect=self.timeout_s),
            ) as response:
                if not await self._taken(response):
                    return
                await self._stream(response, sent)
        except asyncio.CancelledError:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            why = f"upstream {self.worker_id}: {type(err).__name__}: {err}"
            if not self.acked.done():
                self.acked.set_exception(BusError(why))
            elif self.last is not None:  # (lost after the answer's end: it is whole)
                self.deliver([self.last])
            else:
                self._error(rid, why)
        finally:
            if not self.acked.done():  # (cancelled before the server answered)
                self.acked.set_result(TaskAck(accepted=False, reason="cancelled"))

    async def _taken(self, response: aiohttp.ClientResponse) -> bool:
        """Whether the server took the request: its status as an ack."""
        if response.status == 200:
            self.acked.set_result(TaskAck(accepted=True))
            return True
        text = (await response.text())[:500]
        if response.status in (429, 503):
            self.acked.set_result(TaskAck(accepted=False, reason="busy"))
        elif 400 <= response.status < 500:
            self.acked.set_exception(
                ApiError(400, f"the upstream server refused the request: {message_of(text)}")
            )
        else:
            self.acked.set_exception(BusError(f"HTTP {response.status}: {message_of(text)}"))
        return False

    async def _stream(self, response: aiohttp.ClientResponse, sent: float) -> None:
        rid, wanted = self.job.request_id, self.job.sampling.logprobs
        index, first = 0, True
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                self._error(rid, f"upstream {self.worker_id}: {message_of(json.dumps(chunk))}")
                return
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            for choice in chunk.get("choices") or ():
                ids = tokens_of(choice)
                finish = choice.get("finish_reason")
                stop = choice.get("stop_reason")
                event = TokenEvent(
                    request_id=rid,
                    index=index,
                    token_ids=ids,
                    logprobs=logprobs_of(choice, wanted),
                    finish_reason=finish if finish in FINISHES else ("stop" if finish else None),
                    stop_string=stop if isinstance(stop, str) else None,
                    prefill_s=time.monotonic() - sent if first else None,
                    worker_id=self.worker_id,
                )
                index, first = index + len(ids), False
                if finish:
                    self.last = event  # (its usage, with the cached tokens, comes next)
                    continue
                self.deliver([event])
            if self.last is not None and usage:
                self.deliver([self.last.model_copy(update={"cached_tokens": cached})])
                return
        if self.last is not None:
            self.deliver([self.last])
            return
        self._error(rid, f"upstream {self.worker_id}: the answer ended without a finish")

    def _error(self, rid: str, why: str) -> None:
        log.warning("%s: %s", rid, why)
        self.deliver(
            [
                TokenEvent(
                    request_id=rid,
                    index=-1,
                    error=why,
                    error_code="unavailable",
                    worker_id=self.worker_id,
                )
            ]
        )


def message_of(text: str) -> str:
    """An error body's message (OpenAI's shape, or FastAPI's ``detail``), else the text."""
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        body = json.loads(text)
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message") or error.get("detail") or text)
        return str(body.get("detail") or error)
    return text

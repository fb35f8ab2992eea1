"""One attempt at a request on a server kvmesh did not start: the prompt's token ids and the
sampling parameters as the server's own API takes them (``protocols.py``), its streamed answer
as token events. They come back through the same path as a worker's (``deliver``): the
dispatcher cannot tell an upstream's answer from a worker's.

The first token's event says the prompt tokens the router's index expected the server to reuse
(its own cache, and the storage tier its connector reads): the routing policy learns the
prefill from it, and the server says how many it did reuse only with its last (the usage,
where the server was started with ``--enable-prompt-tokens-details``), which the answer's usage
reports.

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
from services.router.upstream.protocols import Protocol
from shared.bus import BusError
from shared.messages.generate import TaskAck, TokenEvent

log = logging.getLogger(__name__)


NO_PROMPT_SCORES = (
    "prompt_logprobs (or echo with logprobs): not served by the servers behind this router "
    "(their streamed answers carry no prompt log-probabilities)"
)


class Call:
    """The request's attempt on one server, streaming until its last token (a task)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        protocol: Protocol,
        served: str,
        worker_id: str,
        job: Job,
        deliver: Callable[[list[TokenEvent]], None],
        timeout_s: float,
        reuse: dict[str, int],
    ) -> None:
        self.session = session
        self.url = url
        self.protocol = protocol
        self.served = served
        self.worker_id = worker_id
        self.job = job
        self.deliver = deliver
        self.timeout_s = timeout_s
        self.reuse = reuse  # the prompt tokens the router expects it to reuse, by tier
        self.acked: asyncio.Future[TaskAck] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task | None = None
        self.last: TokenEvent | None = None  # the finishing event, held for the usage after it

    async def start(self) -> TaskAck:
        """Send it; the server's answer to it as a worker's ack (BusError: no answer)."""
        if self.job.sampling.prompt_logprobs is not None:
            raise ApiError(400, NO_PROMPT_SCORES, param="prompt_logprobs")
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
                f"{self.url}{self.protocol.path}",
                json=self.protocol.body(self.job, self.served),
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
            cached = self.protocol.cached(chunk)
            for piece in self.protocol.pieces(chunk, wanted):
                ids, finish = piece.token_ids, piece.finish
                event = TokenEvent(
                    request_id=rid,
                    index=index,
                    token_ids=ids,
                    logprobs=piece.logprobs,
                    finish_reason=finish,  # type: ignore[arg-type]
                    stop_string=piece.stop,
                    prefill_s=time.monotonic() - sent if first else None,
                    worker_id=self.worker_id,
                    # (what the router expects it reused: the server says only at the end)
                    cached_tokens=sum(self.reuse.values()) if first and self.reuse else None,
                    cached_by_tier=self.reuse if first and self.reuse else None,
                )
                index, first = index + len(ids), False
                if finish:
                    self.last = event  # (its usage, with the cached tokens, comes next)
                    continue
                self.deliver([event])
            if self.last is not None and self.protocol.ends(chunk):
                said = {"cached_tokens": cached, "cached_by_tier": None}  # (the server's own)
                self.deliver([self.last.model_copy(update=said if cached is not None else {})])
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

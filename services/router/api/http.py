"""The generation endpoints over HTTP: every endpoint of the format table
(``formats/endpoints.py``: OpenAI's Chat Completions, Completions and Responses, Anthropic's
Messages) and Anthropic's token count; JSON answers or server-sent events.

Each request goes one way: its format's adapter makes the conversation, the preparer checks
and renders it, the answers run it, and the same format's writer writes the answer. The
envelope (``middleware.py``) has already identified and admitted it, and renders its errors.
aiohttp cancels a handler whose client disconnected (handler_cancellation); closing the delta
stream then cancels the request on its workers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

from aiohttp import web

from services.router.api.middleware import GENERATE, TENANT, Route, current
from services.router.errors import ApiError
from services.router.formats.endpoints import (
    COUNT_TOKENS,
    ENDPOINTS,
    Endpoint,
    count_conversation,
    count_error_body,
)
from services.router.observe.recorder import request_ids
from services.router.request.answer import Answers, Delta, Writer
from services.router.request.prepare import Prepared, Preparer
from services.router.settings import ApiSettings
from services.router.tenancy.admission import KvOptions
from services.router.tenancy.keys import Caller
from shared.telemetry.tracing import mark_span

log = logging.getLogger(__name__)

CACHE_HEADER = "x-kvmesh-cache"  # why the prompt missed the cache (a whole answer's)


def cache_header(explained: dict) -> str:
    """The x-kvmesh-cache header's value: the explanation's figures as key=value pairs."""
    keys = ("kind", "field", "char", "first_uncached_block", "message", "part", "cached_tokens")
    return "; ".join(f"{k}={explained[k]}" for k in keys if explained.get(k) is not None)


class HttpApi:
    def __init__(
        self, preparer: Preparer, answers: Answers, settings: ApiSettings, max_body_bytes: int
    ) -> None:
        self.preparer = preparer
        self.answers = answers
        self.settings = settings
        self.max_body_bytes = max_body_bytes

    def routes(self) -> list[Route]:
        generation = [
            (web.post(e.path, self._handler(e)), replace(GENERATE, errors=e.error_body))
            for e in ENDPOINTS.values()
        ]
        counting = replace(TENANT, errors=count_error_body)
        return [*generation, (web.post(COUNT_TOKENS, self.count_tokens), counting)]

    def _handler(self, endpoint: Endpoint):  # noqa: ANN202 (a route's handler)
        async def generate(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, endpoint)

        return generate

    async def generate(self, request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
        call = current()
        conv = endpoint.adapter(await self._body(request))
        p = await self.preparer.prepare(conv, call.rid, call.kv)
        mark_span("prepared")
        call.outcome.prepared = p
        writer = endpoint.writer(p)
        if conv.stream:
            return await self._stream(request, p, writer)
        return await self._whole(p, writer)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count: the prompt's tokens exactly, by the same renderer."""
        call = current()
        conv = count_conversation(await self._body(request))
        count = await self.preparer.count(conv, call.kv)
        return web.json_response({"input_tokens": count}, headers=request_ids(call.rid))

    async def answer(self, path: str, body: bytes, rid: str, tenant: str) -> dict:
        """A batch line: the whole answer's body as the endpoint at ``path`` gives it,
        computed at the batch priority (ApiError as that endpoint would answer it)."""
        endpoint = ENDPOINTS[path]
        conv = endpoint.adapter(body)
        if conv.stream:
            raise ApiError(400, "stream: a batch line cannot stream", param="stream")
        kv = KvOptions(retention="chat", tenant=tenant, caller=Caller(tenant=tenant))
        p = await self.preparer.prepare(conv, rid, kv, priority="batch")
        return await self._whole_body(p, endpoint.writer(p))

    async def _whole_body(self, p: Prepared, writer: Writer) -> dict:
        deltas = self.answers.deltas(p)
        choices: dict[int, list[Delta]] = {}
        try:
            async for delta in deltas:
                choices.setdefault(delta.index, []).append(delta)
        finally:
            await deltas.aclose()  # on a disconnect: cancels the request on its workers
        answers = [Delta.joined(choices[i]) for i in sorted(choices)]
        assert all(a.finish_reason for a in answers)
        return writer.whole(answers)

    async def _whole(self, p: Prepared, writer: Writer) -> web.Response:
        body = await self._whole_body(p, writer)
        headers = request_ids(p.job.request_id)
        if p.timing.cache_miss:
            headers[CACHE_HEADER] = cache_header(p.timing.cache_miss)
        return web.json_response(body, headers=headers)

    async def _stream(
        self, request: web.Request, p: Prepared, writer: Writer
    ) -> web.StreamResponse:
        """The answer as server-sent events. An error before the first token is a plain HTTP
        error, unless the first token is so long in coming (a long prefill) that the stream
        opened to keep the client's connection alive; after that, errors go in the stream."""
        deltas = self.answers.deltas(p)
        first = asyncio.ensure_future(anext(deltas))
        resp: web.StreamResponse | None = None
        try:
            while not (await asyncio.wait({first}, timeout=self.settings.stream_ping_s))[0]:
                if resp is None:
                    resp = await self._open(request, p, writer.start())
                await resp.write(writer.ping())
            try:
                delta = first.result()
            except ApiError as err:
                if resp is None:
                    raise
                return await self._close(resp, writer.error(err), p)
            if resp is None:
                resp = await self._open(request, p, writer.start())
            return await self._close(resp, await self._rest(resp, delta, deltas, writer), p)
        except ConnectionResetError:
            log.info("%s: client went away", p.job.request_id)
            raise
        finally:
            if not first.done():
                first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await deltas.aclose()

    @staticmethod
    async def _rest(resp: web.StreamResponse, delta: Delta, deltas, writer: Writer) -> list[bytes]:  # noqa: ANN001
        """Write the answer from ``delta`` on; what is left to write last (its end, or an
        error that came mid-stream). An answer of several choices ends when each has."""
        written = 0
        while True:
            out = writer.text(delta) if delta.text or delta.calls or delta.prompt_logprobs else []
            if delta.finish_reason:
                out += writer.end(delta)
            for chunk in out:
                await resp.write(chunk)
            if not written:
                mark_span("first_write")
            written += 1
            try:
                delta = await anext(deltas)
            except StopAsyncIteration:
                return []
            except ApiError as err:  # mid-stream: the error goes in the stream
                return writer.error(err)

    @staticmethod
    async def _open(request: web.Request, p: Prepared, start: list[bytes]) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **request_ids(p.job.request_id),
            }
        )
        await resp.prepare(request)
        for chunk in start:
            await resp.write(chunk)
        return resp

    @staticmethod
    async def _close(
        resp: web.StreamResponse, last: list[bytes], p: Prepared
    ) -> web.StreamResponse:
        for chunk in last:
            await resp.write(chunk)
        p.delivered = True  # every byte of the answer is out: a client leaving now had it all
        await resp.write_eof()
        return resp

    async def _body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413,
                f"request body: at most {self.max_body_bytes} bytes (KVMESH_ROUTER_MAX_BODY_BYTES)",
                code="body_too_large",
            ) from None

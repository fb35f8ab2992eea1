"""The generation endpoints: OpenAI's /v1/chat/completions and /v1/completions, Anthropic's
/v1/messages and /v1/messages/count_tokens; JSON answers or server-sent events.

Each request goes one way: its format's adapter makes the conversation, the frontend prepares
and runs it, and the same adapter writes the answer (and any error) in the format that came.
aiohttp cancels a handler whose client disconnected (handler_cancellation); closing the delta
stream then cancels the request on its workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from aiohttp import web

from services.router import anthropic_api, cachemiss, responses_api
from services.router.auth import Caller
from services.router.conversation import Conversation
from services.router.frontend import Frontend, KvOptions, request_id
from services.router.generation import Delta, Prepared, Writer
from services.router.openai_api import ApiError, conversation
from services.router.openai_writer import OpenAIWriter
from services.router.recorder import request_ids
from shared.httperrors import error_response

log = logging.getLogger(__name__)

CACHE_HEADER = "x-kvmesh-cache"  # why the prompt missed the cache (a whole answer's)


def _error_headers(err: ApiError, rid: str) -> dict[str, str]:
    headers = request_ids(rid) if rid else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    return headers


def api_error(err: ApiError, rid: str = "") -> web.Response:
    headers = _error_headers(err, rid)
    return error_response(err.status, err.message, err.param, err.code, headers)


def anthropic_error(err: ApiError, rid: str = "") -> web.Response:
    body = anthropic_api.error_body(err)
    return web.json_response(body, status=err.status, headers=_error_headers(err, rid))


def query_int(request: web.Request, name: str, default: int, most: int) -> int:
    """A query parameter from 1 to ``most``; ApiError(400) naming it otherwise."""
    try:
        value = int(request.query.get(name, str(default)))
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise ApiError(400, f"{name}: 1 to {most}", param=name)
    return value


class HttpApi:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self._endpoints = self._formats()

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
            web.post("/v1/messages", self.messages),
            web.post("/v1/messages/count_tokens", self.count_tokens),
            web.post("/v1/responses", self.responses),
        ]

    # Each endpoint is its format's adapter in (the body → a conversation) and writer out.

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, *self._endpoints["/v1/chat/completions"])

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, *self._endpoints["/v1/completions"])

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, *self._endpoints["/v1/messages"])

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, responses_api.conversation, self._responses, api_error)

    def _openai(self, p: Prepared) -> Writer:
        return OpenAIWriter(p, lambda: self._timing(p))

    def _anthropic(self, p: Prepared) -> Writer:
        block_size = self.frontend.dispatcher.block_size(p.job.model)
        return anthropic_api.MessageWriter(p, lambda: self._timing(p), block_size)

    def _responses(self, p: Prepared) -> Writer:
        return responses_api.ResponseWriter(p, lambda: self._timing(p))

    async def _generate(
        self,
        request: web.Request,
        adapter: Callable[[bytes], Conversation],
        writer: Callable[[Prepared], Writer],
        on_error: Callable[[ApiError, str], web.Response],
    ) -> web.StreamResponse:
        rid = request_id(request.headers.get("x-request-id"))
        with self.frontend.recorder.handling(rid, request.path, request.headers) as handled:
            try:
                caller = self.frontend.identify(request.headers)
                with self.frontend.admitted(caller):
                    kv = KvOptions.from_headers(request.headers, caller)
                    body = await self._body(request)
                    p = await self.frontend.prepare(adapter(body), rid, kv, caller)
                    handled.prepared = p
                    out = writer(p)
                    resp = await (
                        self._stream(request, p, out) if p.stream else self._whole(p, out)
                    )
                    handled.status = resp.status
                    return resp
            except ApiError as err:
                handled.status = err.status
                return on_error(err, rid)

    async def count_tokens(self, request: web.Request) -> web.Response:
        """Anthropic's count: the prompt's tokens exactly, by the same renderer."""
        rid = request_id(request.headers.get("x-request-id"))
        try:
            caller = self.frontend.identify(request.headers)
            kv = KvOptions.from_headers(request.headers, caller)
            body = await self._body(request)
            count = await self.frontend.count(anthropic_api.count_conversation(body), kv)
            return web.json_response({"input_tokens": count}, headers=request_ids(rid))
        except ApiError as err:
            return anthropic_error(err, rid)

    async def answer(self, endpoint: str, body: bytes, rid: str, tenant: str) -> dict:
        """A batch line: the whole answer's body as ``endpoint`` gives it, computed at the
        batch priority (ApiError as that endpoint would answer it)."""
        adapter, writer, _ = self._endpoints[endpoint]
        kv = KvOptions(retention="chat", tenant=tenant)
        caller = Caller(tenant=tenant)
        p = await self.frontend.prepare(adapter(body), rid, kv, caller, priority="batch")
        if p.stream:
            raise ApiError(400, "stream: a batch line cannot stream", param="stream")
        return await self._whole_body(p, writer(p))

    def _formats(self) -> dict[str, tuple[Callable, Callable, Callable]]:
        """Each endpoint's adapter in (body → conversation), writer out, and error body."""
        return {
            "/v1/chat/completions": (
                lambda body: conversation(body, chat=True),
                self._openai,
                api_error,
            ),
            "/v1/completions": (
                lambda body: conversation(body, chat=False),
                self._openai,
                api_error,
            ),
            "/v1/messages": (anthropic_api.conversation, self._anthropic, anthropic_error),
        }

    async def _whole_body(self, p: Prepared, writer: Writer) -> dict:
        deltas = self.frontend.deltas(p)
        try:
            answer = Delta.joined([delta async for delta in deltas])
        finally:
            await deltas.aclose()  # on a disconnect: cancels the request on its workers
        assert answer.finish_reason
        return writer.whole(answer)

    async def _whole(self, p: Prepared, writer: Writer) -> web.Response:
        body = await self._whole_body(p, writer)
        headers = request_ids(p.job.request_id)
        if p.timing.cache_miss:
            headers[CACHE_HEADER] = cachemiss.header(p.timing.cache_miss)
        return web.json_response(body, headers=headers)

    async def _stream(
        self, request: web.Request, p: Prepared, writer: Writer
    ) -> web.StreamResponse:
        """The answer as server-sent events. An error before the first token is a plain HTTP
        error, unless the first token is so long in coming (a long prefill) that the stream
        opened to keep the client's connection alive; after that, errors go in the stream."""
        deltas = self.frontend.deltas(p)
        first = asyncio.ensure_future(anext(deltas))
        resp: web.StreamResponse | None = None
        ping_s = self.frontend.settings.stream_ping_s
        try:
            while not (await asyncio.wait({first}, timeout=ping_s))[0]:
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
            out: list[bytes] = []
            while True:
                if delta.text or delta.calls:
                    out += writer.text(delta)
                if delta.finish_reason:
                    out += writer.end(delta)
                    break
                for chunk in out:
                    await resp.write(chunk)
                out = []
                try:
                    delta = await anext(deltas)
                except ApiError as err:  # mid-stream: the error goes in the stream
                    out = writer.error(err)
                    break
            return await self._close(resp, out, p)
        except ConnectionResetError:
            log.info("%s: client went away", p.job.request_id)
            raise
        finally:
            if not first.done():
                first.cancel()
            await asyncio.gather(first, return_exceptions=True)
            await deltas.aclose()

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
            limit = self.frontend.settings.max_body_bytes
            raise ApiError(
                413,
                f"request body: at most {limit} bytes (KVMESH_ROUTER_MAX_BODY_BYTES)",
                code="body_too_large",
            ) from None

    @staticmethod
    def _timing(p: Prepared) -> dict:
        """The `kvmesh` extension: where the time went, and the prompt's cache hits and
        misses as DeepSeek's API names them."""
        return {
            **p.timing.to_dict(),
            "router_ms": round((time.perf_counter() - p.received_at) * 1e3, 3),
            "prompt_cache_hit_tokens": p.usage.cached_tokens,
            "prompt_cache_miss_tokens": p.usage.prompt_tokens - p.usage.cached_tokens,
        }

"""POST /v1/chat/completions and /v1/completions: JSON answers or server-sent events.

aiohttp cancels a handler whose client disconnected (handler_cancellation); closing the delta
stream then cancels the request on its workers.
"""

from __future__ import annotations

import json
import logging
import time

from aiohttp import web

from services.router.frontend import Frontend, KvOptions, request_id
from services.router.generation import Prepared
from services.router.openai_api import ApiError, conversation
from services.router.recorder import request_ids
from shared.httperrors import error_response

log = logging.getLogger(__name__)


def api_error(err: ApiError, rid: str = "") -> web.Response:
    headers = request_ids(rid) if rid else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    return error_response(err.status, err.message, err.param, err.code, headers)


def _sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class HttpApi:
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/chat/completions", self.chat),
            web.post("/v1/completions", self.completions),
        ]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        rid = request_id(request.headers.get("x-request-id"))
        with self.frontend.recorder.handling(rid, request.path, request.headers) as handled:
            try:
                caller = self.frontend.identify(request.headers)
                with self.frontend.admitted(caller):
                    kv = KvOptions.from_headers(request.headers, caller)
                    body = await self._body(request)
                    p = await self.frontend.prepare(conversation(body, chat), rid, kv, caller)
                    handled.prepared = p
                    resp = await (self._stream(request, p) if p.stream else self._whole(p))
                    handled.status = resp.status
                    return resp
            except ApiError as err:
                handled.status = err.status
                return api_error(err, rid)

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

    async def _whole(self, p: Prepared) -> web.Response:
        deltas = self.frontend.deltas(p)
        parts, finish = [], "stop"
        try:
            async for delta in deltas:
                parts.append(delta.text)
                finish = delta.finish_reason or finish
        finally:
            await deltas.aclose()  # on a disconnect: cancels the request on its workers
        body = p.shape.response("".join(parts), finish, p.usage, self._timing(p))
        return web.json_response(body, headers=request_ids(p.job.request_id))

    async def _stream(self, request: web.Request, p: Prepared) -> web.StreamResponse:
        deltas = self.frontend.deltas(p)
        try:
            # Errors before the first token are still plain HTTP errors.
            first = await anext(deltas)
            resp = web.StreamResponse(
                headers={
                    "Content-Type": "text/event-stream",
                    "Cache-Control": "no-cache",
                    **request_ids(p.job.request_id),
                }
            )
            await resp.prepare(request)
            usage_field = p.include_usage
            shape = p.shape
            if shape.chat:
                await resp.write(
                    _sse(shape.chat and shape.chunk("", first=True, with_usage_field=usage_field))
                )
            delta = first
            while True:
                if delta.text:
                    await resp.write(_sse(shape.chunk(delta.text, with_usage_field=usage_field)))
                if delta.finish_reason:
                    await resp.write(
                        _sse(shape.chunk(None, delta.finish_reason, with_usage_field=usage_field))
                    )
                    break
                try:
                    delta = await anext(deltas)
                except ApiError as err:  # mid-stream: the error goes in the stream
                    body = {
                        "error": {"message": err.message, "type": "server_error", "code": err.code}
                    }
                    await resp.write(_sse(body))
                    break
            if p.include_usage:
                await resp.write(_sse(shape.usage_chunk(p.usage, self._timing(p))))
            await resp.write(_sse("[DONE]"))
            await resp.write_eof()
            return resp
        except ConnectionResetError:
            log.info("%s: client went away", p.job.request_id)
            raise
        finally:
            await deltas.aclose()

    @staticmethod
    def _timing(p: Prepared) -> dict:
        return {
            **p.timing.to_dict(),
            "router_ms": round((time.perf_counter() - p.received_at) * 1e3, 3),
        }

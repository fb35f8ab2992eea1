"""The generation endpoints: OpenAI's /v1/chat/completions and /v1/completions, Anthropic's
/v1/messages and /v1/messages/count_tokens; JSON answers or server-sent events.

Each request goes one way: its format's adapter makes the conversation, the frontend prepares
and runs it, and the same adapter writes the answer (and any error) in the format that came.
aiohttp cancels a handler whose client disconnected (handler_cancellation); closing the delta
stream then cancels the request on its workers.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

from aiohttp import web

from services.router import anthropic_api, responses_api
from services.router.conversation import Conversation
from services.router.frontend import Frontend, KvOptions, request_id
from services.router.generation import Delta, Prepared
from services.router.openai_api import ApiError, conversation
from services.router.recorder import request_ids
from shared.httperrors import error_response

log = logging.getLogger(__name__)


def api_error(err: ApiError, rid: str = "") -> web.Response:
    headers = request_ids(rid) if rid else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    return error_response(err.status, err.message, err.param, err.code, headers)


def anthropic_error(err: ApiError, rid: str = "") -> web.Response:
    headers = request_ids(rid) if rid else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(err.retry_after_s)
    return web.json_response(anthropic_api.error_body(err), status=err.status, headers=headers)


def _event(name: str, obj: dict) -> bytes:
    """One server-sent event with a name (Anthropic's streams name theirs)."""
    return f"event: {name}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


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
            web.post("/v1/messages", self.messages),
            web.post("/v1/responses", self.responses),
            web.post("/v1/messages/count_tokens", self.count_tokens),
        ]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: conversation(body, chat=True))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, lambda body: conversation(body, chat=False))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, anthropic_api.conversation, "anthropic")

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, responses_api.conversation, "responses")

    async def _generate(
        self,
        request: web.Request,
        adapter: Callable[[bytes], Conversation],
        fmt: str = "openai",
    ) -> web.StreamResponse:
        """``adapter``: the body → its conversation; ``fmt``: how the answer is written."""
        anthropic = fmt == "anthropic"
        rid = request_id(request.headers.get("x-request-id"))
        with self.frontend.recorder.handling(rid, request.path, request.headers) as handled:
            try:
                caller = self.frontend.identify(request.headers)
                with self.frontend.admitted(caller):
                    kv = KvOptions.from_headers(request.headers, caller)
                    body = await self._body(request)
                    p = await self.frontend.prepare(adapter(body), rid, kv, caller)
                    handled.prepared = p
                    if anthropic:
                        write = self._anthropic_stream if p.stream else self._anthropic_whole
                        resp = await write(request, p)
                    elif fmt == "responses":
                        write = self._responses_stream if p.stream else self._responses_whole
                        resp = await write(request, p)
                    else:
                        resp = await (self._stream(request, p) if p.stream else self._whole(p))
                    handled.status = resp.status
                    return resp
            except ApiError as err:
                handled.status = err.status
                if anthropic:
                    return anthropic_error(err, rid)
                return api_error(err, rid)

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

    # -- OpenAI Responses' shapes -----------------------------------------------------------

    async def _responses_whole(self, request: web.Request, p: Prepared) -> web.Response:
        text, last = await self._collect(p)
        body = responses_api.response(
            f"resp_{p.job.request_id}", p.job.model, text, last.finish_reason, p.usage
        )
        body["kvmesh"] = self._timing(p)
        return web.json_response(body, headers=request_ids(p.job.request_id))

    async def _responses_stream(self, request: web.Request, p: Prepared) -> web.StreamResponse:
        deltas = self.frontend.deltas(p)
        seq = iter(range(1 << 30))
        resp_id, model = f"resp_{p.job.request_id}", p.job.model

        def event(kind: str, **fields: object) -> bytes:
            return _event(kind, {"type": kind, "sequence_number": next(seq), **fields})

        try:
            first = await anext(deltas)  # errors before the first token: plain HTTP errors
            resp = await self._open_stream(request, p)
            item = responses_api.message_item(resp_id, "", "in_progress")
            where = {"item_id": item["id"], "output_index": 0, "content_index": 0}
            started = responses_api.response(resp_id, model, None, None, None)
            await resp.write(event("response.created", response=started))
            await resp.write(event("response.in_progress", response=started))
            await resp.write(event("response.output_item.added", output_index=0, item=item))
            part = {"type": "output_text", "text": "", "annotations": []}
            await resp.write(event("response.content_part.added", **where, part=part))
            parts, delta = [], first
            while True:
                if delta.text:
                    parts.append(delta.text)
                    await resp.write(event("response.output_text.delta", **where, delta=delta.text))
                if delta.finish_reason:
                    break
                try:
                    delta = await anext(deltas)
                except ApiError as err:  # mid-stream: the error goes in the stream
                    await resp.write(event("error", code=err.code, message=err.message))
                    await resp.write_eof()
                    return resp
            text = "".join(parts)
            await resp.write(event("response.output_text.done", **where, text=text))
            part = {**part, "text": text}
            await resp.write(event("response.content_part.done", **where, part=part))
            done_item = responses_api.message_item(resp_id, text, "completed")
            await resp.write(event("response.output_item.done", output_index=0, item=done_item))
            final = responses_api.response(resp_id, model, text, delta.finish_reason, p.usage)
            final["kvmesh"] = self._timing(p)
            kind = (
                "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            )
            await resp.write(event(kind, response=final))
            await resp.write_eof()
            return resp
        except ConnectionResetError:
            log.info("%s: client went away", p.job.request_id)
            raise
        finally:
            await deltas.aclose()

    async def _collect(self, p: Prepared) -> tuple[str, Delta]:
        """The whole answer's text, and its last delta (why it ended)."""
        deltas = self.frontend.deltas(p)
        parts, last = [], None
        try:
            async for delta in deltas:
                parts.append(delta.text)
                last = delta
        finally:
            await deltas.aclose()  # on a disconnect: cancels the request on its workers
        assert last is not None and last.finish_reason
        return "".join(parts), last

    async def _open_stream(self, request: web.Request, p: Prepared) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **request_ids(p.job.request_id),
            }
        )
        await resp.prepare(request)
        return resp

    # -- Anthropic's shapes ---------------------------------------------------------------

    def _anthropic_usage(self, p: Prepared) -> dict:
        block_size = self.frontend.dispatcher.block_size(p.job.model)
        u = p.usage
        return anthropic_api.usage(
            u.prompt_tokens, u.cached_tokens, u.completion_tokens, block_size
        )

    async def _anthropic_whole(self, request: web.Request, p: Prepared) -> web.Response:
        text, last = await self._collect(p)
        body = anthropic_api.message(
            f"msg_{p.job.request_id}",
            p.job.model,
            text,
            last.finish_reason,
            last.stop_sequence,
            self._anthropic_usage(p),
        )
        body["kvmesh"] = self._timing(p)
        return web.json_response(body, headers=request_ids(p.job.request_id))

    async def _anthropic_stream(self, request: web.Request, p: Prepared) -> web.StreamResponse:
        """message_start, content_block_start, ping, content_block_delta…, content_block_stop,
        message_delta (stop reason, usage), message_stop."""
        deltas = self.frontend.deltas(p)
        try:
            first = await anext(deltas)  # errors before the first token: plain HTTP errors
            resp = await self._open_stream(request, p)
            msg_id = f"msg_{p.job.request_id}"
            start = anthropic_api.message(
                msg_id, p.job.model, "", None, None, self._anthropic_usage(p)
            )
            await resp.write(_event("message_start", {"type": "message_start", "message": start}))
            block = {"type": "text", "text": ""}
            await resp.write(
                _event(
                    "content_block_start",
                    {"type": "content_block_start", "index": 0, "content_block": block},
                )
            )
            await resp.write(_event("ping", {"type": "ping"}))
            delta = first
            while True:
                if delta.text:
                    body = {"type": "text_delta", "text": delta.text}
                    await resp.write(
                        _event(
                            "content_block_delta",
                            {"type": "content_block_delta", "index": 0, "delta": body},
                        )
                    )
                if delta.finish_reason:
                    break
                try:
                    delta = await anext(deltas)
                except ApiError as err:  # mid-stream: the error goes in the stream
                    await resp.write(_event("error", anthropic_api.error_body(err)))
                    await resp.write_eof()
                    return resp
            await resp.write(
                _event("content_block_stop", {"type": "content_block_stop", "index": 0})
            )
            reason = anthropic_api.stop_reason(delta.finish_reason, delta.stop_sequence)
            stop_sequence = delta.stop_sequence if reason == "stop_sequence" else None
            await resp.write(
                _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                        "usage": self._anthropic_usage(p),
                        "kvmesh": self._timing(p),
                    },
                )
            )
            await resp.write(_event("message_stop", {"type": "message_stop"}))
            await resp.write_eof()
            return resp
        except ConnectionResetError:
            log.info("%s: client went away", p.job.request_id)
            raise
        finally:
            await deltas.aclose()

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
        """The `kvmesh` extension: where the time went, and the prompt's cache hits and
        misses as DeepSeek's API names them."""
        return {
            **p.timing.to_dict(),
            "router_ms": round((time.perf_counter() - p.received_at) * 1e3, 3),
            "prompt_cache_hit_tokens": p.usage.cached_tokens,
            "prompt_cache_miss_tokens": p.usage.prompt_tokens - p.usage.cached_tokens,
        }

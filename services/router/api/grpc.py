"""The public gRPC API (shared/proto/api.proto): the same checks and generation as HTTP.

A call's messages mirror OpenAI's Chat Completions and Completions bodies, so a request is
turned into the body it mirrors and checked by the OpenAI adapter: both APIs refuse the same
things with the same words. The interceptor wraps every method in the envelope HTTP routes get
(``middleware.Gate``): its record, the caller identified and admitted; an ``ApiError`` ends
the call with its status code.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import grpc

from services.router.api.middleware import GENERATE, Gate, current, request_id
from services.router.errors import ApiError
from services.router.formats.openai import conversation
from services.router.formats.openai_writer import response_id
from services.router.observe.recorder import request_ids
from services.router.request.answer import Answers, Delta
from services.router.request.prepare import Prepared, Preparer
from services.router.settings import RouterSettings
from shared.proto import api_pb2, api_pb2_grpc
from shared.security.tls import add_port, grpc_server
from shared.settings import CommonSettings, env_name

CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}


def _parts(parts) -> list[dict]:  # noqa: ANN001 (repeated ContentPart)
    """Content parts as OpenAI's: an image as a data: URL (checked like any other)."""
    out = []
    for p in parts:
        if p.WhichOneof("part") == "image":
            url = f"data:{p.image.media_type};base64,{base64.b64encode(p.image.data).decode()}"
            out.append({"type": "image_url", "image_url": {"url": url}})
        else:
            out.append({"type": "text", "text": p.text})
    return out


# The request's optional scalars, carried into the body under the same names when set.
OPTIONAL_FIELDS = (
    *("max_tokens", "temperature", "top_p", "seed", "n", "top_k", "min_p"),
    *("repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "best_of"),
)


def as_body(req: api_pb2.GenerateRequest) -> tuple[bytes, bool]:
    """The request as the OpenAI JSON body it mirrors, and whether it is a chat."""
    body: dict = {"model": req.model, "stop": list(req.stop)}
    if req.user:
        body["user"] = req.user
    for name in OPTIONAL_FIELDS:
        if req.HasField(name):
            body[name] = getattr(req, name)
    if req.ignore_eos:
        body["ignore_eos"] = True
    if req.stop_token_ids:
        body["stop_token_ids"] = list(req.stop_token_ids)
    if req.service_tier:
        body["service_tier"] = req.service_tier
    chat = len(req.messages) > 0
    if chat == req.HasField("prompt"):
        raise ApiError(400, "messages or prompt: give exactly one of them", param="messages")
    if chat:
        body["messages"] = [
            {"role": m.role, "content": _parts(m.parts) if m.parts else m.content}
            for m in req.messages
        ]
    else:
        body["prompt"] = req.prompt
    return json.dumps(body).encode(), chat


def _usage(p: Prepared) -> api_pb2.Usage:
    usage = p.answer_usage()
    return api_pb2.Usage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        cached_tokens=usage.cached_tokens,
    )


class Interceptor(grpc.aio.ServerInterceptor):
    """Every method of the API inside the generation envelope."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        method, wrap = details.method, self._enveloped
        if handler is None:
            return handler
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_unary:
            inner = handler.unary_unary

            async def unary(request, context):  # noqa: ANN001, ANN202 (gRPC's)
                async with wrap(context, method):
                    return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, **codec)
        if handler.unary_stream:
            streaming = handler.unary_stream

            async def stream(request, context):  # noqa: ANN001, ANN202 (gRPC's)
                async with wrap(context, method):
                    async for item in streaming(request, context):
                        yield item

            return grpc.unary_stream_rpc_method_handler(stream, **codec)
        return handler

    @contextlib.asynccontextmanager
    async def _enveloped(self, context, method: str) -> AsyncIterator[None]:  # noqa: ANN001
        metadata = dict(context.invocation_metadata() or ())
        rid = request_id(metadata.get("x-request-id"))
        with self.gate.recorded(rid, method, metadata, GENERATE) as outcome:
            await context.send_initial_metadata(tuple(request_ids(rid).items()))
            try:
                with self.gate.entered(rid, metadata, GENERATE, outcome):
                    yield
            except ApiError as err:
                outcome.status = err.status
                await context.abort(CODES.get(err.status, grpc.StatusCode.INTERNAL), err.message)


class GrpcApi(api_pb2_grpc.GenerationServicer):
    def __init__(self, preparer: Preparer, answers: Answers) -> None:
        self.preparer = preparer
        self.answers = answers

    @contextlib.asynccontextmanager
    async def _answering(
        self, request: api_pb2.GenerateRequest
    ) -> AsyncIterator[tuple[Prepared, AsyncIterator[Delta]]]:
        """The call's request prepared, with its answer's deltas (closed on the way out: that
        cancels the request on its workers if the call ends early)."""
        call = current()
        body, chat = as_body(request)
        p = await self.preparer.prepare(conversation(body, chat), call.rid, call.kv)
        call.outcome.prepared = p
        deltas = self.answers.deltas(p)
        try:
            yield p, deltas
        finally:
            await deltas.aclose()

    async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        parts: dict[int, list[Delta]] = {}
        async with self._answering(request) as (p, deltas):
            async for delta in deltas:
                parts.setdefault(delta.index, []).append(delta)
        choices = [
            api_pb2.Choice(index=i, text=a.text, finish_reason=a.finish_reason or "stop")
            for i in sorted(parts)
            for a in [Delta.joined(parts[i])]
        ]
        return api_pb2.GenerateResponse(
            id=response_id(p),
            model=p.job.model,
            text=choices[0].text,
            finish_reason=choices[0].finish_reason,
            usage=_usage(p),
            choices=choices,
            service_tier=p.job.priority,
        )

    async def GenerateStream(self, request, context):  # noqa: ANN001, ANN201, N802
        async with self._answering(request) as (p, deltas):
            left = p.choices
            async for delta in deltas:
                left -= delta.finish_reason is not None
                yield api_pb2.GenerateChunk(
                    id=response_id(p),
                    text=delta.text,
                    finish_reason=delta.finish_reason or "",
                    usage=_usage(p) if not left else None,
                    index=delta.index,
                )


async def serve_grpc(
    stack: AsyncExitStack,
    api: GrpcApi,
    interceptor: Interceptor,
    settings: RouterSettings,
    common: CommonSettings,
) -> str:
    """Serve the API until the stack closes (over TLS when the mesh has it); its address."""
    size = settings.max_body_bytes  # a gRPC message carries what an HTTP body would
    server = grpc_server(
        interceptors=[interceptor],
        options=[
            ("grpc.max_receive_message_length", size),
            ("grpc.max_send_message_length", size),
        ],
    )
    api_pb2_grpc.add_GenerationServicer_to_server(api, server)
    where = f"{settings.http_host}:{settings.grpc_port}"
    port = add_port(server, where, common, False, env_name(type(settings), "grpc_port"))
    await server.start()
    stack.push_async_callback(server.stop, 1.0)
    return f"{settings.advertised_host()}:{port}"

"""The public gRPC API (shared/proto/api.proto): the same checks and generation as HTTP."""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import AsyncIterator

import grpc

from services.router.frontend import Frontend, KvOptions, request_id
from services.router.generation import Delta, Prepared
from services.router.openai_api import ApiError, conversation
from services.router.recorder import request_ids
from shared.proto import api_pb2, api_pb2_grpc

_CODES = {
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


def _as_body(req: api_pb2.GenerateRequest) -> tuple[bytes, bool]:
    """The request as an OpenAI JSON body (so both APIs share one set of checks)."""
    body: dict = {"model": req.model, "stop": list(req.stop)}
    if req.user:
        body["user"] = req.user
    for name in ("max_tokens", "temperature", "top_p", "seed", "n"):
        if req.HasField(name):
            body[name] = getattr(req, name)
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
    return api_pb2.Usage(
        prompt_tokens=p.usage.prompt_tokens,
        completion_tokens=p.usage.completion_tokens,
        cached_tokens=p.usage.cached_tokens,
    )


class GrpcApi(api_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend

    @contextlib.asynccontextmanager
    async def _answering(
        self,
        request: api_pb2.GenerateRequest,
        context,
        method: str,  # noqa: ANN001
    ) -> AsyncIterator[tuple[Prepared, AsyncIterator[Delta]]]:
        """One call's request, recorded (span, log line, metrics), admitted and prepared, with
        its answer's deltas (closed on the way out: that cancels the request on its workers
        if the call ends early). An ApiError ends the call with its gRPC status code."""
        metadata = dict(context.invocation_metadata() or ())
        rid = request_id(metadata.get("x-request-id"))
        endpoint = f"/kvmesh.api.v1.Generation/{method}"
        with self.frontend.recorder.handling(rid, endpoint, metadata) as handled:
            await context.send_initial_metadata(tuple(request_ids(rid).items()))
            try:
                caller = self.frontend.identify(metadata)
                with self.frontend.admitted(caller):
                    body, chat = _as_body(request)
                    kv = KvOptions.from_headers(metadata, caller)
                    p = await self.frontend.prepare(conversation(body, chat), rid, kv, caller)
                    handled.prepared = p
                    deltas = self.frontend.deltas(p)
                    try:
                        yield p, deltas
                    finally:
                        await deltas.aclose()
            except ApiError as err:
                handled.status = err.status
                await context.abort(_CODES.get(err.status, grpc.StatusCode.INTERNAL), err.message)

    async def Generate(self, request, context):  # noqa: ANN001, ANN201, N802
        parts, finish = [], "stop"
        async with self._answering(request, context, "Generate") as (p, deltas):
            async for delta in deltas:
                parts.append(delta.text)
                finish = delta.finish_reason or finish
        return api_pb2.GenerateResponse(
            id=p.shape.response_id,
            model=p.job.model,
            text="".join(parts),
            finish_reason=finish,
            usage=_usage(p),
        )

    async def GenerateStream(self, request, context):  # noqa: ANN001, ANN201, N802
        async with self._answering(request, context, "GenerateStream") as (p, deltas):
            async for delta in deltas:
                last = delta.finish_reason is not None
                yield api_pb2.GenerateChunk(
                    id=p.shape.response_id,
                    text=delta.text,
                    finish_reason=delta.finish_reason or "",
                    usage=_usage(p) if last else None,
                )

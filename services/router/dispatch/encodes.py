"""Images on their way to the encoder pool: every image of a request sent as soon as the
request is checked, and the request's events held back until all are encoded.

``Encodes`` stands between the request's events and the client: the first token is released
only when every image was encoded, and a failed encode ends the request at once (its workers
are told to cancel). A text request never asks the encoders anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry.trace import SpanKind, StatusCode

from services.router.dispatch.workers import WorkerRegistry
from services.router.errors import ApiError
from shared.bus import Bus, BusError, subjects
from shared.messages.encode import EncodeReply, EncodeRequest
from shared.messages.generate import ImageRef, TokenEvent
from shared.telemetry.metrics import BYTES
from shared.telemetry.tracing import tracer

ENCODE_RESEND_S = 5.0  # an image's encode unanswered this long is sent again


@dataclass(frozen=True)
class ImageInput:
    param: str  # where it was in the request: messages[1].content[0].image_url
    data: bytes
    image_hash: str  # content_hash(data, salt)
    tokens: int
    salt: str = ""  # the tenant's

    def ref(self, start: int) -> ImageRef:
        return ImageRef(image_hash=self.image_hash, start=start, tokens=self.tokens)


@dataclass
class Encodes:
    """The encode requests of one chat request's images, in flight from the start."""

    images: list[ImageInput]
    tasks: list[asyncio.Task[EncodeReply]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # each one's first position in the prompt

    def start(self, bus: Bus, model: str, timeout_s: float) -> None:
        self.tasks = [
            asyncio.create_task(_encode(bus, model, img, timeout_s)) for img in self.images
        ]

    def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def wait(self) -> list[EncodeReply]:
        """Every image's reply; ApiError when one failed (400 for a bad image, else 503)."""
        replies = []
        try:
            for img, task in zip(self.images, self.tasks, strict=True):
                reply = await task
                if reply.error_code == "bad_image":
                    raise ApiError(
                        400, f"{img.param}: {reply.error}", param=img.param, code="invalid_image"
                    )
                if reply.error or reply.tokens != img.tokens:
                    why = reply.error or f"{reply.tokens} embeddings for {img.tokens} tokens"
                    raise ApiError(
                        503, f"image encoder {reply.encoder_id}: {why}", code="encoder_failed"
                    )
                replies.append(reply)
        except BaseException:
            self.cancel()
            raise
        return replies

    def report(self) -> list[dict]:
        """Per image, for the response's kvmesh object (those encoded so far)."""
        out = []
        for img, task in zip(self.images, self.tasks, strict=True):
            ok = task.done() and not task.cancelled() and task.exception() is None
            reply = task.result() if ok else None
            out.append(
                {
                    "start": self.starts[len(out)] if len(self.starts) > len(out) else None,
                    "tokens": img.tokens,
                    "cached": reply.cached if reply else None,
                    "source": reply.source if reply else None,
                    "encode_ms": round(reply.encode_s * 1e3, 3) if reply else None,
                    "encoder": reply.encoder_id if reply else None,
                    **({"untrained_tower": True} if reply and reply.untrained else {}),
                }
            )
        return out

    async def guard(self, events: AsyncIterator[TokenEvent]) -> AsyncIterator[TokenEvent]:
        """``events``, the first held back until every image is encoded; a failed encode
        ends the request at once (its workers are told to cancel)."""
        waiting = asyncio.ensure_future(self.wait())
        it = aiter(events)
        step: asyncio.Future | None = None
        try:
            while not waiting.done():
                step = step or asyncio.ensure_future(anext(it))
                await asyncio.wait({step, waiting}, return_when=asyncio.FIRST_COMPLETED)
                if waiting.done() and waiting.exception() is not None:
                    raise waiting.exception()  # type: ignore[misc]
                if step.done():
                    failed = step.exception()
                    if failed is not None and not isinstance(failed, StopAsyncIteration):
                        raise failed  # the request failed on its workers: no need to wait
                    await waiting  # the first event waits for the encodes
                    break
            while True:  # the encodes are done: events flow
                try:
                    event = await (step or anext(it))
                except StopAsyncIteration:
                    return
                step = None
                yield event
        finally:
            waiting.cancel()
            if step is not None and not step.done():
                step.cancel()
                with contextlib.suppress(BaseException):
                    await step
            await it.aclose()  # type: ignore[attr-defined]


async def _encode(bus: Bus, model: str, img: ImageInput, timeout_s: float) -> EncodeReply:
    req = EncodeRequest(
        model=model,
        image_hash=img.image_hash,
        tokens=img.tokens,
        salt=img.salt,
        ask=secrets.token_hex(8),  # (sent again, it is still this request's encode)
    )
    attributes = {"image_hash": img.image_hash, "tokens": img.tokens, "bytes": len(img.data)}
    with tracer.start_as_current_span(
        "encode", kind=SpanKind.CLIENT, attributes=attributes
    ) as span:
        BYTES.labels("image", "out").inc(len(img.data))
        try:
            # Sent again if unanswered for a while: a request lost with a NATS node (at most
            # once) is not waited on to the end; an image encoded twice is the same.
            reply = await bus.ask(
                subjects.ENCODE,
                req,
                EncodeReply,
                timeout_s,
                ENCODE_RESEND_S,
                nobody_again=False,  # (no encoder at all: 503 at once)
                blob=img.data,
            )
        except BusError as err:
            span.set_status(StatusCode.ERROR, str(err))
            raise ApiError(503, f"image encoder: {err}", code="encoder_unavailable") from None
        span.set_attributes(
            {"encoder": reply.encoder_id, "source": reply.source, "error": reply.error}
        )
        return reply


def check_encoders(registry: WorkerRegistry, model: str) -> None:
    """503 at once when no live encoder serves the model (text requests never ask)."""
    if not any(model in w.heartbeat.models for w in registry.ready("encoder")):
        raise ApiError(
            503, f"no image encoder is available for {model}", code="encoder_unavailable"
        )

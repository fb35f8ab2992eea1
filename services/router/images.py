"""Images in a chat request: checked, counted in tokens, and sent to the encoder pool at once.

Each image is refused here (400 naming its part and the limit) before anything else happens:
not a data: URL (or http(s) when allowed), not PNG/JPEG/WebP, too many bytes, too many pixels
declared (a decompression bomb is refused from its header), too many images. Its tokens come
from its header (``VisionGrid``). ``Encodes`` sends every image to the encoder pool as soon as
the request is checked, and stands between the request's events and the client: the first
token is released only when every image was encoded, and a failed encode ends the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry.trace import SpanKind, StatusCode

from services.router.openai_api import ApiError
from services.router.registry import WorkerRegistry
from services.router.remote import fetch_image
from services.router.tokens import Segments
from shared.bus import Bus, BusError, subjects
from shared.kvstore.hashing import image_stream
from shared.messages.encode import EncodeReply, EncodeRequest
from shared.messages.generate import ImageRef, TokenEvent
from shared.telemetry.metrics import BYTES
from shared.telemetry.tracing import tracer
from shared.vision.grid import VisionGrid
from shared.vision.images import BadImage, content_hash, decode_data_url, probe

PLACEHOLDER_ID = 0  # the token id under an image's positions (its embeddings replace it)
FRAMING_BYTES = 4096  # room in a NATS message for the request beside the image


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    per_request: int
    allow_remote: bool
    remote_timeout_s: float
    encode_timeout_s: float
    grid: VisionGrid
    remote_private: bool = False  # remote URLs may reach non-public addresses (remote.py)


@dataclass(frozen=True)
class ImageInput:
    param: str  # where it was in the request: messages[1].content[0].image_url
    data: bytes
    image_hash: str  # content_hash(data, salt)
    tokens: int
    salt: str = ""  # the tenant's

    def ref(self, start: int) -> ImageRef:
        return ImageRef(image_hash=self.image_hash, start=start, tokens=self.tokens)


async def read_image(
    url: str, param: str, limits: ImageLimits, max_payload: int, salt: str = ""
) -> ImageInput:
    """An image part's bytes, checked; ApiError(400) naming ``param`` and the limit. Its
    identity is salted with the tenant's salt."""
    max_bytes = min(limits.max_bytes, max_payload - FRAMING_BYTES)
    try:
        if url.startswith(("http://", "https://")):
            if not limits.allow_remote:
                raise BadImage(
                    "only data: URLs are accepted (this server fetches nothing; "
                    "KVMESH_ROUTER_ALLOW_REMOTE_IMAGES=true allows http(s) URLs)"
                )
            data = await fetch_image(url, max_bytes, limits.remote_timeout_s, limits.remote_private)
        else:
            data = decode_data_url(url, max_bytes)
        info = probe(data, limits.max_pixels)
    except BadImage as err:
        raise ApiError(400, f"{param}: {err}", param=param, code="invalid_image") from None
    tokens = limits.grid.tokens(info.width, info.height)
    return ImageInput(param, data, content_hash(data, salt), tokens, salt)


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


def join_prompt(
    parts: list[tuple[list[int], Segments] | ImageInput],
) -> tuple[list[int], Segments, tuple[ImageRef, ...]]:
    """A prompt from its tokenized text pieces and its images, in order: the ids (an image as
    its placeholder tokens), the segments (an image as its content's hash stream, so prefix
    hashes built from segments equal ``block_hashes(ids, images=refs)``) and the image refs."""
    ids: list[int] = []
    segments: list[tuple[str, bytes]] = []
    refs = []
    for part in parts:
        if isinstance(part, ImageInput):
            refs.append(part.ref(len(ids)))
            ids += [PLACEHOLDER_ID] * part.tokens
            stream = image_stream(part.image_hash, part.tokens)
            segments.append((f"\x00image {part.image_hash}", stream))
        else:
            ids += part[0]
            segments += part[1]
    return ids, tuple(segments), tuple(refs)


async def _encode(bus: Bus, model: str, img: ImageInput, timeout_s: float) -> EncodeReply:
    req = EncodeRequest(model=model, image_hash=img.image_hash, tokens=img.tokens, salt=img.salt)
    attributes = {"image_hash": img.image_hash, "tokens": img.tokens, "bytes": len(img.data)}
    with tracer.start_as_current_span(
        "encode", kind=SpanKind.CLIENT, attributes=attributes
    ) as span:
        BYTES.labels("image", "out").inc(len(img.data))
        try:
            reply = await bus.request(subjects.ENCODE, req, EncodeReply, timeout_s, blob=img.data)
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

"""The encoder link: router → encoder pool (a queue group), encoder → the embeddings stream.

An EncodeRequest travels with the image's bytes after it (``frame``): base64 in JSON would
add a third to every image. The embeddings go to a JetStream stream, one subject per image,
where whichever prefill worker computes the request picks them up (``subjects.embeds``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.messages import Message

ImageErrorCode = Literal["", "bad_image", "internal"]


class EncodeRequest(Message):
    model: str
    image_hash: str  # content_hash of the bytes that follow, salted with ``salt``
    tokens: int = Field(ge=1, description="embeddings the router counted for it")
    salt: str = Field(default="", max_length=64, description="the tenant's (shared/security)")
    ask: str = Field(default="", max_length=64, description="the same on an ask sent again")


class EncodeReply(Message):
    image_hash: str
    tokens: int = 0
    encoder_id: str = ""
    cached: bool = False  # its embeddings were made before: nothing was encoded now
    source: Literal["", "encoded", "memory", "storage", "shared"] = ""  # shared: another
    # request's encode of the same image, in flight
    encode_s: float = 0.0  # decoding, resizing and the tower (0 when cached)
    untrained: bool = False  # the tower's weights are random: its embeddings mean nothing
    error: str = ""
    error_code: ImageErrorCode = ""


# Headers of a message on the embeddings stream.
EMBEDS_SHAPE_HEADER = "Kvmesh-Shape"  # "tokens,hidden" of the float32 rows that follow


def frame(msg: Message, blob: bytes) -> bytes:
    """A message and a binary payload in one NATS message (JSON never holds a raw newline)."""
    return msg.to_bytes() + b"\n" + blob


def unframe(data: bytes) -> tuple[bytes, memoryview]:
    """The JSON of a framed message and its binary payload."""
    end = data.index(b"\n")
    return data[:end], memoryview(data)[end + 1 :]

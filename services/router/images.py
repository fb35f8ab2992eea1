"""Images in a chat request: checked, counted in tokens, and sent to the encoder pool at once.

Each image is refused here (400 naming its part and the limit) before anything else happens:
not a data: URL (or http(s) when allowed), not PNG/JPEG/WebP, too many bytes, too many pixels
declared (a decompression bomb is refused from its header), too many images. Its tokens come
from its header (``VisionGrid``). ``Encodes`` sends every image to the encoder pool as soon as
the request is checked, and stands between the request's events and the client: the first
token is released only when every image was encoded, and a failed encode ends the request.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.router.dispatch.encodes import ImageInput
from services.router.errors import ApiError
from services.router.remote import fetch_image
from services.router.tokens import Segments
from shared.kvstore.hashing import image_stream
from shared.messages.generate import ImageRef
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

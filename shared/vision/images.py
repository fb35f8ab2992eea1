"""An image from a request: its bytes checked, its identity, its size from the header alone.

``probe`` reads only the header (size, format, orientation), so the router can refuse a bad or
oversized image and count its tokens without decoding it; a decompression bomb (a small file
that declares a huge size) is refused there, before any pixel is decoded. The pixels themselves
are the encoder's (``pixels.py``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass

from PIL import Image

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp"}

_DATA_URL = re.compile(r"^data:([\w.+-]+/[\w.+-]+)?((?:;[\w.+-]+=[\w.+-]+)*)(;base64)?,", re.I)


class BadImage(ValueError):
    """An image a client sent that cannot be used; the message names the limit or the fault."""


@dataclass(frozen=True)
class ImageInfo:
    format: str  # PNG, JPEG, WEBP
    width: int  # after EXIF orientation
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def content_hash(data: bytes, salt: str = "") -> str:
    """An image's identity: the same bytes (for one tenant: its salt), the same embeddings
    and the same KV. Salted, one tenant's image never finds another's embeddings."""
    return hashlib.blake2b(data, digest_size=16, key=salt.encode()).hexdigest()


def decode_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:image/...;base64,...`` URL, at most ``max_bytes`` of them."""
    m = _DATA_URL.match(url)
    if not m:
        raise BadImage("not a data: URL (expected data:image/png;base64,...)")
    media = (m.group(1) or "").lower()
    if media not in MEDIA_TYPES:
        raise BadImage(f"media type {media or 'none'!r} is not one of image/png, jpeg, webp")
    if not m.group(3):
        raise BadImage("the data: URL must be base64 (;base64,)")
    body = url[m.end() :]
    if len(body) > (max_bytes + 2) // 3 * 4 + 4:  # refuse before decoding megabytes
        raise BadImage(f"image is larger than {max_bytes:,} bytes")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise BadImage("the data: URL's base64 is not valid") from None
    if len(data) > max_bytes:
        raise BadImage(f"image is larger than {max_bytes:,} bytes ({len(data):,})")
    if not data:
        raise BadImage("image is empty")
    return data


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """The image opened lazily (header read, no pixels), within limits."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data), formats=list(FORMATS))
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise BadImage(f"image has more than {max_pixels:,} pixels") from None
        except Exception as err:  # Pillow raises several kinds for a file it cannot read
            raise BadImage(f"not a PNG, JPEG or WebP image ({type(err).__name__})") from None
    if img.width * img.height > max_pixels:
        raise BadImage(f"image has more than {max_pixels:,} pixels ({img.width}×{img.height})")
    return img


def probe(data: bytes, max_pixels: int) -> ImageInfo:
    """Format and size from the header alone (no pixels decoded)."""
    img = open_image(data, max_pixels)
    width, height = img.size
    # EXIF orientations 5–8 turn the image a quarter: width and height swap once applied.
    if img.format == "JPEG" and img.getexif().get(0x0112, 1) in (5, 6, 7, 8):
        width, height = height, width
    return ImageInfo(img.format or "", width, height)

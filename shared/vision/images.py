"""An image from a request: its bytes checked, its identity, and its pixels for the tower.

``probe`` reads only the header (size, format, orientation), so the router can refuse a bad or
oversized image and count its tokens without decoding it; a decompression bomb (a small file
that declares a huge size) is refused there, before any pixel is decoded. ``pixels`` decodes,
orients, converts to RGB, resizes to the grid and normalizes.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps

from shared.vision.grid import VisionGrid

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}
MEDIA_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp"}
# CLIP's normalization, which most vision towers were trained with.
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)

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


def content_hash(data: bytes) -> str:
    """An image's identity: the same bytes, the same embeddings and the same KV."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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


def _open(data: bytes, max_pixels: int) -> Image.Image:
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
    img = _open(data, max_pixels)
    width, height = img.size
    # EXIF orientations 5–8 turn the image a quarter: width and height swap once applied.
    if img.format == "JPEG" and img.getexif().get(0x0112, 1) in (5, 6, 7, 8):
        width, height = height, width
    return ImageInfo(img.format or "", width, height)


def pixels(data: bytes, grid: VisionGrid, max_pixels: int) -> torch.Tensor:
    """Decoded, oriented, RGB, resized to the grid and normalized: [3, H, W] float32."""
    img = _open(data, max_pixels)
    try:
        img = ImageOps.exif_transpose(img.convert("RGB") if img.mode == "P" else img)
        img = img.convert("RGB")
    except Exception as err:  # truncated or corrupt pixel data
        raise BadImage(f"image data is damaged ({err})") from None
    height, width = grid.pixels_hw(img.width, img.height)
    img = img.resize((width, height), Image.Resampling.BICUBIC)
    x = torch.from_numpy(np.asarray(img, dtype=np.float32)).permute(2, 0, 1) / 255.0
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return (x - mean) / std

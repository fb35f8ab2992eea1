"""Images for tests: seeded noise PNGs, data URLs, and chat content parts."""

from __future__ import annotations

import base64
import io

from PIL import Image


def png(seed: int, size: tuple[int, int] = (300, 200), mode: str = "RGB") -> bytes:
    """A noise image, different for every seed (so a different image hash)."""
    img = Image.effect_noise(size, 60 + seed).convert(mode)
    img.putpixel((seed % size[0], 0), (seed * 37) % 256 if mode == "L" else (seed, 0, 0))
    out = io.BytesIO()
    img.save(out, "PNG")
    return out.getvalue()


def encoded(size: tuple[int, int], fmt: str = "PNG", **save) -> bytes:  # noqa: ANN003
    """A noise image of ``size`` in ``fmt`` (saved with ``save``'s options)."""
    out = io.BytesIO()
    Image.effect_noise(size, 50).convert("RGB").save(out, fmt, **save)
    return out.getvalue()


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def image(url: str) -> dict:
    """A chat content part holding an image."""
    return {"type": "image_url", "image_url": {"url": url}}


def ask(*parts: dict | str, role: str = "user") -> list[dict]:
    """One chat message of text and image parts."""
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return [{"role": role, "content": content}]

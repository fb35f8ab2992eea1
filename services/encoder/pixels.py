"""An image's pixels for the vision tower: decoded, oriented, RGB, resized to its grid and
normalized (the encoder's work; the router only checks images, ``images.py``)."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image, ImageOps

from shared.vision.grid import VisionGrid
from shared.vision.images import BadImage, open_image

# CLIP's normalization, which most vision towers were trained with.
MEAN = (0.48145466, 0.4578275, 0.40821073)
STD = (0.26862954, 0.26130258, 0.27577711)


def pixels(data: bytes, grid: VisionGrid, max_pixels: int) -> torch.Tensor:
    """Decoded, oriented, RGB, resized to the grid and normalized: [3, H, W] float32."""
    img = open_image(data, max_pixels)
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

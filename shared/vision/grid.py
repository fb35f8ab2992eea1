"""How many placeholder tokens an image becomes: the patch grid after resizing.

The router counts an image's tokens from its header alone (before anything is decoded), and the
encoder resizes the pixels to exactly that grid, so both always agree. The rule (as in
Qwen2-VL's "smart resize"): keep the aspect ratio, round each side to a multiple of
patch × merge, then scale the whole image down (or up) until its token count is within limits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class VisionGrid:
    patch_size: int = 14  # pixels per patch side
    merge: int = 2  # patches per token side: merge × merge patches become one token
    min_tokens: int = 4
    max_tokens: int = 256

    @property
    def factor(self) -> int:
        """Pixels per token side."""
        return self.patch_size * self.merge

    def tokens_hw(self, width: int, height: int) -> tuple[int, int]:
        """(token rows, token columns) for an image of ``width`` × ``height`` pixels."""
        assert width > 0 and height > 0
        f = self.factor
        rows, cols = max(1, round(height / f)), max(1, round(width / f))
        if rows * cols > self.max_tokens:
            scale = math.sqrt(rows * cols / self.max_tokens)
            rows, cols = max(1, math.floor(rows / scale)), max(1, math.floor(cols / scale))
        elif rows * cols < self.min_tokens:
            scale = math.sqrt(self.min_tokens / (rows * cols))
            rows, cols = math.ceil(rows * scale), math.ceil(cols * scale)
        # A very long, thin image: cut the long side so the count stays within the maximum.
        if rows * cols > self.max_tokens:
            if rows >= cols:
                rows = max(1, self.max_tokens // cols)
            else:
                cols = max(1, self.max_tokens // rows)
        return rows, cols

    def tokens(self, width: int, height: int) -> int:
        rows, cols = self.tokens_hw(width, height)
        return rows * cols

    def pixels_hw(self, width: int, height: int) -> tuple[int, int]:
        """The size the encoder resizes the image to: (height, width) in pixels."""
        rows, cols = self.tokens_hw(width, height)
        return rows * self.factor, cols * self.factor

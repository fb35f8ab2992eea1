"""Images: token counts from the grid, header checks, pixels, and the tower's batching."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from shared.vision.grid import VisionGrid
from shared.vision.images import BadImage, decode_data_url, probe

GRID = VisionGrid(patch_size=14, merge=2, min_tokens=4, max_tokens=256)


@pytest.mark.parametrize(
    ("size", "tokens_hw"),
    [
        ((448, 448), (16, 16)),  # exactly the maximum
        ((1920, 1080), (12, 21)),  # scaled down, aspect kept
        ((10, 10), (2, 2)),  # scaled up to the minimum
        ((1, 5000), (179, 1)),  # a thin strip stays within the maximum
        ((20000, 1), (1, 256)),
    ],
)
def test_grid_keeps_aspect_and_limits(size: tuple[int, int], tokens_hw: tuple[int, int]) -> None:
    assert GRID.tokens_hw(*size) == tokens_hw
    assert GRID.min_tokens <= GRID.tokens(*size) <= GRID.max_tokens


def test_a_decompression_bomb_is_refused_from_its_header() -> None:
    out = io.BytesIO()
    Image.new("1", (30000, 30000)).save(out, "PNG")
    assert len(out.getvalue()) < 200_000
    with pytest.raises(BadImage, match="more than 25,000,000 pixels"):
        probe(out.getvalue(), 25_000_000)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:text/plain;base64,aGk=", "media type"),
        ("data:image/png;base64,", "empty"),
        ("file:///etc/passwd", "not a data: URL"),
        ("data:image/png;base64," + "A" * 200, "larger than 100 bytes"),
    ],
)
def test_data_urls_are_checked(url: str, message: str) -> None:
    with pytest.raises(BadImage, match=message):
        decode_data_url(url, 100)

"""Images: token counts from the grid, header checks, pixels, and the tower's batching."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image

from shared.vision.grid import VisionGrid
from shared.vision.images import BadImage, decode_data_url, probe
from shared.vision.pixels import pixels
from shared.vision.tower import TowerConfig, VisionTower

GRID = VisionGrid(patch_size=14, merge=2, min_tokens=4, max_tokens=256)


def encoded(size: tuple[int, int], fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    Image.effect_noise(size, 50).convert("RGB").save(out, fmt, **save)
    return out.getvalue()


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


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_pixels_match_the_grid_the_router_counted(fmt: str) -> None:
    data = encoded((300, 200), fmt)
    info = probe(data, 10**7)
    assert (info.format, info.width, info.height) == (fmt, 300, 200)
    x = pixels(data, GRID, 10**7)
    assert x.shape == (3, *GRID.pixels_hw(300, 200))


def test_exif_rotation_swaps_the_sides_before_counting() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90°
    data = encoded((300, 200), "JPEG", exif=exif)
    info = probe(data, 10**7)
    assert (info.width, info.height) == (200, 300)
    assert pixels(data, GRID, 10**7).shape == (3, *GRID.pixels_hw(200, 300))


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


def test_a_batch_encodes_each_image_as_alone() -> None:
    tower = VisionTower(TowerConfig(hidden=48, grid=GRID, dim=32, layers=2, heads=2))
    a, b = pixels(encoded((300, 200)), GRID, 10**7), pixels(encoded((56, 120)), GRID, 10**7)
    alone = [tower.encode([a])[0], tower.encode([b])[0]]
    together = tower.encode([a, b])
    assert [t.shape for t in together] == [(77, 48), (8, 48)]
    for x, y in zip(together, alone, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


def test_real_weights_load_from_a_file(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    config = TowerConfig(hidden=48, grid=GRID, dim=32, layers=1, heads=2)
    trained = VisionTower(TowerConfig(**{**config.__dict__, "seed": 7}))
    save_file(trained.state_dict(), str(tmp_path / "tiny.safetensors"))
    tower = VisionTower(config)
    x = pixels(encoded((120, 90)), GRID, 10**7)
    assert not torch.equal(tower.encode([x])[0], trained.encode([x])[0])
    tower.load(tmp_path / "tiny.safetensors")
    torch.testing.assert_close(tower.encode([x])[0], trained.encode([x])[0])
    other = VisionTower(TowerConfig(hidden=64, grid=GRID, dim=32, layers=1, heads=2))
    with pytest.raises(ValueError, match="does not fit"):
        other.load(tmp_path / "tiny.safetensors")

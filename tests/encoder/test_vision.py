"""The encoder's side of an image: its pixels on the grid the router counted, and the vision
tower (a batch encodes each image as alone; real weights load from a file)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image

from services.encoder.pixels import pixels
from services.encoder.tower import TowerConfig, VisionTower
from shared.vision.grid import VisionGrid
from shared.vision.images import probe
from tests.images import encoded

GRID = VisionGrid(patch_size=14, merge=2, min_tokens=4, max_tokens=256)


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

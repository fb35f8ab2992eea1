"""A small vision transformer: pixels to embeddings in the language model's hidden size.

    [3, H, W] → patches [P, 3·p·p] → linear → + 2-D sin-cos positions → L pre-norm blocks
    → norm → merge m×m neighbouring patches → MLP projector → [P / m², hidden]

Images of different sizes are batched by padding to the longest and masking the padding out of
attention. No vision weights can be downloaded here: by default the weights are random, from a
seed (the embeddings are then consistent but meaningless to the language model); ``load``
reads real ones from a local safetensors file whose names and shapes match ``state_dict()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from shared.vision.grid import VisionGrid


@dataclass(frozen=True)
class TowerConfig:
    hidden: int  # the language model's hidden size (the projector's output)
    grid: VisionGrid = VisionGrid()
    dim: int = 256
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    seed: int = 0


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, mlp), nn.Linear(mlp, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, n, d = x.shape  # [batch, patches, dim]
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask
        )  # [b, heads, n, d/heads]; mask: [b, 1, 1, n], True where a key is a real patch
        x = x + self.proj(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class VisionTower(nn.Module):
    def __init__(self, config: TowerConfig) -> None:
        super().__init__()
        c = self.config = config
        p, m = c.grid.patch_size, c.grid.merge
        assert c.dim % c.heads == 0 and (c.dim // c.heads) % 4 == 0
        self.patch_embed = nn.Linear(3 * p * p, c.dim)
        self.blocks = nn.ModuleList(
            _Block(c.dim, c.heads, c.dim * c.mlp_ratio) for _ in range(c.layers)
        )
        self.norm = nn.LayerNorm(c.dim)
        self.merger = nn.Sequential(
            nn.Linear(c.dim * m * m, c.hidden), nn.GELU(), nn.Linear(c.hidden, c.hidden)
        )
        gen = torch.Generator().manual_seed(c.seed)
        with torch.no_grad():
            for name, w in self.named_parameters():
                if name.endswith("bias"):
                    w.zero_()
                elif w.dim() > 1:
                    w.normal_(0.0, 0.02, generator=gen)
        self.eval()

    def load(self, path: Path) -> None:
        """Real weights from a safetensors file (names and shapes as ``state_dict()``)."""
        from safetensors.torch import load_file

        weights = load_file(str(path))
        mine = self.state_dict()
        missing = sorted(set(mine) - set(weights))
        wrong = [k for k in mine if k in weights and weights[k].shape != mine[k].shape]
        if missing or wrong:
            raise ValueError(
                f"{path}: does not fit this tower (missing {missing[:3]}, wrong shape {wrong[:3]})"
            )
        self.load_state_dict({k: weights[k].float() for k in mine})

    def tokens(self, image: torch.Tensor) -> int:
        """Embeddings ``encode`` returns for this [3, H, W] image."""
        f = self.config.grid.factor
        return (image.shape[1] // f) * (image.shape[2] // f)

    @torch.inference_mode()
    def encode(self, images: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each [3, H, W] image (H, W multiples of patch × merge) → [tokens, hidden]."""
        c = self.config
        p, m = c.grid.patch_size, c.grid.merge
        seqs, shapes = [], []
        for img in images:
            _, h, w = img.shape
            gh, gw = h // p, w // p
            assert gh % m == 0 and gw % m == 0, "resize to the grid first"
            # Patches ordered so each token's m×m patches are adjacent: [gh/m, gw/m, m, m, 3pp].
            x = img.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)
            seqs.append(x.reshape(gh * gw, 3 * p * p))
            shapes.append((gh, gw))
        longest = max(s.shape[0] for s in seqs)
        x = torch.zeros(len(seqs), longest, 3 * p * p)
        mask = torch.zeros(len(seqs), 1, 1, longest, dtype=torch.bool)
        pos = torch.zeros(len(seqs), longest, c.dim)
        for i, (s, (gh, gw)) in enumerate(zip(seqs, shapes, strict=True)):
            x[i, : len(s)] = s
            mask[i, ..., : len(s)] = True
            pos[i, : len(s)] = _positions(gh, gw, m, c.dim)
        x = self.patch_embed(x) + pos
        full = all(len(s) == longest for s in seqs)
        for block in self.blocks:
            x = block(x, None if full else mask)
        x = self.norm(x)
        out = []
        for i, s in enumerate(seqs):
            merged = x[i, : len(s)].reshape(len(s) // (m * m), m * m * c.dim)
            out.append(self.merger(merged))
        return out


def _positions(gh: int, gw: int, m: int, dim: int) -> torch.Tensor:
    """2-D sin-cos position of each patch, in the merge-friendly order: [gh·gw, dim]."""
    rows = torch.arange(gh).view(gh // m, m, 1, 1).expand(gh // m, m, gw // m, m)
    cols = torch.arange(gw).view(1, 1, gw // m, m).expand(gh // m, m, gw // m, m)
    rows = rows.permute(0, 2, 1, 3).reshape(-1).float()
    cols = cols.permute(0, 2, 1, 3).reshape(-1).float()
    quarter = dim // 4
    freq = torch.exp(-math.log(10000.0) * torch.arange(quarter) / quarter)
    r, c = rows[:, None] * freq, cols[:, None] * freq
    return torch.cat([r.sin(), r.cos(), c.sin(), c.cos()], dim=1)

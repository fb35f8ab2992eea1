"""The matrix product decode and verification spend their time in: x times a weight
transposed, laid out for this machine's threads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PANELS = 2  # one per core here
SMALL_M = 4  # up to this many rows, the weight-first product is the faster one


def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, in] times the weight w [out, in] transposed → [M, out].

    One bmm over ``PANELS`` row blocks of w (views: no copy), so the blocks run in parallel
    (torch's one-row matrix product runs on a single thread) and each reads its rows of w in
    order, once. Decode and verification read every weight every step, so this is where
    their time goes. Which operand goes first matters by M (measured here): for a few rows
    the block times xᵀ (BLAS's small-N path reads the weight once) is up to twice as fast;
    from about five rows x times the block's transpose is (the small-N path stops paying)."""
    m = x.shape[0]
    out_dim, in_dim = w.shape
    if out_dim % PANELS or x.is_cuda:  # (a GPU's own kernels split the work themselves)
        return F.linear(x, w)
    blocks = w.unflatten(0, (PANELS, out_dim // PANELS))  # (w may be strided: LoRA's fused)
    if m > SMALL_M:
        y = torch.bmm(x.unsqueeze(0).expand(PANELS, -1, -1), blocks.transpose(1, 2))
        return y.transpose(0, 1).reshape(m, out_dim)  # [P, M, out/P] → [M, out]
    y = torch.bmm(blocks, x.t().unsqueeze(0).expand(PANELS, -1, -1))  # [P, out/P, M]
    # (row-major again: a [M, out] view of y would be column-major, and every later op on it,
    # attention included, would take a slow strided path)
    return y.permute(2, 0, 1).contiguous().view(m, out_dim)

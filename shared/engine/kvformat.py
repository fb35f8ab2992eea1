"""KV blocks as bytes: to ship to another process or to write to the storage tier.

Layout: MAGIC, a 4-byte little-endian header length, a JSON header, then the data as cells.
A cell is one layer's K then V for one block: [block_size, G, E] each, in the header's dtype.
Cells are ordered layer-major (layer 0 blocks 0..n-1, layer 1 ...), so a reader can seek to
exactly the cells it needs: a sliding-window layer needs only the blocks inside its window.
Each cell has its own CRC32 in the header; a reader checks every cell it reads.
"""

from __future__ import annotations

import io
import json
import struct
import zlib
from dataclasses import asdict, dataclass
from typing import BinaryIO

import numpy as np
import torch

from shared.engine.interface import KV_DTYPES, KVFormatError

MAGIC = b"KVMESH\x01\n"
DTYPES = {name: getattr(torch, name) for name in KV_DTYPES}


@dataclass(frozen=True)
class KVHeader:
    fingerprint: str  # ModelConfig.fingerprint of the model that computed the KV
    dtype: str
    block_size: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    windows: list[int]  # per layer: its attention window, 0 for full attention
    n_blocks: int
    n_tokens: int  # tokens with KV: the last block may be partial (a handoff's prompt)
    crc32: list[int]  # per cell, layer-major

    @property
    def cell_bytes(self) -> int:
        itemsize = torch.empty(0, dtype=DTYPES[self.dtype]).element_size()
        return 2 * self.block_size * self.n_kv_heads * self.head_dim * itemsize

    def cell_index(self, layer: int, block: int) -> int:
        return layer * self.n_blocks + block

    def first_needed_block(self, layer: int) -> int:
        return first_needed_block(self.windows[layer], self.n_tokens, self.block_size)


def first_needed_block(window: int, n_tokens: int, block_size: int) -> int:
    """The first block the token after ``n_tokens`` can attend to at a layer with this window
    (0: full attention); a window layer skips the blocks before it."""
    if not window:
        return 0
    return max(0, n_tokens - window + 1) // block_size


def _from_bytes(data: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bfloat16:
        return torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(dtype).view(shape)
    np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    return torch.from_numpy(np.frombuffer(data, dtype=np_dtype).copy()).view(shape)


def encode(header_fields: dict, k: torch.Tensor, v: torch.Tensor) -> bytes:
    """k, v: [layers, n_blocks, block_size, G, E] in the dtype to store."""
    return b"".join(encode_parts(header_fields, k, v))


def encode_parts(header_fields: dict, k: torch.Tensor, v: torch.Tensor) -> list:
    """``encode``'s bytes in parts: the header, then each cell's K and V as views of ``k`` and
    ``v`` (made contiguous once, not copied again), for a writer that takes parts as they are
    (``FileStore.put_parts``: one writev)."""
    k_raw, v_raw = _raw(k), _raw(v)
    parts: list = []
    crcs = []
    for layer in range(k_raw.shape[0]):
        for block in range(k_raw.shape[1]):
            kc = memoryview(k_raw[layer, block]).cast("B")
            vc = memoryview(v_raw[layer, block]).cast("B")
            crcs.append(zlib.crc32(vc, zlib.crc32(kc)))  # (the CRC of K then V)
            parts += [kc, vc]
    header = KVHeader(**header_fields, crc32=crcs)
    blob = json.dumps(asdict(header)).encode()
    return [MAGIC + struct.pack("<I", len(blob)) + blob, *parts]


def _raw(t: torch.Tensor) -> np.ndarray:
    """A tensor's memory as a contiguous numpy array (bfloat16's 16-bit words as int16)."""
    t = t.contiguous()
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def checked(header: KVHeader, data: memoryview, check: bool = True) -> memoryview:
    """The cells' bytes of a blob whose data starts ``data``, every cell's CRC checked
    (unless not ``check``: the length is, always)."""
    size, count = header.cell_bytes, len(header.crc32)
    data = data[: size * count]
    if len(data) < size * count:
        raise KVFormatError(f"KV data truncated: {len(data)} of {size * count} bytes")
    if check:
        check_cells(header, data, 0, count)
    return data


def check_cells(header: KVHeader, data: memoryview, first: int, last: int) -> None:
    """Cells ``first`` .. ``last - 1`` of ``data`` (a blob's cells) against their CRCs."""
    size = header.cell_bytes
    for i in range(first, last):
        if zlib.crc32(data[i * size : (i + 1) * size]) != header.crc32[i]:
            layer, block = divmod(i, header.n_blocks)
            raise KVFormatError(f"KV checksum mismatch at layer {layer} block {block}")


def raw_view(t: torch.Tensor) -> np.ndarray:
    """A contiguous host tensor's memory as bytes (a writable numpy view)."""
    return _raw(t).view(np.uint8).reshape(-1)


def all_cells(source: bytearray | memoryview) -> tuple[KVHeader, torch.Tensor]:
    """A blob's header and every cell at once, as one tensor [layers, blocks, 2 (K, V),
    block_size, G, E] over the blob's own memory (no copy: ``source`` must be writable),
    every cell's CRC checked first."""
    view = memoryview(source).cast("B")
    header, start = read_header(as_reader(view))
    data = checked(header, view[start:])
    count = len(header.crc32)
    shape = (header.n_layers, header.n_blocks, 2, header.block_size, header.n_kv_heads)
    cells = torch.frombuffer(data, dtype=DTYPES[header.dtype]) if count else torch.empty(0)
    return header, cells.view(*shape, header.head_dim)


def read_header(f: BinaryIO) -> tuple[KVHeader, int]:
    """The header and the offset where the data starts."""
    head = f.read(len(MAGIC) + 4)
    if len(head) < len(MAGIC) + 4 or head[: len(MAGIC)] != MAGIC:
        raise KVFormatError("not kvmesh KV data (bad magic)")
    (size,) = struct.unpack("<I", head[len(MAGIC) :])
    try:
        header = KVHeader(**json.loads(bytes(f.read(size))))
    except (ValueError, TypeError) as err:
        raise KVFormatError(f"damaged KV header: {err}") from None
    if len(header.crc32) != header.n_layers * header.n_blocks or header.dtype not in DTYPES:
        raise KVFormatError("damaged KV header: inconsistent fields")
    return header, len(MAGIC) + 4 + size


def read_cell(
    f: BinaryIO, header: KVHeader, data_start: int, layer: int, block: int, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V for one block, [block_size, G, E] each; checksum verified (unless
    not ``check``)."""
    index = header.cell_index(layer, block)
    f.seek(data_start + index * header.cell_bytes)
    cell = f.read(header.cell_bytes)
    if len(cell) != header.cell_bytes:
        raise KVFormatError(f"KV data truncated at layer {layer} block {block}")
    if check and zlib.crc32(cell) != header.crc32[index]:
        raise KVFormatError(f"KV checksum mismatch at layer {layer} block {block}")
    shape = (header.block_size, header.n_kv_heads, header.head_dim)
    dtype = DTYPES[header.dtype]
    half = header.cell_bytes // 2
    return _from_bytes(cell[:half], dtype, shape), _from_bytes(cell[half:], dtype, shape)


class _ViewReader:
    """read/seek over a buffer without copying it first (io.BytesIO copies a memoryview)."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.pos = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.view) if n < 0 else min(len(self.view), self.pos + n)
        data = self.view[self.pos : end]
        self.pos = end
        return data  # type: ignore[return-value]  # a view: callers only slice and unpack

    def seek(self, pos: int) -> int:
        self.pos = pos
        return pos


def as_reader(source: bytes | bytearray | memoryview | BinaryIO) -> BinaryIO:
    if isinstance(source, bytes):
        return io.BytesIO(source)  # shares the bytes, no copy
    if isinstance(source, bytearray | memoryview):
        return _ViewReader(memoryview(source).cast("B"))  # type: ignore[return-value]
    return source

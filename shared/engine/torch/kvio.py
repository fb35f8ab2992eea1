"""KV export and import for the torch engine: a sequence's blocks as kvformat bytes (for a
handoff, or one blob per block for the storage tiers), and bytes back into pool blocks.

Blocks cross between the cache and the bytes in one copy each way: gathered (or scattered)
by one indexed copy, staged in one host buffer (pinned on a GPU: the copy engine reads and
writes it directly, no bounce buffer), and encoded from or decoded into it, a block a view
of it. A model with window layers loads cell by cell (a window layer skips old blocks)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import BinaryIO

import numpy as np
import torch

from shared.engine import kvformat
from shared.engine.interface import BadBlock, Prefix
from shared.engine.torch.blocks import BlockPool
from shared.engine.torch.model import KVCache
from shared.engine.torch.sequence import Sequence
from shared.model.config import ModelConfig

STAGING_THREADS = 8
# Blobs this small are checked and staged on the calling thread: handing their layers or
# blocks to the staging threads costs more (their wake-ups) than the work (crc32: ~1 GB/s).
CHECK_ALONE_BYTES = 1 << 20


class KvIO:
    """Reads and writes one engine's cache; holds no state of its own."""

    def __init__(self, config: ModelConfig, pool: BlockPool, cache: KVCache, dtype: str) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.cache = cache
        self.dtype = dtype  # the cache's, and what is exported unless asked otherwise
        self._pool: ThreadPoolExecutor | None = None  # (staging copies and checks)
        # Whole blocks (no window layer skips any) are staged in one buffer, one copy each way.
        self.windowed = any(map(config.window, range(config.n_layers)))

    def _header_fields(self, n_blocks: int, n_tokens: int, dtype: str) -> dict:
        c = self.config
        return dict(
            fingerprint=c.fingerprint,
            dtype=dtype,
            block_size=self.block_size,
            n_layers=c.n_layers,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            windows=[c.window(i) for i in range(c.n_layers)],
            n_blocks=n_blocks,
            n_tokens=n_tokens,
        )

    def export_kv(self, seq: Sequence, dtype: str | None = None, partial: bool = False) -> bytes:
        dtype = dtype or self.dtype
        bs = self.block_size
        n_tokens = seq.n_cached if partial else seq.n_cached // bs * bs
        n_blocks = self.pool.blocks_for(n_tokens)
        slots = seq.slots(bs, n_blocks * bs).to(self.cache.k.device)
        shape = (self.config.n_layers, n_blocks, bs, self.config.n_kv_heads, -1)
        k = _host(self.cache.k[:, slots].reshape(shape).to(kvformat.DTYPES[dtype]))
        v = _host(self.cache.v[:, slots].reshape(shape).to(kvformat.DTYPES[dtype]))
        return kvformat.encode(self._header_fields(n_blocks, n_tokens, dtype), k, v)

    def export_blocks(
        self, seq: Sequence, first: int, last: int, dtype: str | None = None
    ) -> list[bytes]:
        """Blocks ``first``..``last`` of the sequence, a blob each: gathered block-major in one
        indexed copy (and one copy to the host), each blob encoded from its block's view."""
        bs = self.block_size
        assert last * bs <= seq.n_cached, "only blocks whose KV is computed"
        if last <= first:
            return []
        dtype = dtype or self.dtype
        n = last - first
        slots = self._slots(seq.block_table[first:last])
        shape = (self.config.n_layers, n, bs, self.config.n_kv_heads, -1)
        # [layers, n, bs, G, E] → [n, layers, 1, bs, G, E]: a block's cells contiguous
        k, v = (
            _host(
                c[:, slots]
                .reshape(shape)
                .to(kvformat.DTYPES[dtype])
                .transpose(0, 1)
                .unsqueeze(2)
                .contiguous()
            )
            for c in (self.cache.k, self.cache.v)
        )
        fields = self._header_fields(1, bs, dtype)
        return [kvformat.encode(fields, k[b], v[b]) for b in range(n)]

    def import_blocks(self, sources: list[bytes | BinaryIO], trusted: int = 0) -> Prefix:
        """A window layer reads only blocks inside its window. The first ``trusted`` sources'
        checksums are not read (the engine's ``import_blocks``)."""
        bs = self.block_size
        n_tokens = len(sources) * bs
        blocks = self.pool.allocate(len(sources))
        try:
            if not self.windowed:
                self._staged(sources, blocks, trusted)
                return Prefix(tuple(blocks), n_tokens)
            for i, source in enumerate(sources):
                f = kvformat.as_reader(source)
                try:
                    header, data_start = self.read_header(f)
                    if header.n_blocks != 1 or header.n_tokens != bs:
                        raise kvformat.KVFormatError("not a single full block")
                    for layer in range(self.config.n_layers):
                        window = self.config.window(layer)
                        if i < kvformat.first_needed_block(window, n_tokens, bs):
                            continue
                        cell = kvformat.read_cell(f, header, data_start, layer, 0, i >= trusted)
                        self._put(layer, blocks[i], *cell)
                except kvformat.KVFormatError as err:
                    raise BadBlock(i, str(err)) from None
        except Exception:
            self.pool.free(blocks)
            raise
        return Prefix(tuple(blocks), n_tokens)

    def import_kv(self, source: bytes | BinaryIO) -> Prefix:
        f = kvformat.as_reader(source)
        header, data_start = self.read_header(f)
        blocks = self.pool.allocate(header.n_blocks)
        try:
            self.write_cells(f, header, data_start, blocks)
        except Exception:
            self.pool.free(blocks)
            raise
        return Prefix(tuple(blocks), header.n_tokens)

    def _staged(self, sources: list[bytes | BinaryIO], blocks: list[int], trusted: int) -> None:
        """Whole blocks (no window layers): each blob's cells checked and copied into one
        staging buffer (by several threads: zlib and numpy let go of the GIL), which goes to
        the cache's device in one copy and is scattered into the blocks' slots there."""
        c, bs = self.config, self.block_size
        sources = [
            s if isinstance(s, bytes | bytearray | memoryview) else s.read() for s in sources
        ]
        headers, starts = [], []
        for i, source in enumerate(sources):
            try:
                header, start = kvformat.read_header(kvformat.as_reader(source))
                self.check_header(header)
                if header.n_blocks != 1 or header.n_tokens != bs:
                    raise kvformat.KVFormatError("not a single full block")
                if header.dtype != (headers[0].dtype if headers else header.dtype):
                    raise kvformat.KVFormatError(f"dtype {header.dtype}, not {headers[0].dtype}")
            except kvformat.KVFormatError as err:
                raise BadBlock(i, str(err)) from None
            headers.append(header)
            starts.append(start)
        shape = (len(sources), c.n_layers, 2, bs, c.n_kv_heads, c.head_dim)
        staged = self._host_buffer(shape, kvformat.DTYPES[headers[0].dtype])

        def stage(i: int) -> None:
            try:
                view = memoryview(sources[i]).cast("B")[starts[i] :]
                data = kvformat.checked(headers[i], view, check=i >= trusted)
            except kvformat.KVFormatError as err:
                raise BadBlock(i, str(err)) from None
            kvformat.raw_view(staged[i])[:] = np.frombuffer(data, dtype=np.uint8)

        if sum(len(s) for s in sources) <= CHECK_ALONE_BYTES:
            for i in range(len(sources)):
                stage(i)
        else:
            for done in self._threads().map(stage, range(len(sources))):
                assert done is None  # (raises the first block's error, in order)
        self._scatter(staged.to(self.cache.k.device, non_blocking=True), blocks)

    def _host_buffer(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Where blocks are staged on the host: pinned when they go on to a GPU."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cache.k.is_cuda)

    def _threads(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(STAGING_THREADS, thread_name_prefix="kv-staging")
        return self._pool

    def _scatter(self, cells: torch.Tensor, blocks: list[int]) -> None:
        """``cells`` [n, layers, 2 (K, V), bs, G, E] on the cache's device into ``blocks``, one
        indexed copy for K and one for V."""
        c = self.config
        slots = self._slots(blocks)
        for part, cache in enumerate((self.cache.k, self.cache.v)):
            # [n, layers, bs, G, E] → [layers, n·bs, G, E]
            x = cells[:, :, part].transpose(0, 1).reshape(c.n_layers, -1, c.n_kv_heads, c.head_dim)
            cache[:, slots] = x.to(cache.dtype)

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        """The cache slots of whole ``blocks``, in order, on the cache's device."""
        ids = torch.tensor(blocks, dtype=torch.int64)
        slots = ids.unsqueeze(1) * self.block_size + torch.arange(self.block_size)
        return slots.flatten().to(self.cache.k.device)

    def read_header(self, f: BinaryIO) -> tuple[kvformat.KVHeader, int]:
        """The blob's header, checked against this engine's model and layout."""
        header, data_start = kvformat.read_header(f)
        self.check_header(header)
        return header, data_start

    def check_header(self, header: kvformat.KVHeader) -> None:
        """Raises unless the KV is this engine's model's, in its layout."""
        expected = self._header_fields(header.n_blocks, header.n_tokens, header.dtype)
        for key in ("fingerprint", "block_size", "n_layers", "n_kv_heads", "head_dim", "windows"):
            if getattr(header, key) != expected[key]:
                raise kvformat.KVFormatError(
                    f"KV is for another model or layout: {key} is {getattr(header, key)!r}, "
                    f"this engine has {expected[key]!r}"
                )

    def write_cells(
        self, f: BinaryIO, header: kvformat.KVHeader, data_start: int, blocks: list[int]
    ) -> None:
        """Every cell a layer needs, from the blob into ``blocks`` (block i of the blob into
        ``blocks[i]``). Whole blocks (no window layers) cross in one copy."""
        c = self.config
        if not self.windowed:
            f.seek(data_start)
            data = kvformat.checked(header, memoryview(f.read()).cast("B"), check=False)
            per_layer = header.n_blocks  # (the cells checked a layer a thread)
            if len(data) <= CHECK_ALONE_BYTES:
                kvformat.check_cells(header, data, 0, header.n_layers * per_layer)
            else:
                spans = [(n * per_layer, (n + 1) * per_layer) for n in range(header.n_layers)]
                for done in self._threads().map(
                    lambda r: kvformat.check_cells(header, data, *r), spans
                ):
                    assert done is None
            shape = (c.n_layers, header.n_blocks, 2, header.block_size, c.n_kv_heads, c.head_dim)
            staged = self._host_buffer(shape, kvformat.DTYPES[header.dtype])
            kvformat.raw_view(staged)[:] = np.frombuffer(data, dtype=np.uint8)
            cells = staged.to(self.cache.k.device, non_blocking=True).transpose(0, 1)
            self._scatter(cells, blocks[: header.n_blocks])
            return
        for layer in range(header.n_layers):
            for b in range(header.first_needed_block(layer), header.n_blocks):
                self._put(layer, blocks[b], *kvformat.read_cell(f, header, data_start, layer, b))

    def _put(self, layer: int, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        base = block * self.block_size
        self.cache.k[layer, base : base + self.block_size] = k.to(self.cache.k.dtype)
        self.cache.v[layer, base : base + self.block_size] = v.to(self.cache.v.dtype)


def _host(t: torch.Tensor) -> torch.Tensor:
    """``t`` in host memory: a device tensor copied once into a pinned buffer (the copy engine
    writes it directly; torch's host allocator keeps such buffers for reuse)."""
    if not t.is_cuda:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out

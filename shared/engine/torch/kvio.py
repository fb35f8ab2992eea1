"""KV export and import for the torch engine: a sequence's blocks as kvformat bytes (for a
handoff, or one blob per block for the storage tiers), and bytes back into pool blocks."""

from __future__ import annotations

from typing import BinaryIO

import torch

from shared.engine import kvformat
from shared.engine.interface import Prefix
from shared.engine.torch.blocks import BlockPool
from shared.engine.torch.model import KVCache
from shared.engine.torch.sequence import Sequence
from shared.model.config import ModelConfig


class KvIO:
    """Reads and writes one engine's cache; holds no state of its own."""

    def __init__(self, config: ModelConfig, pool: BlockPool, cache: KVCache, dtype: str) -> None:
        self.config = config
        self.pool = pool
        self.block_size = pool.block_size
        self.cache = cache
        self.dtype = dtype  # the cache's, and what is exported unless asked otherwise

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
        slots = seq.slots(bs, n_blocks * bs)
        shape = (self.config.n_layers, n_blocks, bs, self.config.n_kv_heads, -1)
        k = self.cache.k[:, slots].reshape(shape).to(kvformat.DTYPES[dtype])
        v = self.cache.v[:, slots].reshape(shape).to(kvformat.DTYPES[dtype])
        return kvformat.encode(self._header_fields(n_blocks, n_tokens, dtype), k, v)

    def export_blocks(
        self, seq: Sequence, first: int, last: int, dtype: str | None = None
    ) -> list[bytes]:
        bs = self.block_size
        assert last * bs <= seq.n_cached, "only blocks whose KV is computed"
        dtype = dtype or self.dtype
        shape = (self.config.n_layers, 1, bs, self.config.n_kv_heads, -1)
        blobs = []
        for b in range(first, last):
            base = seq.block_table[b] * bs
            k = self.cache.k[:, base : base + bs].reshape(shape).to(kvformat.DTYPES[dtype])
            v = self.cache.v[:, base : base + bs].reshape(shape).to(kvformat.DTYPES[dtype])
            blobs.append(kvformat.encode(self._header_fields(1, bs, dtype), k, v))
        return blobs

    def import_blocks(self, sources: list[bytes | BinaryIO]) -> Prefix:
        """A window layer reads only blocks inside its window."""
        bs = self.block_size
        n_tokens = len(sources) * bs
        blocks = self.pool.allocate(len(sources))
        try:
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
                        self._put(
                            layer, blocks[i], *kvformat.read_cell(f, header, data_start, layer, 0)
                        )
                except kvformat.KVFormatError as err:
                    raise kvformat.BadBlock(i, str(err)) from None
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

    def read_header(self, f: BinaryIO) -> tuple[kvformat.KVHeader, int]:
        """The blob's header, checked against this engine's model and layout."""
        header, data_start = kvformat.read_header(f)
        expected = self._header_fields(header.n_blocks, header.n_tokens, header.dtype)
        for key in ("fingerprint", "block_size", "n_layers", "n_kv_heads", "head_dim", "windows"):
            if getattr(header, key) != expected[key]:
                raise kvformat.KVFormatError(
                    f"KV is for another model or layout: {key} is {getattr(header, key)!r}, "
                    f"this engine has {expected[key]!r}"
                )
        return header, data_start

    def write_cells(
        self, f: BinaryIO, header: kvformat.KVHeader, data_start: int, blocks: list[int]
    ) -> None:
        """Every cell a layer needs, from the blob into ``blocks`` (block i of the blob into
        ``blocks[i]``)."""
        for layer in range(header.n_layers):
            for b in range(header.first_needed_block(layer), header.n_blocks):
                self._put(layer, blocks[b], *kvformat.read_cell(f, header, data_start, layer, b))

    def _put(self, layer: int, block: int, k: torch.Tensor, v: torch.Tensor) -> None:
        base = block * self.block_size
        self.cache.k[layer, base : base + self.block_size] = k.to(self.cache.k.dtype)
        self.cache.v[layer, base : base + self.block_size] = v.to(self.cache.v.dtype)

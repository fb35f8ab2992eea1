"""KV export and import for the torch engine: a sequence's blocks as kvformat bytes (for a
handoff, or one blob per block for the storage tiers), and bytes back into fresh blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO

from shared.engine import kvformat

if TYPE_CHECKING:
    import torch

    from shared.engine.blocks import BlockPool
    from shared.engine.config import ModelConfig
    from shared.engine.engine import EngineOptions
    from shared.engine.model import KVCache
    from shared.engine.sequence import Sequence


@dataclass(frozen=True)
class Prefix:
    """A hold on cached KV blocks covering the first ``n_tokens`` of some token sequence."""

    block_ids: tuple[int, ...]
    n_tokens: int


class KvIO:
    """Mixed into TorchEngine: uses its config, block size, pool, cache and sequences."""

    config: ModelConfig
    block_size: int
    options: EngineOptions
    pool: BlockPool
    cache: KVCache
    dtype: torch.dtype
    seqs: dict[str, Sequence]

    # -- KV export and import --------------------------------------------------------------

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

    def export_kv(self, seq_id: str, dtype: str | None = None, partial: bool = False) -> bytes:
        """``partial``: include the last, partly filled block (a handoff ships the whole prompt;
        a cache keeps whole blocks only)."""
        seq = self.seqs[seq_id]
        dtype = dtype or self.options.dtype
        n_tokens = seq.n_cached if partial else seq.n_cached // self.block_size * self.block_size
        n_blocks = self.pool.blocks_for(n_tokens)
        slots = seq.slots(self.block_size, n_blocks * self.block_size)
        shape = (self.config.n_layers, n_blocks, self.block_size, self.config.n_kv_heads, -1)
        k = self.cache.k[:, slots].reshape(shape).to(kvformat.DTYPES[dtype])
        v = self.cache.v[:, slots].reshape(shape).to(kvformat.DTYPES[dtype])
        return kvformat.encode(self._header_fields(n_blocks, n_tokens, dtype), k, v)

    def export_blocks(
        self, seq_id: str, first: int, last: int, dtype: str | None = None
    ) -> list[bytes]:
        """Full blocks ``first`` .. ``last - 1`` of a sequence, one kvformat blob each (what the
        storage tiers keep, keyed by block hash)."""
        seq = self.seqs[seq_id]
        bs = self.block_size
        assert last * bs <= seq.n_cached, "only blocks whose KV is computed"
        dtype = dtype or self.options.dtype
        shape = (self.config.n_layers, 1, bs, self.config.n_kv_heads, -1)
        blobs = []
        for b in range(first, last):
            base = seq.block_table[b] * bs
            k = self.cache.k[:, base : base + bs].reshape(shape).to(kvformat.DTYPES[dtype])
            v = self.cache.v[:, base : base + bs].reshape(shape).to(kvformat.DTYPES[dtype])
            blobs.append(kvformat.encode(self._header_fields(1, bs, dtype), k, v))
        return blobs

    def import_blocks(self, sources: list[bytes | BinaryIO]) -> Prefix:
        """Load single-block blobs (block i of a prefix from ``sources[i]``) into fresh blocks
        and hold them, like import_kv. A window layer reads only blocks inside its window.
        Every cell read is checksummed; a bad block raises BadBlock naming its index (nothing
        is held then)."""
        bs = self.block_size
        n_tokens = len(sources) * bs
        blocks = self.pool.allocate(len(sources))
        try:
            for i, source in enumerate(sources):
                f = kvformat.as_reader(source)
                try:
                    header, data_start = self._read_header(f)
                    if header.n_blocks != 1 or header.n_tokens != bs:
                        raise kvformat.KVFormatError("not a single full block")
                    base = blocks[i] * bs
                    for layer in range(self.config.n_layers):
                        window = self.config.window(layer)
                        if i < kvformat.first_needed_block(window, n_tokens, bs):
                            continue
                        k, v = kvformat.read_cell(f, header, data_start, layer, 0)
                        self.cache.k[layer, base : base + bs] = k.to(self.dtype)
                        self.cache.v[layer, base : base + bs] = v.to(self.dtype)
                except kvformat.KVFormatError as err:
                    raise kvformat.BadBlock(i, str(err)) from None
        except Exception:
            self.pool.free(blocks)
            raise
        return Prefix(tuple(blocks), n_tokens)

    def _read_header(self, f: BinaryIO) -> tuple[kvformat.KVHeader, int]:
        header, data_start = kvformat.read_header(f)
        expected = self._header_fields(header.n_blocks, header.n_tokens, header.dtype)
        for key in ("fingerprint", "block_size", "n_layers", "n_kv_heads", "head_dim", "windows"):
            if getattr(header, key) != expected[key]:
                raise kvformat.KVFormatError(
                    f"KV is for another model or layout: {key} is {getattr(header, key)!r}, "
                    f"this engine has {expected[key]!r}"
                )
        return header, data_start

    def _write_cells(
        self, f: BinaryIO, header: kvformat.KVHeader, data_start: int, blocks: list[int]
    ) -> None:
        for layer in range(header.n_layers):
            for b in range(header.first_needed_block(layer), header.n_blocks):
                k, v = kvformat.read_cell(f, header, data_start, layer, b)
                base = blocks[b] * self.block_size
                self.cache.k[layer, base : base + self.block_size] = k.to(self.dtype)
                self.cache.v[layer, base : base + self.block_size] = v.to(self.dtype)

    def import_kv(self, source: bytes | BinaryIO) -> Prefix:
        f = kvformat.as_reader(source)
        header, data_start = self._read_header(f)
        blocks = self.pool.allocate(header.n_blocks)
        try:
            self._write_cells(f, header, data_start, blocks)
        except Exception:
            self.pool.free(blocks)
            raise
        return Prefix(tuple(blocks), header.n_tokens)

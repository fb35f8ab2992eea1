"""The paged KV cache's bookkeeping: a pool of fixed-size blocks with reference counts.

Pure and synchronous. A sequence owns a block table (block ids in token order); sequences that
share a prefix share its blocks, each share counted, and a block returns to the free list
when its last user frees it.
"""

from __future__ import annotations

from collections import deque

from shared.engine.interface import PoolExhausted


class BlockPool:
    def __init__(self, n_blocks: int, block_size: int) -> None:
        assert n_blocks > 0 and block_size > 0
        self.n_blocks = n_blocks
        self.block_size = block_size
        self.refcount = [0] * n_blocks
        self._free: deque[int] = deque(range(n_blocks))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        return self.n_blocks - len(self._free)

    def blocks_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    def can_allocate(self, n_blocks: int) -> bool:
        return n_blocks <= len(self._free)

    def allocate(self, n_blocks: int) -> list[int]:
        if not self.can_allocate(n_blocks):
            raise PoolExhausted(
                f"KV cache full: {n_blocks} blocks of {self.block_size} tokens needed, "
                f"{len(self._free)} of {self.n_blocks} free"
            )
        ids = [self._free.popleft() for _ in range(n_blocks)]
        for i in ids:
            self.refcount[i] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """Another sequence starts using these (already allocated) blocks."""
        for i in ids:
            assert self.refcount[i] > 0, f"block {i} is free; it cannot be shared"
            self.refcount[i] += 1

    def free(self, ids: list[int]) -> None:
        for i in ids:
            assert self.refcount[i] > 0, f"block {i} freed twice"
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                self._free.append(i)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for i, count in enumerate(self.refcount):
            assert count >= 0, f"block {i} has a negative reference count"
            assert (count == 0) == (i in free), f"block {i}: refcount {count} vs free list"

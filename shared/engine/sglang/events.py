"""SGLang's KV events as kvmesh's (``shared/engine/bridge.py``).

SGLang's ``BlockStored`` carries its event ids (the first 8 bytes of a hash chain of its own),
the parent's, the blocks' token ids (consecutive stores merged into one event: split here by
the block size) and the request's ``cache_salt``. Each stored block gets the hash SGLang names
its page with in storage (SHA-256 chained from the ``cache_salt``'s seed:
``shared/kvstore/hashing.py``), which the router computes for the same prompt: a lookup finds
SGLang's blocks in its GPU and host memory and in the storage tier under one hash. A block is
the worker's while its GPU memory or its host memory (``CPU_PINNED``) holds it.

SGLang keeps its last batches for replay: the bridge asks for what it missed (its
``replay_endpoint``).
"""

from __future__ import annotations

import logging
import struct
from typing import Any

from shared.engine.bridge import KvEventBridge
from shared.kvstore.hashing import sglang_chain, sglang_seed

log = logging.getLogger(__name__)


class SglangEventBridge(KvEventBridge):
    def chain(self, event: Any, parent: str | None) -> list[str]:
        tokens = event.token_ids
        if tokens and not isinstance(tokens[0], int):  # (an EAGLE bigram page: not kvmesh's)
            return []
        packed = struct.pack(f"<{len(tokens)}I", *tokens)
        prev = bytes.fromhex(parent) if parent else sglang_seed(event.cache_salt)
        return sglang_chain(packed, self.block_size, prev)

    def stored(self, event: Any, medium: str) -> list[str]:
        # A merged event says the size of each block it holds: as many ids as full blocks.
        if event.block_size == self.block_size and len(event.token_ids) != self.block_size * len(
            event.block_hashes
        ):
            log.warning(
                "SGLang stored %d ids for %d tokens", len(event.block_hashes), len(event.token_ids)
            )
            return []
        return super().stored(event, medium)

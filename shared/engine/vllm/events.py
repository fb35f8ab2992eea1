"""vLLM's KV events as kvmesh's (``shared/engine/bridge.py``): vLLM's ``BlockStored`` carries
the blocks' token ids, its hashes and its parent block's hash; each stored block gets
**kvmesh's** hash, recomputed from its tokens and chained on its parent's kvmesh hash (the
first block's chain starts from the model's fingerprint, the block size and the tenant salt
vLLM carries as the block's ``cache_salt`` extra key), so the router's lookup for a prompt
finds vLLM's blocks as it finds the torch engine's. A vLLM server's publisher keeps its last
batches for replay when started with a ``replay_endpoint``: the bridge asks it for what it
missed.

The storage connector's events (``shared/engine/vllm/connector.py``) come through vLLM's
publisher too, under a medium of their own; they carry kvmesh's hashes already and are the
storage tier's.
"""

from __future__ import annotations

import logging
from typing import Any

from shared.engine.bridge import KvEventBridge
from shared.engine.interface import BlockEvents
from shared.kvstore.hashing import pack_tokens, packed_block_hashes
from shared.messages.kvevents import STORAGE
from shared.model.lora import kv_fingerprint

# The medium of the storage connector's events, which carry kvmesh's hashes already:
# "kvmesh:<retention>:<bytes of each block's file>" (vLLM's events have no field for a size).
STORAGE_MEDIUM = "kvmesh"

log = logging.getLogger(__name__)


class VllmEventBridge(KvEventBridge):
    def __init__(
        self, fingerprint: str, block_size: int, publish: BlockEvents, replay_endpoint: str = ""
    ) -> None:
        super().__init__(block_size, publish, replay_endpoint)
        self.fingerprint = fingerprint
        self.digests: dict[str, str] = {}  # LoRA adapters' digests, by their vLLM name

    async def other(self, event: Any) -> bool:
        medium = getattr(event, "medium", None) or ""
        if not medium.startswith(f"{STORAGE_MEDIUM}:"):
            return False
        _, retention, size = (medium.split(":") + ["0"])[:3]
        hashes = [bytes(h).hex() for h in event.block_hashes]
        change = "stored" if type(event).__name__ == "BlockStored" else "removed"
        await self.publish(change, hashes, STORAGE, retention, int(size or 0))
        return True

    def chain(self, event: Any, parent: str | None) -> list[str]:
        salt = ""
        extra = (event.extra_keys or [None])[0] if parent is None else None
        adapter = getattr(event, "lora_name", None) or ""
        keys = list(extra or ())
        if adapter and keys and keys[0] == adapter:  # (the adapter's name comes first)
            keys = keys[1:]
        for key in keys:
            if isinstance(key, str):
                salt = key
        fingerprint = kv_fingerprint(self.fingerprint, self.digests.get(adapter, ""))
        known = [] if parent is None else [parent]
        return packed_block_hashes(
            pack_tokens(event.token_ids), self.block_size, fingerprint, salt, (), known, 0
        )[len(known) :]

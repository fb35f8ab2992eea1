"""Block identity: a chained hash over the full blocks of a token sequence.

Block i's hash covers every token up to the end of block i (it chains block i-1's hash), the
model's fingerprint (another model's KV never matches), the block size, and extra keys (a
tenant salt; image content hashes later). blake2b, so the same prefix has the same hashes in
every process and after restarts, unlike Python's ``hash()``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

DIGEST_BYTES = 16


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    salt: str = "",
    extra_keys: Sequence[str] = (),
    known: Sequence[str] = (),
) -> list[str]:
    """Hex hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``known``: hashes already computed for a leading run of these blocks (the same tokens);
    the chain goes on from the last of them."""
    assert block_size > 0
    if known:
        prev = bytes.fromhex(known[-1])
    else:
        seed = hashlib.blake2b(digest_size=DIGEST_BYTES)
        # The block size is part of the identity: blocks of another size never match.
        for key in (fingerprint, str(block_size), salt, *extra_keys):
            seed.update(key.encode())
            seed.update(b"\x00")
        prev = seed.digest()
    first, n_full = len(known), len(token_ids) // block_size
    todo = token_ids[first * block_size : n_full * block_size]
    data = memoryview(struct.pack(f"<{len(todo)}i", *todo))
    step = block_size * 4  # bytes of one block's int32 token ids
    hashes = list(known)
    blake2b = hashlib.blake2b
    for start in range(0, len(data), step):
        h = blake2b(prev, digest_size=DIGEST_BYTES)
        h.update(data[start : start + step])
        prev = h.digest()
        hashes.append(prev.hex())
    return hashes

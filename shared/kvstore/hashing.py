"""Block identity: a chained hash over the full blocks of a token sequence.

Block i's hash covers every token up to the end of block i (it chains block i-1's hash), the
model's fingerprint (another model's KV never matches), the block size, a tenant salt and
extra keys, and, at an image's placeholder positions, the image's content hash instead of the
placeholder ids. The same prefix has the same hashes in every process and after restarts,
unlike Python's ``hash()``.

XXH3-128 (as NVIDIA Dynamo's KV router uses XXH3): the router hashes every prompt before it
routes, and a 77K-token prompt's 1,200 blocks take 0.3 ms with it against 1 ms with blake2b,
whose cost here is per call, not per byte. It is not built to resist crafted collisions; to
aim one at another request's block an attacker would need that block's chain value, which
covers the whole prefix before it (and the tenant's salt, which isolates tenants anyway).

A second scheme, ``sglang``, is SGLang's own (its HiCache storage keys): SHA-256 over the
previous block's digest and the block's token ids as u32 little-endian, the chain seeded from
the request's ``cache_salt`` (``sglang_cache_salt``: kvmesh passes the model's fingerprint, the
block size and the tenant salt in it, so the chain covers what the XXH3 one does). SGLang names
what it writes to its storage backend with these hashes and the backend never sees token ids,
so for a model served by SGLang the router hashes prompts this way and one hash names a block
from the router to the storage tier (``HASH_SCHEMES``; workers say their scheme in heartbeats).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import xxhash

from shared.messages.generate import pack_ids


class ImageSpan(Protocol):
    image_hash: str  # hex
    start: int  # position of its first placeholder token
    tokens: int


def pack_tokens(token_ids: Sequence[int], images: Sequence[ImageSpan] = ()) -> bytes:
    """Token ids as the bytes their blocks are hashed over (int32, little-endian); an image's
    placeholder positions contribute ``image_stream`` of its content hash instead."""
    packed = pack_ids(token_ids)
    if not images:
        return packed
    out = bytearray(packed)
    for img in images:
        end = min(img.start + img.tokens, len(token_ids))
        if end > img.start:
            out[img.start * 4 : end * 4] = image_stream(img.image_hash, img.tokens)[
                : (end - img.start) * 4
            ]
    return bytes(out)


def image_stream(image_hash: str, n_tokens: int) -> bytes:
    """What an image's ``n_tokens`` placeholders hash as: int32 values drawn from its content
    hash, all negative, so they never equal token ids. The same image at the same place →
    the same blocks; another image there → other blocks, and so every block after it."""
    digest = bytes.fromhex(image_hash)
    raw = (digest * (n_tokens * 4 // len(digest) + 1))[: n_tokens * 4]
    return (np.frombuffer(raw, dtype="<u4") | np.uint32(0x80000000)).tobytes()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    salt: str = "",
    extra_keys: Sequence[str] = (),
    known: Sequence[str] = (),
    images: Sequence[ImageSpan] = (),
) -> list[str]:
    """Hex hashes of the full blocks of ``token_ids`` (a trailing partial block has none).

    ``known``: hashes already computed for a leading run of these blocks (the same tokens);
    the chain goes on from the last of them."""
    first, n_full = len(known), len(token_ids) // block_size
    if images:  # image spans are in prompt positions: pack it whole
        packed = pack_tokens(token_ids[: n_full * block_size], images)
        return packed_block_hashes(packed, block_size, fingerprint, salt, extra_keys, known)
    todo = token_ids[first * block_size : n_full * block_size]
    return packed_block_hashes(
        pack_tokens(todo), block_size, fingerprint, salt, extra_keys, known, offset=0
    )


def scheme_block_hashes(
    scheme: str,
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: str,
    salt: str = "",
    known: Sequence[str] = (),
    images: Sequence[ImageSpan] = (),
) -> list[str]:
    """``block_hashes`` in the hash scheme ``scheme`` (one of ``HASH_SCHEMES``)."""
    if scheme == XXH3:
        return block_hashes(token_ids, block_size, fingerprint, salt, (), known, images)
    n_full = len(token_ids) // block_size
    packed = pack_tokens(token_ids[: n_full * block_size], images)
    return HASH_SCHEMES[scheme](packed, block_size, fingerprint, salt, (), known, None)


def packed_block_hashes(
    packed: bytes,
    block_size: int,
    fingerprint: str,
    salt: str = "",
    extra_keys: Sequence[str] = (),
    known: Sequence[str] = (),
    offset: int | None = None,
) -> list[str]:
    """``block_hashes`` over tokens already packed (``pack_tokens``): the router keeps each
    prompt segment packed, so a long prompt is not packed again for every request.
    ``offset``: the byte where hashing starts (after the ``known`` blocks by default)."""
    assert block_size > 0
    if known:
        prev = bytes.fromhex(known[-1])
    else:
        # The block size is part of the identity: blocks of another size never match.
        keys = (fingerprint, str(block_size), salt, *extra_keys)
        prev = xxhash.xxh3_128_digest(b"".join(k.encode() + b"\x00" for k in keys))
    step = block_size * 4  # bytes of one block's int32 token ids
    start = len(known) * step if offset is None else offset
    data = memoryview(packed)
    end = start + (len(data) - start) // step * step
    hashes = list(known)
    digest = xxhash.xxh3_128_digest
    for at in range(start, end, step):
        prev = digest(prev + data[at : at + step])  # 16 bytes of chain, then the block
        hashes.append(prev.hex())
    return hashes


def sglang_cache_salt(fingerprint: str, block_size: int, salt: str = "") -> str:
    """The ``cache_salt`` kvmesh gives SGLang for a request: it seeds SGLang's hash chain (and
    keeps one tenant's radix-cache entries from another's), so the chain covers the model, the
    block size and the tenant as the XXH3 one does."""
    return f"kvmesh/{fingerprint}/{block_size}/{salt}"


def sglang_seed(cache_salt: str | None, extra_key: str | None = None) -> bytes | None:
    """The digest SGLang's storage chain starts from for a request (its
    ``storage_namespace_seed``): None with neither salt nor extra key."""
    if cache_salt is None and extra_key is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):  # presence and length keep the parts apart
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def sglang_chain(packed: bytes, block_size: int, prev: bytes | None, start: int = 0) -> list[str]:
    """SGLang's chained SHA-256 over the full blocks of ``packed`` from byte ``start``, going
    on from digest ``prev`` (None: a chain with no seed)."""
    step = block_size * 4
    data = memoryview(packed)
    end = start + (len(data) - start) // step * step
    out = []
    sha = hashlib.sha256
    for at in range(start, end, step):
        prev = (sha(prev + data[at : at + step]) if prev else sha(data[at : at + step])).digest()
        out.append(prev.hex())
    return out


def packed_sglang_hashes(
    packed: bytes,
    block_size: int,
    fingerprint: str,
    salt: str = "",
    extra_keys: Sequence[str] = (),
    known: Sequence[str] = (),
    offset: int | None = None,
) -> list[str]:
    """``packed_block_hashes`` in SGLang's scheme (token ids are u32 there: the int32 packing
    is the same bytes; an image's placeholders are not SGLang's and such prompts do not go to
    it)."""
    assert block_size > 0 and not extra_keys, "SGLang's chain takes no extra keys"
    if known:
        prev: bytes | None = bytes.fromhex(known[-1])
    else:
        prev = sglang_seed(sglang_cache_salt(fingerprint, block_size, salt))
    start = len(known) * block_size * 4 if offset is None else offset
    return [*known, *sglang_chain(packed, block_size, prev, start)]


XXH3, SGLANG = "xxh3", "sglang"
PackedHasher = Callable[..., list[str]]
# A worker's hash scheme → how the router hashes prompts for its model.
HASH_SCHEMES: dict[str, PackedHasher] = {XXH3: packed_block_hashes, SGLANG: packed_sglang_hashes}

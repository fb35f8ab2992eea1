"""Which weights a model has, as a short id. It is part of the model's fingerprint, and so of
every KV block's hash: two different checkpoints never share KV, and the same weights always
do (under one served name).

The id is a digest (xxh3-128) of every weight file's whole content, computed once per machine
and file: cached under the state dir by the file's path, size, modification time and inode, so
later starts (the router's, every worker's) read a few bytes, not the weights.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import xxhash

from shared.files import write_atomically

log = logging.getLogger(__name__)

CHUNK = 16 << 20


def _stamp(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"


def file_digest(path: Path, cache_dir: Path | None = None) -> str:
    """The file's content digest (hex), from the cache when the file has not changed."""
    cache = cache_dir / "digests.json" if cache_dir is not None else None
    stamp = _stamp(path)
    known: dict[str, str] = {}
    if cache is not None and cache.is_file():
        try:
            known = json.loads(cache.read_text())
        except ValueError:
            known = {}  # (a damaged cache is rebuilt)
        if stamp in known:
            return known[stamp]
    started = time.monotonic()
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    took = time.monotonic() - started
    if took > 1:
        log.info("read %s to identify its weights in %.1f s (once per machine)", path, took)
    if cache is not None:
        known[stamp] = digest
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(cache, json.dumps(known))
    return digest


def weights_id(kind: str, files: list[Path], cache_dir: Path | None = None) -> str:
    """``<kind>:<digest>`` of the weight files, in order (a sharded checkpoint's shards)."""
    if len(files) == 1:
        return f"{kind}:{file_digest(files[0], cache_dir)[:16]}"
    h = xxhash.xxh3_128()
    for path in files:
        h.update(f"{path.name}:{file_digest(path, cache_dir)}\n".encode())
    return f"{kind}:{h.hexdigest()[:16]}"

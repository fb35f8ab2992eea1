"""Files that several processes share (caches, snapshots): each written whole or not at all."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; when the block ends without an error it
    replaces ``path`` in one rename, so readers see the old file or the new one, never half of
    it. Processes and threads writing the same file at once each use their own temporary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        yield tmp
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def write_atomically(path: Path, data: str | bytes) -> None:
    """Write ``data`` to ``path`` whole (see ``replacing``)."""
    with replacing(path) as tmp:
        if isinstance(data, str):
            tmp.write_text(data)
        else:
            tmp.write_bytes(data)


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` (a lock file, made if missing) for the block: another
    process taking it meanwhile waits (two workers starting at once build a cache once)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

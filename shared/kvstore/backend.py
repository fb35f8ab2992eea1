"""Where KV blocks are kept, behind one small interface: a blob store keyed by block hash.

A blob is one block's KV in kvformat, which carries a CRC32 per cell: the engine verifies every
cell it loads, so a damaged block never reaches the model; whoever loaded it then calls
``discard`` (deleted, counted, reported). Checking the CRCs once, while the cells are copied
into the cache, keeps a read at the speed of a plain read. ``FileStore`` keeps one file per
block under a root path, written atomically (temp file + rename) and framed with its length, so
a truncated file is a miss at once. Any POSIX mount works, so a shared file system mounted at
the same path on every worker makes it a cluster-wide tier. ``MemoryStore`` is a worker's
host-memory tier: LRU within a byte capacity.
"""

from __future__ import annotations

import errno
import logging
import os
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"KVB1"
_FRAME = struct.Struct("<4sQ")  # magic, payload length


def _write_all(fd: int, parts: list[bytes]) -> None:
    """One writev for all parts (and more only after a short write)."""
    views = [memoryview(p) for p in parts]
    while views:
        n = os.writev(fd, views)
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def why_not_written(err: OSError) -> str:
    """What a failed write says of the storage tier: full, read_only, or io."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "full"
    if err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return "read_only"
    return "io"


class BlockStore(ABC):
    @abstractmethod
    def put(self, key: str, blob: bytes) -> list[str]:
        """Keep ``blob`` under ``key``; returns the keys this pushed out (capacity)."""

    @abstractmethod
    def get(self, key: str) -> bytes | memoryview | None:
        """The blob; None when absent or visibly damaged (truncated: then it is removed)."""

    def discard(self, key: str, reason: str) -> None:
        """A blob found damaged by its reader: remove it."""
        self.delete(key)

    @abstractmethod
    def delete(self, key: str) -> bool:
        """Remove the blob; True when it was there."""

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...


class FileStore(BlockStore):
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.damaged = 0  # files found damaged (and deleted) by this process
        self.read_errors = 0  # files that could not be read (each a miss)
        # 256 fan-out directories (by the hash's first byte), made once: a write never waits
        # on a mkdir, and a million blocks are ~4K files per directory. A tier that cannot be
        # written now (full, read-only) still reads; a write makes its directory later.
        try:
            for i in range(256):
                (self.root / f"{i:02x}").mkdir(exist_ok=True)
        except OSError as err:
            log.warning("storage tier %s: its directories cannot be made now (%s)", self.root, err)

    def path(self, key: str) -> Path:
        assert len(key) >= 4 and all(c in "0123456789abcdef" for c in key), key
        return self.root / key[:2] / f"{key}.kvb"

    def put(self, key: str, blob: bytes) -> list[str]:
        """Raises OSError when the file cannot be written (full, read-only, I/O): nothing
        of it is left behind."""
        return self.put_parts(key, [blob])

    def put_parts(self, key: str, parts: list) -> list[str]:
        """``put`` of a blob given in parts (bytes-like), written as they are (one writev)."""
        blob_len = sum(memoryview(p).nbytes for p in parts)
        path = self.path(key)
        tmp = path.with_name(f".{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # its directory could not be made at start
            path.parent.mkdir(exist_ok=True)
            fd = os.open(tmp, flags, 0o644)
        try:
            try:
                _write_all(fd, [_FRAME.pack(MAGIC, blob_len), *parts])
            finally:
                os.close(fd)
            # No fsync: this is a cache. A file lost in a crash is a miss; a torn one is found
            # by its length or its cells' checksums and deleted.
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return []

    def get(self, key: str) -> memoryview | None:
        """The blob as a view into one buffer read straight from the file (no extra copy).
        A file that cannot be read (an I/O error) is a miss, counted and logged."""
        try:
            data = self._read(self.path(key))
        except FileNotFoundError:
            return None
        except OSError as err:
            self.read_errors += 1
            log.warning("KV block %s in %s cannot be read (%s): a miss", key, self.root, err)
            return None
        problem = self._check(data[: _FRAME.size], len(data) - _FRAME.size)
        if problem:
            self.discard(key, problem)
            return None
        return memoryview(data)[_FRAME.size :]

    @staticmethod
    def _read(path: Path) -> bytearray:
        """The file, read straight into one fresh buffer (writable: a reader may view it as
        tensors without a copy)."""
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            data = bytearray(size)
            view, got = memoryview(data), 0
            while got < size:  # short reads are rare, but allowed
                n = os.readv(fd, [view[got:]])
                if not n:
                    break
                got += n
        finally:
            os.close(fd)
        return data[:got] if got < size else data

    def discard(self, key: str, reason: str) -> None:
        """A damaged blob: delete it, say so, count it."""
        log.warning("KV block %s in %s is damaged (%s): deleted", key, self.root, reason)
        self.damaged += 1
        try:
            self.delete(key)
        except OSError as err:  # a read-only tier: the next reader finds it damaged too
            log.warning("KV block %s cannot be deleted (%s)", key, err)

    @staticmethod
    def _check(head: bytes, payload_len: int) -> str:
        if len(head) < _FRAME.size:
            return "truncated header"
        magic, length = _FRAME.unpack(head)
        if magic != MAGIC:
            return "bad magic"
        if length != payload_len:
            return f"{payload_len} of {length} bytes"
        return ""

    def delete(self, key: str) -> bool:
        try:
            self.path(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def __contains__(self, key: str) -> bool:
        return self.path(key).is_file()

    def size_on_disk(self, key: str) -> int:
        try:
            return self.path(key).stat().st_size
        except FileNotFoundError:
            return 0


class MemoryStore(BlockStore):
    """LRU within ``capacity_bytes``, but for blocks pinned until a time not yet come (a
    conversation that said it will continue); thread-safe (written behind, read by
    prefill)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._pins: dict[str, float] = {}  # key → unix time it is kept until
        self._lock = threading.Lock()

    def put(self, key: str, blob: bytes | memoryview, pinned_until: float = 0.0) -> list[str]:
        """Keep ``blob``, evicting the least recently used unpinned blocks for room; returns
        those evicted. Nothing is kept (or evicted) when pinned blocks leave no room."""
        if len(blob) > self.capacity_bytes:
            return []
        with self._lock:
            old = self._blobs.pop(key, None)
            if old is not None:
                self.used_bytes -= len(old)
            victims, freed = self._victims(self.used_bytes + len(blob) - self.capacity_bytes)
            if self.used_bytes - freed + len(blob) > self.capacity_bytes:
                if old is not None:  # (as it was)
                    self._blobs[key] = old
                    self.used_bytes += len(old)
                return []
            for gone in victims:
                self.used_bytes -= len(self._blobs.pop(gone))
                self._pins.pop(gone, None)
            self._blobs[key] = blob
            self.used_bytes += len(blob)
            if pinned_until > self._pins.get(key, 0.0):
                self._pins[key] = pinned_until
        return victims

    def _victims(self, needed: int) -> tuple[list[str], int]:
        """The least recently used blocks not pinned now whose bytes add up to ``needed``."""
        victims: list[str] = []
        freed, now = 0, time.time()
        for key, data in self._blobs.items():
            if freed >= needed:
                break
            if self._pins.get(key, 0.0) > now:
                continue
            victims.append(key)
            freed += len(data)
        return victims, freed

    def pin(self, keys: list[str], until: float) -> None:
        """Keep the blocks of ``keys`` held here until ``until`` (unix time), at least."""
        with self._lock:
            for key in keys:
                if key in self._blobs and until > self._pins.get(key, 0.0):
                    self._pins[key] = until

    def get(self, key: str) -> bytes | None:
        with self._lock:
            blob = self._blobs.get(key)
            if blob is not None:
                self._blobs.move_to_end(key)
            return blob

    def delete(self, key: str) -> bool:
        with self._lock:
            blob = self._blobs.pop(key, None)
            self._pins.pop(key, None)
            if blob is not None:
                self.used_bytes -= len(blob)
            return blob is not None

    def __contains__(self, key: str) -> bool:
        return key in self._blobs

    def sizes(self) -> list[tuple[str, int]]:
        """Each block held and its bytes, least recently used first."""
        with self._lock:
            return [(key, len(blob)) for key, blob in self._blobs.items()]

    def __len__(self) -> int:
        return len(self._blobs)

    def leading(self, keys: list[str]) -> int:
        """How many of ``keys``, from the first, are held."""
        n = 0
        for key in keys:
            if key not in self._blobs:
                break
            n += 1
        return n

    def check_integrity(self) -> None:
        with self._lock:
            assert self.used_bytes == sum(len(b) for b in self._blobs.values())
            assert self.used_bytes <= self.capacity_bytes
            assert self._pins.keys() <= self._blobs.keys(), "a pin on a block not held"

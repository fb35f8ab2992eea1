"""kvmesh's storage tier as SGLang's HiCache storage backend: a turn SGLang computed on one
worker is read back by any other, after restarts too.

SGLang loads it by module path, no patch to SGLang (``--hicache-storage-backend dynamic`` with
``{"backend_name": "kvmesh", "module_path": "shared.engine.sglang.storage", "class_name":
"KvmeshHiCacheStorage", "interface_v1": 1, ...}`` as its extra config: ``storage_args``). It
runs in SGLang's scheduler process, between SGLang's host memory pool (its second tier) and
the files:

- **keys** are SGLang's page hashes (chained SHA-256, seeded by the request's ``cache_salt``,
  which kvmesh fills with the model's fingerprint, the block size and the tenant's salt:
  ``shared/kvstore/hashing.py``), the same the router computes for an SGLang model's prompts,
  so a file is named by the hash cachemeta indexes it under;
- **pages** are written in kvmesh's block format (``shared/engine/kvformat.py``: a header
  naming the model and the shape, a CRC per layer), converted from whichever MHA layout
  SGLang's host pool has (``layer_first``, ``page_first``, ``page_first_direct``,
  ``page_head``), and read back into any of them: a block written by an engine with one
  layout is read by one with another. A damaged file, or another model's, is a miss: deleted,
  reported, and SGLang computes the page again;
- **no eviction** here: cachemeta owns expiry and eviction of the tier;
- **an adapter's pages** (a worker with LoRA on) are filed under the names the worker told it
  before the request (``shared/engine/sglang/lora.py``: SGLang seeds an adapter's page hashes
  with its load's random id, the router with the adapter's digest); a chain it was not told of
  is not written;
- **what it wrote and what it found damaged** goes to the worker (which has the NATS
  connection) over a ZMQ socket the worker binds (``report``): SGLang publishes no events for
  its storage tier, and cachemeta must index it.

MLA models and tensor parallelism above 1 are refused with a message in this version (their
pages are split or shared across ranks).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from shared.engine import kvformat
from shared.engine.sglang.lora import ToldNames
from shared.kvstore.backend import FileStore

log = logging.getLogger(__name__)

BACKEND = "kvmesh"
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
DTYPE_NAMES = {dtype: name for name, dtype in kvformat.DTYPES.items()}


def storage_args(
    store_dir: str, fingerprint: str, store_dtype: str, report: str, names: str = ""
) -> dict:
    """SGLang's ``hicache_storage_backend_extra_config`` that loads this backend (``names``:
    where the worker tells page names, with LoRA on)."""
    told = {"names": names, "hicache_storage_pass_prefix_keys": True} if names else {}
    return told | {
        "backend_name": BACKEND,
        "module_path": __name__,
        "class_name": KvmeshHiCacheStorage.__name__,
        "interface_v1": 1,  # zero-copy: pages move between the files and the host pool here
        "store_dir": store_dir,
        "fingerprint": fingerprint,
        "store_dtype": store_dtype,
        "report": report,
    }


def page_views(pool: Any, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V of the page that starts at token slot ``index`` of SGLang's host pool, as
    views [layers, page tokens, heads, head dim] into its buffer, whatever its layout."""
    buf, size = pool.kv_buffer, pool.page_size
    if pool.layout == "layer_first":  # [2, layers, slots, heads, dim]
        return buf[0, :, index : index + size], buf[1, :, index : index + size]
    if pool.layout == "page_first":  # [2, slots, layers, heads, dim]
        k, v = buf[0, index : index + size], buf[1, index : index + size]
        return k.transpose(0, 1), v.transpose(0, 1)
    page = index // size
    if pool.layout == "page_first_direct":  # [2, pages, layers, page, heads, dim]
        return buf[0, page], buf[1, page]
    if pool.layout == "page_head":  # [2, pages, heads, page, layers, dim]
        return buf[0, page].permute(2, 1, 0, 3), buf[1, page].permute(2, 1, 0, 3)
    raise ValueError(f"SGLang host layout {pool.layout!r}: kvmesh's tier reads {LAYOUTS}")


class Reporter:
    """What the backend wrote and found damaged, sent to the worker (JSON over a ZMQ PUSH
    socket; nothing is sent while nobody listens, and a report never blocks SGLang)."""

    def __init__(self, endpoint: str) -> None:
        self._socket = None
        if endpoint:
            import zmq

            self._socket = zmq.Context.instance().socket(zmq.PUSH)
            self._socket.setsockopt(zmq.SNDHWM, 10_000)
            self._socket.setsockopt(zmq.LINGER, 1000)
            self._socket.connect(endpoint)
        self._lock = threading.Lock()  # (SGLang's prefetch and backup threads both report)

    def send(self, stored: list[tuple[str, int]], damaged: list[str]) -> None:
        if self._socket is None or not (stored or damaged):
            return
        import zmq

        data = json.dumps({"stored": stored, "damaged": damaged}).encode()
        with self._lock:
            try:
                self._socket.send(data, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("storage report dropped (the worker is not reading)")


class KvmeshHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = storage_config.extra_config or {}
        if storage_config.is_mla_model:
            raise ValueError(
                "kvmesh's storage tier takes MHA models' pages in this version: an MLA model's "
                "latent pages are not in kvmesh's block format"
            )
        if storage_config.tp_size > 1 or storage_config.pp_size > 1:
            raise ValueError(
                "kvmesh's storage tier takes one rank's whole pages in this version: tensor "
                f"parallelism {storage_config.tp_size} and pipeline parallelism "
                f"{storage_config.pp_size} split them"
            )
        for field in ("store_dir", "fingerprint"):
            if not extra.get(field):
                raise ValueError(f"kvmesh's storage backend needs {field!r} in its extra config")
        self.store = FileStore(Path(extra["store_dir"]))
        self.fingerprint: str = extra["fingerprint"]
        self.store_dtype: str = extra.get("store_dtype") or ""
        self.reporter = Reporter(extra.get("report", ""))
        self.told = ToldNames(extra["names"]) if extra.get("names") else None
        self.pool: Any = None
        self.written = self.loaded = self.damaged = 0

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        if mem_pool_host.layout not in LAYOUTS:
            raise ValueError(
                f"SGLang host layout {mem_pool_host.layout!r}: kvmesh's tier reads {LAYOUTS}"
            )
        if mem_pool_host.dtype not in DTYPE_NAMES:
            raise ValueError(f"KV dtype {mem_pool_host.dtype}: kvmesh's tier stores {DTYPE_NAMES}")
        super().register_mem_pool_host(mem_pool_host)
        self.pool = mem_pool_host

    # -- what SGLang asks --------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        (name,) = self._names([key], None, writing=False)
        return name is not None and name in self.store

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The leading keys whose pages are in the tier."""
        for i, name in enumerate(self._names(keys, extra_info, writing=False)):
            if name is None or name not in self.store:
                return i
        return len(keys)

    def _names(self, keys: list[str], extra_info: Any, writing: bool) -> list[str | None]:
        """Each page's name in the tier (None: not to be read or written): SGLang's, but
        for an adapter's chain, whose names the worker told (its head: the chain's first)."""
        if self.told is None or not keys:
            return list(keys)
        prefix = getattr(extra_info, "prefix_keys", None)
        return self.told.of(prefix[0] if prefix else keys[0], keys, writing)

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Each page read into the host pool at its slots; False for a page missing, damaged
        or another model's (SGLang computes it again; it stops at the first False)."""
        names = self._names(keys, extra_info, False)
        return self._each(names, host_indices, self._read, unnamed=False)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Each page written from the host pool (a page already in the tier is not written
        again); False for one that could not be (a full or read-only tier)."""
        names = self._names(keys, extra_info, True)
        return self._each(names, host_indices, self._write, unnamed=True)

    def _each(
        self,
        keys: list[str | None],
        host_indices: torch.Tensor,
        one: Callable[..., bool],
        unnamed: bool,
    ) -> list[bool]:
        """``one`` for each page named; ``unnamed`` for each not (a miss to read: False;
        nothing to write: True, no failure)."""
        assert self.pool is not None, "register_mem_pool_host first"
        size = self.pool.page_size
        stored: list[tuple[str, int]] = []
        damaged: list[str] = []
        out = []
        for i, key in enumerate(keys):
            if key is None:
                out.append(unnamed)
                continue
            try:
                out.append(one(key, int(host_indices[i * size]), stored, damaged))
            except Exception as err:  # never raised to SGLang's I/O threads: a failed page
                log.warning("KV page %s: %s", key, err)
                out.append(False)
        self.reporter.send(stored, damaged)
        return out

    def _read(self, key: str, index: int, stored: list, damaged: list) -> bool:
        blob = self.store.get(key)
        if blob is None:
            return False
        try:
            self.read_into(blob, index)
        except kvformat.KVFormatError as err:
            self.store.discard(key, str(err))
            self.damaged += 1
            damaged.append(key)
            return False
        self.loaded += 1
        return True

    def read_into(self, blob: bytes | memoryview, index: int) -> None:
        """A block's bytes into the host pool's page at slot ``index`` (every cell's CRC
        checked first: nothing damaged reaches the pool)."""
        pool = self.pool
        header, cells = kvformat.all_cells(blob)  # [layers, 1, K and V, page, heads, dim]
        want = (self.fingerprint, 1, pool.layer_num, pool.page_size, pool.head_num, pool.head_dim)
        have = (
            header.fingerprint,
            header.n_blocks,
            header.n_layers,
            header.block_size,
            header.n_kv_heads,
            header.head_dim,
        )
        if have != want:
            raise kvformat.KVFormatError(f"another model's or another shape's block: {have}")
        k, v = page_views(pool, index)
        k.copy_(cells[:, 0, 0])  # (one strided copy each, from the file's buffer)
        v.copy_(cells[:, 0, 1])

    def _write(self, key: str, index: int, stored: list, damaged: list) -> bool:
        if key in self.store:
            return True
        parts = self.encode(index)
        try:
            self.store.put_parts(key, parts)
        except OSError as err:
            log.warning("KV page %s not stored: %s", key, err)
            return False
        self.written += 1
        stored.append((key, sum(memoryview(p).nbytes for p in parts)))
        return True

    def encode(self, index: int) -> list:
        """The host pool's page at slot ``index`` in kvmesh's block format, in parts (the
        header, then each layer's K and V: views of one gather out of the pool's layout)."""
        pool = self.pool
        dtype_name = self.store_dtype or DTYPE_NAMES[pool.dtype]
        k, v = page_views(pool, index)
        fields = dict(
            fingerprint=self.fingerprint,
            dtype=dtype_name,
            block_size=pool.page_size,
            n_layers=pool.layer_num,
            n_kv_heads=pool.head_num,
            head_dim=pool.head_dim,
            windows=[0] * pool.layer_num,
            n_blocks=1,
            n_tokens=pool.page_size,
        )
        dtype = kvformat.DTYPES[dtype_name]
        k, v = (x.to(dtype).unsqueeze(1) for x in (k, v))
        return kvformat.encode_parts(fields, k, v)

    # -- the older, copying interface: SGLang uses interface_v1 with this backend ----------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> None:
        raise NotImplementedError("kvmesh's backend is zero-copy: set interface_v1")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None):  # noqa: ANN201
        raise NotImplementedError("kvmesh's backend is zero-copy: set interface_v1")

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:  # noqa: E501
        raise NotImplementedError("kvmesh's backend is zero-copy: set interface_v1")

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:  # noqa: E501
        raise NotImplementedError("kvmesh's backend is zero-copy: set interface_v1")

    def clear(self) -> None:
        """Nothing: the tier is shared, and cachemeta owns what leaves it."""

    def get_stats(self) -> dict:
        return {"written": self.written, "loaded": self.loaded, "damaged": self.damaged}

"""kvmesh's storage tier as vLLM's KV connector: a turn vLLM computed on one worker is read
back by any other, after restarts too.

vLLM loads it by module path (``kv_connector_module_path``), no patch to vLLM. It runs in two
halves, in vLLM's own processes:

- the **scheduler's** half decides: for a new request, how many leading prompt blocks past
  vLLM's own prefix cache are in the tier (``get_num_new_matched_tokens``: a file per block,
  named by kvmesh's block hash, so the check is a stat per block); each step, which of a
  request's blocks became full (prompt and answer alike) and are not yet in the tier;
- the **worker's** half moves the bytes: before the forward pass it copies the planned blocks
  from their files into vLLM's paged cache, checking every cell's CRC (a damaged file is
  deleted and its blocks reported to vLLM, which recomputes them: never given to the model);
  after the pass it copies the newly full blocks out and a background thread writes them.

The files are the torch engine's: kvformat blobs in ``FileStore``, one block each, under the
same hashes (the model's fingerprint, the block size and the tenant salt vLLM carries as
``cache_salt`` start the chain). What was written and what was found damaged goes back to the
scheduler's half, which hands it to vLLM's KV event publisher as events of medium
``kvmesh:<retention>``; the worker's event bridge turns them into kvmesh KV events at the
storage location, so cachemeta indexes them and its GC ages them by their retention class.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from shared.engine import kvformat
from shared.engine.vllm.events import STORAGE_MEDIUM as MEDIUM
from shared.kvstore.backend import FileStore
from shared.kvstore.hashing import block_hashes
from shared.model.lora import digest_of, kv_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

RETENTION_KEY = "kvmesh_retention"  # in a request's SamplingParams.extra_args
STORAGE_TOKENS = "kvmesh_storage_tokens"  # in the finished request's kv_transfer_params
STORED = "kvmesh_stored"  # ... and the hashes of the blocks written for it (maybe on their way)
WRITE_QUEUE = 256  # blocks waiting to be written; beyond it they are skipped


@dataclass
class Plan(KVConnectorMetadata):
    """One step's moves: (kvmesh hash, vLLM block id, retention)."""

    loads: list[tuple[str, int]] = field(default_factory=list)
    saves: list[tuple[str, int, str]] = field(default_factory=list)


@dataclass
class Report(KVConnectorWorkerMetadata):
    """What the worker's half did: blocks written (hash, bytes, retention), files damaged."""

    written: list[tuple[str, int, str]] = field(default_factory=list)
    damaged: list[str] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, Report)
        return Report(self.written + other.written, self.damaged + other.damaged)


@dataclass
class _Tracked:
    """A request the scheduler's half follows: its blocks, their hashes, what is in the tier."""

    request: Request
    retention: str
    block_ids: list[int] = field(default_factory=list)
    hashes: list[str] = field(default_factory=list)
    stored: int = 0  # leading blocks known to be in the tier (loaded, found or saved)
    load_from: int = 0  # the blocks [load_from, stored) are to be loaded, once
    load: bool = False
    storage_tokens: int = 0
    saving: list[str] = field(default_factory=list)  # hashes of the blocks planned to be saved


class KvmeshStorageConnector(KVConnectorBase_V1):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.store = FileStore(Path(extra["store_dir"]))
        self.fingerprint: str = extra["fingerprint"]
        self.digests: dict[str, str] = {}  # LoRA adapters' identities, by their directory
        self.block_size = vllm_config.cache_config.block_size
        self.store_dtype: str = extra.get("store_dtype") or "float32"
        # the scheduler's half
        self.tracked: dict[str, _Tracked] = {}
        self.events: list = []
        # the worker's half
        self.caches: list[torch.Tensor] = []  # per layer, [blocks, kv heads, block_size, 2 E]
        self.invalid: set[int] = set()
        self.report = Report()
        self.lock = threading.Lock()
        self.writes: queue.Queue = queue.Queue(WRITE_QUEUE)
        self.writer: threading.Thread | None = None

    # ---- the scheduler's half ----

    def hashes_of(self, t: _Tracked, n_blocks: int) -> list[str]:
        """kvmesh's hashes of the request's first ``n_blocks`` blocks (computed once each)."""
        if len(t.hashes) < n_blocks:
            tokens = t.request.all_token_ids[: n_blocks * self.block_size]
            salt = t.request.cache_salt or ""
            fingerprint = self.fingerprint_of(t.request)
            t.hashes = block_hashes(tokens, self.block_size, fingerprint, salt, known=t.hashes)
        return t.hashes[:n_blocks]

    def fingerprint_of(self, request: Request) -> str:
        """The fingerprint of the request's KV: the model's, and its LoRA adapter's."""
        lora = request.lora_request
        if lora is None:
            return self.fingerprint
        if lora.lora_path not in self.digests:  # (read once: the adapter's two files)
            self.digests[lora.lora_path] = digest_of(lora.lora_path)
        return kv_fingerprint(self.fingerprint, self.digests[lora.lora_path])

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        extra = request.sampling_params.extra_args if request.sampling_params else None
        retention = (extra or {}).get(RETENTION_KEY, "chat")
        t = self.tracked.setdefault(request.request_id, _Tracked(request, retention))
        # vLLM computes a prompt's last token itself: blocks up to the one before it
        n_full = (request.num_prompt_tokens - 1) // self.block_size
        first = num_computed_tokens // self.block_size
        hashes = self.hashes_of(t, n_full)
        end = first
        while end < n_full and hashes[end] in self.store:
            end += 1
        t.stored, t.load_from = end, first
        return (end - first) * self.block_size, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        t = self.tracked.get(request.request_id)
        if t is not None and num_external_tokens > 0:
            t.load = True
            t.storage_tokens = num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan = Plan()
        steps: list[tuple[str, int]] = []  # (request id, tokens with KV after this step)
        for new in scheduler_output.scheduled_new_reqs:
            t = self.tracked.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            steps.append((new.req_id, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self.tracked.get(rid)
            if t is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                t.block_ids += new_ids[0]
            steps.append((rid, cached.num_computed_tokens[i]))
        for rid, computed in steps:
            t = self.tracked[rid]
            if t.load:
                plan.loads += zip(
                    self.hashes_of(t, t.stored)[t.load_from :],
                    t.block_ids[t.load_from : t.stored],
                    strict=True,
                )
                t.load = False
            done = computed + scheduler_output.num_scheduled_tokens.get(rid, 0)
            full = min(done, len(t.request.all_token_ids)) // self.block_size
            full = min(full, len(t.block_ids))
            for j, h in enumerate(self.hashes_of(t, full)[t.stored :], start=t.stored):
                if h not in self.store:
                    plan.saves.append((h, t.block_ids[j], t.retention))
                    t.saving.append(h)
            t.stored = max(t.stored, full)
        return plan

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        report = connector_output.kv_connector_worker_meta
        if not isinstance(report, Report):
            return
        by_kind: dict[tuple[str, int], list[str]] = {}  # (retention, file bytes) → hashes
        for h, size, retention in report.written:
            by_kind.setdefault((retention, size), []).append(h)
        for (retention, size), hashes in by_kind.items():
            self.events.append(
                BlockStored(
                    block_hashes=[bytes.fromhex(h) for h in hashes],
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=self.block_size,
                    lora_id=None,
                    medium=f"{MEDIUM}:{retention}:{size}",
                    lora_name=None,
                )
            )
        if report.damaged:
            hashes = [bytes.fromhex(h) for h in report.damaged]
            self.events.append(BlockRemoved(block_hashes=hashes, medium=f"{MEDIUM}:chat"))

    def take_events(self):  # noqa: ANN201 (vLLM's KVCacheEvent iterable)
        events, self.events = self.events, []
        return events

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        t = self.tracked.pop(request.request_id, None)
        if t is None:
            return False, {STORAGE_TOKENS: 0, STORED: []}
        return False, {STORAGE_TOKENS: t.storage_tokens, STORED: t.saving}

    # ---- the worker's half ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def layer(name: str) -> int:
            return int(next(p for p in name.split(".") if p.isdigit()))

        self.caches = [kv_caches[n] for n in sorted(kv_caches, key=layer)]
        shape = tuple(self.caches[0].shape[2:])
        if shape[0] != self.block_size or shape[1] % 2 or not self.caches[0].is_contiguous():
            raise RuntimeError(f"the storage connector knows vLLM's CPU KV layout, not {shape}")
        self.writer = threading.Thread(target=self._write_loop, name="kvmesh-kv-writer")
        self.writer.daemon = True
        self.writer.start()

    @property
    def head_dim(self) -> int:
        return self.caches[0].shape[-1] // 2

    def kv_of(self, cache: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One block of one layer's cache as views: its keys [H, E, N] and values [H, N, E].
        vLLM's CPU layout keeps, per block and head, the keys transposed then the values
        (its [blocks, heads, N, 2 E] tensor is that memory, viewed)."""
        heads, n, e = cache.shape[1], self.block_size, self.head_dim
        flat = cache[block].view(heads, 2 * n * e)
        return flat[:, : n * e].view(heads, e, n), flat[:, n * e :].view(heads, n, e)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        plan = self._get_connector_metadata()
        assert isinstance(plan, Plan)
        for h, block in plan.loads:
            try:
                self._load(h, block)
            except kvformat.KVFormatError as err:
                self.store.discard(h, str(err))
                self.invalid.add(block)
                with self.lock:
                    self.report.damaged.append(h)

    def _load(self, h: str, block: int) -> None:
        blob = self.store.get(h)
        if blob is None:
            raise kvformat.KVFormatError("gone or truncated")
        f = kvformat.as_reader(blob)
        header, start = kvformat.read_header(f)
        shape = (self.block_size, self.caches[0].shape[1], self.head_dim)
        if (header.fingerprint, header.n_blocks, header.n_layers) != (
            self.fingerprint,
            1,
            len(self.caches),
        ) or (header.block_size, header.n_kv_heads, header.head_dim) != shape:
            raise kvformat.KVFormatError("another model's or another layout's block")
        for layer, cache in enumerate(self.caches):
            k, v = kvformat.read_cell(f, header, start, layer, 0)  # [N, H, E] each
            keys, values = self.kv_of(cache, block)
            keys.copy_(k.permute(1, 2, 0))
            values.copy_(v.transpose(0, 1))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs):  # noqa: ANN001, ANN201
        return  # all layers at once, after the pass (wait_for_save)

    def wait_for_save(self) -> None:
        plan = self._get_connector_metadata()
        assert isinstance(plan, Plan)
        for h, block, retention in plan.saves:
            # [layers, 1 block, N, H, E], copied now: the block may be reused once freed
            kvs = [self.kv_of(c, block) for c in self.caches]
            k = torch.stack([keys.permute(2, 0, 1) for keys, _ in kvs]).unsqueeze(1)
            v = torch.stack([values.transpose(0, 1) for _, values in kvs]).unsqueeze(1)
            try:
                self.writes.put_nowait((h, k, v, retention))
            except queue.Full:
                log.warning("KV write queue full: block %s not stored", h)

    def _write_loop(self) -> None:
        dtype = kvformat.DTYPES[self.store_dtype]
        while True:
            h, k, v, retention = self.writes.get()
            fields = dict(
                fingerprint=self.fingerprint,
                dtype=self.store_dtype,
                block_size=self.block_size,
                n_layers=k.shape[0],
                n_kv_heads=k.shape[3],
                head_dim=k.shape[4],
                windows=[0] * k.shape[0],
                n_blocks=1,
                n_tokens=self.block_size,
            )
            try:
                blob = kvformat.encode(fields, k.to(dtype), v.to(dtype))
                self.store.put(h, blob)
            except OSError as err:
                log.warning("KV block %s not stored: %s", h, err)
                continue
            with self.lock:
                self.report.written.append((h, len(blob), retention))

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self.lock:
            report, self.report = self.report, Report()
        return report if report.written or report.damaged else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self.invalid = self.invalid, set()
        return invalid

"""SGLang in the worker's process, through ``sglang.Engine`` (as Dynamo's SGLang worker runs it):
its tokenizer manager on the worker's event loop, its scheduler and detokenizer as processes of
their own; token ids in (the router tokenizes), token ids and log-probabilities out (its
tokenizer skipped: ``skip_tokenizer_init``), SGLang's own scheduler, radix cache and paging.

What kvmesh sets (``server_args``): the page size is kvmesh's block size (one hash per block);
the GPU pool, the running requests and the prefill chunk come from the worker's settings; the
worker's memory tier is SGLang's host memory (HiCache), and the storage tier is its storage
backend (``storage.py``); its KV events come to ``events.py`` over ZMQ. Each request's
``cache_salt`` carries the model's fingerprint, the block size and the tenant's salt, so
SGLang's page hashes are the router's (``shared/kvstore/hashing.py``) and one tenant's cached
prefix is never another's. LoRA adapters are SGLang's own (``lora.py``), their KV named by
the adapter's digest as well.

With its tokenizer skipped SGLang applies no stop strings: the worker does, on the tokens as
they come, with the model's tokenizer (the request is aborted in SGLang at the stop). Seeded
sampling that gives the same answer wherever it runs needs SGLang's deterministic inference,
which is on.

Nothing here imports SGLang until ``start``; it needs CUDA (``bench/sglang_gpu.py`` runs it on
an operator's GPU machine).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from shared.engine.interface import (
    BlockEvents,
    EngineOptions,
    EngineStats,
    Generated,
    OwningEngine,
    Peer,
)
from shared.engine.sglang.lora import SglangAdapters, StorageNames, lora_args
from shared.engine.sglang.params import (
    logprob_fields,
    logprobs_of,
    prompt_logprobs_of,
    sglang_params,
)
from shared.kvstore.hashing import SGLANG, pack_tokens, packed_sglang_hashes, sglang_cache_salt
from shared.messages.kvevents import STORAGE
from shared.messages.sampling import SamplingParams, stop_string_hit
from shared.model.catalog import ModelSource
from shared.model.config import ModelConfig
from shared.model.export import hf_directory
from shared.model.lora import AdapterSpec
from shared.model.text import text_of
from shared.orphans import spawned_children_die_with_us

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"  # the release its plug points are tested against
LOAD_EVERY_S = 0.5  # how often SGLang's load is read (for heartbeats and routing)
RETENTIONS_KEPT = 100_000  # page hash → retention class of recent requests' pages
FINISHED = {"stop": "stop", "length": "length", "abort": "abort"}


class SglangEngine(OwningEngine):
    hash_scheme = SGLANG

    def __init__(
        self,
        config: ModelConfig,
        directory: Path,
        options: EngineOptions,
        state_dir: Path,
        tokenizer: Any = None,
    ) -> None:
        self.config = config
        self.block_size = options.block_size
        self.directory = directory
        self.options = options
        self.state_dir = state_dir
        self.tokenizer = tokenizer  # (the model's: stop strings are matched here)
        self.run_dir = state_dir / "run" / f"sglang-{id(self):x}"
        self._engine: Any = None
        self._bridge: Any = None
        self._reports: Any = None
        self._tasks: list[asyncio.Task] = []
        self._load: Any = None  # SGLang's last load snapshot
        self.adapters = SglangAdapters(config, options)
        self._names: StorageNames | None = None  # (LoRA and a storage tier: page names told)
        # A page's retention class, for the storage backend's reports (it sees hashes only).
        self._retention: OrderedDict[str, str] = OrderedDict()

    @classmethod
    def refusal(cls, options: EngineOptions) -> str:
        if importlib.util.find_spec("sglang") is None:
            return (
                f"SGLang is not installed here (it runs on CUDA GPUs: pip install "
                f"sglang=={SGLANG_VERSION} on one; bench/sglang_gpu.py checks such a machine)"
            )
        return ""

    @classmethod
    def load(cls, model: ModelSource, state_dir: Path, options: EngineOptions) -> SglangEngine:
        text = text_of(model, state_dir)
        directory = hf_directory(model, text.config, state_dir)
        return cls(text.config, directory, options, state_dir, text.tokenizer)

    # -- SGLang's arguments -------------------------------------------------------------------

    def server_args(
        self, events: str = "", replay: str = "", report: str = "", names: str = ""
    ) -> dict:
        """``sglang.Engine``'s arguments (``ServerArgs`` fields) for this worker: ``events``,
        ``replay``: where its KV events go and are replayed from; ``report``: where its
        storage backend says what it wrote; ``names``: where it is told pages' names (LoRA on)."""
        o = self.options
        args: dict[str, Any] = {
            "model_path": str(self.directory),
            "tokenizer_path": str(self.directory),
            "skip_tokenizer_init": True,  # token ids in and out
            "incremental_streaming_output": True,  # each piece's new tokens only
            "page_size": self.block_size,
            "max_total_tokens": o.kv_cache_tokens,
            "max_running_requests": o.max_running,
            "chunked_prefill_size": o.prefill_chunk,
            "context_length": self.config.max_context,
            "random_seed": 0,
            "enable_deterministic_inference": True,  # a seed gives one answer wherever it runs
            "grammar_backend": "llguidance",  # the router's grammars are llguidance's
            "enable_cache_report": True,  # cached tokens by device, host and storage
            # Waiting requests by class (a rank: 0 first), then arrival.
            "enable_priority_scheduling": True,
            "schedule_low_priority_values_first": True,
            "log_level": "error",
        } | lora_args(o)
        if o.memory_tier_bytes or o.kv_store_dir:  # SGLang's host memory: the memory tier
            args |= {
                "enable_hierarchical_cache": True,
                "hicache_size": max(1, math.ceil(o.memory_tier_bytes / 2**30)),
                "hicache_mem_layout": "page_first",
                "hicache_write_policy": "write_through",
            }
        if o.kv_store_dir:
            from shared.engine.sglang.storage import storage_args

            fingerprint = self.config.fingerprint
            extra = storage_args(o.kv_store_dir, fingerprint, o.store_dtype, report, names)
            args |= {
                "hicache_storage_backend": "dynamic",
                "hicache_storage_backend_extra_config": json.dumps(extra),
            }
        if o.pd_transfer:  # SGLang's own P/D: its KV moves by its transfer backend
            args |= {
                "disaggregation_mode": o.pd_role,
                "disaggregation_transfer_backend": o.pd_transfer,
            }
            if o.pd_role == "prefill":
                args["disaggregation_bootstrap_port"] = o.bootstrap_port
        if events:
            config = {"publisher": "zmq", "endpoint": events, "topic": ""}
            if replay:
                config["replay_endpoint"] = replay
            args["kv_events_config"] = json.dumps(config)
        return args

    # -- running -----------------------------------------------------------------------------

    async def start(self, on_blocks: BlockEvents | None = None) -> None:
        import sglang

        from shared.engine.sglang.events import SglangEventBridge

        self.run_dir.mkdir(parents=True, exist_ok=True)
        events = replay = report = ""
        if on_blocks is not None:
            replay = f"ipc://{self.run_dir}/kv-replay"
            self._bridge = SglangEventBridge(self.block_size, on_blocks, replay)
            events = self._bridge.bind()
            if self.options.kv_store_dir:
                report = self._bind_reports(on_blocks)
        if self.options.enable_lora and self.options.kv_store_dir:
            self._names = StorageNames()
        names = self._names.endpoint if self._names is not None else ""
        spawned_children_die_with_us(self.state_dir)  # its processes go with this worker
        self._engine = sglang.Engine(**self.server_args(events, replay, report, names))
        self.adapters.engine = self._engine
        if self._bridge is not None:
            self._bridge.start()
        self._tasks.append(asyncio.create_task(self._read_load()))
        log.info("SGLang ready: %s, pages of %d tokens", self.directory, self.block_size)

    def _bind_reports(self, on_blocks: BlockEvents) -> str:
        """The socket the storage backend reports to, and the task that reads it."""
        import zmq
        import zmq.asyncio

        self._reports = zmq.asyncio.Context.instance().socket(zmq.PULL)
        port = self._reports.bind_to_random_port("tcp://127.0.0.1")
        self._tasks.append(asyncio.create_task(self._read_reports(on_blocks)))
        return f"tcp://127.0.0.1:{port}"

    async def _read_reports(self, on_blocks: BlockEvents) -> None:
        """What the storage backend wrote (as stored at the tier, under the retention class
        of the request it was for) and found damaged (removed)."""
        while True:
            try:
                said = json.loads(await self._reports.recv())
                by_class: dict[tuple[str, int], list[str]] = {}
                for h, size in said.get("stored", ()):
                    by_class.setdefault((self._retention.get(h, "chat"), size), []).append(h)
                for (retention, size), hashes in by_class.items():
                    await on_blocks("stored", hashes, STORAGE, retention, size)
                if said.get("damaged"):
                    await on_blocks("removed", list(said["damaged"]), STORAGE, "chat", 0)
            except asyncio.CancelledError:
                raise
            except Exception:  # one bad report must not stop the reading
                log.exception("storage report")

    async def _read_load(self) -> None:
        while True:
            try:
                loads = await self._engine.tokenizer_manager.get_loads()
                self._load = loads[0] if loads else None
            except asyncio.CancelledError:
                raise
            except Exception as err:
                log.debug("SGLang's load not read: %s", err)
            await asyncio.sleep(LOAD_EVERY_S)

    def pages(
        self, token_ids: list[int], salt: str, fingerprint: str, cache_salt: str, lora_id: str
    ) -> list[str]:
        """The hashes the router names the prompt's full pages by (in storage too), told to
        the storage backend where SGLang's differ (an adapter's: ``lora_id``) or may (LoRA
        on). ``fingerprint``, ``cache_salt``: the request's KV's, as SGLang is given them."""
        n = len(token_ids) // self.block_size * self.block_size
        packed = pack_tokens(token_ids[:n])
        names = packed_sglang_hashes(packed, self.block_size, fingerprint, salt)
        if self._names is not None:
            self._names.tell(packed, self.block_size, cache_salt, lora_id, names)
        return names

    def remember(self, pages: list[str], retention: str) -> None:
        """The retention class of a request's pages, by their hashes (the storage backend
        reports hashes only); "chat", the default, is not kept."""
        if retention == "chat":
            return
        for h in pages:
            self._retention[h] = retention
            self._retention.move_to_end(h)
        while len(self._retention) > RETENTIONS_KEPT:
            self._retention.popitem(last=False)

    async def generate(
        self,
        seq_id: str,
        token_ids: list[int],
        params: SamplingParams,
        salt: str = "",
        retention: str = "chat",
        peer: Peer | None = None,
        rank: int = 1,
    ) -> AsyncIterator[Generated]:
        assert self._engine is not None, "start() first"
        if bool(peer) != bool(self.options.pd_transfer):
            raise ValueError(
                "an SGLang engine in P/D takes requests with their bootstrap room only"
                if self.options.pd_transfer
                else "this SGLang engine is not in P/D: no bootstrap room"
            )
        adapter = params.adapter
        lora_id = await self.adapters.acquire(adapter) if adapter else ""
        try:
            # The prompt's pages go to the storage tier as SGLang backs them up (a P/D
            # prefill worker handing over through the tier waits for them: ``stored``).
            fingerprint = self.adapters.fingerprint(adapter)
            cache_salt = sglang_cache_salt(fingerprint, self.block_size, salt)
            pages = []
            if self.options.kv_store_dir:
                pages = self.pages(token_ids, salt, fingerprint, cache_salt, lora_id)
            self.remember(pages, retention)
            where = {"lora_path": adapter} if adapter else {}
            if peer is not None:
                host, port, room = peer
                where |= {"bootstrap_host": host, "bootstrap_port": port, "bootstrap_room": room}
            stream = await self._engine.async_generate(
                input_ids=list(token_ids),
                sampling_params=sglang_params(params),
                stream=True,
                rid=seq_id,
                priority=rank,
                cache_salt=cache_salt,
                **logprob_fields(params),
                **where,
            )
            async for piece in pieces(stream, params, self.tokenizer, seq_id, self.abort):
                yield replace(piece, stored=pages) if piece.finish_reason and not peer else piece
        finally:
            if adapter:
                self.adapters.release(adapter)

    def register_adapter(self, spec: AdapterSpec) -> None:
        self.adapters.register(spec)

    def unregister_adapter(self, name: str) -> None:
        self.adapters.unregister(name)

    def peer_address(self) -> str:
        o = self.options
        if o.pd_transfer and o.pd_role == "prefill":
            return f"{o.bootstrap_host}:{o.bootstrap_port}"
        return ""

    @property
    def pd_only(self) -> bool:
        return bool(self.options.pd_transfer) and self.options.pd_role == "decode"

    async def abort(self, seq_id: str) -> None:
        if self._engine is not None:
            self._engine.tokenizer_manager.abort_request(rid=seq_id)

    def stats(self) -> EngineStats:
        load, a = self._load, self.adapters
        lora = {"adapters": a.resident, "adapter_loads": a.loads, "adapter_load_s": a.load_seconds}
        if load is None:  # (not read yet)
            total = self.options.kv_cache_tokens // self.block_size
            return EngineStats(0, total, self.block_size, 0, 0, **lora)
        total = max(1, load.max_total_num_tokens // self.block_size)
        used = load.num_used_tokens // self.block_size
        held = load.num_running_reqs + load.num_waiting_reqs
        return EngineStats(used, total, self.block_size, held, load.num_running_reqs, **lora)

    def cached_blocks(self) -> list[str]:
        return self._bridge.cached() if self._bridge is not None else []

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._bridge is not None:
            await self._bridge.stop()
        await self.adapters.stop()
        if self._reports is not None:
            self._reports.close(linger=0)
        if self._names is not None:
            self._names.close()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


async def pieces(
    stream: AsyncIterator[dict], params: SamplingParams, tokenizer: Any, seq_id: str, abort: Any
) -> AsyncIterator[Generated]:
    """SGLang's streamed outputs as kvmesh's pieces: new tokens, their log-probabilities,
    why it ended, the cached tokens by tier; a stop string found in the text ends it here
    (SGLang, its tokenizer skipped, does not look for them) and aborts it there."""
    first, answer = True, []
    try:
        async for out in stream:
            meta = out.get("meta_info", {})
            new = list(out.get("output_ids") or ())
            finish = meta.get("finish_reason")
            reason = FINISHED.get(finish.get("type")) if isinstance(finish, dict) else None
            if not new and reason is None:  # (nothing yet: the first piece is still to come)
                continue
            stop = None
            if params.stop and new:
                for i in range(len(new)):  # (a piece may hold several tokens)
                    answer.append(new[i])
                    if len(answer) < params.min_tokens:
                        continue  # (stop strings end the answer from its least length on)
                    if hit := stop_string_hit(tokenizer.decode, answer, params.stop):
                        new, stop, reason = new[: i + 1], hit, "stop"
                        break
            cached = int(meta.get("cached_tokens") or 0) if first else 0
            tiers = None
            if reason is not None:
                details = meta.get("cached_tokens_details") or {}
                memory = int(details.get("device", 0)) + int(details.get("host", 0))
                tiers = {"memory": memory or int(meta.get("cached_tokens") or 0)}
                tiers["storage"] = int(details.get("storage", 0))
            yield Generated(
                token_ids=new,
                logprobs=logprobs_of(meta, len(new), params.logprobs),
                prompt_logprobs=prompt_logprobs_of(meta, params.prompt_logprobs) if first else None,
                finish_reason=reason,  # type: ignore[arg-type]
                stop_string=stop,
                cached_tokens=cached,
                cached_by_tier=tiers,
            )
            first = False
            if reason is not None:
                if stop is not None and not isinstance(finish, dict):
                    await abort(seq_id)  # (ended here, still running there)
                return
    finally:
        with contextlib.suppress(Exception):
            await stream.aclose()  # type: ignore[attr-defined]

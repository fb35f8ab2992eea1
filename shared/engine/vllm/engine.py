"""vLLM in the worker's process, through its async engine (``AsyncLLM``, as Dynamo's vLLM
worker runs it): token ids in (the router tokenizes), token ids and log-probabilities out,
vLLM's own scheduler, batching and prefix cache.

The model is a Hugging Face directory; a GGUF model (the bundled SmolLM2) is exported to one
once per machine, under the state dir (``shared/model/export.py``). vLLM starts its engine
core as a process of its own; its KV pool is sized from ``kv_cache_tokens``, its block size is
kvmesh's, and it runs eagerly (no compilation: answers equal across runs, start in seconds).
A request's tenant salt is vLLM's ``cache_salt``: one tenant's cached prefix is never
another's. LoRA adapters (``enable_lora``) are vLLM's own, one ``LoRARequest`` each, under the
name they are served as; their KV is theirs in vLLM's prefix cache and in kvmesh's hashes (the
adapter's digest in the fingerprint: ``lora_fingerprint``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
from collections.abc import AsyncIterator
from pathlib import Path

from shared.engine.interface import (
    BlockEvents,
    EngineOptions,
    EngineStats,
    Generated,
    OwningEngine,
    Peer,
)
from shared.engine.vllm.events import VllmEventBridge
from shared.engine.vllm.params import sampling_fields
from shared.messages.sampling import SamplingParams, TokenLogprobs
from shared.model.catalog import ModelSource
from shared.model.config import ModelConfig
from shared.model.export import hf_directory
from shared.model.lora import AdapterSpec, check_spec
from shared.model.text import text_of
from shared.orphans import spawned_children_die_with_us

log = logging.getLogger(__name__)

BLOCK_MULTIPLE = 32  # vLLM's CPU attention backend's kernel block sizes (MultipleOf(32))


class VllmEngine(OwningEngine):
    def __init__(
        self, config: ModelConfig, directory: Path, options: EngineOptions, state_dir: Path
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.block_size = options.block_size
        self.directory = directory
        self.options = options
        self._engine = None  # vllm's AsyncLLM, once started
        self._stats = _Stats()
        self._bridge: VllmEventBridge | None = None
        self._loras: dict[str, object] = {}  # served name → vLLM's LoRARequest
        self._digests: dict[str, str] = {}  # ... and the adapter's digest
        self._lora_ids = itertools.count(1)

    @classmethod
    def refusal(cls, options: EngineOptions) -> str:
        if options.block_size % BLOCK_MULTIPLE:
            return (
                f"vLLM's CPU attention pages KV in blocks of a multiple of {BLOCK_MULTIPLE} "
                "tokens, and its block size must be kvmesh's (one hash per block)"
            )
        return ""

    @classmethod
    def load(cls, model: ModelSource, state_dir: Path, options: EngineOptions) -> VllmEngine:
        config = text_of(model, state_dir).config
        return cls(config, hf_directory(model, config, state_dir), options, state_dir)

    def kv_cache_gib(self) -> int:
        """vLLM's CPU KV space for ``kv_cache_tokens`` tokens, in whole GiB (it reads an int)."""
        per_token = self.config.kv_bytes_per_token()  # fp32 here: its compute dtype
        return max(1, math.ceil(self.options.kv_cache_tokens * per_token / 2**30))

    def storage_connector(self):  # noqa: ANN201 (vllm's KVTransferConfig)
        """kvmesh's storage tier as vLLM's KV connector (shared/engine/vllm/connector.py),
        loaded by vLLM by its module path; None without a storage tier."""
        from vllm.config import KVTransferConfig

        if not self.options.kv_store_dir:
            return None
        return KVTransferConfig(
            kv_connector="KvmeshStorageConnector",
            kv_connector_module_path="shared.engine.vllm.connector",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",  # a damaged block is computed again
            kv_connector_extra_config={
                "store_dir": self.options.kv_store_dir,
                "fingerprint": self.config.fingerprint,
                "store_dtype": self.options.store_dtype,
            },
        )

    async def start(self, on_blocks: BlockEvents | None = None) -> None:
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        events = None
        if on_blocks is not None:  # its cache's events, bridged into kvmesh's hashes
            self._bridge = VllmEventBridge(self.config.fingerprint, self.block_size, on_blocks)
            self._bridge.digests = self._digests
            endpoint = self._bridge.bind()
            events = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)

        # vLLM's engine core is a process of its own: it goes with this worker, even one
        # killed with SIGKILL (its own workers go with it).
        spawned_children_die_with_us(self.state_dir)
        # The engine core reads these as it starts.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.kv_cache_gib())
        if self.options.threads:
            os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        if self.options.cpu_cores:  # (vLLM's own choice pins every engine to the first cores)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.options.cpu_cores
        args = AsyncEngineArgs(
            model=str(self.directory),
            tokenizer=str(self.directory),
            dtype="float32",
            enforce_eager=True,
            block_size=self.block_size,
            enable_prefix_caching=True,
            max_model_len=self.config.max_context,
            max_num_seqs=self.options.max_running,
            seed=0,
            scheduling_policy="priority",  # waiting requests by class (rank), then arrival
            disable_log_stats=False,
            # the router's grammars are llguidance's: the same library applies them here
            structured_outputs_config={"backend": "guidance"},
            kv_events_config=events,
            kv_transfer_config=self.storage_connector(),
            **self.lora_args(),
        )
        self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[self._stats.factory])
        total = self._engine.vllm_config.cache_config.num_gpu_blocks or 0
        self._stats.blocks_total = int(total)
        if self._bridge is not None:
            self._bridge.start()
        log.info(
            "vLLM ready: %s, %d KV blocks of %d tokens", self.directory, total, self.block_size
        )

    def lora_args(self) -> dict:
        """vLLM's LoRA settings: none unless asked (its LoRA layers cost every step)."""
        o = self.options
        if not o.enable_lora:
            return {}
        return {
            "enable_lora": True,
            "max_loras": o.max_loras,
            "max_lora_rank": o.max_lora_rank,
            "max_cpu_loras": 4 * o.max_loras,
        }

    def register_adapter(self, spec: AdapterSpec) -> None:
        """Served as vLLM's LoRARequest of that name (vLLM reads it at its first request)."""
        from vllm.lora.request import LoRARequest

        if not self.options.enable_lora:
            raise ValueError("LoRA adapters on a vLLM worker need KVMESH_<ROLE>_ENABLE_LORA=true")
        checked = check_spec(spec, self.config, self.options.max_lora_rank)
        self._loras[spec.name] = LoRARequest(spec.name, next(self._lora_ids), spec.path)
        self._digests[spec.name] = checked.digest

    def unregister_adapter(self, name: str) -> None:
        self._loras.pop(name, None)  # (vLLM drops it from its slots as others need them)
        self._digests.pop(name, None)

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
        from vllm.inputs import TokensPrompt

        from shared.engine.vllm.connector import RETENTION_KEY, STORAGE_TOKENS, STORED

        assert self._engine is not None, "start() first"
        if peer is not None:
            raise ValueError("vLLM's P/D goes through the storage tier here: no peer engine")
        prompt = TokensPrompt(prompt_token_ids=list(token_ids))
        if salt:
            prompt["cache_salt"] = salt
        first, cached = True, 0
        asked = vllm_params(params)
        asked.extra_args = {**(asked.extra_args or {}), RETENTION_KEY: retention}
        lora = None
        if params.adapter:
            lora = self._loras.get(params.adapter)
            if lora is None:
                raise ValueError(f"model {params.adapter!r}: no such adapter on this worker")
        stream = self._engine.generate(
            prompt, asked, request_id=seq_id, priority=rank, lora_request=lora
        )
        try:
            async for out in stream:
                piece = out.outputs[0]
                finish = piece.finish_reason
                stop = piece.stop_reason if isinstance(piece.stop_reason, str) else None
                if first:
                    cached = out.num_cached_tokens or 0
                tiers, stored = None, []
                if finish is not None:  # what came from the storage tier: known at the end
                    transfer = out.kv_transfer_params or {}
                    storage = transfer.get(STORAGE_TOKENS, 0)
                    tiers = {"memory": max(0, cached - storage), "storage": storage}
                    stored = list(transfer.get(STORED, ()))
                scores = None
                if first and params.prompt_logprobs is not None:
                    scores = prompt_logprobs_of(token_ids, out.prompt_logprobs, params)
                yield Generated(
                    token_ids=list(piece.token_ids),
                    logprobs=logprobs_of(piece, params.logprobs),
                    prompt_logprobs=scores,
                    finish_reason=finish if finish in ("stop", "length", "abort") else None,
                    stop_string=stop,
                    cached_tokens=cached if first else 0,
                    cached_by_tier=tiers,
                    stored=stored,
                )
                first = False
        finally:
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def abort(self, seq_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(seq_id)

    def stats(self) -> EngineStats:
        s = self._stats
        used = round(s.kv_usage * s.blocks_total)
        held = s.running + s.waiting
        return EngineStats(used, s.blocks_total, self.block_size, held, s.running)

    def cached_blocks(self) -> list[str]:
        return self._bridge.cached() if self._bridge is not None else []

    async def stop(self) -> None:
        if self._bridge is not None:
            await self._bridge.stop()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None


def vllm_params(p: SamplingParams):  # noqa: ANN201 (vllm's SamplingParams)
    """kvmesh's sampling parameters as vLLM's (answers streamed as deltas)."""
    from vllm import SamplingParams as Params
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    fields = sampling_fields(p)
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(t): b for t, b in fields["logit_bias"].items()}
    if "structured_outputs" in fields:
        fields["structured_outputs"] = StructuredOutputsParams(**fields["structured_outputs"])
    return Params(n=1, output_kind=RequestOutputKind.DELTA, **fields)


def logprobs_of(piece, wanted: int | None) -> list[TokenLogprobs] | None:  # noqa: ANN001
    """Each new token's log-probability and the ``wanted`` most likely (id, log-probability)."""
    if wanted is None or piece.logprobs is None:
        return None
    pairs = zip(piece.token_ids, piece.logprobs, strict=False)
    return [_scored(t, ranked, wanted) for t, ranked in pairs]


def prompt_logprobs_of(
    token_ids: list[int], entries: list | None, params: SamplingParams
) -> list[TokenLogprobs]:
    """The prompt's tokens' scores from vLLM's ``prompt_logprobs`` (None for the first)."""
    wanted = params.prompt_logprobs or 0
    pairs = zip(token_ids[1:], (entries or [None])[1:], strict=False)
    return [_scored(t, ranked, wanted) for t, ranked in pairs if ranked is not None]


def _scored(token: int, ranked: dict, wanted: int) -> TokenLogprobs:
    """vLLM's {token id: Logprob} of one position as the chosen token's score and the
    ``wanted`` likeliest."""
    top = sorted(
        ((t, lp.logprob) for t, lp in ranked.items() if lp.rank and lp.rank <= wanted),
        key=lambda x: -x[1],
    )
    return TokenLogprobs(ranked[token].logprob, tuple(top[:wanted]))


class _Stats:
    """What vLLM's scheduler last reported (a stat logger of vLLM's, called per step)."""

    def __init__(self) -> None:
        self.running = self.waiting = self.blocks_total = 0
        self.kv_usage = 0.0

    def factory(self, vllm_config, engine_index: int = 0):  # noqa: ANN001, ANN201
        from vllm.v1.metrics.loggers import StatLoggerBase

        stats = self

        class Logger(StatLoggerBase):
            def __init__(self, vllm_config, engine_index: int = 0) -> None:  # noqa: ANN001
                pass

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):  # noqa: ANN001, ANN201
                if scheduler_stats is not None:
                    stats.running = scheduler_stats.num_running_reqs
                    stats.waiting = scheduler_stats.num_waiting_reqs
                    stats.kv_usage = scheduler_stats.kv_cache_usage

            def log_engine_initialized(self) -> None:
                pass

        return Logger(vllm_config, engine_index)

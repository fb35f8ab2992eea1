"""The engine boundary: what a prefill or decode worker needs of a compute engine.

Workers import this module and ``registry`` only; the backend is picked by name from a setting
(``KVMESH_PREFILL_ENGINE``, ``KVMESH_DECODE_ENGINE``). Nothing here imports torch: the types
name tensors, the backends hold them.

A sequence's life, as workers drive it:

- prefill here, decode here:   ``can_admit`` → ``prefill`` → ``step`` … → ``free``
- prefill here, decode there:  ``prefill(handoff=True)`` → ``export_kv(partial=True)`` → ``free``
- KV from a prefill worker:    ``reserve`` → ``receive`` → ``step`` … → ``free``
- KV from the tiers:           ``import_blocks`` → ``prefill(prefix=…)`` → ``release(prefix)``
- KV to the tiers:             ``export_blocks`` (full blocks, one kvformat blob each)

An engine that schedules, batches and keeps its own KV (vLLM, SGLang) is the second kind,
``OwningEngine``: it takes a whole request (token ids in) and streams its answer
(``Generated`` pieces); the worker adds nothing between its steps.

KV crosses the boundary only as kvformat bytes (``shared/engine/kvformat.py``): a header naming
the model's fingerprint, block size and layer layout, then one K/V cell per layer and block,
each with its own CRC32. Any two engines that agree on the header can exchange KV, whatever
runs inside them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal, Protocol

from shared.kvstore.hashing import XXH3
from shared.messages.sampling import SamplingParams, TokenLogprobs
from shared.model.catalog import ModelSource
from shared.model.config import ModelConfig

if TYPE_CHECKING:
    import torch

    from shared.eplb.balancer import BalancerStats
    from shared.model.lora import AdapterSpec

FinishReason = Literal["stop", "length", "abort"]
KV_DTYPES = ("float32", "bfloat16", "float16")  # what KV is kept and shipped as (by name)


class KVFormatError(Exception):
    """The bytes are not valid KV for this engine (wrong model, damaged, truncated)."""


class BadBlock(KVFormatError):
    """Block ``index`` of several being loaded is not valid KV (damaged, or another model's)."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(f"block {index}: {reason}")
        self.index = index


class PoolExhausted(Exception):
    """Not enough free KV blocks (or sequence slots); the message says how many were asked
    for and how many are free. Nothing running is harmed: the caller retries or refuses."""


class Cancelled(Exception):
    """A prefill was stopped between chunks because its request was cancelled."""


class Paused(Exception):
    """A prefill was paused between chunks (to let more urgent work run): the sequence keeps
    its blocks and what it computed; ``prefill`` of the same sequence goes on from there."""

    def __init__(self, seq_id: str, n_cached: int) -> None:
        super().__init__(f"prefill of {seq_id} paused at token {n_cached}")
        self.n_cached = n_cached


@dataclass(frozen=True)
class EngineOptions:
    block_size: int = 64
    kv_cache_tokens: int = 65536  # pool size, in tokens (rounded down to whole blocks)
    dtype: str = ""  # the weights' and KV cache's; "": float32 on a CPU, bfloat16 on a GPU
    device: str = "cpu"  # where the torch engine computes: cpu, cuda, cuda:N
    cuda_graphs: bool = True  # on a GPU, plain decode steps replayed as CUDA graphs
    threads: int = 0  # 0: leave the backend's default
    cpu_cores: str = ""  # cores its threads are bound to ("1", "0-3,8"); "": the backend's choice
    prefill_chunk: int = 512  # tokens per forward pass in prefill (bounds attention memory)
    max_running: int = 64  # sequences decoding together
    # Speculative decoding (shared/engine/torch/speculate.py): off, fixed (every sequence
    # verifies up to fixed_draft drafted tokens a step), adaptive (each its own length).
    speculative: str = "off"
    max_draft: int = 8
    fixed_draft: int = 5
    max_ngram: int = 4
    # Expert placement for MoE models (shared/eplb/): off while eplb_cards is 0; the cards are
    # logical groups of slots in one process, what a multi-card deployment would apply as is.
    eplb_cards: int = 0
    eplb_slots: int = 0  # in all; 0: one per expert (no replicas)
    eplb_window_steps: int = 1000
    eplb_replan_steps: int = 10_000
    eplb_move_cost: float = 0.05  # mean-card decode steps per expert moved
    eplb_record: str = ""  # a load file the per-step expert counts are written to
    # Engines that own their KV (vLLM, SGLang) read and write the shared storage tier
    # themselves; SGLang keeps the worker's memory tier in its own host memory (HiCache).
    kv_store_dir: str = ""  # empty: no storage tier
    store_dtype: str = ""  # of stored blocks; empty: the engine's
    memory_tier_bytes: int = 0
    # An engine's own P/D (SGLang's): the transfer backend its KV moves by ("": none), this
    # worker's side of it, and (prefill) where its bootstrap server listens.
    pd_transfer: str = ""
    pd_role: str = ""  # "prefill" or "decode"
    bootstrap_host: str = ""
    bootstrap_port: int = 8998
    # LoRA adapters (shared/model/lora.py): how many are resident at once (the rest read
    # from disk when needed, least recently used out), and the largest rank taken.
    max_loras: int = 4
    max_lora_rank: int = 64
    enable_lora: bool = False  # (vLLM: its LoRA layers, which its base model's steps pay for)


@dataclass(frozen=True)
class Prefix:
    """A hold on cached KV blocks covering the first ``n_tokens`` of some token sequence."""

    block_ids: tuple[int, ...]
    n_tokens: int


# An image in a prompt: the position of its first placeholder token, and its embeddings
# [tokens, dim] float32, which take the place of those placeholders' token embeddings.
ImageEmbeds = tuple[int, "torch.Tensor"]


@dataclass(frozen=True)
class PrefillRequest:
    seq_id: str
    token_ids: list[int]
    params: SamplingParams
    prefix: Prefix | None = None
    handoff: bool = False
    images: tuple[ImageEmbeds, ...] = ()


@dataclass(frozen=True)
class StepOutput:
    """One new token of one sequence; finish_reason is set on its last."""

    seq_id: str
    token_id: int
    finish_reason: FinishReason | None = None
    stop_string: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them
    # On its first token, when asked for: the prompt's tokens' (each but the first).
    prompt_logprobs: list[TokenLogprobs] | None = None
    # On a sequence's last token: the drafted tokens verified over its answer (speculation),
    # and how many were accepted.
    drafted: int = 0
    accepted: int = 0


class SequenceState(Protocol):
    """What a worker reads of a sequence the engine holds (read-only to the worker)."""

    @property
    def prompt_ids(self) -> list[int]: ...

    @property
    def output_ids(self) -> list[int]: ...

    @property
    def tokens(self) -> list[int]: ...

    @property
    def n_cached(self) -> int:
        """Leading tokens whose KV is computed and in the cache."""
        ...

    @property
    def finish_reason(self) -> FinishReason | None: ...

    @property
    def drafted(self) -> int:
        """Drafted tokens verified over its answer (speculation), and how many accepted."""
        ...

    @property
    def accepted(self) -> int: ...


@dataclass(frozen=True)
class EngineStats:
    """Capacity and use, for heartbeats and logs."""

    kv_blocks_used: int
    kv_blocks_total: int
    block_size: int
    sequences: int  # held: prefilling, reserved, running
    running: int  # in the decode batch
    draft_tokens: int = 0  # speculation, since start: drafted tokens verified
    accepted_tokens: int = 0  # ... of which accepted
    eplb: BalancerStats | None = None  # expert placement, on a MoE model with it on
    adapters: tuple[str, ...] = ()  # LoRA adapters resident (computing without a load)
    adapter_loads: int = 0  # adapters loaded since start, and the seconds that took
    adapter_load_s: float = 0.0


class AdapterHost:
    """LoRA adapters, for an engine that serves them (the torch engine, vLLM's, SGLang's)."""

    def register_adapter(self, spec: AdapterSpec) -> None:
        """Serve the LoRA adapter ``spec`` as the model ``spec.name``: a sequence whose
        ``params.adapter`` names it computes with it (loaded when first needed; LoraError
        then for an adapter that does not fit the model)."""
        raise ValueError(f"the {type(self).__name__} serves no LoRA adapters")

    def unregister_adapter(self, name: str) -> None:
        """Serve ``name`` no more (sequences computing with it finish first)."""
        return  # (an engine that serves none has none to forget)


class Engine(AdapterHost, ABC):
    """A compute engine behind a worker. Not thread-safe: the worker calls it from one thread
    (``shared/hosting/runner.py``), so calls never overlap and need no locks inside.

    ``config`` is the model's text-side configuration; its ``fingerprint`` names the KV (same
    fingerprint, interchangeable blocks). ``running`` lists the ids of the sequences in the
    decode batch, in batch order; the worker steps while it is not empty.

    Room for a whole answer (prompt + max_tokens) is taken when a sequence is admitted, so a
    full pool refuses new work (``PoolExhausted``) and never stops a running sequence.

    SGLang is not one of these: it schedules, batches and keeps its own KV, as vLLM does, so it
    is an ``OwningEngine`` (``shared/engine/sglang/``).
    """

    config: ModelConfig
    block_size: int
    running: list[str]

    # -- lifecycle ---------------------------------------------------------------------------

    @classmethod
    @abstractmethod
    def load(cls, model: ModelSource, state_dir: Path, options: EngineOptions) -> Engine:
        """Load a model (weights and all; seconds) from its source (``shared/model/catalog``:
        checked by the caller) and build the engine."""

    @abstractmethod
    def start(self) -> None:
        """Get ready to serve (threads, warm-up)."""

    @abstractmethod
    def cleanup(self) -> None:
        """Abort everything and free memory."""

    # -- admission and compute ---------------------------------------------------------------

    @abstractmethod
    def can_admit(self, n_prompt: int, params: SamplingParams, held_blocks: int = 0) -> bool:
        """True when prefill of such a request would find the KV blocks it needs
        (``held_blocks``: of its prompt's, those it would not take: a prefix shared or
        already imported)."""

    @abstractmethod
    def prefill(
        self,
        seq_id: str,
        token_ids: list[int],
        params: SamplingParams,
        prefix: Prefix | None = None,
        images: tuple[ImageEmbeds, ...] = (),
        handoff: bool = False,
        cancelled: Callable[[], bool] | None = None,
        pause: Callable[[], bool] | None = None,
    ) -> StepOutput:
        """Admit a sequence and compute the prompt past ``prefix`` in chunks, then sample the
        first token; the sequence then joins the decode batch unless that token finished it.
        Raises PoolExhausted when full, ValueError for a prompt that cannot fit the context.

        ``images``: embeddings spliced in place of their placeholder tokens (only those past
        the prefix are needed; the prefix's KV already holds the rest).

        ``handoff``: the sequence will decode elsewhere: blocks are reserved for the prompt
        only, it never joins the batch; export it with ``export_kv(partial=True)``, then free.
        ``cancelled`` is polled between chunks; when it says True, Cancelled is raised and the
        sequence is freed. ``pause`` too: when it says True (and a chunk was computed), Paused
        is raised and the sequence kept; calling ``prefill`` for it again (the same arguments;
        its prefix is held already) computes the rest."""

    @abstractmethod
    def prefill_batch(self, requests: list[PrefillRequest]) -> list[StepOutput | Exception]:
        """Several short prompts in one pass; per request, its first token or the error it
        alone got (ValueError, PoolExhausted); the others are unaffected."""

    @abstractmethod
    def reserve(self, seq_id: str, token_ids: list[int], params: SamplingParams) -> None:
        """Hold blocks for a prompt whose KV comes from elsewhere, and for its whole answer.
        Raises PoolExhausted (or ValueError for a prompt too long) when it cannot."""

    @abstractmethod
    def write_kv(self, seq_id: str, source: bytes | BinaryIO) -> None:
        """Write a reserved sequence's prompt KV (from ``export_kv(partial=True)``) into its
        blocks. Raises KVFormatError for KV of another model or layout, or damaged. The one
        call that may run on another thread beside the engine's (steps go on meanwhile): it
        touches nothing but the reserved sequence's own blocks, which nothing else reads or
        frees until it returns."""

    @abstractmethod
    def join(self, seq_id: str, first_token: int) -> None:
        """A sequence whose KV was written joins the decode batch with its first token
        (sampled by the prefill side)."""

    def receive(self, seq_id: str, source: bytes | BinaryIO, first_token: int) -> None:
        """``write_kv`` then ``join``, on the engine's thread."""
        self.write_kv(seq_id, source)
        self.join(seq_id, first_token)

    @abstractmethod
    def step(self) -> list[StepOutput]:
        """Advance every running sequence by one token."""

    # -- ending --------------------------------------------------------------------------------

    @abstractmethod
    def abort(self, seq_id: str) -> None:
        """Stop a sequence now and free its blocks (nothing when it is not held)."""

    @abstractmethod
    def free(self, seq_id: str) -> None:
        """Forget a (finished) sequence and release its blocks (nothing when it is not held)."""

    # -- what is held --------------------------------------------------------------------------

    @abstractmethod
    def holds(self, seq_id: str) -> bool:
        """True while the sequence has blocks here (from admission until free or abort)."""

    @abstractmethod
    def sequence(self, seq_id: str) -> SequenceState:
        """A held sequence's tokens and progress."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Blocks used and total, sequences held and running."""

    # -- KV in the block format ----------------------------------------------------------------

    @abstractmethod
    def export_kv(self, seq_id: str, dtype: str | None = None, partial: bool = False) -> bytes:
        """The KV of the sequence's computed blocks as one kvformat blob. ``partial``: include
        the last, partly filled block (a handoff ships the whole prompt; a cache keeps whole
        blocks only)."""

    @abstractmethod
    def export_blocks(
        self, seq_id: str, first: int, last: int, dtype: str | None = None
    ) -> list[bytes]:
        """Full blocks ``first`` .. ``last - 1`` of a sequence, one kvformat blob each (what the
        storage tiers keep, keyed by block hash)."""

    @abstractmethod
    def import_kv(self, source: bytes | BinaryIO) -> Prefix:
        """Load a kvformat blob into fresh blocks and hold them; release with ``release``."""

    @abstractmethod
    def import_blocks(self, sources: list[bytes | BinaryIO], trusted: int = 0) -> Prefix:
        """Load single-block blobs (block i of a prefix from ``sources[i]``) into fresh blocks
        and hold them, like import_kv. Every cell read is checksummed, but for the first
        ``trusted`` sources: this worker's own memory tier's, bytes its engine encoded that
        never left the process. A bad block raises BadBlock naming its index (nothing is held
        then)."""

    @abstractmethod
    def release(self, prefix: Prefix) -> None:
        """Drop a hold taken by an import or a share (blocks stay while a sequence uses them)."""

    @abstractmethod
    def share_prefix(self, seq_id: str, n_blocks: int) -> Prefix | None:
        """A hold on the first ``n_blocks`` blocks of a held sequence whose KV they carry
        (copy on write: a sequence admitted with it reads them and writes its own blocks
        after them), for another sequence with the same leading tokens; None when it is not
        held, or its KV does not cover them yet (still on its way). Release as an import."""


# -- engines that own their KV --------------------------------------------------------------


@dataclass(frozen=True)
class Generated:
    """A piece of an answer from an engine that owns its KV: the new tokens (with their
    log-probabilities when asked for), and on the last piece why it ended."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_string: str | None = None  # the stop string that ended it, when one did
    prompt_logprobs: list[TokenLogprobs] | None = None  # (first piece) when asked for
    cached_tokens: int = 0  # (first piece) prompt tokens with KV at hand, of all tiers
    cached_by_tier: dict[str, int] | None = None  # (last piece) those tokens by tier
    # (last piece) kvmesh's hashes of the blocks its storage connector writes for it (they
    # may still be on their way to the tier: a P/D prefill worker waits for them)
    stored: list[str] = field(default_factory=list)


# In an engine's own P/D (SGLang's): the prefill engine's bootstrap host and port, and the
# request's room there; both engines are given the same.
Peer = tuple[str, int, int]

# What an engine that owns its KV says of its blocks: ("stored" or "removed", kvmesh's hashes
# of the blocks, the tier: "memory" (its own cache) or "storage", their retention class, the
# bytes each block takes there: 0 when the engine does not say, then its in-memory size), for
# the worker to publish as KV events.
BlockEvents = Callable[[str, list[str], str, str, int], Awaitable[None]]


class OwningEngine(AdapterHost, ABC):
    """An engine that schedules, batches, keeps its own prefix cache and moves its own KV
    (vLLM: shared/engine/vllm/). It runs on the worker's event loop: ``generate`` streams
    one request's answer while others stream beside it; nothing here blocks the loop.

    ``config`` is the model's text-side configuration (its fingerprint names the KV, as for
    ``Engine``); ``block_size`` is the engine's, equal to kvmesh's (checked at load)."""

    config: ModelConfig
    block_size: int
    hash_scheme: str = XXH3  # how its blocks are named (shared/kvstore/hashing.py): the router's

    @classmethod
    @abstractmethod
    def load(cls, model: ModelSource, state_dir: Path, options: EngineOptions) -> OwningEngine:
        """Build the engine for a model (its files checked by the caller); nothing runs yet."""

    @classmethod
    def refusal(cls, options: EngineOptions) -> str:
        """Why the engine cannot run with these options (a block size it cannot page in);
        "" when it can. Asked before anything loads."""
        return ""

    @abstractmethod
    async def start(self, on_blocks: BlockEvents | None = None) -> None:
        """Start it (its processes, its weights: seconds). ``on_blocks``: called as blocks
        enter and leave its prefix cache, with kvmesh's hashes of them."""

    @abstractmethod
    def generate(
        self,
        seq_id: str,
        token_ids: list[int],
        params: SamplingParams,
        salt: str = "",
        retention: str = "chat",
        peer: Peer | None = None,
        rank: int = 1,
    ) -> AsyncIterator[Generated]:
        """The answer to a prompt, in pieces. ``salt``: the tenant's, so one tenant's cached
        prefix is never another's; ``retention``: the class its stored blocks are kept under;
        ``peer``: in an engine's own P/D, where the KV moves between the two engines;
        ``rank``: its class's (shared/messages/generate.py: 0 first), for the engine's own
        priority scheduling. Closing the iterator early aborts the request."""

    @abstractmethod
    async def abort(self, seq_id: str) -> None:
        """Stop a request; its stream ends with finish_reason "abort"."""

    @abstractmethod
    def stats(self) -> EngineStats:
        """Blocks used and total, requests held (running and waiting) and running."""

    def cached_blocks(self) -> list[str]:
        """kvmesh's hashes of the blocks its prefix cache holds now, as its events said (a
        resync republishes them)."""
        return []

    def peer_address(self) -> str:
        """Where a P/D peer reaches this engine's KV, host:port ("" when it takes no peer):
        a prefill engine's in an engine's own P/D."""
        return ""

    @property
    def pd_only(self) -> bool:
        """It decodes only what a peer prefill engine hands it (it cannot prefill alone)."""
        return False

    @abstractmethod
    async def stop(self) -> None:
        """Abort everything and stop its processes."""

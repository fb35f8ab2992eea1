"""How long a simulated prefill worker takes over a request: the world the routing policies are
replayed in.

``PolicyWorld`` is the router's own estimate (uncached tokens at the prefill rate, loaded ones
at the load rate, memory-tier hits free): a world built from the formula the ``ttft`` policy
ranks with, fair only between policies that share that estimate. ``ProfiledWorld`` is not:

- compute comes from a measured engine profile (``simulator/profile.py``, ``bench/profile.py``)
  scaled to a card's rate, so a token after a long context costs more than one after none;
- a prompt longer than a pass is computed in chunks, each after the ones before it;
- each request's compute varies (the profile's own spread, or more);
- the storage tier has a cluster-wide read bandwidth that the loads running at once share
  (a load gets the share free when it starts), and each worker a link it cannot exceed;
- a memory-tier hit costs a copy into the engine;
- short prompts queued together share one pass (as a prefill worker batches them): the pass
  costs their compute less the fixed part of a pass that they share (the profile's batches);
- a decode step reads every sequence's KV: more sequences, and longer ones, slow each other;
- (``aggregated``) each worker decodes what it prefilled, as vLLM's and SGLang's whole-request
  servers do: every pass of a prompt also steps the answers the worker is decoding, and takes
  their tokens' compute and their KV's reads longer.

Each default says where it comes from.
"""

from __future__ import annotations

import json
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from pathlib import Path

from simulator.profile import EngineProfile

GB = 1e9
WORLDS = Path(__file__).resolve().parent / "worlds"  # named worlds: <name>.json


@dataclass(frozen=True)
class Service:
    """A request's time on its prefill worker, by part (seconds), in the order they run."""

    load_s: float  # its cached blocks read from the storage tier
    copy_s: float  # its cached blocks copied from the worker's memory tier
    compute_s: float  # its uncached tokens computed

    @property
    def total_s(self) -> float:
        return self.load_s + self.copy_s + self.compute_s


@dataclass(frozen=True)
class Part:
    """A request's prompt on a prefill worker (tokens): in its memory tier, then in the storage
    tier, then to compute."""

    memory: int
    loaded: int
    uncached: int


class World(ABC):
    batch_tokens = 0  # uncached tokens one pass may take over several requests (0: one each)
    aggregated = False  # each prefill worker decodes its own requests (no decode pool)
    overhead_s = 0.0  # every request's time outside the engine's compute, added to its TTFT...
    overhead_s_per_token = 0.0  # ...and per prompt token (hashing, lookups, KV exported)

    @abstractmethod
    def service(
        self, worker: str, memory_tokens: int, loaded_tokens: int, uncached: int, now: float
    ) -> Service:
        """A request starting on ``worker`` at ``now``: ``memory_tokens`` of its prompt in the
        worker's memory tier, then ``loaded_tokens`` in the storage tier, then ``uncached``."""

    def batch(self, worker: str, parts: list[Part], now: float) -> tuple[float, list[Service]]:
        """One pass over requests starting together: how long it takes, and each request's
        part of it (each is done when the pass is)."""
        assert len(parts) == 1, "this world prefills one request at a time"
        s = self.service(worker, parts[0].memory, parts[0].loaded, parts[0].uncached, now)
        return s.total_s, [s]

    @abstractmethod
    def tpot_s(self, sequences: int, context_tokens: int) -> float:
        """Seconds per output token on a decode worker holding ``sequences`` of
        ``context_tokens`` tokens together."""

    @abstractmethod
    def decode_step_s(self, sequences: int, context_tokens: int) -> float:
        """What ``sequences`` decoding (``context_tokens`` together) add to a prefill pass
        that steps them too: their tokens' compute and their KV read (the weights are read
        for the pass anyway)."""


class PolicyWorld(World):
    def __init__(
        self,
        prefill_tok_s: float,
        load_tok_s: float,
        decode_tok_s: float = 14_000.0,
        min_tpot_s: float = 0.02,
    ) -> None:
        self.prefill_tok_s = prefill_tok_s
        self.load_tok_s = load_tok_s
        self.decode_tok_s = decode_tok_s
        self.min_tpot_s = min_tpot_s

    def service(
        self, worker: str, memory_tokens: int, loaded_tokens: int, uncached: int, now: float
    ) -> Service:
        return Service(loaded_tokens / self.load_tok_s, 0.0, uncached / self.prefill_tok_s)

    def tpot_s(self, sequences: int, context_tokens: int) -> float:
        """A card's decode rate shared by its sequences, each at most 1/min_tpot."""
        return max(self.min_tpot_s, sequences / self.decode_tok_s)

    def decode_step_s(self, sequences: int, context_tokens: int) -> float:
        return sequences / self.decode_tok_s


@dataclass(frozen=True)
class WorldSettings:
    """A world's description (``kvmesh sim --world FILE``: a JSON object of these fields)."""

    profile: str  # an engine profile file (bench/profile.py writes one)
    # The card's rate the profile is scaled to, for 1024 uncached tokens and nothing cached
    # (DeepInfer's published prefill figure without cache hits).
    prefill_tok_s: float = 60_000.0
    variation: float = -1.0  # relative spread of a request's compute; < 0: the profile's own
    # KV bytes per token: DeepSeek-V3's MLA latent, (512 + 64) × 61 layers × 2 bytes.
    kv_bytes_per_token: int = 70_272
    # The storage tier's aggregate read bandwidth, per prefill worker of the pool (the tier of
    # a pool of N is N times this): 3FS's published read test, 6.6 TiB/s over its 500 client
    # nodes, all reading at once.
    store_gb_s_per_worker: float = 6.6 * 2**40 / 500 / GB
    # A worker's link to it: a 3FS client node's 1 × 200 Gb/s InfiniBand NIC.
    link_gb_s: float = 25.0
    # Host memory into the engine: PCIe 5.0 × 16's 64 GB/s.
    memory_gb_s: float = 64.0
    # Uncached tokens one prefill pass may take over several short prompts queued together:
    # SGLang's default chunked-prefill size on an 80 GB card.
    batch_tokens: int = 8192
    # Decode: a card's rate shared by its sequences, each at most 1/min_tpot (DeepInfer's
    # published 14.8K output tok/s a node, ~20 tok/s a sequence), and each step reading every
    # sequence's KV from HBM (an H800's 3.35 TB/s).
    decode_tok_s: float = 14_000.0
    min_tpot_s: float = 0.02
    hbm_gb_s: float = 3350.0
    # Tokens of its context each token attends to, at most, in prefill and in a decode step
    # (0: all of it; sparse attention picks a fixed number: DeepSeek-V3.2's 2048).
    attended_tokens: int = 0
    # What every request spends outside the engine's compute (router, bus, lookups, its KV
    # exported), and per prompt token: none in a card's figures; measured on a live mesh
    # (simulator/validate.py).
    overhead_s: float = 0.0
    overhead_s_per_token: float = 0.0
    # Whole-request workers (vLLM or SGLang servers, no P/D): each prefill worker decodes what
    # it prefilled, in the same steps as its next prompts' passes.
    aggregated: bool = False
    seed: int = 0

    @classmethod
    def named(cls, name: str) -> WorldSettings:
        """A world by the name of one in simulator/worlds/ ("profiled": the torch engine's
        profile at a card's rate), or a world file's path."""
        own = WORLDS / f"{name}.json"
        return cls.read(own if "/" not in name and own.is_file() else Path(name))

    @classmethod
    def read(cls, path: Path) -> WorldSettings:
        """A world file; ValueError naming the file and the field when it is not one."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a world description ({err})") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or "profile" not in raw:
            raise ValueError(f"{path}: a JSON object with at least 'profile' (a profile file)")
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown fields {unknown}; known: {sorted(known)}")
        profile = Path(raw["profile"])
        if not profile.is_absolute():  # relative to the world file
            raw["profile"] = str(Path(path).parent / profile)
        return cls(**raw)


class ProfiledWorld(World):
    def __init__(
        self, settings: WorldSettings, profile: EngineProfile | None = None, workers: int = 1
    ) -> None:
        self.settings = settings
        base = profile or EngineProfile.read(Path(settings.profile))
        self.profile = base.scaled(settings.prefill_tok_s)
        self.shared_s = self.profile.shared_pass_s()
        self.batch_tokens = settings.batch_tokens
        self.aggregated = settings.aggregated
        self.overhead_s = settings.overhead_s
        self.overhead_s_per_token = settings.overhead_s_per_token
        self.store_gb_s = settings.store_gb_s_per_worker * workers
        spread = settings.variation if settings.variation >= 0 else base.spread
        # a lognormal of median 1 whose median |x - 1| is about ``spread`` (small spreads)
        self.sigma = spread / 0.6745
        self.rng = random.Random(settings.seed)
        self.loads_until: list[float] = []  # when each load running now ends

    def service(
        self, worker: str, memory_tokens: int, loaded_tokens: int, uncached: int, now: float
    ) -> Service:
        s = self.settings
        load_s = 0.0
        if loaded_tokens:
            self.loads_until = [t for t in self.loads_until if t > now]
            share = min(s.link_gb_s, self.store_gb_s / (len(self.loads_until) + 1)) * GB
            load_s = loaded_tokens * s.kv_bytes_per_token / share
            self.loads_until.append(now + load_s)
        copy_s = memory_tokens * s.kv_bytes_per_token / (s.memory_gb_s * GB)
        compute_s = 0.0
        if not uncached and memory_tokens + loaded_tokens:  # (an engine computes the last
            uncached, loaded_tokens = 1, max(0, loaded_tokens - 1)  # token for its logits)
        if uncached:
            noise = math.exp(self.rng.gauss(0.0, self.sigma)) if self.sigma else 1.0
            compute_s = self.compute_s(memory_tokens + loaded_tokens, uncached) * noise
        return Service(load_s, copy_s, compute_s)

    def compute_s(self, cached: int, uncached: int) -> float:
        """A prompt's uncached tokens computed in chunks of the pass budget, each after the
        context before it (chunked prefill, as SGLang and vLLM do): a long prompt's attention
        grows with it (up to ``attended_tokens``, where sparse attention stops it)."""
        chunk = self.batch_tokens or uncached
        seconds, done = 0.0, 0
        attended = self.settings.attended_tokens or cached + uncached
        while done < uncached:
            n = min(chunk, uncached - done)
            seconds += self.profile.prefill_s(min(cached + done, attended), n)
            done += n
        return seconds

    def batch(self, worker: str, parts: list[Part], now: float) -> tuple[float, list[Service]]:
        """Each request's blocks loaded and copied in turn (one link), then one pass computing
        them all: their compute less the fixed part of a pass for all but one."""
        alone, t = [], now
        for p in parts:
            s = self.service(worker, p.memory, p.loaded, p.uncached, t)
            t += s.load_s + s.copy_s
            alone.append(s)
        longest = max(s.compute_s for s in alone)
        compute = max(longest, sum(s.compute_s for s in alone) - (len(parts) - 1) * self.shared_s)
        return t - now + compute, [Service(s.load_s, s.copy_s, compute) for s in alone]

    def tpot_s(self, sequences: int, context_tokens: int) -> float:
        share = max(self.settings.min_tpot_s, sequences / self.settings.decode_tok_s)
        return share + self._kv_read_s(sequences, context_tokens)

    def decode_step_s(self, sequences: int, context_tokens: int) -> float:
        s = self.settings
        return sequences / s.decode_tok_s + self._kv_read_s(sequences, context_tokens)

    def _kv_read_s(self, sequences: int, context_tokens: int) -> float:
        """A decode step's read of its sequences' KV from HBM."""
        s = self.settings
        if s.attended_tokens:
            context_tokens = min(context_tokens, sequences * s.attended_tokens)
        return context_tokens * s.kv_bytes_per_token / (s.hbm_gb_s * GB)

"""LoRA adapters resident in the torch engine, and their low-rank products in a forward pass.

Up to ``n_slots`` adapters are resident at once, each in one slot of a stack per (layer,
fused projection): A [slots, R, in] and B transposed [slots, R, out], where R is the largest
fused rank of the adapters resident (smaller ones padded with zeros). A forward pass whose
rows belong to sequences of different adapters (and none) computes every row's product in
the same two matrix products per projection, over the slots the pass uses:
u = x·A[lo..hi]ᵀ ([N, K·R]), each row's u kept in its own slot's R columns only (a 0/1
mask), then u·Bᵀ[lo..hi] ([N, out]). No batch is split per adapter, and a pass with no
adapted row does none of this.

Adapters are registered by name (``register``: where to read them), read from disk when a
sequence first needs one, and kept read (on the host) for ``n_host`` more; a slot whose
sequences have all ended is taken by the next adapter needed, least recently used first. A
slot in use by a sequence is never taken: when every slot is, admission waits
(``PoolExhausted``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from functools import partial

import torch

from shared.engine.interface import PoolExhausted
from shared.engine.torch.project import project
from shared.model.config import ModelConfig
from shared.model.lora import (
    Adapter,
    AdapterSpec,
    LoraError,
    check_spec,
    projection_shape,
    read_adapter,
)

BASE = -1  # a row's slot when no adapter computes it


@dataclass
class _Stack:
    """One (layer, projection)'s adapters: A [slots, R, in]; ``cat`` [out, base + slots·R],
    the base weight's columns first where it is fused (``base``: their count, 0 on a GPU),
    then each slot's B (times its scale) in R columns of its own."""

    a: torch.Tensor
    cat: torch.Tensor
    base: int

    @property
    def rank(self) -> int:
        return self.a.shape[1]

    def b(self, slot: int) -> torch.Tensor:
        """The slot's B columns, [out, R]."""
        start = self.base + slot * self.rank
        return self.cat[:, start : start + self.rank]


class AdapterSlots:
    def __init__(
        self,
        config: ModelConfig,
        n_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        n_host: int = 0,
        weights: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.config = config
        # The model's weights, where an adapted projection's base weight is fused with its
        # adapters' B (one matrix product computes the base and every row's adapter: on a
        # CPU, where many small products in a pass cost more than their bytes); None: apart.
        self.weights = weights
        self.n_slots = n_slots
        self.max_rank = max_rank
        self.dtype, self.device = dtype, device
        self.specs: dict[str, AdapterSpec] = {}  # registered, by name
        self.held: list[AdapterSpec | None] = [None] * n_slots  # each slot's adapter
        self.users = [0] * n_slots  # sequences computing with each slot's
        self.recent: OrderedDict[int, None] = OrderedDict()  # slots, least recently used first
        self.host: OrderedDict[str, Adapter] = OrderedDict()  # read, by digest (LRU)
        self.n_host = n_host or 4 * n_slots
        self.stacks: dict[tuple[int, str], _Stack] = {}
        self.loads = 0  # adapters put in a slot, since start
        self.load_seconds = 0.0  # ... and the time it took, read from disk or not
        self.reads = 0  # of those, read from disk

    # -- the registry ------------------------------------------------------------------------

    def register(self, spec: AdapterSpec) -> None:
        """Serve ``spec.name`` from ``spec.path``, checked now against the model from its
        files' headers (LoraError), its tensors read when first needed. A name registered
        again with other files takes effect for sequences admitted after."""
        check_spec(spec, self.config, self.max_rank)
        old = self.specs.get(spec.name)
        self.specs[spec.name] = spec
        if old is not None and old.digest != spec.digest:
            self._forget(spec.name)

    def unregister(self, name: str) -> None:
        """Serve ``name`` no more; sequences computing with it finish first."""
        self.specs.pop(name, None)
        self._forget(name)

    def _forget(self, name: str) -> None:
        for slot, held in enumerate(self.held):
            if held is not None and held.name == name and not self.users[slot]:
                self._clear(slot)

    def _current(self, held: AdapterSpec | None) -> bool:
        """Whether a slot's adapter is still served as it was loaded."""
        return held is not None and self.specs.get(held.name) == held

    @property
    def resident(self) -> list[str]:
        """Names of the adapters resident, as registered now."""
        return [h.name for h in self.held if h is not None and self._current(h)]

    # -- sequences -----------------------------------------------------------------------------

    def acquire(self, name: str) -> int:
        """The slot computing ``name`` for one more sequence, loaded when it is not resident.
        ValueError for a name not registered or an adapter that cannot be read; PoolExhausted
        while every slot is in use."""
        spec = self.specs.get(name)
        if spec is None:
            raise ValueError(f"model {name!r}: no such adapter on this worker")
        slot = self._slot_of(spec)
        if slot is None:
            slot = self._free_slot()
            self._load(slot, spec)
        self.users[slot] += 1
        self.recent.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot == BASE:
            return
        assert self.users[slot] > 0, f"adapter slot {slot} released more than acquired"
        self.users[slot] -= 1
        if not self.users[slot] and not self._current(self.held[slot]):
            self._clear(slot)  # (unregistered, or registered again, while in use: now gone)

    def _slot_of(self, spec: AdapterSpec) -> int | None:
        for slot, held in enumerate(self.held):
            if held == spec:
                return slot
        return None

    def _free_slot(self) -> int:
        for slot, held in enumerate(self.held):
            if held is None:
                return slot
        for slot in self.recent:  # least recently used first
            if not self.users[slot]:
                self._clear(slot)
                return slot
        raise PoolExhausted(f"all {self.n_slots} adapter slots are in use by running sequences")

    def _load(self, slot: int, spec: AdapterSpec) -> None:
        started = time.perf_counter()
        adapter = self.host.get(spec.digest) if spec.digest else None
        if adapter is None:
            adapter = read_adapter(spec.path, self.config, self.max_rank)
            if spec.digest and adapter.digest != spec.digest:
                raise LoraError(
                    f"{spec.path}: its files changed since {spec.name!r} was registered "
                    f"(digest {adapter.digest}, registered {spec.digest}); register it again"
                )
            self.reads += 1
        self.host[adapter.digest] = adapter
        self.host.move_to_end(adapter.digest)
        while len(self.host) > self.n_host:
            self.host.popitem(last=False)
        for (layer, projection), (a, b) in adapter.weights.items():
            stack = self._stack(layer, projection, a.shape[0])
            r = a.shape[0]
            stack.a[slot, :r] = a.to(self.device, self.dtype)
            stack.b(slot)[:, :r] = b.to(self.device, self.dtype)
        self.held[slot] = spec
        self.recent[slot] = None
        self.loads += 1
        self.load_seconds += time.perf_counter() - started

    def _clear(self, slot: int) -> None:
        for stack in self.stacks.values():
            stack.a[slot].zero_()
            stack.b(slot).zero_()
        self.held[slot] = None
        self.recent.pop(slot, None)

    def _stack(self, layer: int, projection: str, rank: int) -> _Stack:
        """The (layer, projection) stack, with room for ``rank`` (grown, zero-padded)."""
        stack = self.stacks.get((layer, projection))
        have = stack.rank if stack else 0
        if rank <= have:
            return stack
        out, in_ = projection_shape(self.config, projection)
        key = f"layers.{layer}.{projection}"
        base = in_ if self.weights is not None else 0
        zeros = partial(torch.zeros, dtype=self.dtype, device=self.device)
        grown = _Stack(zeros(self.n_slots, rank, in_), zeros(out, base + self.n_slots * rank), base)
        if self.weights is not None:
            grown.cat[:, :in_] = self.weights[key]
        if stack is not None:
            grown.a[:, :have] = stack.a
            for slot in range(self.n_slots):
                grown.b(slot)[:, :have] = stack.b(slot)
        if self.weights is not None:
            self.weights[key] = grown.cat[:, :in_]  # (the base's own, a view now)
        self.stacks[(layer, projection)] = grown
        return grown

    # -- forward passes ----------------------------------------------------------------------------

    def batch(self, row_slots: list[int]) -> LoraPass | None:
        """What a pass whose rows are computed by these slots (``BASE``: none) adds to each
        adapted projection; None when no row is adapted."""
        distinct = set(row_slots)
        used = [s for s in distinct if s != BASE]
        if not used:
            return None
        rows = torch.tensor(row_slots, device=self.device)
        return LoraPass(self, rows, min(used), max(used), uniform=len(distinct) == 1)

    def check_integrity(self) -> None:
        for slot, held in enumerate(self.held):
            assert self.users[slot] >= 0
            assert held is not None or not self.users[slot], f"slot {slot} used, empty"
            assert (held is None) == (slot not in self.recent)
        resident = self.resident
        assert len(resident) == len(set(resident)), "an adapter in two slots"


class LoraPass:
    """One forward pass's low-rank products: rows' slots [N], slots lo..hi the pass uses."""

    def __init__(
        self, slots: AdapterSlots, row_slots: torch.Tensor, lo: int, hi: int, uniform: bool
    ) -> None:
        self.stacks = slots.stacks
        self.lo, self.hi = lo, hi
        k = hi - lo + 1
        # [N, K]: 1 in the column of the row's slot (none for a base row)
        self.onehot = (
            (row_slots - lo).unsqueeze(1) == torch.arange(k, device=row_slots.device)
        ).to(slots.dtype)
        self._masks: dict[int, torch.Tensor] = {}
        self.uniform = uniform  # every row under one adapter: no mask needed

    def _mask(self, rank: int) -> torch.Tensor:
        """[N, K·R]: each row's own slot's R columns."""
        if rank not in self._masks:
            self._masks[rank] = self.onehot.repeat_interleave(rank, dim=1)
        return self._masks[rank]

    def project(
        self, layer: int, projection: str, x: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """x [N, in] times the base weight ``w`` transposed, plus what each row's adapter adds
        to ``projection``: [N, out]."""
        stack = self.stacks.get((layer, projection))
        if stack is None:
            return project(x, w)
        a = stack.a[self.lo : self.hi + 1]
        k, r = a.shape[0], a.shape[1]
        u = project(x, a.reshape(k * r, -1))  # [N, K·R]
        if not self.uniform:
            u.mul_(self._mask(r))
        first = stack.base + self.lo * r  # (the pass's first slot's first B column)
        if not stack.base:  # apart (a GPU's): the base's product, then the adapters' added
            y = project(x, w)
            return y.addmm_(u, stack.cat[:, first : first + k * r].t())
        # [x | 0 for the slots before the pass's first | u] times [W | B of slots 0..hi]ᵀ
        cols = first + k * r
        joined = x.new_empty(x.shape[0], cols)
        joined[:, : stack.base] = x
        joined[:, stack.base : first] = 0
        joined[:, first:] = u
        return project(joined, stack.cat[:, :cols])

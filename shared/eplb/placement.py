"""Where a MoE model's experts live: slots on cards, per layer.

A placement is data: ``slot_expert[layer, slot]`` names the expert whose weights a slot holds;
card ``c`` owns the slots ``c * per_card .. (c + 1) * per_card - 1``. An expert held by several
slots (replicas) has its tokens split evenly between them. Every expert has at least one slot,
so any placement computes the same outputs; only where the work lands differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, eq=False)
class Placement:
    slot_expert: np.ndarray  # [layers, slots] int64
    experts: int
    cards: int

    def __post_init__(self) -> None:
        assert self.slot_expert.ndim == 2, "slot_expert is [layers, slots]"
        assert self.slots % self.cards == 0, "every card holds the same number of slots"

    @property
    def layers(self) -> int:
        return self.slot_expert.shape[0]

    @property
    def slots(self) -> int:
        return self.slot_expert.shape[1]

    @property
    def per_card(self) -> int:
        return self.slots // self.cards

    def replicas(self) -> np.ndarray:
        """Slots per expert, [layers, experts]."""
        out = np.zeros((self.layers, self.experts), dtype=np.int64)
        for layer in range(self.layers):
            out[layer] = np.bincount(self.slot_expert[layer], minlength=self.experts)
        return out

    def card_share(self) -> np.ndarray:
        """[layers, experts, cards]: the share of an expert's tokens each card serves."""
        share = np.zeros((self.layers, self.experts, self.cards))
        cards = np.arange(self.slots) // self.per_card
        replicas = self.replicas()
        for layer in range(self.layers):
            e = self.slot_expert[layer]
            np.add.at(share[layer], (e, cards), 1.0 / replicas[layer, e])
        return share

    def card_loads(self, load: np.ndarray) -> np.ndarray:
        """Tokens each card computes: load [..., layers, experts] → [..., layers, cards]."""
        return np.einsum("...le,lec->...lc", load, self.card_share())

    def presence(self) -> np.ndarray:
        """[layers, cards, experts]: whether a card holds the expert (in any of its slots)."""
        out = np.zeros((self.layers, self.cards, self.experts), dtype=bool)
        cards = np.arange(self.slots) // self.per_card
        for layer in range(self.layers):
            out[layer, cards, self.slot_expert[layer]] = True
        return out

    def check_integrity(self) -> None:
        assert self.slot_expert.min() >= 0 and self.slot_expert.max() < self.experts
        assert (self.replicas() >= 1).all(), "an expert without a slot"

    def to_json(self) -> dict:
        return {
            "experts": self.experts,
            "cards": self.cards,
            "slot_expert": self.slot_expert.tolist(),
        }

    @classmethod
    def from_json(cls, data: dict) -> Placement:
        placement = cls(
            np.asarray(data["slot_expert"], dtype=np.int64), data["experts"], data["cards"]
        )
        placement.check_integrity()
        return placement


def contiguous(layers: int, experts: int, cards: int, slots: int | None = None) -> Placement:
    """Experts in order, ``experts / cards`` to a card; spare slots (if any) hold the first
    experts again, in order (the placement a deployment starts from, before any load is seen)."""
    slots = slots or experts
    assert slots >= experts, f"{slots} slots cannot hold {experts} experts"
    row = np.arange(slots) % experts
    return Placement(np.tile(row, (layers, 1)), experts, cards)


def gamma(card_loads: np.ndarray) -> np.ndarray:
    """Busiest card ÷ mean card, over the last axis (cards)."""
    mean = card_loads.mean(-1)
    return card_loads.max(-1) / np.where(mean > 0, mean, 1.0)


def moves(old: Placement, new: Placement) -> int:
    """Expert copies a card must load to go from ``old`` to ``new``: per layer and card, the
    experts the new placement puts there that the old one did not."""
    assert (old.layers, old.cards) == (new.layers, new.cards)
    return int((new.presence() & ~old.presence()).sum())


def relabel_cards(old: Placement, new: Placement) -> Placement:
    """``new`` with its cards renumbered (and each card's slots reordered) so that as many
    slots as it can keep the expert they hold in ``old``: the same balance, fewer moves."""
    rows = []
    held_new, held_old = new.presence(), old.presence()
    for layer in range(new.layers):
        overlap = held_new[layer].astype(np.int64) @ held_old[layer].T.astype(np.int64)
        target = _max_assignment(overlap)
        row = np.empty(new.slots, dtype=np.int64)
        for a, b in enumerate(target):
            row[b * new.per_card : (b + 1) * new.per_card] = _keep_order(
                _card_slots(old, layer, b), _card_slots(new, layer, a)
            )
        rows.append(row)
    return Placement(np.stack(rows), new.experts, new.cards)


def _card_slots(p: Placement, layer: int, card: int) -> np.ndarray:
    return p.slot_expert[layer, card * p.per_card : (card + 1) * p.per_card]


def _keep_order(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``new``'s experts arranged so each one the card already held stays in its slot."""
    out = np.full(len(old), -1, dtype=np.int64)
    rest = list(new.tolist())
    for i, e in enumerate(old.tolist()):
        if e in rest:
            out[i] = e
            rest.remove(e)
    out[out < 0] = rest
    return out


def _max_assignment(gain: np.ndarray) -> list[int]:
    """A one-to-one assignment of rows to columns with a large summed gain: the largest gains
    first, each pair taken while both its row and column are free (near the optimum when, as
    here, most rows have one clear match; a Hungarian method's O(n³) cost is not worth it)."""
    n = gain.shape[0]
    order = np.argsort(-gain, axis=None, kind="stable")
    assignment = [-1] * n
    used = np.zeros(n, dtype=bool)
    left = n
    for flat in order.tolist():
        row, column = divmod(flat, n)
        if assignment[row] < 0 and not used[column]:
            assignment[row] = column
            used[column] = True
            left -= 1
            if not left:
                break
    return assignment

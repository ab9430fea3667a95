"""The decode policy over the expert slots: two slot buffers alternating by layer parity,
loaded with the experts a layer's rows chose.

A decode step touches few experts per layer, so the unit copied in is one expert
(:meth:`ExpertSlots.load`). Layer l's experts go to buffer l % 2: the copy of layer
l+1's experts into the other buffer may run while layer l computes. They are loaded
on demand once the layer has routed (``moejax.decode.runners.OffloadRunner``), or ahead
from a prediction (``moejax.prefetch.runner.PrefetchRunner``): the policy is the
caller's, the slots and the host store are the same as the scoring window's.
"""

from __future__ import annotations

import numpy as np

from moejax.backends.base import BackendError
from moejax.offload.host import HostExperts, LayerArrays
from moejax.offload.slots import ExpertSlots, slot_shapes


class AlternatingSlots:
    """Two :class:`ExpertSlots` of ``num_slots`` slots each, layer l in buffer l % 2."""

    def __init__(self, host: HostExperts, num_slots: int | None, owner: str = "offload"):
        experts = host.num_experts
        slots = experts if num_slots is None else num_slots
        if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= experts:
            raise BackendError(f"backend {owner!r}: expert_slots must be an integer in "
                               f"[1, {experts}], got {num_slots!r}")
        self.host = host
        self.owner = owner
        self.pair = [ExpertSlots.empty(host, slots) for _ in range(2)]
        self.experts_copied = 0

    @property
    def num_slots(self) -> int:
        return self.pair[0].num_slots

    def slots(self, layer: int) -> ExpertSlots:
        """The buffer layer ``layer``'s experts go to."""
        return self.pair[layer % 2]

    def buffers(self, layer: int) -> LayerArrays:
        return self.slots(layer).buffers

    def load(self, layer: int, wanted: np.ndarray) -> tuple[np.ndarray, int]:
        """Make layer ``layer``'s experts ``wanted`` held in its buffer -> (the slot of
        each expert id [E] (-1: absent), how many were copied)."""
        if len(wanted) > self.num_slots:
            raise BackendError(f"backend {self.owner!r}: layer {layer} needs {len(wanted)} "
                               f"experts at once, more than expert_slots={self.num_slots}")
        slot_of, copied = self.slots(layer).load(self.host, layer, wanted)
        self.experts_copied += copied
        return slot_of, copied

    def precompile(self) -> None:
        """Compile the one-expert copy (padding rows copy no expert) by loading one
        expert into each buffer; the buffers then count as empty again."""
        for slots in self.pair:
            slots.load(self.host, 0, np.zeros(1, np.int64))
            slots.held = [None] * slots.num_slots

    def shapes(self) -> set[tuple[int, ...]]:
        """Shapes of the slot buffers and of an expert in flight."""
        return slot_shapes(self.host, self.num_slots)


__all__ = ("AlternatingSlots",)

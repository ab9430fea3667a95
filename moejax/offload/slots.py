"""Expert slots: the one device-side unit of offloaded experts.

An :class:`ExpertSlots` is a buffer of S expert slots per weight name ([S, ...], the
same layout as one layer's expert stack) and which (layer, expert) each slot holds. It
is filled from the one host store (:class:`~moejax.offload.host.HostExperts`) in one of
two ways:

* :meth:`ExpertSlots.whole_layer`: every expert of a layer, one copy per weight name
  (slot e holds expert e). The scoring window (``moejax.offload.window``) holds W of
  these.
* :meth:`ExpertSlots.load`: the experts a layer wants, one by one, into free slots,
  in place (the buffer is donated). Decode's alternating slots
  (``moejax.offload.alternating``) load this way; a load that wants every expert of a
  layer none of whose experts is held, into as many slots as experts, is a whole-layer
  copy instead.

A compute program reads a slot buffer as the layer's experts, with the routing's
expert ids renumbered to slots (:data:`RENUMBER_EXPERTS`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax.offload.host import HostExperts, LayerArrays


def free(arrays: LayerArrays) -> None:
    """Delete device buffers now rather than when Python drops them."""
    for array in arrays.values():
        if not array.is_deleted():
            array.delete()


def _set_slot(buffers: LayerArrays, slot: jax.Array, expert: LayerArrays) -> LayerArrays:
    return {k: v.at[slot].set(expert[k]) for k, v in buffers.items()}


# Written in place: the buffers are donated.
SET_SLOT = jax.jit(_set_slot, donate_argnums=0)
# An expert-id -> slot map applied to a routing's expert ids.
RENUMBER_EXPERTS = jax.jit(lambda slot_of, experts: slot_of[experts])


@dataclasses.dataclass
class ExpertSlots:
    """A device buffer of expert slots ([S, ...] per weight name) and which (layer,
    expert) each slot holds (None: nothing, or stale)."""

    buffers: LayerArrays
    held: list[tuple[int, int] | None]

    @classmethod
    def empty(cls, host: HostExperts, num_slots: int) -> "ExpertSlots":
        """``num_slots`` zeroed slots on the host store's device."""
        buffers = {k: jnp.zeros((num_slots, *shape), host.dtype, device=host.device_sharding)
                   for k, shape in host.expert_shapes.items()}
        return cls(buffers=buffers, held=[None] * num_slots)

    @classmethod
    def whole_layer(cls, host: HostExperts, layer: int) -> "ExpertSlots":
        """Every expert of layer ``layer``, copied in (asynchronously) as one stack per
        weight name: slot e holds expert e."""
        return cls(buffers=host.layer_to_device(layer),
                   held=[(layer, e) for e in range(host.num_experts)])

    @property
    def num_slots(self) -> int:
        return len(self.held)

    def free(self) -> None:
        """Delete the buffers now (nothing is held after)."""
        free(self.buffers)
        self.held = [None] * self.num_slots

    def slot_map(self, layer: int, num_experts: int) -> np.ndarray:
        """The slot of each expert id of layer ``layer`` [E] (-1: not held)."""
        slot_of = np.full(num_experts, -1, np.int32)
        for slot, held in enumerate(self.held):
            if held is not None and held[0] == layer:
                slot_of[held[1]] = slot
        return slot_of

    def load(self, host: HostExperts, layer: int, wanted: np.ndarray
             ) -> tuple[np.ndarray, int]:
        """Make every expert id of ``wanted`` (layer ``layer``) held -> (the slot of each
        expert id [E] (-1: absent), how many experts were copied). Slots holding another
        layer's experts, or experts of this layer not wanted, are reused."""
        num_experts = host.num_experts
        if len(wanted) > self.num_slots:
            raise ValueError(f"{len(wanted)} experts wanted at once, more than the "
                             f"{self.num_slots} slots")
        slot_of = self.slot_map(layer, num_experts)
        if (self.num_slots == num_experts and len(np.unique(wanted)) == num_experts
                and not (slot_of >= 0).any()):
            self.buffers = host.layer_to_device(layer)       # (the old buffers: dropped)
            self.held = [(layer, e) for e in range(num_experts)]
            return np.arange(num_experts, dtype=np.int32), num_experts
        missing = [int(e) for e in wanted if slot_of[e] < 0]
        keep = {int(slot_of[e]) for e in wanted if slot_of[e] >= 0}
        spare = (s for s in range(self.num_slots) if s not in keep)
        for expert in missing:
            slot = next(spare)
            if self.held[slot] is not None and self.held[slot][0] == layer:
                slot_of[self.held[slot][1]] = -1
            self.buffers = SET_SLOT(self.buffers, np.int32(slot),
                                    host.expert_to_device(layer, expert))
            self.held[slot] = (layer, expert)
            slot_of[expert] = slot
        return slot_of, len(missing)


def slot_map_is_injective(slots: ExpertSlots, layer: int, slot_of: np.ndarray) -> bool:
    """Whether ``slot_of`` maps distinct experts to distinct slots, each holding it."""
    present = np.flatnonzero(slot_of >= 0)
    targets = slot_of[present]
    return (len(set(targets.tolist())) == len(targets)
            and all(slots.held[s] == (layer, int(e)) for e, s in zip(present, targets)))


def slot_shapes(host: HostExperts, num_slots: int) -> set[tuple[int, ...]]:
    """The shapes of a slot buffer and of one expert in flight (to find them among the
    live arrays)."""
    return ({(num_slots, *s) for s in host.expert_shapes.values()}
            | set(host.expert_shapes.values()))


__all__: Any = ("ExpertSlots", "RENUMBER_EXPERTS", "SET_SLOT", "free", "slot_map_is_injective",
                "slot_shapes")

"""The one host copy of an offloaded model's experts.

Every layer's experts are held in host memory once, one stack ``[E, ...]`` per (layer,
weight name), in the ``pinned_host`` memory kind where the platform has it (copies from
pinned memory run on their own DMA engine on a GPU), else as NumPy arrays. Both uses of
the offloaded experts copy from this one store:

* a whole layer (the scoring window, ``moejax.offload.window``): one copy per weight
  name, the stack as it is;
* one expert (decode's slots, ``moejax.offload.slots``): the expert's row of the stack,
  read in host memory by a small program whose output lives on the device (the
  dynamic-slice-from-host pattern XLA's host offloading turns into a copy of that row
  alone), or sliced on the host when the store is NumPy.

With several devices (``hybrid``) each stack is split over them on the expert axis
(the store's sharding), and only whole-layer copies are made.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np
from jax import lax
from jax.sharding import NamedSharding

HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")

LayerArrays = dict[str, Any]


def host_memory_kind(device: jax.Device) -> str | None:
    """The best host memory kind ``device`` can address, or None (host NumPy then)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_MEMORY_KINDS if k in kinds), None)


def _take_expert(stack: LayerArrays, expert: jax.Array) -> LayerArrays:
    """One expert's row of each host stack [E, ...] -> [...]."""
    return {k: lax.dynamic_index_in_dim(v, expert, keepdims=False) for k, v in stack.items()}


class HostExperts:
    """Every layer's experts in host memory (module docstring), and how to copy a layer or
    one expert of it to the device(s) of ``device_sharding``.

    ``experts``: {name: [L, E, ...]} (already in the serving dtype). ``device_sharding``:
    where a whole layer [E, ...] goes on the device(s) (memory kind ``device``); the host
    stacks use the same sharding in host memory. ``memory_kind``: the host memory kind
    ("auto": the best the first device has; None: NumPy)."""

    def __init__(self, experts: Mapping[str, np.ndarray], device_sharding: NamedSharding,
                 memory_kind: str | None = "auto"):
        first = next(iter(device_sharding.device_set))
        if memory_kind == "auto":
            memory_kind = host_memory_kind(first)
        self.memory_kind = memory_kind
        self.device_sharding = device_sharding
        host = device_sharding.with_memory_kind(memory_kind) if memory_kind else None
        self.layers: list[LayerArrays] = [
            {k: (jax.device_put(v[layer], host) if host else np.ascontiguousarray(v[layer]))
             for k, v in experts.items()}
            for layer in range(next(iter(experts.values())).shape[0])]
        # One expert's shape and dtype per weight name (without the E axis).
        self.expert_shapes = {k: tuple(v.shape[2:]) for k, v in experts.items()}
        self.dtype = np.dtype(next(iter(experts.values())).dtype)
        self.expert_bytes = sum(int(np.prod(s)) for s in self.expert_shapes.values()
                                ) * self.dtype.itemsize
        self._one_device = len(device_sharding.device_set) == 1
        self._take = (jax.jit(_take_expert, out_shardings=device_sharding)
                      if host else None)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_experts(self) -> int:
        """Experts per layer as stored (``hybrid``: padded to a multiple of the devices)."""
        return int(np.shape(next(iter(self.layers[0].values())))[0])

    def layer_to_device(self, layer: int) -> LayerArrays:
        """Layer ``layer``'s experts [E, ...] copied to the device(s) (asynchronously)."""
        return jax.device_put(self.layers[layer], self.device_sharding)

    def expert_to_device(self, layer: int, expert: int) -> LayerArrays:
        """Expert ``expert`` of layer ``layer`` [...] copied to the device: its row alone
        (one device only)."""
        if not self._one_device:
            raise ValueError("HostExperts: single experts are copied to one device only")
        if self._take is None:
            return jax.device_put({k: v[expert] for k, v in self.layers[layer].items()},
                                  self.device_sharding)
        return self._take(self.layers[layer], np.int32(expert))


__all__ = ("HOST_MEMORY_KINDS", "HostExperts", "LayerArrays", "host_memory_kind")

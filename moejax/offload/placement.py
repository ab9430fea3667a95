"""The offload placement: what the ``offload`` and ``hybrid`` scoring backends and the
offload decode runners run on.

Everything but the experts (attention, norms, router, embeddings, LM head) is on the
device(s), replicated; every layer's experts are in host memory once
(:class:`~moejax.offload.host.HostExperts`; with several devices padded to a multiple
of them and split on the expert axis). Built once (:meth:`OffloadPlacement.place`): a
server that scores with ``offload`` and generates with ``offload`` on the device hands
the same placement to both, so it holds one copy of the weights, on the device and on
the host. The scoring window and decode's slots are two policies over it
(``moejax.offload``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax.backends.async_ep import AXIS, pad_experts
from moejax.backends.base import (BackendError, dense_bytes, expert_bytes_per_layer,
                                  resolve_placement, validated)
from moejax.config import ModelConfig
from moejax.offload.host import HostExperts
from moejax.param_layout import Params, split_experts


@dataclasses.dataclass(frozen=True, eq=False)
class OffloadPlacement:
    """Dense weights on ``devices`` (``params``, without the experts), experts in
    ``host``. ``expert_bytes_per_layer``: one layer's experts, unpadded."""

    cfg: ModelConfig
    dtype: Any
    devices: tuple[jax.Device, ...]
    mesh: Mesh
    params: Params
    host: HostExperts
    dense_weight_bytes: int
    expert_bytes_per_layer: int

    @classmethod
    def place(cls, cfg: ModelConfig, params: Params, dtype: Any,
              devices: Sequence[jax.Device]) -> "OffloadPlacement":
        """``params`` validated and cast to ``dtype``: the dense part on ``devices``, the
        experts into host memory."""
        dtype = jnp.dtype(dtype)
        devices = tuple(devices)
        host = validated(params, cfg, dtype)
        dense_layers, experts = split_experts(host["layers"])
        if len(devices) > 1:
            experts = pad_experts(experts, len(devices))
        mesh = Mesh(np.array(devices), (AXIS,))
        dense = jax.device_put({**{k: v for k, v in host.items() if k != "layers"},
                                "layers": dense_layers}, NamedSharding(mesh, P()))
        layer_spec = P(AXIS) if len(devices) > 1 else P()
        store = HostExperts(experts, NamedSharding(mesh, layer_spec, memory_kind="device"))
        return cls(cfg=cfg, dtype=dtype, devices=devices, mesh=mesh, params=dense, host=store,
                   dense_weight_bytes=dense_bytes(host),
                   expert_bytes_per_layer=expert_bytes_per_layer(host))

    @classmethod
    def resolve(cls, name: str, cfg: ModelConfig, params: Params | None, dtype: Any,
                devices: Sequence[jax.Device], placement: "OffloadPlacement | None"
                ) -> "OffloadPlacement":
        """What backend or runner ``name`` runs on: ``placement`` as it is (it must hold
        ``cfg``'s weights on ``devices``), or ``params`` placed now."""
        if placement is not None and not isinstance(placement, OffloadPlacement):
            raise BackendError(f"backend {name!r} runs on an OffloadPlacement, got "
                               f"{type(placement).__name__}")
        resolved = resolve_placement(name, cfg, params, placement,
                                     lambda: cls.place(cfg, params, dtype, devices))
        if resolved.devices != tuple(devices):
            raise BackendError(f"backend {name!r}: the placement is on "
                               f"{len(placement.devices)} other device(s) than the "
                               f"{len(tuple(devices))} asked for")
        return resolved

    @property
    def replicated(self) -> NamedSharding:
        """Replicated over the placement's devices (the dense weights' sharding)."""
        return NamedSharding(self.mesh, P())


__all__ = ("OffloadPlacement",)

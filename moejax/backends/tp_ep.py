"""``tp_ep``: tensor-parallel attention with expert-parallel experts (the paper's TP+EP
baseline, MoE-Prefill Table 1).

Layout over a 1-D mesh of G devices, axis ``"tp"`` (every device runs the same,
replicated packed batch; ``num_ranks`` is 1):

* attention exactly as ``tp`` (``moejax.backends.tp``): heads split over the devices,
  the output projection a partial sum, **all-reduce #1** before the residual add;
* experts split on E: device g holds experts [g·E/G, (g+1)·E/G) of every layer whole
  (w_gate / w_up / w_down [L, E/G, ...]; E padded with zero experts up to a multiple of G,
  which the router, with its E columns, never picks). The router is replicated, so every
  device routes every token identically; each runs only the routed rows of the experts
  it owns (``moejax.dispatch.OwnedExpertTokens``: the others' rows sort past every group
  and are computed by none), and the combined outputs are partial sums: **all-reduce
  #2** before the residual.
* norms, q/k norms, embeddings, routers, shared experts, final norm and LM head:
  replicated.

The same two all-reduces of [T, d] per layer as ``tp``; the experts' FLOPs split by the
routing (a device whose experts are popular does more: the load imbalance TP+TP does
not have), and no expert weight moves.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax import model, moe
from moejax.backends.async_ep import pad_experts
from moejax.backends.base import (Backend, MemoryReport, StepOutput, expert_bytes_per_layer,
                                  nbytes, validated)
from moejax.backends.tp import AXIS, head_split_mesh, param_specs, shardings
from moejax.config import ModelConfig
from moejax.dispatch import MoEDispatcher, OwnedExpertTokens, StackedExperts
from moejax.model import ForwardOptions, PackedBatch
from moejax.param_layout import Params, split_experts

EXPERT_SPEC = P(None, AXIS)       # [L, E, ...] split on E


def tp_ep_local_forward(dense: Params, experts: Mapping[str, jax.Array], batch: PackedBatch,
                        *, cfg: ModelConfig, opts: ForwardOptions
                        ) -> tuple[jax.Array, jax.Array | None]:
    """One device's forward (inside the shard_map): ``MoEDecoder.score`` over the local
    attention heads (``cfg``: the local config of n_q/G and n_kv/G heads) and the local
    experts [L, E/G, ...]; attention outputs and combined MoE outputs are all-reduced."""
    local_experts = next(iter(experts.values())).shape[1]
    dispatcher = MoEDispatcher(
        source=StackedExperts(experts),
        transport=OwnedExpertTokens(local_experts, opts.expert_impl, opts.tile_rows,
                                    psum_axis=AXIS, activation=moe.expert_activation_of(cfg)))
    module = model.decoder(cfg, dense, with_experts=False)
    out = module.score(batch, opts, dispatcher=dispatcher, psum_axis=AXIS)
    return out.readout


class TPEPBackend(Backend):
    """Attention heads split over G devices, each device owning E/G whole experts; two
    all-reduces per layer; one jitted forward per batch shape."""

    name = "tp_ep"
    no_prefix_pool_reason = ("its attention heads are split over the devices and its "
                             "forward has no pooled attention kind")

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.float32,
                 devices: int = 1, device_pool: Sequence[jax.Device] | None = None):
        super().__init__(cfg, dtype=dtype)
        self._devices, self.mesh = head_split_mesh(self.name, cfg, devices, device_pool)
        shards = len(self._devices)
        self.local_cfg = dataclasses.replace(cfg, num_heads=cfg.num_heads // shards,
                                             num_kv_heads=cfg.num_kv_heads // shards)
        host = validated(params, cfg, self.dtype)
        dense_layers, experts = split_experts(host["layers"])
        experts = pad_experts(experts, shards)
        dense = {**{k: v for k, v in host.items() if k != "layers"}, "layers": dense_layers}
        self.dense_specs = param_specs(dense)
        self.params = jax.device_put(dense, shardings(self.mesh, self.dense_specs))
        self.experts = jax.device_put(experts, NamedSharding(self.mesh, EXPERT_SPEC))
        self.padded_experts = next(iter(experts.values())).shape[1]
        per_layer = expert_bytes_per_layer(host)
        local_experts = per_layer * self.padded_experts // cfg.num_experts // shards
        replicated = nbytes({k: v for k, v in dense.items() if k != "layers"})
        dense_local = sum(int(np.prod(np.shape(a))) * np.dtype(a.dtype).itemsize
                          // (shards if self.dense_specs["layers"][k] != P() else 1)
                          for k, a in dense_layers.items())
        self._memory = MemoryReport(
            dense_weight_bytes=replicated + dense_local,
            expert_weight_bytes=local_experts * cfg.num_layers,
            expert_bytes_all_layers=per_layer * cfg.num_layers,
            detail={"experts_per_device": self.padded_experts // shards})
        body = functools.partial(tp_ep_local_forward, cfg=self.local_cfg)
        self._batch_sharding = NamedSharding(self.mesh, P())
        self._forward = jax.jit(self._sharded, static_argnames=("opts",))
        self._body = body

    def _sharded(self, dense: Params, experts: Mapping[str, jax.Array], batch: PackedBatch,
                 opts: ForwardOptions) -> tuple[jax.Array, jax.Array | None]:
        """The forward over the mesh: dense params by their specs, experts split on E,
        the batch and the outputs replicated."""
        expert_specs = {k: EXPERT_SPEC for k in experts}
        # check_vma=False: the outputs are replicated by construction (psum'd activations).
        return jax.shard_map(functools.partial(self._body, opts=opts), mesh=self.mesh,
                             in_specs=(self.dense_specs, expert_specs, P()), out_specs=P(),
                             check_vma=False)(dense, experts, batch)

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        batch = jax.device_put(batches[0], self._batch_sharding)   # every device: the whole batch
        return [self._forward(self.params, self.experts, batch, opts=opts)]

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        batch = jax.device_put(batches[0], self._batch_sharding)
        return [self._forward.lower(self.params, self.experts, batch, opts=opts)]

    def memory_report(self) -> MemoryReport:
        return self._memory

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mesh": {AXIS: len(self._devices)},
                "experts_per_device": self.padded_experts // len(self._devices)}

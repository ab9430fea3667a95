"""``dp_tp``: data-parallel attention with tensor-parallel experts (the paper's DP+TP
baseline, MoE-Prefill Table 1).

G devices on a 1-D mesh ``('dp',)``; each device is a data-parallel rank with its own
packed batch (``num_ranks = G``) and runs attention on it with replicated attention
weights. The experts are split on their intermediate axis f as in ``tp`` (w_gate /
w_up [L, E, d, f/G], w_down [L, E, f/G, d]; f padded with zero columns to a multiple of
G, exact). Each MoE layer (``moejax.dispatch.GatheredTokens``):

1. **all-gather** every rank's normed rows and routing (every device then holds the
   step's T·G rows);
2. each device runs its f/G slice of every routed expert on all of them;
3. **reduce-scatter** the combined outputs (partial sums over f): each rank receives
   the full MoE output of its own rows.

No expert weight moves; per layer the activations move twice (an all-gather and a
reduce-scatter of [T·G, d]), against AsyncEP's one weight all-gather that overlaps the
layer's compute.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax import model, moe
from moejax.backends import xla_flags
from moejax.backends.async_ep import local_rank
from moejax.backends.base import (RANK_AXIS, MemoryReport, MeshBackend, StepOutput, dense_bytes,
                                  expert_bytes_per_layer, rank_axis, require_devices,
                                  stack_batches, unstack_outputs, validated)
from moejax.backends.tp import pad_experts as pad_intermediate, padded_intermediate
from moejax.config import ModelConfig
from moejax.dispatch import GatheredTokens, MoEDispatcher, StackedExperts
from moejax.distributed import place_local_ranks
from moejax.model import ForwardOptions, PackedBatch, VocabReadout
from moejax.param_layout import Params, split_experts

AXIS = RANK_AXIS
# [L, E, d, f] split on f; [L, E, f, d] on its f rows.
EXPERT_SPECS = {"w_gate": P(None, None, None, AXIS), "w_up": P(None, None, None, AXIS),
                "w_down": P(None, None, AXIS, None)}


def dp_tp_local_forward(dense: Params, experts: Mapping[str, jax.Array], batch: PackedBatch,
                        *, cfg: ModelConfig, opts: ForwardOptions) -> VocabReadout:
    """One rank (inside the shard_map): ``MoEDecoder.score`` on its own batch [1, ...],
    with the MoE over every rank's rows and this device's f/G slice of the experts."""
    batch = local_rank(batch)
    dispatcher = MoEDispatcher(
        source=StackedExperts(experts),
        transport=GatheredTokens(cfg.num_experts, opts.expert_impl, opts.tile_rows,
                                 psum_axis=AXIS, activation=moe.expert_activation_of(cfg)))
    out = model.decoder(cfg, dense, with_experts=False).score(batch, opts,
                                                              dispatcher=dispatcher)
    return rank_axis(out.readout)


class DPTPBackend(MeshBackend):
    """Attention data-parallel over G ranks, experts split on f over the same devices."""

    name = "dp_tp"
    no_prefix_pool_reason = ("its MoE gathers every rank's rows in each layer and its "
                             "forward has no pooled attention kind yet")

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.float32,
                 devices: int = 1, device_pool: Sequence[jax.Device] | None = None):
        super().__init__(cfg, dtype=dtype)
        self._devices = require_devices(self.name, devices, device_pool)
        shards = len(self._devices)
        if shards > 1:
            xla_flags.warn_if_overlap_flags_missing(self.name)
        self.mesh = Mesh(np.array(self._devices), (AXIS,))
        host = validated(params, cfg, self.dtype)
        per_layer = expert_bytes_per_layer(host)
        self.f_padded = padded_intermediate(cfg.moe_intermediate_size, shards)
        padded = pad_intermediate(host, self.f_padded)
        dense_layers, experts = split_experts(padded["layers"])
        replicated = NamedSharding(self.mesh, P())
        self.params = jax.device_put({**{k: v for k, v in padded.items() if k != "layers"},
                                      "layers": dense_layers}, replicated)
        self.expert_specs = {k: EXPERT_SPECS[k] for k in experts}
        self.experts = jax.device_put(experts, {k: NamedSharding(self.mesh, s)
                                                for k, s in self.expert_specs.items()})
        self._batch_sharding = NamedSharding(self.mesh, P(AXIS))
        padded_layer = per_layer * self.f_padded // cfg.moe_intermediate_size
        self._memory = MemoryReport(
            dense_weight_bytes=dense_bytes(host),
            expert_weight_bytes=padded_layer * cfg.num_layers // shards,
            expert_bytes_all_layers=per_layer * cfg.num_layers,
            detail={"shards": per_layer * cfg.num_layers // shards})
        self._forward = jax.jit(self._sharded, static_argnames=("opts",))

    def _sharded(self, dense: Params, experts: Mapping[str, jax.Array], batch: PackedBatch,
                 opts: ForwardOptions) -> VocabReadout:
        body = functools.partial(dp_tp_local_forward, cfg=self.cfg, opts=opts)
        return jax.shard_map(body, mesh=self.mesh,
                             in_specs=(P(), self.expert_specs, P(AXIS)), out_specs=P(AXIS),
                             check_vma=False)(dense, experts, batch)

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        return unstack_outputs(self._forward(self.params, self.experts, batch, opts=opts),
                               self.num_ranks)

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        return [self._forward.lower(self.params, self.experts, batch, opts=opts)]

    def memory_report(self) -> MemoryReport:
        return self._memory

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mesh": dict(self.mesh.shape),
                "expert_intermediate_padded": self.f_padded}

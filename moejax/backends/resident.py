"""``resident``: every weight on one device; the reference the other backends are held to."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from moejax import model as model_lib
from moejax.attention_kinds import PrefixContext, PrefixPooled
from moejax.backends.base import (Backend, MemoryReport, StepOutput, dense_bytes,
                                  expert_bytes_per_layer, one_device, resolve_placement,
                                  validated)
from moejax.config import ModelConfig
from moejax.kv import KVPool
from moejax.model import ForwardOptions, PackedBatch
from moejax.param_layout import Params


def pooled_score(params: Params, batch: PackedBatch, context: PrefixContext, pool: KVPool,
                 *, cfg: ModelConfig, opts: ForwardOptions) -> tuple[StepOutput, KVPool]:
    """The scoring forward with the prefix pool as its attention kind -> (output, pool)."""
    attn = PrefixPooled.of(batch.positions, batch.segment_ids, opts.attn_block, context,
                           pool.keys, pool.values, defer_writes=True)
    out = model_lib.decoder(cfg, params).score(batch, opts, attn=attn)
    keys, values = out.attn.written()
    # The signature cache (if any) passes through: scoring keeps no expert counts.
    return out.readout, dataclasses.replace(pool, keys=keys, values=values)


@dataclasses.dataclass(frozen=True, eq=False)
class ResidentPlacement:
    """Every weight on one device, in one dtype: the placement that the resident scoring
    backend and the resident decode runner (:class:`moejax.decode.runners.ResidentRunner`)
    both run on. Built once (:meth:`place`); a server that scores and generates on the
    device hands the same placement to both, so it holds one copy of the weights."""

    cfg: ModelConfig
    dtype: Any
    device: jax.Device
    params: Params

    @classmethod
    def place(cls, cfg: ModelConfig, params: Params, dtype: Any, device: jax.Device
              ) -> "ResidentPlacement":
        """``params`` validated, cast to ``dtype`` and put on ``device``."""
        dtype = jnp.dtype(dtype)
        return cls(cfg, dtype, device, jax.device_put(validated(params, cfg, dtype), device))

    @classmethod
    def resolve(cls, name: str, cfg: ModelConfig, params: Params | None, dtype: Any,
                device: jax.Device | None, placement: "ResidentPlacement | None"
                ) -> "ResidentPlacement":
        """What backend or runner ``name`` runs on: ``placement`` as it is (it must hold
        ``cfg``'s weights), or ``params`` placed now on ``device`` (default: the first)."""
        return resolve_placement(
            name, cfg, params, placement,
            lambda: cls.place(cfg, params, dtype, one_device(name, device)))


class ResidentBackend(Backend):
    """All params on one device; one jitted forward per batch shape. ``placement``: run on
    an existing :class:`ResidentPlacement` (``params`` then None)."""

    name = "resident"
    holds_prefix_pool = True
    serves_expert_bias = True
    serves_fp8_experts = True     # FP8 experts and scales placed as they are (cast_params)

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *,
                 dtype: Any = jnp.float32, devices: int = 1, device: jax.Device | None = None,
                 placement: ResidentPlacement | None = None):
        if placement is not None:
            dtype = placement.dtype
        super().__init__(cfg, dtype=dtype)
        if devices != 1:
            raise ValueError(f"backend 'resident' runs on one device, got devices={devices}; "
                             f"use async_ep, sync_ep or tp for several")
        placement = ResidentPlacement.resolve(self.name, cfg, params, dtype, device, placement)
        self.placement = placement
        self.device = placement.device
        self.params = placement.params
        per_layer = expert_bytes_per_layer(self.params)
        self._memory = MemoryReport(dense_weight_bytes=dense_bytes(self.params),
                                    expert_weight_bytes=per_layer * cfg.num_layers,
                                    expert_bytes_all_layers=per_layer * cfg.num_layers)
        self._forward = jax.jit(model_lib.score_readout, static_argnames=("cfg", "opts"))
        # The pool is donated: written in place, O(stored rows) per step.
        self._pooled = jax.jit(functools.partial(pooled_score, cfg=cfg),
                               static_argnames=("opts",), donate_argnames=("pool",))

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return (self.device,)

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        batch = jax.device_put(batches[0], self.device)
        return [self._forward(self.params, batch, cfg=self.cfg, opts=opts)]

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        batch = jax.device_put(batches[0], self.device)
        return [self._forward.lower(self.params, batch, cfg=self.cfg, opts=opts)]

    @property
    def kv_placement(self) -> Any:
        return self.device

    def prefix_step(self, batch: PackedBatch, context: PrefixContext, pool: KVPool,
                    opts: ForwardOptions) -> tuple[StepOutput, KVPool]:
        batch, context = jax.device_put((batch, context), self.device)
        return self._pooled(self.params, batch, context, pool, opts=opts)

    def memory_report(self) -> MemoryReport:
        return self._memory

    def time_expert_transfer(self, repeats: int) -> tuple[str, float]:
        return "none", 0.0    # every expert is already on the device

"""``async_ep`` decode: data-parallel attention over G ranks, every layer's experts
all-gathered a layer ahead (the MoE-Prefill seed's AsyncEP), on paged steps.

The weights are the scoring backend's :class:`~moejax.backends.async_ep.AsyncEPPlacement`
(experts sharded on E, layer 0's kept whole); a step's per-rank body is
:func:`moejax.decode.programs.paged_forward` with the backend's expert source
(:class:`~moejax.dispatch.GatheredAhead`: fetching layer l's gathered experts issues the
all-gather of layer l+1's shards, which the scheduler can run under layer l's compute)
behind a local transport: no token leaves its rank, only weights move. The ranks, the
pool (and its signature cache) and the writes are :mod:`moejax.decode.rank_mesh`'s.

Its place is prefill: a prefill→decode pipeline (``moejax.core.decoders``) prefills on an
AsyncEP group and hands each prompt's blocks to a decoder. It decodes too (every step
gathers every layer: the right trade only where a step has many rows).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec as P

from moejax import model, sampling
from moejax.backends.async_ep import AsyncEPPlacement, gathered_ahead_dispatcher
from moejax.backends.base import BackendError
from moejax.config import ModelConfig
from moejax.decode import programs
from moejax.decode.programs import PagedBatch, StepOptions, StepResult
from moejax.decode.rank_mesh import AXIS, RankMeshRunner, rank_rows, result_specs
from moejax.kv import KVPool
from moejax.param_layout import Params


def rank_step(params: Params, shards: dict[str, jax.Array], first: dict[str, jax.Array],
              kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams, *,
              cfg: ModelConfig, opts: StepOptions) -> StepResult:
    """Per-rank body (inside shard_map): the paged step with the experts gathered a
    layer ahead. shards: this device's [L, E/G, ...]; first: layer 0's [E, ...]; kv: this
    rank's pool; batch, samp: this rank's rows (``last`` still global)."""
    programs.count_compile("async_ep_step")
    dispatcher = gathered_ahead_dispatcher(shards, first, cfg, opts)
    module = model.decoder(cfg, params, with_experts=False)
    return programs.paged_forward(module, kv, rank_rows(batch), samp, dispatcher, opts)[0]


def make_step(mesh: Mesh, cfg: ModelConfig, opts: StepOptions) -> Any:
    """The jitted step: (params, shards, first, kv, batch, samp) -> StepResult."""
    body = functools.partial(rank_step, cfg=cfg, opts=opts)
    return jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(None, AXIS), P(), P(None, AXIS), P(AXIS), P(AXIS)),
        out_specs=result_specs(opts.router_inputs), check_vma=False))


class AsyncEPRunner(RankMeshRunner):
    """Data-parallel attention over G ranks, experts gathered a layer ahead (module
    docstring). ``placement``: an :class:`AsyncEPPlacement` to run on (the async_ep
    scoring backend's), else ``params`` are placed on the first ``devices`` devices (of
    ``device_pool`` when given)."""

    name = "async_ep"
    serves_expert_bias = True     # biases in the expert shards; activation passed

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, dtype: Any,
                 opts: StepOptions, devices: int = 1,
                 placement: AsyncEPPlacement | None = None,
                 device_pool: Sequence[jax.Device] | None = None, **options: Any):
        if options:
            raise BackendError(f"backend 'async_ep' (decode) got unknown option(s) "
                               f"{', '.join(map(repr, sorted(options)))}; it takes none")
        placement = AsyncEPPlacement.resolve(
            self.name, cfg, params, dtype, devices, placement, device_pool)
        super().__init__(cfg, dtype=placement.dtype, opts=opts, mesh=placement.mesh)
        self.placement = placement
        self.dense_params = placement.params
        self._step = make_step(self.mesh, cfg, opts)

    def dispatch(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
                 ) -> StepResult:
        placement = self.placement
        return self._step(placement.params, placement.shards, placement.first_experts, kv,
                          batch, samp)

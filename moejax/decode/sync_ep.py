"""``sync_ep`` decode: data-parallel attention, expert-parallel MoE with all-to-all.

G devices on the mesh ``('dp',)`` of the scoring backend (``moejax.backends.sync_ep``)
are G data-parallel *ranks* (``num_ranks = G``). The scheduler puts each sequence on
one rank; a step's :class:`~moejax.decode.programs.PagedBatch` is rank-major (G ranks ×
B rows × C tokens, flat), so its leading axis, sharded over the mesh, gives every
device exactly its own rows. Block tables and write slots are rank-local.

* **KV pool.** ``keys``/``values`` are [L, G·S, n_kv, h] (S = num_blocks · 16 slots
  per rank), sharded on the slot axis: device g holds rank g's pool [L, S, n_kv, h],
  and inside the ``shard_map`` it is an ordinary :class:`~moejax.kv.KVPool`.
* **Weights.** Dense weights (embedding, attention, norms, routers, head) are
  replicated; the experts are the scoring backend's per-device slots [G, L, S_e, ...]
  (:func:`~moejax.backends.sync_ep.slot_weights` of its
  :class:`~moejax.backends.sync_ep.ExpertLayout`, with replicas placed by EPLB when
  ``replicas`` is given).
* **A step.** One jitted ``shard_map`` program: on each rank, the body of
  :func:`moejax.decode.programs.fused_step` (embed, ``run_layers`` with the paged
  attention kind over the rank's pool, the head and sampling at the rank's ``last``
  tokens), with an MoE dispatcher whose transport is the scoring backend's
  :class:`~moejax.backends.sync_ep.AllToAllTokens` (the layout's replica router:
  home, ``eplb_even`` or ``metro``). Then a second ``shard_map`` program writes each
  rank's new rows into its pool (:func:`moejax.kv.write_rows`, pool donated).
  The result is rank-major: tokens [G·B], experts/weights/new keys [L, G·B·C, ...].

**Capacity: nothing is ever dropped.** The scoring backend sizes its dispatch buffers
with a capacity factor and re-runs a step that overflowed; a decode step cannot be
re-run cheaply (and should not cost two), so here the buffer rows per (source,
destination) pair are the worst case of the batch: T tokens per rank, each sending its
k routed rows to k distinct experts, of which one device holds at most S_e (its slots
hold distinct experts), so one device receives at most ``T · min(k, S_e)`` rows from
one source (:func:`step_capacity`; ≤ T·k, the cap of ``AllToAllTokens``). Overflow is
still measured every step (the transport's stats): ``overflow_steps`` counts steps in
which any routed row did not fit, and must stay 0.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax import model, moe, sampling
from moejax.backends.base import BackendError
from moejax.backends.sync_ep import (AXIS, HOME, STAT_ACTIVATED, STAT_OVERFLOW, STAT_PEAK,
                                     STAT_TOKENS, AllToAllTokens, DispatchContext, EPStepStats,
                                     ExpertLayout, SyncEPPlacement, check_router)
from moejax.config import ModelConfig
from moejax.decode import programs
from moejax.kv import KVPool, empty_pool, write_rows
from moejax.decode.programs import PagedBatch, StepOptions, StepResult
from moejax.decode.runners import DecodeRunner
from moejax.distributed import fetch_global
from moejax.dispatch import MoEDispatcher, StackedExperts
from moejax.param_layout import Params

log = logging.getLogger(__name__)

OPTIONS = ("replicas", "router", "expert_load")


def step_capacity(tokens: int, k: int, expert_slots: int) -> int:
    """Dispatch buffer rows per device pair that no routing can overflow: ``tokens``
    tokens per rank, each routing k rows to distinct experts, at most ``expert_slots``
    of them held by one device (module docstring)."""
    return max(1, tokens * min(k, expert_slots))


def check_options(options: dict[str, Any]) -> None:
    """A BackendError naming any backend option sync_ep decode does not take."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise BackendError(f"backend 'sync_ep' (decode) got unknown option(s) "
                           f"{', '.join(map(repr, unknown))}; it takes {', '.join(OPTIONS)}")


# ----------------------------------------------------------------------------- per rank
def rank_step(params: Params, slots: dict[str, jax.Array], kv: KVPool, batch: PagedBatch,
              samp: sampling.SamplingParams, *, cfg: ModelConfig, opts: StepOptions,
              ctx: DispatchContext) -> tuple[StepResult, jax.Array]:
    """Per-rank body (inside shard_map): ``programs.fused_step`` with the local expert
    slots behind the all-to-all transport. slots: this device's [1, L, S_e, ...]; kv:
    this rank's pool [L, S, ...]; batch, samp: this rank's rows (``last`` still global).
    Returns the rank's StepResult and its stats [1, NUM_STATS] (max over the layers)."""
    programs.count_compile("sync_ep_step")
    tokens_here = batch.tokens.shape[0]
    offset = jax.lax.axis_index(AXIS) * tokens_here
    batch = dataclasses.replace(batch, last=batch.last - offset)
    capacity = step_capacity(tokens_here, cfg.num_experts_per_tok, ctx.layout.slots)
    transport = AllToAllTokens(ctx, capacity, opts.expert_impl, opts.tile_rows)
    dispatcher = MoEDispatcher(StackedExperts({k: w[0] for k, w in slots.items()}), transport)
    module = model.decoder(cfg, params, with_experts=False)
    result, moe_carry = programs.paged_forward(module, kv, batch, samp, dispatcher, opts)
    _, stats = moe_carry                          # (source carry, transport carry)
    return result, stats[None]


def result_specs(router_inputs: bool) -> StepResult:
    """Out specs of a step: rows concatenated rank-major (tokens on axis 0, the per-layer
    arrays [L, rows, ...] on axis 1)."""
    rows = P(None, AXIS)
    return StepResult(tokens=P(AXIS), new_keys=rows, new_values=rows, experts=rows,
                      weights=rows, router_inputs=rows if router_inputs else None)


def make_step(mesh: Mesh, cfg: ModelConfig, opts: StepOptions, ctx: DispatchContext) -> Any:
    """The jitted step: (params, slots, kv, batch, samp) -> (StepResult, stats [G, 4])."""
    body = functools.partial(rank_step, cfg=cfg, opts=opts, ctx=ctx)
    pool = P(None, AXIS)
    return jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(AXIS), pool, P(AXIS), P(AXIS)),
        out_specs=(result_specs(opts.router_inputs), P(AXIS)), check_vma=False))


def make_write(mesh: Mesh) -> Any:
    """The jitted write of every rank's new rows into its own pool (pool donated)."""
    pool, rows = P(None, AXIS), P(None, AXIS)
    return jax.jit(jax.shard_map(write_rows, mesh=mesh, in_specs=(pool, P(AXIS), rows, rows),
                                 out_specs=pool, check_vma=False), donate_argnums=0)


# ----------------------------------------------------------------------------- the runner
class SyncEPRunner(DecodeRunner):
    """Data-parallel attention over G ranks, expert-parallel MoE (module docstring).

    Options: ``replicas`` (None, or replica slots per expert on average in [1, G]),
    ``router`` (``"eplb_even"`` | ``"metro"``: which replica a row goes to; validated
    and unused without replicas), ``expert_load`` ([E] load for the EPLB placement).
    After each step: ``last_stats`` (:class:`~moejax.backends.sync_ep.EPStepStats`) and
    ``overflow_steps`` (steps in which a routed row did not fit: always 0)."""

    name = "sync_ep"
    steps = ("fused",)

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, dtype: Any,
                 opts: StepOptions, devices: int = 1, replicas: float | None = None,
                 router: str = "eplb_even", expert_load: Any = None,
                 placement: SyncEPPlacement | None = None, **options: Any):
        if placement is not None:
            dtype = placement.dtype
        super().__init__(cfg, dtype=dtype, opts=opts)
        check_options(options)
        check_router(self.name, router)
        placement = SyncEPPlacement.resolve(self.name, cfg, params, self.dtype, devices,
                                            replicas, expert_load, placement)
        # The layout's replica router (home without replicas), as the scoring backend's.
        self.ctx = DispatchContext(layout=placement.layout,
                                   router=router if placement.replicated else HOME,
                                   num_devices=len(placement.devices))
        # The one placement of sync_ep's weights (moejax.backends.sync_ep.SyncEPPlacement).
        self.placement = placement
        self._devices = placement.devices
        self.mesh = placement.mesh
        self._ranks = NamedSharding(self.mesh, P(AXIS))
        self._pool = NamedSharding(self.mesh, P(None, AXIS))
        self.dense_params = placement.dense_params
        self.expert_slots = placement.expert_slots
        self._step = make_step(self.mesh, cfg, opts, self.ctx)
        self._write = make_write(self.mesh)
        self.overflow_steps = 0
        self.last_stats: EPStepStats | None = None

    @property
    def layout(self) -> ExpertLayout:
        """Where the expert replicas live."""
        return self.ctx.layout

    @property
    def num_ranks(self) -> int:
        return len(self._devices)

    @property
    def device(self) -> Any:
        """The sharding of the pool: the slot axis split over the ranks."""
        return self._pool

    def make_kv(self, num_blocks: int, expert_counts: bool = False) -> KVPool:
        """A zeroed pool of ``num_blocks`` blocks per rank: [L, G·S, n_kv, h], rank g's
        slots on device g (no signature cache: its ranks would each need their own)."""
        if expert_counts:
            raise BackendError("backend 'sync_ep': the signature cache (expert counts per KV "
                               "block) needs a one-rank decode backend")
        return empty_pool(self.cfg, num_blocks * self.num_ranks, self.dtype, self._pool)

    def run(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams, step: str
            ) -> tuple[KVPool, StepResult]:
        """One step over every rank, then the writes (``kv`` is consumed)."""
        self.check_step(step)
        batch, samp = jax.device_put((batch, samp), self._ranks)
        result, stats = self._step(self.dense_params, self.expert_slots, kv, batch, samp)
        kv = self._write(kv, batch.write_slots, result.new_keys, result.new_values)
        self._record(np.asarray(fetch_global(stats)), batch.tokens.shape[0] // self.num_ranks)
        if not result.tokens.is_fully_addressable:
            # Over several processes: what the host reads back (the sampled tokens, the
            # routing for traces) is gathered to every process; the KV stays sharded.
            result = dataclasses.replace(result, tokens=fetch_global(result.tokens),
                                         experts=fetch_global(result.experts),
                                         weights=fetch_global(result.weights))
        return kv, result

    def _record(self, stats: np.ndarray, tokens: int) -> None:
        """Keep the step's stats [G, NUM_STATS]; count (and report) an overflow."""
        k = self.cfg.num_experts_per_tok
        capacity = step_capacity(tokens, k, self.layout.slots)
        self.last_stats = EPStepStats(activated_per_device=stats[:, STAT_ACTIVATED],
                                      tokens_per_device=stats[:, STAT_TOKENS],
                                      peak_pair_rows=stats[:, STAT_PEAK], capacity=capacity,
                                      rows_per_device=tokens * k)
        if stats[:, STAT_OVERFLOW].any():
            self.overflow_steps += 1
            log.error("sync_ep decode: %d routed rows overflowed dispatch buffers of %d rows "
                      "per device pair (a bug: the capacity is the worst case); this step's "
                      "tokens are wrong", int(stats[:, STAT_OVERFLOW].sum()), capacity)

    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], int, moe.Routing]:
        """Never called: the experts stay in the fused program (``steps``)."""
        raise BackendError("backend 'sync_ep' runs fused decode steps only")

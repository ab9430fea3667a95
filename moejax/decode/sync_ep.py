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
* **Two routers.** Prefill steps (rows of ``prefill_row_tokens`` tokens, ``chunk > 1``)
  and decode steps (one token a row) are separate programs (``moejax.core.paged_runner``),
  so each kind has its own :class:`~moejax.backends.sync_ep.DispatchContext` and step
  program: ``router`` routes the decode steps, ``prefill_router`` (default: the same) the
  prefill steps. The METRO seed's pairing is ``router="metro"`` (fewest activated
  replicas where the step is memory-bound) with ``prefill_router="eplb_even"`` (rows
  spread evenly where it is compute-bound).
* **No host wait.** The step's stats (below) are replicated in the program and kept on
  the device; they are read back one step later (after the next step is dispatched) or
  when ``last_stats`` / ``overflow_steps`` is read, so ``run`` returns as soon as the
  step is dispatched (the scheduler's pipelined steps stay pipelined).

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

import collections
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

OPTIONS = ("replicas", "router", "prefill_router", "expert_load")


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
    Returns the rank's StepResult and every rank's stats [G, NUM_STATS] (max over the
    layers; all-gathered, so the step's stats are replicated on every device)."""
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
    return result, jax.lax.all_gather(stats, AXIS)


def result_specs(router_inputs: bool) -> StepResult:
    """Out specs of a step: rows concatenated rank-major (tokens on axis 0, the per-layer
    arrays [L, rows, ...] on axis 1)."""
    rows = P(None, AXIS)
    return StepResult(tokens=P(AXIS), new_keys=rows, new_values=rows, experts=rows,
                      weights=rows, router_inputs=rows if router_inputs else None)


def make_step(mesh: Mesh, cfg: ModelConfig, opts: StepOptions, ctx: DispatchContext) -> Any:
    """The jitted step: (params, slots, kv, batch, samp) -> (StepResult, stats [G, 4]
    replicated on every device: read back later without a collective)."""
    body = functools.partial(rank_step, cfg=cfg, opts=opts, ctx=ctx)
    pool = P(None, AXIS)
    return jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(AXIS), pool, P(AXIS), P(AXIS)),
        out_specs=(result_specs(opts.router_inputs), P()), check_vma=False))


def make_write(mesh: Mesh) -> Any:
    """The jitted write of every rank's new rows into its own pool (pool donated)."""
    pool, rows = P(None, AXIS), P(None, AXIS)
    return jax.jit(jax.shard_map(write_rows, mesh=mesh, in_specs=(pool, P(AXIS), rows, rows),
                                 out_specs=pool, check_vma=False), donate_argnums=0)


# ----------------------------------------------------------------------------- the runner
class SyncEPRunner(DecodeRunner):
    """Data-parallel attention over G ranks, expert-parallel MoE (module docstring).

    Options: ``replicas`` (None, or replica slots per expert on average in [1, G]),
    ``router`` (``"eplb_even"`` | ``"metro"``: which replica a decode step's row goes to),
    ``prefill_router`` (the same choice for the prefill steps; default None: ``router``),
    both validated and unused without replicas, and ``expert_load`` ([E] load for the
    EPLB placement). The METRO seed pairs ``router="metro"`` with
    ``prefill_router="eplb_even"``. ``ctx`` / ``prefill_ctx``: the decode and prefill
    steps' dispatch contexts (``HOME`` without replicas); ``router_steps``: steps
    dispatched per router actually used (a Counter). ``last_stats``
    (:class:`~moejax.backends.sync_ep.EPStepStats` of the last step run) and
    ``overflow_steps`` (steps in which a routed row did not fit: always 0) count every
    step run; ``run`` never waits for its step: the stats are read back after the next
    step is dispatched, or when either property is read."""

    name = "sync_ep"
    steps = ("fused",)

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, dtype: Any,
                 opts: StepOptions, devices: int = 1, replicas: float | None = None,
                 router: str = "eplb_even", prefill_router: str | None = None,
                 expert_load: Any = None, placement: SyncEPPlacement | None = None,
                 **options: Any):
        if placement is not None:
            dtype = placement.dtype
        super().__init__(cfg, dtype=dtype, opts=opts)
        check_options(options)
        prefill_router = router if prefill_router is None else prefill_router
        for option, value in (("router", router), ("prefill_router", prefill_router)):
            check_router(self.name, value, option)
        placement = SyncEPPlacement.resolve(self.name, cfg, params, self.dtype, devices,
                                            replicas, expert_load, placement)
        # The layout's replica routers (home without replicas), as the scoring backend's:
        # ``ctx`` for the decode steps, ``prefill_ctx`` for the prefill steps.
        self.ctx, self.prefill_ctx = (
            DispatchContext(layout=placement.layout,
                            router=name if placement.replicated else HOME,
                            num_devices=len(placement.devices))
            for name in (router, prefill_router))
        # The one placement of sync_ep's weights (moejax.backends.sync_ep.SyncEPPlacement).
        self.placement = placement
        self._devices = placement.devices
        self.mesh = placement.mesh
        self._ranks = NamedSharding(self.mesh, P(AXIS))
        self._pool = NamedSharding(self.mesh, P(None, AXIS))
        self.dense_params = placement.dense_params
        self.expert_slots = placement.expert_slots
        # One step program per router (one only when both kinds route alike).
        self._steps = {c.router: make_step(self.mesh, cfg, opts, c)
                       for c in (self.ctx, self.prefill_ctx)}
        self._write = make_write(self.mesh)
        self.router_steps: collections.Counter = collections.Counter()
        self._overflow_steps = 0
        self._last_stats: EPStepStats | None = None
        # Stats of steps dispatched and not yet read back: (stats [G, NUM_STATS] on the
        # device, tokens per rank).
        self._pending: list[tuple[jax.Array, int]] = []

    @property
    def last_stats(self) -> EPStepStats | None:
        """The last step's stats (waits for that step if it is still running)."""
        self._record_pending()
        return self._last_stats

    @property
    def overflow_steps(self) -> int:
        """Steps run so far in which a routed row did not fit (waits for every step)."""
        self._record_pending()
        return self._overflow_steps

    def step_context(self, batch: PagedBatch) -> DispatchContext:
        """The dispatch context of a step: the prefill router's for prefill rows
        (``chunk > 1``), the decode router's for decode rows (one token each)."""
        return self.prefill_ctx if batch.chunk > 1 else self.ctx

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
        """One step over every rank, then the writes (``kv`` is consumed). Returns once
        both are dispatched: the step's stats stay pending (class docstring)."""
        self.check_step(step)
        ctx = self.step_context(batch)
        batch, samp = jax.device_put((batch, samp), self._ranks)
        result, stats = self._steps[ctx.router](self.dense_params, self.expert_slots, kv,
                                                batch, samp)
        kv = self._write(kv, batch.write_slots, result.new_keys, result.new_values)
        self.router_steps[ctx.router] += 1
        # The earlier steps' stats (done, or done before this one): read them back now,
        # after this step is dispatched; this step's wait for the next run or a read.
        self._record_pending()
        self._pending.append((stats, batch.tokens.shape[0] // self.num_ranks))
        if not result.tokens.is_fully_addressable:
            # Over several processes: what the host reads back (the sampled tokens, the
            # routing for traces) is gathered to every process; the KV stays sharded.
            result = dataclasses.replace(result, tokens=fetch_global(result.tokens),
                                         experts=fetch_global(result.experts),
                                         weights=fetch_global(result.weights))
        return kv, result

    def _record_pending(self) -> None:
        """Read back and record the pending steps' stats, oldest first (each is
        replicated: this process's copy is all of it, no collective)."""
        pending, self._pending = self._pending, []
        for stats, tokens in pending:
            self._record(np.asarray(stats.addressable_data(0)), tokens)

    def _record(self, stats: np.ndarray, tokens: int) -> None:
        """Keep the step's stats [G, NUM_STATS]; count (and report) an overflow."""
        k = self.cfg.num_experts_per_tok
        capacity = step_capacity(tokens, k, self.layout.slots)
        self._last_stats = EPStepStats(activated_per_device=stats[:, STAT_ACTIVATED],
                                       tokens_per_device=stats[:, STAT_TOKENS],
                                       peak_pair_rows=stats[:, STAT_PEAK], capacity=capacity,
                                       rows_per_device=tokens * k)
        if stats[:, STAT_OVERFLOW].any():
            self._overflow_steps += 1
            log.error("sync_ep decode: %d routed rows overflowed dispatch buffers of %d rows "
                      "per device pair (a bug: the capacity is the worst case); this step's "
                      "tokens are wrong", int(stats[:, STAT_OVERFLOW].sum()), capacity)

    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], int, moe.Routing]:
        """Never called: the experts stay in the fused program (``steps``)."""
        raise BackendError("backend 'sync_ep' runs fused decode steps only")

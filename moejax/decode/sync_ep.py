"""``sync_ep`` decode: data-parallel attention, expert-parallel MoE with all-to-all.

G devices on the mesh ``('dp',)`` of the scoring backend (``moejax.backends.sync_ep``)
are G data-parallel *ranks*: the rank-major steps, the pool split over the ranks (with
its signature cache when asked) and the writes are :mod:`moejax.decode.rank_mesh`'s.

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
  home, ``eplb_even`` or ``metro``), then the rank-mesh write.
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
import functools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from moejax import model, sampling
from moejax.backends.base import BackendError
from moejax.backends.sync_ep import (AXIS, HOME, STAT_ACTIVATED, STAT_OVERFLOW, STAT_PEAK,
                                     STAT_TOKENS, AllToAllTokens, DispatchContext, EPStepStats,
                                     ExpertLayout, SyncEPPlacement, check_router)
from moejax.config import ModelConfig
from moejax.decode import programs
from moejax.kv import KVPool
from moejax.decode.programs import PagedBatch, StepOptions, StepResult
from moejax.decode.rank_mesh import RankMeshRunner, rank_rows, result_specs
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
    batch = rank_rows(batch)
    capacity = step_capacity(tokens_here, cfg.num_experts_per_tok, ctx.layout.slots)
    transport = AllToAllTokens(ctx, capacity, opts.expert_impl, opts.tile_rows)
    dispatcher = MoEDispatcher(StackedExperts({k: w[0] for k, w in slots.items()}), transport)
    module = model.decoder(cfg, params, with_experts=False)
    result, moe_carry = programs.paged_forward(module, kv, batch, samp, dispatcher, opts)
    _, stats = moe_carry                          # (source carry, transport carry)
    return result, jax.lax.all_gather(stats, AXIS)


def make_step(mesh: Mesh, cfg: ModelConfig, opts: StepOptions, ctx: DispatchContext) -> Any:
    """The jitted step: (params, slots, kv, batch, samp) -> (StepResult, stats [G, 4]
    replicated on every device: read back later without a collective)."""
    body = functools.partial(rank_step, cfg=cfg, opts=opts, ctx=ctx)
    pool = P(None, AXIS)
    return jax.jit(jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(AXIS), pool, P(AXIS), P(AXIS)),
        out_specs=(result_specs(opts.router_inputs), P()), check_vma=False))


# ----------------------------------------------------------------------------- the runner
class SyncEPRunner(RankMeshRunner):
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

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, dtype: Any,
                 opts: StepOptions, devices: int = 1, replicas: float | None = None,
                 router: str = "eplb_even", prefill_router: str | None = None,
                 expert_load: Any = None, placement: SyncEPPlacement | None = None,
                 device_pool: Sequence[jax.Device] | None = None, **options: Any):
        check_options(options)
        prefill_router = router if prefill_router is None else prefill_router
        for option, value in (("router", router), ("prefill_router", prefill_router)):
            check_router(self.name, value, option)
        placement = SyncEPPlacement.resolve(
            self.name, cfg, params, dtype, devices, replicas, expert_load, placement,
            device_pool)
        super().__init__(cfg, dtype=placement.dtype, opts=opts, mesh=placement.mesh)
        # The layout's replica routers (home without replicas), as the scoring backend's:
        # ``ctx`` for the decode steps, ``prefill_ctx`` for the prefill steps.
        self.ctx, self.prefill_ctx = (
            DispatchContext(layout=placement.layout,
                            router=name if placement.replicated else HOME,
                            num_devices=len(placement.devices))
            for name in (router, prefill_router))
        # The one placement of sync_ep's weights (moejax.backends.sync_ep.SyncEPPlacement).
        self.placement = placement
        self.dense_params = placement.dense_params
        self.expert_slots = placement.expert_slots
        # One step program per router (one only when both kinds route alike).
        self._steps = {c.router: make_step(self.mesh, cfg, opts, c)
                       for c in (self.ctx, self.prefill_ctx)}
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

    def dispatch(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
                 ) -> StepResult:
        """The step program of the step's router; its stats stay pending on the device
        (class docstring)."""
        ctx = self.step_context(batch)
        result, stats = self._steps[ctx.router](self.dense_params, self.expert_slots, kv,
                                                batch, samp)
        self.router_steps[ctx.router] += 1
        self._dispatched = (stats, batch.tokens.shape[0] // self.num_ranks)
        return result

    def after_dispatch(self, batch: PagedBatch) -> None:
        """The earlier steps' stats (done, or done before this one): read them back now,
        after this step is dispatched; this step's wait for the next run or a read."""
        self._record_pending()
        self._pending.append(self._dispatched)

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

"""The offload decode runner with expert prefetch (the seed's Algorithm 1).

Each (layer, expert) lives in host memory (``OffloadRunner``); a decode step copies the
experts a layer needs into one of two device slot buffers
(``moejax.offload.AlternatingSlots``: the expert-id -> slot map), alternating by layer
parity. With a predictor, layer l's
attention output also predicts layer l+1's top-k (``moejax.prefetch.predictors``);
the host enqueues layer l's experts first, then reads the predicted ids and copies
those experts into the other buffer, so on a GPU the copy runs while layer l computes.
Layer 0 has no predecessor: its true top-k is copied synchronously.

Modes:

* ``exact`` — every layer computes with its true top-k; a true expert that was not
  prefetched is copied on demand (a miss). Tokens equal resident decode.
* ``speculative`` — layer l >= 1 computes with the predicted experts *and* their
  predicted gate weights and never copies a miss (the seed's Router-PF / Est-PF).
  Tokens may change. The traced routing stays the router's own.

A population prior (``prefetch_prior`` [L, E], e.g. the expert frequencies of the ELDR
cluster this decoder serves: ``moejax.eldr.priors``, and ``prefetch_prior_weight`` w in
[0, 1]) re-ranks a learned predictor's experts (``moejax.prefetch.predictors``); w = 0
(the default) is the predictor alone. Exact mode still computes with the true top-k.

Prefill steps (prompt chunks) copy on demand as the plain offload runner does; the
prediction runs on decode steps (one token per row). :class:`PrefetchStats` counts what
each decode step copied, ahead of time or on demand, and each layer's recall.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from moejax import moe, sampling
from moejax.backends.base import BackendError
from moejax.config import ModelConfig
from moejax.decode import programs
from moejax.kv import KVPool
from moejax.decode.programs import LayerwiseStep, PagedBatch, StepOptions, StepResult
from moejax.decode.runners import OffloadRunner
from moejax.offload.placement import OffloadPlacement
from moejax.offload.slots import RENUMBER_EXPERTS
from moejax.param_layout import Params
from moejax.prefetch import files as files_lib
from moejax.prefetch import predictors

MODES = ("exact", "speculative")
CHOICES = ("none", *predictors.PREDICTORS)


@dataclasses.dataclass
class PrefetchStats:
    """What decode steps copied. ``prefetched``: experts copied ahead from a prediction;
    ``on_demand``: copied after the layer routed (layer 0, and misses in exact mode);
    ``hits``: prefetched experts the layer's true routing used; ``on_demand_layers`` [L]:
    the on-demand copies per layer (speculative mode: layer 0 only); ``recall_hits`` /
    ``recall_rows`` [L]: Σ over valid rows of |predicted ∩ true| / k, and the rows.
    ``prefill_copied``: experts copied by prefill steps (not part of decode)."""

    num_layers: int
    decode_steps: int = 0
    decode_rows: int = 0
    prefetched: int = 0
    on_demand: int = 0
    hits: int = 0
    prefill_copied: int = 0
    peak_expert_bytes: int = 0
    on_demand_layers: np.ndarray = dataclasses.field(default=None)   # type: ignore[assignment]
    recall_hits: np.ndarray = dataclasses.field(default=None)   # type: ignore[assignment]
    recall_rows: np.ndarray = dataclasses.field(default=None)   # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.on_demand_layers = np.zeros(self.num_layers, np.int64)
        self.recall_hits = np.zeros(self.num_layers)
        self.recall_rows = np.zeros(self.num_layers, np.int64)

    def recall(self) -> np.ndarray:
        """Per layer recall@k of the predictions (NaN where none ran: layer 0)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.recall_hits / self.recall_rows

    def as_dict(self, expert_bytes: int) -> dict[str, Any]:
        copied = self.prefetched + self.on_demand
        rows = max(self.decode_rows, 1)
        return {"decode_steps": self.decode_steps, "decode_tokens": self.decode_rows,
                "experts_prefetched": self.prefetched, "experts_on_demand": self.on_demand,
                "prefetch_hits": self.hits,
                "on_demand_per_layer": [int(n) for n in self.on_demand_layers],
                "prefill_experts_copied": self.prefill_copied,
                "bytes_per_token": copied * expert_bytes / rows,
                "on_demand_bytes_per_token": self.on_demand * expert_bytes / rows,
                "recall_per_layer": [None if np.isnan(r) else float(r) for r in self.recall()],
                "peak_expert_bytes": self.peak_expert_bytes}


@dataclasses.dataclass
class Prefetched:
    """A layer's prediction and what was copied for it."""

    routing: moe.Routing | None      # None: oracle / layer (no per-row prediction)
    ids: np.ndarray | None           # predicted ids of the valid rows [rows, k]
    copied: frozenset[int]
    slot_of: np.ndarray


class PrefetchRunner(OffloadRunner):
    """``OffloadRunner`` whose decode steps prefetch the next layer's predicted experts
    (module docstring). ``prefetch="none"`` copies on demand, with the same statistics."""

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, dtype: Any,
                 opts: StepOptions, devices: int = 1, expert_slots: int | None = None,
                 device: Any = None, placement: OffloadPlacement | None = None,
                 prefetch: str = "none", prefetch_mode: str = "exact",
                 prefetch_files: Any = (), track_memory: bool = False,
                 prefetch_prior: Any = None, prefetch_prior_weight: float = 0.0):
        check_choice(prefetch, prefetch_mode)
        prior = check_prior_option(prefetch, prefetch_prior, prefetch_prior_weight, cfg)
        super().__init__(cfg, params, dtype=dtype, opts=opts, devices=devices,
                         expert_slots=expert_slots, device=device, placement=placement)
        self.prefetch, self.mode = prefetch, prefetch_mode
        # The files check the router they were fit to (the placement's dense weights).
        loaded = files_lib.load_files(prefetch_files, cfg, self.dense_params)
        files_lib.check_needs(prefetch, loaded)
        estimator = loaded.estimator
        self.tables = predictors.make_tables(
            cfg, None if loaded.defaults is None else loaded.defaults.defaults,
            None if estimator is None else estimator.params,
            () if estimator is None else estimator.hybrid_layers, self._device,
            prior=prior, prior_weight=prefetch_prior_weight)
        self.use_prior = predictors.uses_prior(self.tables)
        self.track_memory = bool(track_memory)
        self.expert_bytes = self.placement.host.expert_bytes
        self._slot_shapes = self.slots.shapes()
        self.stats = PrefetchStats(cfg.num_layers)
        self._copied_by_layer = np.zeros(cfg.num_layers, np.int64)

    def reset_stats(self) -> None:
        self.stats = PrefetchStats(self.cfg.num_layers)

    def live_expert_bytes(self) -> int:
        """Expert bytes on the device now, measured from JAX's live arrays (slot buffers
        and copies in flight), not from this runner's bookkeeping."""
        return sum(a.nbytes for a in jax.live_arrays()
                   if tuple(a.shape) in self._slot_shapes and not a.is_deleted()
                   and a.sharding.memory_kind == "device"
                   and set(a.sharding.device_set) == {self._device})

    # ---------------------------------------------------------------- copies
    def _load(self, layer: int, wanted: np.ndarray) -> tuple[np.ndarray, int]:
        slot_of, copied = self.slots.load(layer, wanted)
        if self.track_memory:
            self.stats.peak_expert_bytes = max(self.stats.peak_expert_bytes,
                                               self.live_expert_bytes())
        return slot_of, copied

    def _prefetch(self, layer: int, predicted: tuple[jax.Array, jax.Array] | None,
                  valid: np.ndarray) -> Prefetched:
        """Copy layer ``layer``'s predicted experts into its buffer (after the previous
        layer's experts were enqueued)."""
        if self.prefetch == "oracle":   # known when the layer routes: copied then
            return Prefetched(None, None, frozenset(), np.full(self.cfg.num_experts, -1))
        if predicted is None:           # "layer": the whole next layer
            wanted = np.arange(self.cfg.num_experts)
            routing, ids = None, None
        else:
            routing = moe.Routing(weights=predicted[0], experts=predicted[1])
            ids = np.asarray(predicted[1])[valid]
            wanted, counts = np.unique(ids, return_counts=True)
            room = self.slots.num_slots
            if len(wanted) > room:
                if self.mode == "speculative":
                    raise BackendError(f"backend 'offload': speculative prefetch of layer "
                                       f"{layer} predicts {len(wanted)} experts, more than "
                                       f"expert_slots={room}")
                # Exact mode: prefetch the most-predicted ones; the rest come on demand.
                wanted = np.sort(wanted[np.argsort(-counts, kind="stable")[:room]])
        slot_of, copied = self._load(layer, wanted)
        self.stats.prefetched += copied
        return Prefetched(routing, ids, frozenset(int(e) for e in wanted), slot_of)

    def _count_recall(self, layer: int, ahead: Prefetched, true_ids: np.ndarray) -> None:
        if len(true_ids) == 0:          # a step of padding rows only
            return
        predicted = ahead.ids
        if predicted is None:     # oracle / whole layer: every true expert was there
            self.stats.recall_hits[layer] += len(true_ids)
        else:   # recall summed over the rows (recall_at_k averages them)
            recall = predictors.recall_at_k(predicted[None], true_ids[None])[0]
            self.stats.recall_hits[layer] += float(recall) * len(true_ids)
        self.stats.recall_rows[layer] += len(true_ids)

    # ---------------------------------------------------------------- the step
    def layerwise(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
                  ) -> StepResult:
        if batch.chunk != 1 or self.prefetch == "none":
            before = self._copied_by_layer.copy()
            result = super().layerwise(kv, batch, samp)
            copied = self._copied_by_layer - before
            if batch.chunk != 1:
                self.stats.prefill_copied += int(copied.sum())
            else:
                self._count_step(np.asarray(batch.valid))
                self.stats.on_demand += int(copied.sum())
                self.stats.on_demand_layers += copied
            return result
        return self._decode_step(kv, batch, samp)

    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], int, moe.Routing]:
        """The plain offload copy (prefill, and decode without a predictor), counted per
        layer."""
        before = self.experts_copied
        out = super().layer_experts(layer, routing, valid)
        self._copied_by_layer[layer] += self.experts_copied - before
        return out

    def _count_step(self, valid: np.ndarray) -> None:
        rows = int(valid.sum())
        self.stats.decode_rows += rows
        self.stats.decode_steps += rows > 0

    def _decode_step(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
                     ) -> StepResult:
        dense, cfg, opts = self.dense_params, self.cfg, self.opts
        valid = np.asarray(batch.valid)
        self._count_step(valid)
        state = LayerwiseStep(*programs.BEGIN(dense, kv, batch, cfg=cfg, opts=opts))
        ahead: Prefetched | None = None
        for layer in range(cfg.num_layers):
            x, moe_in, routing = self.attend(layer, state, kv)
            used, slot_of = self._experts_for(layer, routing, ahead, valid)
            predicted = None
            if layer + 1 < cfg.num_layers and self.prefetch in predictors.LEARNED:
                predicted = predictors.PREDICT(dense["layers"], self.tables, np.int32(layer), x,
                                               routing.experts, routing.weights,
                                               kind=self.prefetch, cfg=cfg,
                                               use_prior=self.use_prior)
            renumbered = RENUMBER_EXPERTS(np.maximum(slot_of, 0), used.experts)
            state.x = programs.MOE(self.slots.buffers(layer), None, x, moe_in,
                                   dataclasses.replace(used, experts=renumbered), batch.valid,
                                   opts=opts)
            # Layer l's experts are enqueued: copy layer l+1's while they compute.
            if layer + 1 < cfg.num_layers:
                ahead = self._prefetch(layer + 1, predicted, valid)
        tokens = programs.HEAD(dense, state.x, batch, samp, cfg=cfg)
        return state.result(tokens, opts.router_inputs)

    def _experts_for(self, layer: int, routing: moe.Routing, ahead: Prefetched | None,
                     valid: np.ndarray) -> tuple[moe.Routing, np.ndarray]:
        """(the routing layer ``layer`` computes with, its expert -> slot map)."""
        true_ids = np.asarray(routing.experts)[valid]
        wanted = np.unique(true_ids)
        if ahead is None:                                  # layer 0: synchronous copy
            slot_of, copied = self._load(layer, wanted)
            self.stats.on_demand += copied
            self.stats.on_demand_layers[layer] += copied
            return routing, slot_of
        self._count_recall(layer, ahead, true_ids)
        if self.mode == "speculative" and ahead.routing is not None:
            return ahead.routing, ahead.slot_of
        slot_of, copied = self._load(layer, wanted)
        if self.prefetch == "oracle":
            self.stats.prefetched += copied
            self.stats.hits += copied
        else:
            self.stats.on_demand += copied
            self.stats.on_demand_layers[layer] += copied
            self.stats.hits += len(ahead.copied.intersection(int(e) for e in wanted))
        return routing, slot_of


def check_choice(prefetch: Any, mode: Any) -> None:
    """Refuse an unknown predictor or mode, and speculation without a per-row prediction."""
    if prefetch not in CHOICES:
        raise BackendError(f"prefetch must be one of {CHOICES}, got {prefetch!r}")
    if mode not in MODES:
        raise BackendError(f"prefetch_mode must be one of {MODES}, got {mode!r}")
    if mode == "speculative" and prefetch in ("none", "layer"):
        raise BackendError(f"prefetch_mode='speculative' computes with predicted experts; "
                           f"prefetch={prefetch!r} predicts none (choose one of "
                           f"{predictors.LEARNED} or 'oracle')")


def check_prior_option(prefetch: str, prior: Any, weight: Any, cfg: ModelConfig
                       ) -> np.ndarray | None:
    """The normalised ``prefetch_prior`` (``predictors.check_prior``), or a BackendError
    naming the option: a bad prior or weight, or a positive weight for a choice that
    predicts nothing to re-rank (none, oracle, layer)."""
    try:
        normalised, weight = predictors.check_prior(prior, weight, cfg)
    except ValueError as exc:
        raise BackendError(f"backend 'offload': {exc}") from None
    if weight > 0 and prefetch not in predictors.LEARNED:
        raise BackendError(f"prefetch_prior_weight={weight} re-ranks a learned predictor's "
                           f"experts; prefetch={prefetch!r} has none (choose one of "
                           f"{predictors.LEARNED})")
    return normalised


__all__: Sequence[str] = ("PrefetchRunner", "PrefetchStats", "MODES", "CHOICES",
                          "check_choice", "check_prior_option")

"""``sync_ep``: data-parallel attention + expert parallelism with all-to-all dispatch.

The baseline of the MoE-Prefill paper (DP+EP) and the setting of the METRO seed.
G devices on a 1-D mesh ``('dp',)``; each device runs its own packed batch
(``num_ranks = G``). Dense weights (embeddings, attention, norms, routers, LM head)
are replicated; expert weights are split over the devices, each device holding S
expert *slots* per layer (``[G, L, S, d, f]`` sharded on G).

Each device runs the model's own scoring forward (``MoEDecoder.score``: the layer
loop, the last layer at the scoring rows, the LM head) inside a ``shard_map``; only
its MoE dispatcher differs: the local slots ``[L, S, ...]`` are its expert source
(``moejax.dispatch.StackedExperts``) and :class:`AllToAllTokens` its token transport.
One MoE layer, per device (T local tokens, k experts per token, M = T·k routed rows,
C rows of capacity per (source, destination) pair):

1. route locally (``moe.route``, in the decoder layer); ``prepare`` picks a
   destination device for each valid row (see *Placement and routers*); padding
   tokens (``segment_ids < 0``) are never dispatched;
2. dispatch (``prepare``, cont.): rows sorted by destination fill a send buffer
   ``[G, C, d]`` (plus the row's slot id on the destination, ``[G, C]``; ``S`` marks
   an empty slot); one ``all_to_all`` each for the rows and the slot ids;
3. compute (``experts``): the received ``[G·C]`` rows are sorted by local slot and
   run through ``moe.expert_compute`` (``opts.expert_impl``); empty slots belong to
   no group, so the grouped paths do only the routed work;
4. combine (``finalize``): the outputs go back with a second ``all_to_all`` into the
   positions they came from, and each token sums its k rows with its router weights
   (``moe.weighted_sum``, the float32 sum every dispatcher ends in). The layer's stats
   (below) join the transport's carry, a max over the layers.

Capacity and overflow policy (nothing is ever dropped silently). A buffer holds
``C = ceil(capacity_factor · T·k / G)`` rows per pair, rounded up to a multiple of
:data:`CAPACITY_ALIGN` and capped at T·k (all rows to one device: no overflow is
then possible); the last layer, when it runs at the P scoring rows only, uses
``min(C, P·k)``. Each device reports the rows that did not fit and the most rows it
sent to one device (max over layers). If any row overflowed, :meth:`SyncEPBackend.step`
runs the same batches again with the capacity at least doubled (raised to the peak
seen if that is more; one more compile per capacity) until none overflow, so results
are always exact. ``overflow_retries`` counts the re-runs, a warning naming the
capacity_factor that would have sufficed is logged once, and the capacity reached is
kept for later steps of the same shape. The check reads a [G, NUM_STATS] int array
back to the host before ``step`` returns (a small synchronisation that the
weight-moving backends do not need).

:data:`DEFAULT_CAPACITY_FACTOR` is 2.0: buffers of twice the balanced share M/G.
The all-to-alls move whole buffers, so the factor is also the traffic over a perfectly
sized exchange; 2x is the usual headroom for expert-parallel capacity (an assumption,
not measured here on a trained model). Few experts per device and small batches need
more: on the tests' tiny random model (skewed router, 64-token batches) single pairs
needed up to 2.2x at 4 devices and 2.9x at 8 (one expert per device); with 1.5x
replicas at 8 devices, EPLB-even up to 4x and METRO, which sends all of an expert's
rows to one device, up to 5x. Such steps re-run once and the warning names the
factor that would have sufficed.

Placement and routers. Without ``replicas``, each device holds a contiguous run of
experts (``e // (E/G)`` when G divides E). Otherwise every device still has
``S = ceil(E/G)`` slots, the first ``E mod G`` devices hold S experts and the others
S - 1 plus a zero dummy expert that the router can never pick (its E columns are
unchanged): dummies cost memory only, and spreading the real experts this way (rather
than padding E to a multiple of G, which could leave a device with no real expert)
keeps every device's share of the rows close to 1/G.

With ``replicas=r`` (1 <= r <= G), ``round(r·E)`` replica slots are placed by
``kernels_pallas.metro.eplb_placement`` from ``expert_load`` (uniform when not
given); S is the most slots on one device, fewer are padded with zero dummies.
The routers need the global number of rows per expert: each device all-gathers its
per-expert row counts ``[E]``, which is all that the seed's all-gather of the top-k
ids is used for, at a fraction of the bytes. Then

* ``router="eplb_even"``: the rows of each expert are dealt round-robin over its
  replicas (device order) in one global order, rank-major then row-major, as
  ``kernels_pallas.metro.assign_tokens`` does;
* ``router="metro"``: ``route_metro_jax(..., impl="jax")`` picks one device per
  active expert (seed Algorithm 1); all of that expert's rows go there.

A row's destination slot is the slot of its expert on the chosen device. ``router``
without ``replicas`` is validated and then ignored (every expert has one home), and
so is ``expert_load``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, ClassVar, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int

from kernels_pallas import metro
from moejax import moe
from moejax import model as model_lib
from moejax.backends.base import (RANK_AXIS, BackendError, MemoryReport, MeshBackend,
                                  StepOutput, dense_bytes, expert_bytes_per_layer,
                                  require_devices, resolve_placement, rank_axis, stack_batches,
                                  unstack_outputs, validated)
from moejax.config import ModelConfig
from moejax.dispatch import ExpertWeights, MoEDispatcher, StackedExperts
from moejax.distributed import fetch_global, place_local_ranks
from moejax.model import ForwardOptions, PackedBatch, VocabReadout
from moejax.param_layout import Params, split_experts

log = logging.getLogger(__name__)

AXIS = RANK_AXIS
ROUTERS = ("eplb_even", "metro")
HOME = "home"                      # internal router: one replica per expert, no all-gather
DEFAULT_CAPACITY_FACTOR = 2.0      # see the module docstring
CAPACITY_ALIGN = 8                 # buffer rows per pair are a multiple of this
# Columns of the per-device stats the shard_map returns ([G, NUM_STATS] int32, max over
# layers): rows that overflowed, most rows sent to one device, local slots that received
# rows, rows computed.
STAT_OVERFLOW, STAT_PEAK, STAT_ACTIVATED, STAT_TOKENS = 0, 1, 2, 3
NUM_STATS = 4


# --------------------------------------------------------------------------- placement
@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where the expert replicas live (host-side tables, constants of the compiled step).

    placement: [E, G] bool, expert e has a replica on device g;
    slot_of: [E, G] int32, slot of expert e on device g (-1: none there);
    slot_expert: [G, S] int32, expert in each slot (-1: empty, zero weights);
    replica_device: [E, G] int32, device of expert e's r-th replica in device order
    (-1 for r >= its replica count); replica_count: [E] int32.
    """

    placement: np.ndarray
    slot_of: np.ndarray
    slot_expert: np.ndarray
    replica_device: np.ndarray
    replica_count: np.ndarray

    @property
    def slots(self) -> int:
        return int(self.slot_expert.shape[1])

    @property
    def replicated(self) -> bool:
        return bool((self.replica_count > 1).any())


def layout_from_placement(placement: np.ndarray) -> ExpertLayout:
    """The tables of :class:`ExpertLayout` from a placement [E, G] (slots in expert order)."""
    placement = np.asarray(placement, bool)
    num_experts, num_devices = placement.shape
    if not placement.any(axis=1).all():
        raise BackendError("every expert needs at least one replica")
    slot_of = np.where(placement, np.cumsum(placement, axis=0) - 1, -1).astype(np.int32)
    num_slots = max(int(placement.sum(axis=0).max()), 1)
    slot_expert = np.full((num_devices, num_slots), -1, np.int32)
    replica_device = np.full((num_experts, num_devices), -1, np.int32)
    experts, devices = np.nonzero(placement)           # row-major: devices ascending per expert
    slot_expert[devices, slot_of[experts, devices]] = experts
    rank = (np.cumsum(placement, axis=1) - 1)[experts, devices]
    replica_device[experts, rank] = devices
    return ExpertLayout(placement=placement, slot_of=slot_of, slot_expert=slot_expert,
                        replica_device=replica_device,
                        replica_count=placement.sum(axis=1).astype(np.int32))


def sharded_placement(num_experts: int, num_devices: int) -> np.ndarray:
    """No replicas: experts in contiguous runs, the first E mod G devices one more
    ([E, G] bool); a device with fewer than ceil(E/G) keeps zero padding slots."""
    sizes = num_experts // num_devices + (np.arange(num_devices) < num_experts % num_devices)
    placement = np.zeros((num_experts, num_devices), bool)
    placement[np.arange(num_experts), np.repeat(np.arange(num_devices), sizes)] = True
    return placement


def slot_weights(experts: Mapping[str, np.ndarray], layout: ExpertLayout) -> dict[str, np.ndarray]:
    """Expert weights [L, E, ...] -> per-device slots [G, L, S, ...] (empty slots zero)."""
    index = np.maximum(layout.slot_expert, 0)                          # [G, S]
    out = {}
    for name, w in experts.items():
        slots = np.moveaxis(w[:, index], 0, 1)                          # [G, L, S, ...]
        empty = (layout.slot_expert < 0).reshape(
            (index.shape[0], 1, index.shape[1]) + (1,) * (w.ndim - 2))   # [G, 1, S, 1, ...]
        out[name] = np.where(empty, np.zeros((), w.dtype), slots)
    return out


def capacity_rows(rows: int, factor: float, num_devices: int) -> int:
    """Buffer rows per (source, destination) pair for ``rows`` routed rows per device:
    ceil(factor · rows / G), rounded up to CAPACITY_ALIGN, capped at ``rows``."""
    wanted = math.ceil(factor * rows / num_devices)
    return max(1, min(_align(wanted), rows))


def grown_capacity(capacity: int, peak: int, rows: int) -> int:
    """The capacity after an overflow: doubled, or the peak rows per pair seen if more
    (aligned), capped at ``rows``."""
    return min(max(2 * capacity, _align(peak)), rows)


def _align(rows: int) -> int:
    return -(-rows // CAPACITY_ALIGN) * CAPACITY_ALIGN


# --------------------------------------------------------------------------- in-graph pieces
@dataclasses.dataclass(frozen=True)
class DispatchContext:
    """What the per-device MoE needs besides arrays: the layout tables and the router
    (``HOME``, ``"eplb_even"`` or ``"metro"``). Closed over, never traced."""

    layout: ExpertLayout
    router: str
    num_devices: int


def rank_in_group(keys: jax.Array, num_groups: int) -> tuple[jax.Array, jax.Array]:
    """Position of each entry among the entries of its group, in index order, and the
    group sizes. keys [M] int32 in [0, num_groups] (``num_groups`` = no group)
    -> (rank [M] int32, counts [num_groups] int32)."""
    order = jnp.argsort(keys, stable=True)
    sorted_keys = keys[order]
    counts = jnp.bincount(keys, length=num_groups + 1).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    rank_sorted = jnp.arange(keys.shape[0], dtype=jnp.int32) - starts[sorted_keys]
    rank = jnp.zeros_like(rank_sorted).at[order].set(rank_sorted)
    return rank, counts[:num_groups]


def choose_devices(experts: jax.Array, valid: jax.Array, ctx: DispatchContext) -> jax.Array:
    """Destination device [M] int32 of each routed row (experts [M], valid [M] bool);
    invalid rows get device 0 (they are never sent)."""
    layout = ctx.layout
    if ctx.router == HOME:
        dest = jnp.asarray(layout.replica_device[:, 0])[experts]
    else:
        num_experts = layout.placement.shape[0]
        occurrence, local_counts = rank_in_group(jnp.where(valid, experts, num_experts),
                                                 num_experts)
        all_counts = jax.lax.all_gather(local_counts, AXIS)              # [G, E]
        if ctx.router == "eplb_even":
            dest = eplb_even_devices(experts, occurrence, all_counts, layout)
        else:
            dest = metro_devices(experts, all_counts, layout)
    return jnp.where(valid, dest, 0).astype(jnp.int32)


def eplb_even_devices(experts: jax.Array, occurrence: jax.Array, all_counts: jax.Array,
                      layout: ExpertLayout) -> jax.Array:
    """EPLB-even: row i of expert e in the global order (rank-major, then row order) goes
    to e's replica i mod replicas(e). experts, occurrence (index among this rank's rows
    of the same expert) [M]; all_counts [G, E] rows per rank and expert -> devices [M]."""
    earlier = jnp.cumsum(all_counts, axis=0) - all_counts              # rows on lower ranks
    global_index = earlier[jax.lax.axis_index(AXIS)][experts] + occurrence
    replica = global_index % jnp.asarray(layout.replica_count)[experts]
    return jnp.asarray(layout.replica_device)[experts, replica]


def metro_devices(experts: jax.Array, all_counts: jax.Array, layout: ExpertLayout) -> jax.Array:
    """METRO: every row of expert e goes to the one device that the greedy (seed
    Algorithm 1, computed identically on every rank) picks for e -> devices [M]."""
    expert_device = metro.route_metro_jax(jnp.asarray(layout.placement),
                                          all_counts.sum(axis=0), impl="jax")
    return expert_device[experts]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SendPlan:
    """Rows packed for the dispatch all_to_all.

    rows: [G, C, d] send buffer; slots: [G, C] int32 destination slot (S: empty);
    position: [M] int32 place of each routed row in its destination's buffer;
    placed: [M] bool (valid and within capacity); overflow: scalar int32, valid rows
    that did not fit; peak: scalar int32, most valid rows for one destination.
    """

    rows: jax.Array
    slots: jax.Array
    position: jax.Array
    placed: jax.Array
    overflow: jax.Array
    peak: jax.Array


def pack_send(x: jax.Array, k: int, dest: jax.Array, slot: jax.Array, valid: jax.Array,
              num_devices: int, num_slots: int, capacity: int) -> SendPlan:
    """x [T, d]; dest, slot [M] int32; valid [M] bool -> the send buffers (row r of the
    routing is token r // k). Rows beyond ``capacity`` for one destination are counted."""
    position, counts = rank_in_group(jnp.where(valid, dest, num_devices), num_devices)
    placed = valid & (position < capacity)
    flat = jnp.where(placed, dest * capacity + position, num_devices * capacity)  # OOB: dropped
    token = jnp.arange(dest.shape[0], dtype=jnp.int32) // k
    rows = jnp.zeros((num_devices * capacity, x.shape[1]), x.dtype)
    rows = rows.at[flat].set(x[token], mode="drop")
    slots = jnp.full((num_devices * capacity,), num_slots, jnp.int32)
    slots = slots.at[flat].set(slot, mode="drop")
    return SendPlan(rows=rows.reshape(num_devices, capacity, -1),
                    slots=slots.reshape(num_devices, capacity), position=position, placed=placed,
                    overflow=jnp.sum(jnp.maximum(counts - capacity, 0)).astype(jnp.int32),
                    peak=jnp.max(counts).astype(jnp.int32))


# --------------------------------------------------------------------------- the token transport
def local_experts(rows: Float[Array, "N d"], slots: Int[Array, "N"],
                  weights: ExpertWeights, impl: moe.ExpertImpl = "auto",
                  tile_rows: int | tuple[int, int] | None = None) -> Float[Array, "N d"]:
    """The local expert slots on received rows [N, d] with slot ids [N] (S: empty)
    -> outputs [N, d] in received order, zeros for empty slots."""
    num_slots = weights["w_gate"].shape[0]
    # moe.permute with k = 1 sorts by slot; empty rows get the sentinel and no group.
    routing = moe.Routing(weights=jnp.ones((slots.shape[0], 1), jnp.float32),
                          experts=slots[:, None])
    perm = moe.permute(rows, routing, num_slots, valid=slots < num_slots)
    y_sorted = moe.expert_compute(perm, weights["w_gate"], weights["w_up"], weights["w_down"],
                                  impl=impl, tile_rows=tile_rows)
    return jnp.zeros_like(y_sorted).at[perm.order].set(y_sorted)


def layer_stats(send: SendPlan, recv_slots: Int[Array, "N"], num_slots: int) -> jax.Array:
    """This layer's stats [NUM_STATS] int32 on one device: rows that overflowed, most rows
    sent to one device, local slots that received rows, rows received (= computed)."""
    received = jnp.bincount(recv_slots, length=num_slots + 1)[:num_slots]   # S: empty
    return jnp.stack([send.overflow, send.peak, jnp.sum(received > 0).astype(jnp.int32),
                      jnp.sum(received).astype(jnp.int32)])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Exchange:
    """One layer's dispatched rows, as :meth:`AllToAllTokens.prepare` leaves them.

    send: the packed send buffers (and where each routed row went); dest: [M] int32
    destination device of each routed row; rows: [G(src), C, d] and slots: [G(src), C]
    the received rows and their local slot ids; stats: [NUM_STATS] int32 of this layer.
    """

    send: SendPlan
    dest: jax.Array
    rows: jax.Array
    slots: jax.Array
    stats: jax.Array


@dataclasses.dataclass(frozen=True)
class AllToAllTokens:
    """The token transport of expert parallelism (``moejax.dispatch``; module docstring,
    steps 1-4): each routed row travels to a device holding a replica of its expert and
    back, through buffers of ``capacity`` rows per device pair (at most M = T·k used).
    Its carry is the stats [NUM_STATS] int32, max over the layers run so far."""

    ctx: DispatchContext
    capacity: int
    impl: moe.ExpertImpl = "auto"
    tile_rows: int | tuple[int, int] | None = None
    communicates: ClassVar[bool] = True      # two all-to-alls, and the stats carry

    def init_carry(self) -> jax.Array:
        return jnp.zeros((NUM_STATS,), jnp.int32)

    def prepare(self, x: Float[Array, "T d"], routing: moe.Routing,
                valid: Bool[Array, "T"] | None) -> Exchange:
        """Steps 1-2: choose each valid row's device and slot, pack, all_to_all."""
        t, k = routing.experts.shape
        capacity = min(self.capacity, t * k)        # more than M rows per pair never fill
        experts = routing.experts.reshape(-1)
        row_valid = jnp.ones((t * k,), bool) if valid is None else jnp.repeat(valid, k)
        dest = choose_devices(experts, row_valid, self.ctx)
        slot = jnp.asarray(self.ctx.layout.slot_of)[experts, dest]
        send = pack_send(x, k, dest, slot, row_valid, self.ctx.num_devices,
                         self.ctx.layout.slots, capacity)
        rows = jax.lax.all_to_all(send.rows, AXIS, 0, 0)              # [G(src), C, d]
        slots = jax.lax.all_to_all(send.slots, AXIS, 0, 0)            # [G(src), C]
        return Exchange(send=send, dest=dest, rows=rows, slots=slots,
                        stats=layer_stats(send, slots.reshape(-1), self.ctx.layout.slots))

    def experts(self, prepared: Exchange, weights: ExpertWeights) -> Float[Array, "G C d"]:
        """Step 3: the local slots [S, ...] on the received rows."""
        rows = prepared.rows
        y = local_experts(rows.reshape(-1, rows.shape[-1]), prepared.slots.reshape(-1),
                          weights, self.impl, self.tile_rows)
        return y.reshape(rows.shape)

    def finalize(self, y: Float[Array, "G C d"], prepared: Exchange, routing: moe.Routing,
                 valid: Bool[Array, "T"] | None, carry: jax.Array
                 ) -> tuple[Float[Array, "T d"], jax.Array]:
        """Step 4: the outputs back where their rows came from, then each token's
        weighted sum (``moe.weighted_sum``); the stats join the carry."""
        send = prepared.send
        back = jax.lax.all_to_all(y, AXIS, 0, 0)                       # [G(dest), C, d]
        y_rows = back[prepared.dest, jnp.minimum(send.position, y.shape[1] - 1)]
        y_rows = jnp.where(send.placed[:, None], y_rows, 0)
        return moe.weighted_sum(y_rows, routing, valid), jnp.maximum(carry, prepared.stats)


# --------------------------------------------------------------------------- per-device forward
def sync_ep_forward(params: Params, slots: ExpertWeights, batch: PackedBatch, *,
                    cfg: ModelConfig, opts: ForwardOptions, ctx: DispatchContext,
                    capacity: int) -> tuple[VocabReadout, jax.Array]:
    """Per-device body (inside shard_map): ``MoEDecoder.score`` with the local expert
    slots behind an all-to-all transport. params: replicated, ``layers`` without
    experts; slots: this device's [1, L, S, ...]; batch: this rank's (leading axis 1);
    capacity: buffer rows per device pair. Returns the readout (a leading axis of 1) and
    [1, NUM_STATS] stats (max over the MoE layers)."""
    batch = jax.tree.map(lambda a: a[0], batch)
    slots = {name: w[0] for name, w in slots.items()}
    transport = AllToAllTokens(ctx, capacity, opts.expert_impl, opts.tile_rows)
    dispatcher = MoEDispatcher(StackedExperts(slots), transport)
    out = model_lib.decoder(cfg, params, with_experts=False).score(batch, opts,
                                                                   dispatcher=dispatcher)
    _, stats = out.moe_carry                         # (source carry, transport carry)
    return rank_axis(out.readout), stats[None]


# --------------------------------------------------------------------------- the backend
@dataclasses.dataclass(frozen=True)
class EPStepStats:
    """The last step, per device, max over its MoE layers.

    activated_per_device: [G] local expert slots that received rows;
    tokens_per_device: [G] routed rows (token, expert pairs) computed;
    peak_pair_rows: [G] most rows the device sent to one device;
    capacity: buffer rows per device pair used (after any overflow re-runs);
    rows_per_device: T·k, the routed rows of one rank's batch.
    """

    activated_per_device: np.ndarray
    tokens_per_device: np.ndarray
    peak_pair_rows: np.ndarray
    capacity: int
    rows_per_device: int

    @property
    def capacity_factor_needed(self) -> float:
        """The smallest capacity_factor with which this step would not have overflowed
        (before CAPACITY_ALIGN rounding)."""
        devices = self.peak_pair_rows.shape[0]
        return float(self.peak_pair_rows.max()) * devices / self.rows_per_device


def build_layout(num_experts: int, num_devices: int, replicas: float | None,
                 expert_load: Any) -> ExpertLayout:
    """The expert layout for the constructor's options (errors as BackendError)."""
    if replicas is None:
        return layout_from_placement(sharded_placement(num_experts, num_devices))
    if isinstance(replicas, bool) or not isinstance(replicas, (int, float)) \
            or not 1 <= replicas <= num_devices:
        raise BackendError(f"backend 'sync_ep': replicas must be a number in [1, devices="
                           f"{num_devices}] (replica slots per expert on average), "
                           f"got {replicas!r}")
    load = np.ones(num_experts) if expert_load is None else np.asarray(expert_load, np.float64)
    if load.shape != (num_experts,):
        raise BackendError(f"backend 'sync_ep': expert_load must have one entry per expert "
                           f"({num_experts}), got shape {load.shape}")
    num_replicas = min(max(round(replicas * num_experts), num_experts), num_experts * num_devices)
    try:
        placement = metro.eplb_placement(load, num_devices, num_replicas)
    except ValueError as err:
        raise BackendError(f"backend 'sync_ep': {err}") from err
    return layout_from_placement(placement)


def check_router(name: str, router: Any, option: str = "router") -> None:
    """BackendError unless ``router`` (the backend option ``option``) names a replica
    router (checked with or without replicas, so that a typo never passes silently)."""
    if router not in ROUTERS:
        raise BackendError(f"backend {name!r}: backend_options[{option!r}]: unknown router "
                           f"{router!r}; choose one of {ROUTERS}")


@dataclasses.dataclass(frozen=True, eq=False)
class SyncEPPlacement:
    """The weights of ``sync_ep`` on the mesh ``('dp',)`` of ``devices``: the dense weights
    replicated, the experts as each device's slots [G, L, S_e, ...] where ``layout`` puts
    them (replicas placed by EPLB when asked). Built once (:meth:`place`); the sync_ep
    scoring backend and decode runner (``moejax.decode.sync_ep``) both run on it, so a
    server that scores and generates on one mesh holds one copy."""

    cfg: ModelConfig
    dtype: Any
    devices: tuple[jax.Device, ...]
    layout: ExpertLayout
    mesh: Mesh
    dense_params: Params
    expert_slots: dict[str, jax.Array]
    dense_bytes: int
    expert_bytes_per_layer: int
    replicated: bool     # the layout places replicas (a replica router picks among them)

    @classmethod
    def place(cls, cfg: ModelConfig, params: Params, dtype: Any,
              devices: Sequence[jax.Device], layout: ExpertLayout, *,
              replicated: bool = False) -> "SyncEPPlacement":
        """``params`` validated, cast to ``dtype`` and placed on ``devices`` by ``layout``
        (``replicated``: built with replicas)."""
        dtype = jnp.dtype(dtype)
        host = validated(params, cfg, dtype)
        dense_layers, experts = split_experts(host["layers"])
        mesh = Mesh(np.array(devices), (AXIS,))
        dense = jax.device_put({**{k: v for k, v in host.items() if k != "layers"},
                                "layers": dense_layers}, NamedSharding(mesh, P()))
        slots = jax.device_put(slot_weights(experts, layout), NamedSharding(mesh, P(AXIS)))
        return cls(cfg, dtype, tuple(devices), layout, mesh, dense, slots,
                   dense_bytes(host), expert_bytes_per_layer(host), replicated)

    @classmethod
    def resolve(cls, name: str, cfg: ModelConfig, params: Params | None, dtype: Any,
                devices: int, replicas: float | None, expert_load: Any,
                placement: "SyncEPPlacement | None",
                device_pool: Sequence[jax.Device] | None = None) -> "SyncEPPlacement":
        """What backend or runner ``name`` runs on: ``placement`` as it is (it must hold
        ``cfg``'s weights; its layout comes with it, so options that would build another
        are refused), or ``params`` placed now on the first ``devices`` devices by the
        layout ``replicas`` and ``expert_load`` build (the first of ``device_pool``, when
        given)."""
        resolved = resolve_placement(
            name, cfg, params, placement,
            lambda: cls.place_by_layout(cfg, params, dtype,
                                        require_devices(name, devices, device_pool),
                                        replicas, expert_load))
        if placement is not None and (replicas is not None or expert_load is not None):
            raise BackendError(f"backend {name!r}: replicas and expert_load set the expert "
                               f"layout, which an existing placement already has")
        return resolved

    @classmethod
    def place_by_layout(cls, cfg: ModelConfig, params: Params, dtype: Any,
                        devices: Sequence[jax.Device], replicas: float | None,
                        expert_load: Any) -> "SyncEPPlacement":
        """:meth:`place` by the layout ``replicas`` and ``expert_load`` build."""
        layout = build_layout(cfg.num_experts, len(devices), replicas, expert_load)
        return cls.place(cfg, params, dtype, devices, layout, replicated=replicas is not None)


class SyncEPBackend(MeshBackend):
    """DP attention + expert parallelism with two all-to-alls per MoE layer (module docstring).

    capacity_factor: dispatch buffer rows per device pair over the balanced share T·k/G
    (> 0; an overflow re-runs the step with more capacity, rows are never dropped).
    replicas: None (each expert on one device) or the average replicas per expert in
    [1, devices]. router: ``"eplb_even"`` or ``"metro"``, used only with replicas (always
    validated). expert_load: [E] load for the EPLB placement (uniform if None; ignored
    without replicas).

    After each step: ``last_stats`` (:class:`EPStepStats`), ``overflow_retries`` (re-runs
    so far). ``layout`` (:class:`ExpertLayout`) tells where the experts live.
    """

    name = "sync_ep"
    no_prefix_pool_reason = ("its layer loop, with two all-to-alls per MoE layer, has no "
                             "pooled attention kind yet (async_ep and hybrid hold one pool "
                             "per data-parallel rank)")

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *,
                 dtype: Any = jnp.float32, devices: int = 1,
                 capacity_factor: float = DEFAULT_CAPACITY_FACTOR,
                 replicas: float | None = None, router: str = "eplb_even",
                 expert_load: Any = None, placement: SyncEPPlacement | None = None,
                 device_pool: Sequence[jax.Device] | None = None):
        if placement is not None:
            dtype = placement.dtype
        super().__init__(cfg, dtype=dtype)
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
                or not math.isfinite(capacity_factor) or capacity_factor <= 0:
            raise BackendError(f"backend 'sync_ep': capacity_factor must be a finite number > 0, "
                               f"got {capacity_factor!r}")
        check_router(self.name, router)
        placement = SyncEPPlacement.resolve(self.name, cfg, params, dtype, devices, replicas,
                                            expert_load, placement, device_pool)
        self._devices = placement.devices
        num_devices = len(self._devices)
        self.capacity_factor = float(capacity_factor)
        self.replicas = replicas
        self.router = router if placement.replicated else HOME
        self.placement = placement
        self.layout = placement.layout
        self._ctx = DispatchContext(layout=self.layout, router=self.router,
                                    num_devices=num_devices)
        self.mesh = placement.mesh
        self._batch_sharding = NamedSharding(self.mesh, P(AXIS))
        self.params = placement.dense_params
        self.expert_slots = placement.expert_slots
        per_layer = placement.expert_bytes_per_layer
        local = self.layout.slots * (per_layer // cfg.num_experts) * cfg.num_layers
        self._memory = MemoryReport(dense_weight_bytes=placement.dense_bytes,
                                    expert_weight_bytes=local,
                                    expert_bytes_all_layers=per_layer * cfg.num_layers,
                                    detail={"experts_local": local})

        self.overflow_retries = 0                     # re-runs caused by buffer overflow
        self.last_stats: EPStepStats | None = None
        self._capacity_for_shape: dict[Any, int] = {}
        self._programs: dict[tuple[ForwardOptions, int], Any] = {}
        self._warned = False

    def rows_per_device(self, batch: PackedBatch) -> int:
        """T·k: the routed rows of one rank's batch in the T-token layers."""
        return int(np.shape(batch.tokens)[-1]) * self.cfg.num_experts_per_tok

    def program(self, opts: ForwardOptions, capacity: int):
        """The jitted shard_map'd step for one set of options and a capacity (cached)."""
        key = (opts, capacity)
        if key not in self._programs:
            body = functools.partial(sync_ep_forward, cfg=self.cfg, opts=opts, ctx=self._ctx,
                                     capacity=capacity)
            self._programs[key] = jax.jit(jax.shard_map(
                body, mesh=self.mesh, in_specs=(P(), P(AXIS), P(AXIS)), out_specs=P(AXIS),
                check_vma=False))
        return self._programs[key]

    def _capacity(self, first: PackedBatch, opts: ForwardOptions) -> tuple[tuple, int]:
        """(shape key, rows per device pair): the capacity reached for this shape, or the
        one capacity_factor gives."""
        rows = self.rows_per_device(first)
        shape_key = (np.shape(first.tokens), np.shape(first.score_token_ids), opts)
        return shape_key, self._capacity_for_shape.get(
            shape_key, capacity_rows(rows, self.capacity_factor, self.num_ranks))

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        _, capacity = self._capacity(batches[0], opts)
        return [self.program(opts, capacity).lower(self.params, self.expert_slots, batch)]

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        shape_key, capacity = self._capacity(batches[0], opts)
        rows = self.rows_per_device(batches[0])
        retried = False
        while True:
            readout, stats = self.program(opts, capacity)(self.params, self.expert_slots,
                                                          batch)
            stats = np.asarray(fetch_global(stats))              # [G, NUM_STATS]; syncs
            if not stats[:, STAT_OVERFLOW].any():
                break
            if capacity >= rows:
                raise AssertionError("sync_ep: overflow at full capacity (a bug)")
            self.overflow_retries += 1
            retried = True
            capacity = grown_capacity(capacity, int(stats[:, STAT_PEAK].max()), rows)
        self._capacity_for_shape[shape_key] = capacity
        self.last_stats = EPStepStats(activated_per_device=stats[:, STAT_ACTIVATED],
                                      tokens_per_device=stats[:, STAT_TOKENS],
                                      peak_pair_rows=stats[:, STAT_PEAK], capacity=capacity,
                                      rows_per_device=rows)
        if retried:
            self._warn_overflow(self.last_stats.capacity_factor_needed)
        return unstack_outputs(readout, self.num_ranks)

    def _warn_overflow(self, needed: float) -> None:
        if self._warned:
            return
        self._warned = True
        log.warning("sync_ep: routed rows overflowed the dispatch buffers at capacity_factor "
                    "%.3g; the step was re-run with more capacity (results are exact, the time "
                    "is not). This step needed capacity_factor >= %.3g.",
                    self.capacity_factor, needed)

    def memory_report(self) -> MemoryReport:
        return self._memory

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mesh": dict(self.mesh.shape),
                "expert_slots_per_device": self.layout.slots, "router": self.router,
                "replicas": self.replicas, "capacity_factor": self.capacity_factor,
                "overflow_retries": self.overflow_retries}

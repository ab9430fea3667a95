"""``async_ep``: data-parallel attention with expert weights all-gathered a layer ahead.

G devices on a 1-D mesh ``('dp',)``; each device runs its own packed batch through
``MoEDecoder.score``. The expert weights ``[L, E, d, f]`` are sharded on E (each
device holds E/G experts of every layer), the first layer's experts are kept whole on
every device, and the expert source is ``moejax.dispatch.GatheredAhead``: fetching
layer l's experts (gathered one iteration earlier, carried through the layer loop: a
double buffer) issues the all-gather of layer l+1's shards, which depends on nothing
layer l computes, so the scheduler runs it under layer l's compute (on a GPU
``all-gather-start`` … compute … ``all-gather-done``). No token ever leaves its
device: no all-to-all, no per-layer activation exchange; only weights move.

Experts not divisible by G are padded with zero experts that the router can
never pick (its E columns are unchanged); the gathered layer is cut back to E.

Each rank holds its own prefix KV pool (``prefix_steps``): the pool's token-slot axis is
split over the mesh, so a rank's attention reads and writes its own blocks only, and the
blocks of a rank are numbered from 0 by that rank's block allocator (the engine plans
each rank's sequences on its own allocator, ``moejax.core.scoring_engine``).

A step keeps no state between calls (the placed weights and the compiled programs
only), so one that raises leaves the backend as it was; a step on the pool consumes the
pool (donated), as on every backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax import model as model_lib
from moejax import moe
from moejax.backends import xla_flags
from moejax.attention_kinds import PrefixContext, PrefixPooled
from moejax.backends.base import (RANK_AXIS, MeshBackend, MemoryReport, StepOutput, dense_bytes,
                                  expert_bytes_per_layer, rank_axis, require_devices,
                                  resolve_placement, stack_batches, unstack_outputs,
                                  validated)
from moejax.config import ModelConfig
from moejax.dispatch import GatheredAhead, gather_layer, local_dispatcher
from moejax.distributed import place_local_ranks
from moejax.kv import KVPool
from moejax.model import ForwardOptions, PackedBatch, VocabReadout
from moejax.param_layout import Params, split_experts

AXIS = RANK_AXIS


def pad_experts(experts: Mapping[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Zero experts appended on the E axis (axis 1 of [L, E, ...]) up to a multiple."""
    num_experts = next(iter(experts.values())).shape[1]
    extra = -num_experts % multiple
    if not extra:
        return dict(experts)
    return {k: np.concatenate([v, np.zeros((v.shape[0], extra) + v.shape[2:], v.dtype)], axis=1)
            for k, v in experts.items()}


def local_rank(tree: Any) -> Any:
    """This rank's part of a per-rank tree ([1, ...] leaves inside the shard_map; None
    stays None)."""
    return jax.tree.map(lambda a: a[0], tree)


def gathered_ahead_dispatcher(shards: Mapping[str, jax.Array],
                              first_experts: Mapping[str, jax.Array], cfg: ModelConfig,
                              opts: Any) -> Any:
    """The per-rank expert path of AsyncEP (inside shard_map), scoring's and decode's:
    each layer's experts all-gathered a layer ahead, behind a local transport (no token
    leaves its rank). ``opts``: a ForwardOptions or StepOptions (its expert_impl and
    tile_rows)."""
    source = GatheredAhead(shards=shards, first=first_experts, axis=AXIS,
                           num_experts=cfg.num_experts, num_layers=cfg.num_layers)
    return local_dispatcher(source, cfg.num_experts, opts.expert_impl, opts.tile_rows,
                            activation=moe.expert_activation_of(cfg))


def async_ep_forward(params: Params, shards: Mapping[str, jax.Array],
                     first_experts: Mapping[str, jax.Array], batch: PackedBatch,
                     cfg: ModelConfig, opts: ForwardOptions) -> VocabReadout:
    """Per-device body (inside shard_map). params: replicated, ``layers`` without experts;
    shards: local [L, E/G, ...]; first_experts: layer 0's [E, ...]; batch: this rank's
    (leading axis 1). Returns the rank's readout (a leading axis of 1)."""
    dispatcher = gathered_ahead_dispatcher(shards, first_experts, cfg, opts)
    out = model_lib.decoder(cfg, params, with_experts=False).score(local_rank(batch), opts,
                                                                  dispatcher=dispatcher)
    return rank_axis(out.readout)


def async_ep_pooled(params: Params, shards: Mapping[str, jax.Array],
                    first_experts: Mapping[str, jax.Array], batch: PackedBatch,
                    context: PrefixContext, pool: KVPool, cfg: ModelConfig,
                    opts: ForwardOptions) -> tuple[VocabReadout, KVPool]:
    """:func:`async_ep_forward` on this rank's part of the prefix pool (``pool``: the
    rank's blocks [L, S/G, ...]; ``context``: this rank's, in its own slots) -> (readout,
    the rank's pool)."""
    batch, context = local_rank(batch), local_rank(context)
    attn = PrefixPooled.of(batch.positions, batch.segment_ids, opts.attn_block, context,
                           pool.keys, pool.values, defer_writes=True)
    dispatcher = gathered_ahead_dispatcher(shards, first_experts, cfg, opts)
    out = model_lib.decoder(cfg, params, with_experts=False).score(
        batch, opts, attn=attn, dispatcher=dispatcher)
    keys, values = out.attn.written()
    return rank_axis(out.readout), dataclasses.replace(pool, keys=keys, values=values)


@dataclasses.dataclass(frozen=True)
class AsyncEPPlacement:
    """The weights of ``async_ep`` on the mesh ``('dp',)`` of ``devices``: the dense
    weights and layer 0's experts replicated, every layer's experts sharded on E (padded
    to a multiple of G). Built once (:meth:`place`); the async_ep scoring backend and
    decode runner (``moejax.decode.async_ep``) both run on it."""

    cfg: ModelConfig
    dtype: Any
    devices: tuple[jax.Device, ...]
    mesh: Mesh
    params: Params                      # replicated, ``layers`` without experts
    shards: dict[str, jax.Array]        # [L, E_padded, ...] sharded on E
    first_experts: dict[str, jax.Array]  # layer 0's [E, ...], replicated
    memory: MemoryReport

    @classmethod
    def place(cls, cfg: ModelConfig, params: Params, dtype: Any,
              devices: Sequence[jax.Device]) -> "AsyncEPPlacement":
        """``params`` validated, cast to ``dtype`` and placed on ``devices``."""
        dtype = jnp.dtype(dtype)
        mesh = Mesh(np.array(devices), (AXIS,))
        host = validated(params, cfg, dtype)
        dense_layers, experts = split_experts(host["layers"])
        sharded = pad_experts(experts, len(devices))
        replicated = NamedSharding(mesh, P())
        dense = jax.device_put({**{k: v for k, v in host.items() if k != "layers"},
                                "layers": dense_layers}, replicated)
        shards = jax.device_put(sharded, NamedSharding(mesh, P(None, AXIS)))
        first = jax.device_put({k: v[0] for k, v in experts.items()}, replicated)
        per_layer = expert_bytes_per_layer(host)
        padded_layer = per_layer * sharded["w_gate"].shape[1] // cfg.num_experts
        shard_bytes = padded_layer * cfg.num_layers // len(devices)
        memory = MemoryReport(
            dense_weight_bytes=dense_bytes(host),
            expert_weight_bytes=shard_bytes + 3 * per_layer,
            expert_bytes_all_layers=per_layer * cfg.num_layers,
            detail={"shards": shard_bytes, "first_layer": per_layer,
                    "gathered_current": per_layer, "gathered_next": per_layer})
        return cls(cfg, dtype, tuple(devices), mesh, dense, shards, first, memory)

    @classmethod
    def resolve(cls, name: str, cfg: ModelConfig, params: Params | None, dtype: Any,
                devices: int, placement: "AsyncEPPlacement | None",
                device_pool: Sequence[jax.Device] | None = None) -> "AsyncEPPlacement":
        """``placement`` as it is, or ``params`` placed now on the first ``devices``
        devices (of ``device_pool``, when given)."""
        return resolve_placement(
            name, cfg, params, placement,
            lambda: cls.place(cfg, params, dtype, require_devices(name, devices, device_pool)))


class AsyncEPBackend(MeshBackend):
    """Expert weights sharded on E over G devices, gathered a layer ahead."""

    name = "async_ep"
    serves_expert_bias = True     # biases in the expert shards; activation passed
    holds_prefix_pool = True      # one pool per rank (the module docstring)
    overlapped_collectives = ("all-gather",)   # layer l+1's shards, under layer l

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.float32,
                 devices: int = 1, device_pool: Sequence[jax.Device] | None = None):
        super().__init__(cfg, dtype=dtype)
        xla_flags.warn_if_overlap_flags_missing(self.name)
        # The first ``devices`` of ``device_pool`` (default: of the platform's devices).
        placement = AsyncEPPlacement.place(cfg, params, self.dtype,
                                           require_devices(self.name, devices, device_pool))
        self.placement = placement
        self._devices = placement.devices
        self.mesh = placement.mesh
        self.params = placement.params
        self.shards = placement.shards
        self.first_experts = placement.first_experts
        self._batch_sharding = NamedSharding(self.mesh, P(AXIS))
        self._compiled: dict[Any, Any] = {}
        self._memory = placement.memory

    def forward_fn(self, opts: ForwardOptions):
        """The jitted shard_map'd forward for one set of static options."""
        key = opts
        if key not in self._compiled:
            body = jax.shard_map(
                lambda params, shards, first, batch: async_ep_forward(
                    params, shards, first, batch, self.cfg, opts),
                mesh=self.mesh,
                in_specs=(P(), P(None, AXIS), P(), P(AXIS)),
                out_specs=P(AXIS), check_vma=False)
            self._compiled[key] = jax.jit(body)
        return self._compiled[key]

    def pooled_fn(self, opts: ForwardOptions):
        """The jitted shard_map'd forward on the prefix pool (donated), built once."""
        key = ("pooled", opts)
        if key not in self._compiled:
            body = jax.shard_map(
                lambda params, shards, first, batch, context, pool: async_ep_pooled(
                    params, shards, first, batch, context, pool, self.cfg, opts),
                mesh=self.mesh,
                in_specs=(P(), P(None, AXIS), P(), P(AXIS), P(AXIS), P(None, AXIS)),
                out_specs=(P(AXIS), P(None, AXIS)), check_vma=False)
            self._compiled[key] = jax.jit(body, donate_argnums=(5,))
        return self._compiled[key]

    @property
    def kv_placement(self) -> Any:
        """The pool's token slots split over the ranks: each rank holds its own blocks."""
        return NamedSharding(self.mesh, P(None, AXIS))

    def prefix_steps(self, batches: Sequence[PackedBatch], contexts: Sequence[PrefixContext],
                     pool: KVPool, opts: ForwardOptions) -> tuple[list[StepOutput], KVPool]:
        self._check_step(batches)
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        context = place_local_ranks(stack_batches(contexts), self._batch_sharding)
        readout, pool = self.pooled_fn(opts)(
            self.params, self.shards, self.first_experts, batch, context, pool)
        return unstack_outputs(readout, self.num_ranks), pool

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        readout = self.forward_fn(opts)(self.params, self.shards, self.first_experts, batch)
        return unstack_outputs(readout, self.num_ranks)

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        """The lowered step (tests read its compiled HLO for the all-gather overlap)."""
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        return [self.forward_fn(opts).lower(
            self.params, self.shards, self.first_experts, batch)]

    def memory_report(self) -> MemoryReport:
        return self._memory

    def time_expert_transfer(self, repeats: int) -> tuple[str, float]:
        """The all-gather of one layer's shards, alone."""
        from moejax.calibrate import median_seconds

        layer = min(1, self.cfg.num_layers - 1)
        gather = jax.jit(jax.shard_map(
            lambda shards: gather_layer(shards, layer, AXIS, self.cfg.num_experts),
            mesh=self.mesh, in_specs=(P(None, AXIS),), out_specs=P(), check_vma=False))
        return "all_gather", median_seconds(
            lambda: jax.block_until_ready(gather(self.shards)), repeats)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mesh": dict(self.mesh.shape)}

"""``tp``: tensor parallelism for attention and experts (the paper's TP+TP baseline).

Layout over a 1-D mesh of G devices, axis ``"tp"`` (every device runs the same,
replicated packed batch; ``num_ranks`` is 1):

* attention, sharded by head: wq [L, d, n_q·h] and wk / wv [L, d, n_kv·h] on their
  output columns (device g holds query heads [g·n_q/G, (g+1)·n_q/G) and kv heads
  [g·n_kv/G, (g+1)·n_kv/G)), wo [L, n_q·h, d] on its rows. Contiguous head shards keep
  the GQA grouping (query head j reads kv head j // (n_q/n_kv)) local to each device,
  so the model's own stages run on each shard with a local config of n_q/G and n_kv/G
  heads. Each device's output projection is a partial sum over its heads:
  **all-reduce #1** (``psum``) before the residual add.
* experts, sharded on the intermediate axis f: w_gate / w_up [L, E, d, f] on f,
  w_down [L, E, f, d] on its f rows. The router is replicated, so every device routes
  identically and runs its f/G slice of every routed expert; SwiGLU is elementwise in
  f, so the down projections are partial sums: **all-reduce #2** before the residual.
  If G does not divide f, f is padded with zero columns (gate, up) and zero rows (down)
  up to a multiple of G; a zero column gives silu(0)·0 = 0 in the hidden state and a
  zero row of w_down adds nothing, so the padding is exact.
* norms, q/k norms, embeddings, routers, final norm and LM head: replicated.

Two all-reduces of [T, d] per layer (the last layer: of [P, d] when it runs at the
scoring rows only). The forward is one ``jax.jit`` around a ``jax.shard_map`` whose
body is the model's own scoring forward (``MoEDecoder.score``) on a module merged from
the local shards with the local config: the layer is told its attention output is a
partial sum (``psum_axis``), and its dispatcher keeps tokens local and all-reduces the
combined MoE output (``moejax.dispatch.LocalTokens`` with ``psum_axis``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moejax import model
from moejax.backends.base import (Backend, BackendError, MemoryReport, StepOutput, nbytes,
                                  require_devices, validated)
from moejax.config import ModelConfig
from moejax.dispatch import StackedExperts, local_dispatcher
from moejax.model import ForwardOptions, PackedBatch
from moejax.param_layout import EXPERT_KEYS, Params

AXIS = "tp"

# Stacked layer params -> the axis sharded over "tp" (others are replicated).
SHARDED_AXIS = {"wq": 2, "wk": 2, "wv": 2, "wo": 1, "w_gate": 3, "w_up": 3, "w_down": 2,
                "bq": 1, "bk": 1, "bv": 1}


def check_family(cfg: ModelConfig, name: str = "tp") -> None:
    """BackendError for the attention variants a head-sharded layer cannot compute
    locally. (Shared experts and dense layers' MLPs are replicated: each device runs them
    whole after the all-reduce.)"""
    if cfg.mla is not None:
        raise BackendError(f"backend {name!r} does not serve {cfg.model_type}: multi-head "
                           f"latent attention shares one latent over every head, which "
                           f"{name!r} does not shard; use resident, offload, async_ep or "
                           f"sync_ep")
    if cfg.qk_norm and cfg.qk_norm_over_heads:
        raise BackendError(f"backend {name!r} does not serve {cfg.model_type}: its q/k norm "
                           "spans every head, so a device holding some heads cannot compute "
                           "it; use resident, offload, async_ep or sync_ep")


# ------------------------------------------------------------------ layout
def check_heads(cfg: ModelConfig, shards: int, name: str = "tp") -> None:
    """BackendError unless ``shards`` divides both head counts (heads are not split)."""
    if cfg.num_kv_heads % shards or cfg.num_heads % shards:
        usable = [g for g in range(1, cfg.num_kv_heads + 1)
                  if cfg.num_kv_heads % g == 0 and cfg.num_heads % g == 0]
        raise BackendError(
            f"backend {name!r} shards attention by head: num_heads={cfg.num_heads} and "
            f"num_kv_heads={cfg.num_kv_heads} must both be divisible by devices={shards}; "
            f"use fewer devices, a count dividing both (one of {usable})")


def head_split_mesh(name: str, cfg: ModelConfig, devices: int,
                    device_pool: Sequence[jax.Device] | None) -> tuple[tuple[jax.Device, ...],
                                                                       Mesh]:
    """The devices and the ``("tp",)`` mesh of a backend that splits attention heads
    over them (``tp``, ``tp_ep``): the first ``devices`` of ``device_pool``, the family
    and the head counts checked for the split."""
    chosen = require_devices(name, devices, device_pool)
    check_family(cfg, name)
    check_heads(cfg, len(chosen), name)
    return chosen, Mesh(np.array(chosen), (AXIS,))


def padded_intermediate(f: int, shards: int) -> int:
    """f rounded up to a multiple of ``shards``."""
    return -(-f // shards) * shards


def pad_experts(params: Params, f_padded: int) -> Params:
    """Host params with the expert intermediate axis zero-padded to ``f_padded`` (exact:
    the extra hidden units are silu(0)·0 = 0 and their w_down rows are 0)."""
    layers = dict(params["layers"])
    f = layers["w_gate"].shape[3]
    if f_padded == f:
        return params
    extra = f_padded - f
    for name in ("w_gate", "w_up"):   # [L, E, d, f]: zero columns
        layers[name] = np.pad(layers[name], [(0, 0), (0, 0), (0, 0), (0, extra)])
    layers["w_down"] = np.pad(layers["w_down"], [(0, 0), (0, 0), (0, extra), (0, 0)])
    return {**params, "layers": layers}


def layer_spec(name: str, ndim: int) -> P:
    """PartitionSpec of one stacked layer param: ``"tp"`` on its sharded axis, if any."""
    if name not in SHARDED_AXIS:
        return P()
    axes: list[str | None] = [None] * ndim
    axes[SHARDED_AXIS[name]] = AXIS
    return P(*axes)


def param_specs(params: Params) -> dict[str, Any]:
    """The PartitionSpec pytree matching ``params`` (everything but layers replicated)."""
    specs: dict[str, Any] = {name: P() for name in params if name != "layers"}
    specs["layers"] = {name: layer_spec(name, np.ndim(a)) for name, a in params["layers"].items()}
    return specs


def shardings(mesh: Mesh, specs: Mapping[str, Any]) -> dict[str, Any]:
    """NamedShardings of ``specs`` (built explicitly: a PartitionSpec is not a pytree node)."""
    out: dict[str, Any] = {name: NamedSharding(mesh, s) for name, s in specs.items()
                           if name != "layers"}
    out["layers"] = {name: NamedSharding(mesh, s) for name, s in specs["layers"].items()}
    return out


def bytes_per_device(layers: Mapping[str, np.ndarray], names: Sequence[str], shards: int) -> int:
    """Bytes of the named stacked params on one device (sharded ones hold 1/shards)."""
    total = 0
    for name in names:
        a = layers[name]
        size = int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
        total += size // shards if name in SHARDED_AXIS else size
    return total


def local_config(cfg: ModelConfig, shards: int, f_padded: int) -> ModelConfig:
    """The config one device's shard looks like (n_q/G, n_kv/G heads, f/G intermediate)."""
    return dataclasses.replace(cfg, num_heads=cfg.num_heads // shards,
                               num_kv_heads=cfg.num_kv_heads // shards,
                               moe_intermediate_size=f_padded // shards)


def memory_per_device(host: Params, unpadded_expert_bytes: int, shards: int) -> MemoryReport:
    """Weight bytes on each device of the padded ``host`` params once sharded.

    ``expert_bytes_all_layers`` is the unpadded model's (what ``resident`` holds);
    detail: ``shards`` = that / G, ``padding`` = the zero columns' share on top.
    """
    layers = host["layers"]
    experts = bytes_per_device(layers, EXPERT_KEYS, shards)
    dense_layer_names = [k for k in layers if k not in EXPERT_KEYS]
    replicated = nbytes({k: v for k, v in host.items() if k != "layers"})
    shard = unpadded_expert_bytes // shards
    return MemoryReport(
        dense_weight_bytes=replicated + bytes_per_device(layers, dense_layer_names, shards),
        expert_weight_bytes=experts, expert_bytes_all_layers=unpadded_expert_bytes,
        detail={"shards": shard, "padding": experts - shard})


# ------------------------------------------------------------------ per-device forward
def tp_local_forward(params: Params, batch: PackedBatch, *, cfg: ModelConfig,
                     opts: ForwardOptions) -> tuple[jax.Array, jax.Array | None]:
    """One device's forward (inside the shard_map): ``MoEDecoder.score`` over the local
    shards. ``params``: the local shards; ``cfg``: the local config (n_q/G and n_kv/G
    heads, f/G intermediate), which the shards' shapes match, so the module merges from
    them. Attention outputs and the combined MoE outputs are partial sums, all-reduced
    over ``AXIS`` (the layer's ``psum_axis``, the transport's); the outputs are replicated."""
    module = model.decoder(cfg, params)
    dispatcher = local_dispatcher(StackedExperts(module.layers.experts()), cfg.num_experts,
                                  opts.expert_impl, opts.tile_rows, psum_axis=AXIS)
    out = module.score(batch, opts, dispatcher=dispatcher, psum_axis=AXIS)
    return out.readout


def tp_forward(params: Params, batch: PackedBatch, *, cfg: ModelConfig, mesh: Mesh,
               specs: Mapping[str, Any], opts: ForwardOptions
               ) -> tuple[jax.Array, jax.Array | None]:
    """The sharded forward: params placed by ``specs``, batch and outputs replicated."""
    body = functools.partial(tp_local_forward, cfg=cfg, opts=opts)
    # check_vma=False: the outputs are replicated by construction (psum'd activations),
    # which the varying-manual-axes check cannot see through the fori_loop.
    sharded = jax.shard_map(body, mesh=mesh, in_specs=(specs, P()), out_specs=P(),
                            check_vma=False)
    return sharded(params, batch)


# ------------------------------------------------------------------ backend
class TPBackend(Backend):
    """Attention heads and expert intermediate columns sharded over G devices; two
    all-reduces per layer; one jitted forward per batch shape."""

    name = "tp"
    no_prefix_pool_reason = ("its attention heads are split over the devices and its "
                             "forward has no pooled attention kind (one pool per head "
                             "shard is not built)")

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.float32,
                 devices: int = 1, device_pool: Sequence[jax.Device] | None = None):
        super().__init__(cfg, dtype=dtype)
        self._devices, self.mesh = head_split_mesh(self.name, cfg, devices, device_pool)
        shards = len(self._devices)
        self.f_padded = padded_intermediate(cfg.moe_intermediate_size, shards)
        self.local_cfg = local_config(cfg, shards, self.f_padded)

        host = validated(params, cfg, self.dtype)
        unpadded_expert_bytes = nbytes({k: host["layers"][k] for k in EXPERT_KEYS})
        host = pad_experts(host, self.f_padded)
        self._memory = memory_per_device(host, unpadded_expert_bytes, shards)
        self.specs = param_specs(host)
        self.params = jax.device_put(host, shardings(self.mesh, self.specs))
        self._batch_sharding = NamedSharding(self.mesh, P())
        self._forward = jax.jit(functools.partial(tp_forward, cfg=self.local_cfg, mesh=self.mesh,
                                                  specs=self.specs),
                                static_argnames=("opts",))

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        batch = jax.device_put(batches[0], self._batch_sharding)   # every device: the whole batch
        return [self._forward(self.params, batch, opts=opts)]

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        batch = jax.device_put(batches[0], self._batch_sharding)
        return [self._forward.lower(self.params, batch, opts=opts)]

    def memory_report(self) -> MemoryReport:
        return self._memory

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mesh": {AXIS: len(self._devices)},
                "expert_intermediate_padded": self.f_padded}

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
scoring rows only). The forward is one ``jax.jit`` around a ``jax.shard_map``; the
last layer and the LM head follow ``model.finish_scoring`` exactly.
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

from moejax import attention, model, moe
from moejax.backends.base import (Backend, BackendError, MemoryReport, StepOutput, nbytes,
                                  require_devices, validated)
from moejax.config import ModelConfig
from moejax.model import ForwardOptions, PackedBatch
from moejax.param_layout import EXPERT_KEYS, Params

AXIS = "tp"

# Stacked layer params -> the axis sharded over "tp" (others are replicated).
SHARDED_AXIS = {"wq": 2, "wk": 2, "wv": 2, "wo": 1, "w_gate": 3, "w_up": 3, "w_down": 2}


# ------------------------------------------------------------------ layout
def check_heads(cfg: ModelConfig, shards: int) -> None:
    """BackendError unless ``shards`` divides both head counts (heads are not split)."""
    if cfg.num_kv_heads % shards or cfg.num_heads % shards:
        usable = [g for g in range(1, cfg.num_kv_heads + 1)
                  if cfg.num_kv_heads % g == 0 and cfg.num_heads % g == 0]
        raise BackendError(
            f"backend 'tp' shards attention by head: num_heads={cfg.num_heads} and "
            f"num_kv_heads={cfg.num_kv_heads} must both be divisible by devices={shards}; "
            f"use fewer devices, a count dividing both (one of {usable})")


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


# ------------------------------------------------------------------ per-device stages
def tp_attention_residual(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                          bias: jax.Array | None, cfg: ModelConfig,
                          opts: ForwardOptions) -> jax.Array:
    """x [T, d] + attention over this device's heads, all-reduced -> [T, d]."""
    h_in = model.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    partial = model.attention_block(p, h_in, batch, bias, cfg, opts)   # sum over local heads
    return x + jax.lax.psum(partial, AXIS)


def tp_moe_residual(p: Mapping[str, jax.Array], x: jax.Array, valid: jax.Array | None,
                    cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """x [n, d] + MoE(RMSNorm(x)) with this device's f/G slice of every expert, all-reduced.

    The combine is linear, so summing the per-device combined [n, d] outputs equals
    combining the summed expert outputs, and moves k times less data.
    """
    moe_in = model.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    partial = moe.moe_block(moe_in, p["router"], p["w_gate"], p["w_up"], p["w_down"],
                            k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                            valid=valid, impl=opts.expert_impl, tile_rows=opts.tile_rows)
    return x + jax.lax.psum(partial, AXIS)


def tp_decoder_layer(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                     bias: jax.Array | None, cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """``model.decoder_layer`` on one device's shards (``cfg``: the local config) -> [T, d]."""
    x = tp_attention_residual(p, x, batch, bias, cfg, opts)
    return tp_moe_residual(p, x, batch.segment_ids >= 0, cfg, opts)


def tp_decoder_layer_at_rows(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                             rows: jax.Array, cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """``model.decoder_layer_at_rows`` on one device's shards: x [T, d] -> [P, d] at ``rows``.

    Keys and values of the local kv heads come from every token; queries, attention, the
    output projection and the MoE run at the scoring rows alone.
    """
    h_in = model.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    k, v = model.project_kv(p, h_in, batch.positions, cfg)
    q = model.project_q(p, jnp.take(h_in, rows, axis=0), jnp.take(batch.positions, rows), cfg)
    out = attention.attention_at_rows(q, k, v, batch.segment_ids, rows, opts.attn_block)
    partial = out.reshape(rows.shape[0], -1) @ p["wo"].astype(x.dtype)
    x_rows = jnp.take(x, rows, axis=0) + jax.lax.psum(partial, AXIS)
    return tp_moe_residual(p, x_rows, None, cfg, opts)


def tp_layer_step(i: jax.Array, x: jax.Array, *, layers: Mapping[str, jax.Array],
                  batch: PackedBatch, bias: jax.Array | None, cfg: ModelConfig,
                  opts: ForwardOptions) -> jax.Array:
    """fori_loop body: layer ``i`` of the stacked local shards on x [T, d]."""
    return tp_decoder_layer(model.layer_slice(layers, i), x, batch, bias, cfg, opts)


def tp_local_forward(params: Params, batch: PackedBatch, *, cfg: ModelConfig,
                     opts: ForwardOptions) -> tuple[jax.Array, jax.Array | None]:
    """One device's forward (inside the shard_map): ``model.forward`` with TP layers.
    ``params``: the local shards; ``cfg``: the local config; outputs are replicated."""
    bias = attention.attention_bias(batch.segment_ids, opts.attn_block)
    last = cfg.num_layers - 1
    step = functools.partial(tp_layer_step, layers=params["layers"], batch=batch, bias=bias,
                             cfg=cfg, opts=opts)
    x = jax.lax.fori_loop(0, last, step, model.embed_tokens(params, batch))
    return model.finish_scoring(params, model.layer_slice(params["layers"], last), x, batch,
                                bias, cfg, opts, layer_fn=tp_decoder_layer,
                                layer_at_rows_fn=tp_decoder_layer_at_rows)


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

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.float32,
                 devices: int = 1):
        super().__init__(cfg, dtype=dtype)
        self._devices = require_devices(self.name, devices)
        shards = len(self._devices)
        check_heads(cfg, shards)
        self.mesh = Mesh(np.array(self._devices), (AXIS,))
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

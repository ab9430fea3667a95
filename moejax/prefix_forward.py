"""The packed forward over sequences that continue cached prefixes (the prefix KV pool).

A prefix pool holds the keys and values of whole 16-token blocks of earlier prefixes,
per layer: ``pool_k``, ``pool_v`` [L, S, n_kv, h] with S = blocks · block_size token
slots. A batch that uses it carries a :class:`PrefixContext`:

* every attention block lists the pool slots its segments continue from
  (``ctx_slot`` [nb, Cp]), each slot once, and the range of the block's segments that
  read it (``ctx_lo`` ≤ segment ≤ ``ctx_hi``; lo > hi: unused), so siblings of one
  prefix share its entries; a query attends to its own segment's context entries, then
  causally to its own rows (``attention.context_attention``); positions continue after
  the prefix;
* rows whose keys and values are to be kept (``store_row`` [W]) are written, layer by
  layer, to their pool slots (``store_slot`` [W]; slot S = nothing, dropped).

Everything else — stages, experts, the last layer at the scoring rows, the LM head —
is the model's own; with an empty context and no stores the result equals
``model.forward``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import jax
import jax.numpy as jnp

from moejax import attention
from moejax import model as model_lib
from moejax.config import ModelConfig
from moejax.model import ForwardOptions, PackedBatch


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixContext:
    """ctx_slot, ctx_lo, ctx_hi: [nb, Cp] int32; store_row, store_slot: [W] int32."""

    ctx_slot: jax.Array
    ctx_lo: jax.Array
    ctx_hi: jax.Array
    store_row: jax.Array
    store_slot: jax.Array


def _layer_kv(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch, cfg: ModelConfig):
    h_in = model_lib.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    k, v = model_lib.project_kv(p, h_in, batch.positions, cfg)
    return h_in, k, v


def _context(pool: jax.Array, layer, ctx: PrefixContext) -> jax.Array:
    """[nb, Cp, n_kv, h] context entries of one layer, gathered from the pool directly
    (slicing the layer out first would copy the whole layer's pool)."""
    return pool[layer, ctx.ctx_slot]


def _store(pool: jax.Array, layer, rows_kv: jax.Array, ctx: PrefixContext) -> jax.Array:
    """Scatter the stored rows' [W, n_kv, h] into the pool's layer ``layer`` (in place:
    the pool is donated), O(W) rather than O(pool)."""
    return pool.at[layer, ctx.store_slot].set(rows_kv[ctx.store_row], mode="drop")


def has_context(ctx: PrefixContext) -> bool:
    """Does any block read the pool? (Static: a batch that only stores has width 0 and
    keeps the model's own tiled attention.)"""
    return ctx.ctx_slot.shape[1] > 0


def context_layer(p: Mapping[str, jax.Array], layer, x: jax.Array, batch: PackedBatch,
                  ctx: PrefixContext, pool_k: jax.Array, pool_v: jax.Array, cfg: ModelConfig,
                  opts: ForwardOptions, bias: jax.Array | None = None):
    """One decoder layer over the whole batch with its prefix context -> (x, pool_k, pool_v)."""
    h_in, k, v = _layer_kv(p, x, batch, cfg)
    q = model_lib.project_q(p, h_in, batch.positions, cfg)
    if has_context(ctx):
        out = attention.context_attention(q, k, v, batch.segment_ids, opts.attn_block,
                                          _context(pool_k, layer, ctx),
                                          _context(pool_v, layer, ctx), ctx.ctx_lo,
                                          ctx.ctx_hi)
    else:
        out = attention.packed_attention(q, k, v, batch.segment_ids, opts.attn_block, bias)
    x = x + out.reshape(x.shape[0], -1) @ p["wo"].astype(x.dtype)
    x = model_lib.moe_residual(p, x, batch.segment_ids >= 0, cfg, opts)
    return x, _store(pool_k, layer, k, ctx), _store(pool_v, layer, v, ctx)


def context_layer_at_rows(p: Mapping[str, jax.Array], layer, x: jax.Array, batch: PackedBatch,
                          ctx: PrefixContext, pool_k: jax.Array, pool_v: jax.Array,
                          cfg: ModelConfig, opts: ForwardOptions):
    """The last layer at the scoring rows only (keys/values of every row are still
    computed and stored) -> (x at rows [P, d], pool_k, pool_v)."""
    rows = batch.score_positions
    h_in, k, v = _layer_kv(p, x, batch, cfg)
    q = model_lib.project_q(p, jnp.take(h_in, rows, axis=0), jnp.take(batch.positions, rows), cfg)
    if has_context(ctx):
        out = attention.context_attention_at_rows(q, k, v, batch.segment_ids, rows,
                                                  opts.attn_block, _context(pool_k, layer, ctx),
                                                  _context(pool_v, layer, ctx), ctx.ctx_lo,
                                                  ctx.ctx_hi)
    else:
        out = attention.attention_at_rows(q, k, v, batch.segment_ids, rows, opts.attn_block)
    x_rows = jnp.take(x, rows, axis=0) + out.reshape(rows.shape[0], -1) @ p["wo"].astype(x.dtype)
    x_rows = model_lib.moe_residual(p, x_rows, None, cfg, opts)
    return x_rows, _store(pool_k, layer, k, ctx), _store(pool_v, layer, v, ctx)


def prefix_forward(params, batch: PackedBatch, ctx: PrefixContext, pool_k: jax.Array,
                   pool_v: jax.Array, cfg: ModelConfig, opts: ForwardOptions):
    """``model.forward`` with a prefix context
    -> (logits [P, C], lse [P] | None, pool_k, pool_v)."""
    layers = params["layers"]
    last = cfg.num_layers - 1
    bias = None if has_context(ctx) else attention.attention_bias(batch.segment_ids,
                                                                   opts.attn_block)

    def body(i, carry):
        x, pk, pv = carry
        return context_layer(model_lib.layer_slice(layers, i), i, x, batch, ctx, pk, pv, cfg,
                             opts, bias)

    x = model_lib.embed_tokens(params, batch)
    x, pool_k, pool_v = jax.lax.fori_loop(0, last, body, (x, pool_k, pool_v))
    p_last = model_lib.layer_slice(layers, last)
    if model_lib.last_layer_at_rows_only(batch):
        x_rows, pool_k, pool_v = context_layer_at_rows(p_last, last, x, batch, ctx, pool_k,
                                                       pool_v, cfg, opts)
    else:
        x, pool_k, pool_v = context_layer(p_last, last, x, batch, ctx, pool_k, pool_v, cfg, opts,
                                          bias)
        x_rows = jnp.take(x, batch.score_positions, axis=0)
    final = model_lib.rms_norm(x_rows, params["final_norm"], cfg.rms_norm_eps)
    logits, lse = model_lib.lm_head_scores(params, final, batch.score_token_ids, cfg,
                                           opts.full_vocab)
    return logits, lse, pool_k, pool_v


def empty_pool(cfg: ModelConfig, num_blocks: int, block_size: int,
               dtype) -> tuple[jax.Array, jax.Array]:
    """Zeroed pool_k, pool_v [L, num_blocks · block_size, n_kv, h]."""
    shape = (cfg.num_layers, num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

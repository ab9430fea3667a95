"""Attention over block tables of the one KV pool (:class:`moejax.kv.KVPool`).

The pool is one set of token slots per layer, ``keys``/``values`` [L, S, n_kv, h] with
S = blocks × :data:`BLOCK_SIZE` (16, the prefix cache's block and hash-chain size). A
sequence owns a *block table*: its token at position p lives in slot
``table[p // 16] * 16 + p % 16``. The host owns the tables and the free list
(:class:`moejax.kv.BlockAllocator`); the device only reads and writes slots.

A step runs B rows of C tokens each (C = 1 for decode, a fixed row width for prefill;
a long prompt chunk spans several consecutive rows of one *segment*). A row's tokens
have their own positions; every position below ``context_len[b]`` is already in the
pool. The step *reads* the pool and keeps its own new keys/values apart (the
:class:`PagedRows` carry, [L, B·C, n_kv, h]); the host writes them into the pool
afterwards (:func:`moejax.kv.write_rows`, one scatter in place). A layer loop that both read and
wrote the pool would make XLA copy the whole pool per layer; reading only, it copies
nothing.

Attention of a query: its row's pool slots below ``context_len[b]``, read a chunk at a
time up to the step's longest context (:func:`paged_attention`), and the step's new
keys of the same segment at positions up to its own — one softmax over both, in
float32, grouped-query as in :mod:`moejax.attention`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moejax.attention import SoftmaxState, Window, clamp_window, in_window
from moejax.config import ModelConfig
from moejax.kv.pool import KVPool
from moejax.layers import LayerParams, attention_options, expand_kv, project_kv, project_q
from moejax.prefix_hash import BLOCK_SIZE

_STATIC = {"static": True}


def paged_attention(q: Float[Array, "B C n_q h"], pool_keys: Float[Array, "L S s hk"],
                    pool_values: Float[Array, "L S s hpv"], layer: Int[Array, ""],
                    block_tables: Int[Array, "B MB"], context_len: Int[Array, "B"],
                    new_keys: Float[Array, "T n_kv h"], new_values: Float[Array, "T n_kv hv"],
                    segments: Int[Array, "B"], positions: Int[Array, "B C"],
                    new_valid: Bool[Array, "T"], chunk_blocks: int, *,
                    sinks: Float[Array, "n_q"] | None = None,
                    window: Window | None = None,
                    expand: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
                    | None = None) -> Float[Array, "B C n_q hv"]:
    """Attention of each row's C queries (at ``positions``) over its pooled context and
    the step's new keys, one softmax over both, in float32, grouped-query.

    * Pooled context: positions below ``context_len[b]`` through row b's block table, at
      layer ``layer``; read ``chunk_blocks`` whole blocks at a time (a block's keys are
      contiguous: one gather of 16 slots each) in a loop that stops at the step's longest
      context (a dynamic trip count: one compiled program serves every context length,
      and a step pays for the context it has, not for the table's width).
    * New keys (T = B·C, row-major): those of rows in the same ``segments`` (one sequence
      may span several consecutive rows of a prefill step), at a position <= the
      query's, valid; read one row offset at a time (:func:`_attend_new_rows`).

    Values may have their own head dim hv (keys and queries h; scale 1/sqrt(h)).
    ``sinks`` [n_q]: one logit per query head in the softmax's denominator (the running
    softmax starts from it: peak = sink, total = 1, acc = 0). ``window``: a key at
    position p_k (a pooled slot's position is its index in the row's table order) is
    visible to a query at p_q only if ``p_q - p_k < window``; the context loop then starts
    at the first chunk the earliest valid query's window reaches (as :mod:`moejax.attention`).
    ``expand``: the pool holds a stored form (MLA's latents) that ``expand(keys, values)``
    turns into attention keys/values, chunk by chunk; ``new_keys``/``new_values`` come
    expanded already.
    """
    b, c, n_q, h = q.shape
    n_kv = new_keys.shape[1]
    hv = new_values.shape[-1]
    groups = n_q // n_kv
    queries = q.reshape(b, c, n_kv, groups, h) * (1.0 / math.sqrt(h))
    chunk_slots = chunk_blocks * BLOCK_SIZE
    slot_offsets = jnp.arange(chunk_slots)
    # [L, blocks, 16, n_kv, h]: a view (no copy) whose rows are whole blocks.
    block_keys = pool_keys.reshape(pool_keys.shape[0], -1, BLOCK_SIZE, *pool_keys.shape[2:])
    block_values = pool_values.reshape(*block_keys.shape[:-1], pool_values.shape[-1])
    if window is not None:
        window = clamp_window(window)

    def pooled_chunk(i, state: SoftmaxState) -> SoftmaxState:
        start = i * chunk_slots
        blocks = jax.lax.dynamic_slice_in_dim(block_tables, i * chunk_blocks, chunk_blocks,
                                              axis=1)
        keys = block_keys[layer, blocks].reshape(b, chunk_slots, *pool_keys.shape[2:])
        values = block_values[layer, blocks].reshape(b, chunk_slots, *pool_values.shape[2:])
        if expand is not None:
            keys, values = expand(keys, values)
        scores = jnp.einsum("bckgh,bwkh->bkgcw", queries, keys,
                            preferred_element_type=jnp.float32)
        visible = (start + slot_offsets)[None, :] < context_len[:, None]       # [B, w]
        if window is None:
            visible = visible[:, None, None, None, :]
        else:
            near = in_window(positions[:, :, None], (start + slot_offsets)[None, None, :],
                             window)                                          # [B, C, w]
            visible = (visible[:, None, :] & near)[:, None, None]
        return state.add(scores, visible,
                         lambda p: jnp.einsum("bkgcw,bwkh->bkgch", p.astype(values.dtype),
                                              values, preferred_element_type=jnp.float32))

    trips = (jnp.max(context_len) + chunk_slots - 1) // chunk_slots
    first = 0
    if window is not None:
        # The earliest slot any valid query's window reaches (rows of padding: none).
        earliest = jnp.min(jnp.where(new_valid.reshape(b, c), positions,
                                     jnp.iinfo(positions.dtype).max)) - window + 1
        first = jnp.maximum(earliest, 0) // chunk_slots
    group_sinks = None if sinks is None else sinks.reshape(n_kv, groups)[None, :, :, None]
    state = jax.lax.fori_loop(first, trips, pooled_chunk,
                              SoftmaxState.empty((b, n_kv, groups, c), hv, group_sinks))
    return _attend_new_rows(state, queries, new_keys.reshape(b, c, n_kv, h),
                            new_values.reshape(b, c, n_kv, hv), segments, positions,
                            new_valid.reshape(b, c), window=window).astype(q.dtype)


def _attend_new_rows(state: SoftmaxState, queries: Float[Array, "B C n_kv g h"],
                     keys: Float[Array, "B C n_kv h"], values: Float[Array, "B C n_kv hv"],
                     segments: Int[Array, "B"], positions: Int[Array, "B C"],
                     valid: Bool[Array, "B C"], *, window: Window | None = None
                     ) -> Float[Array, "B C n_q hv"]:
    """Fold the step's new keys into ``state`` and finish: row b sees rows b, b-1, ...
    of its own segment (a segment's rows are consecutive), one row offset per loop
    iteration, as many as the longest segment has rows. Rows of other segments cost
    nothing: a step of one-row segments (every decode step) makes one iteration.
    ``window``: keys only at positions ``p_k > p_q - window``."""
    b, c, n_kv, groups, h = queries.shape
    hv = values.shape[-1]
    row_ids = jnp.arange(b)
    first_row = jnp.argmax(segments[None, :] == segments[:, None], axis=1)
    span = jnp.max(jnp.where(segments >= 0, row_ids - first_row + 1, 0))

    def row_offset(j, state: SoftmaxState) -> SoftmaxState:
        source = jnp.maximum(row_ids - j, 0)          # the row whose keys row b sees now
        visible = (((row_ids >= j) & (segments[source] == segments))[:, None, None]
                   & (positions[source][:, None, :] <= positions[:, :, None])
                   & valid[source][:, None, :])                                 # [B, Cq, Ck]
        if window is not None:
            visible = visible & in_window(positions[:, :, None], positions[source][:, None, :],
                                          window)
        scores = jnp.einsum("bckgh,bjkh->bkgcj", queries, keys[source],
                            preferred_element_type=jnp.float32)
        return state.add(scores, visible[:, None, None],
                         lambda p: jnp.einsum("bkgcj,bjkh->bkgch",
                                              p.astype(values.dtype), values[source],
                                              preferred_element_type=jnp.float32))

    state = jax.lax.fori_loop(0, span, row_offset, state)
    out = jnp.moveaxis(state.result(), 3, 1)                                   # [B, C, n_kv, g, hv]
    return out.reshape(b, c, n_kv * groups, hv)


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedRows:
    """The attention kind of a paged step: B rows of ``chunk`` tokens, flattened [B·C].

    positions, valid: [B·C]; segments [B]: the sequence of each row (a prefill step may
    give one sequence several consecutive rows); block_tables [B, MB]: each row's block
    table (padded to a multiple of ``chunk_blocks``); context_len [B]: positions already
    in the pool (the same for every row of a sequence); pool_keys/values: the pool (read only); new_keys/new_values
    [L, B·C, n_kv, h]: this step's keys and values, the carry (written to the pool by
    :func:`moejax.kv.write_rows` after the step). ``chunk_blocks``: KV blocks read per iteration of
    the attention's context loop."""

    positions: jax.Array
    valid: jax.Array
    segments: jax.Array
    block_tables: jax.Array
    context_len: jax.Array
    pool_keys: jax.Array
    pool_values: jax.Array
    new_keys: jax.Array
    new_values: jax.Array
    chunk: int = dataclasses.field(metadata=_STATIC)
    chunk_blocks: int = dataclasses.field(metadata=_STATIC)

    @classmethod
    def of(cls, kv: KVPool, positions: Int[Array, "BC"], valid: Bool[Array, "BC"],
           segments: Int[Array, "B"], block_tables: Int[Array, "B MB"],
           context_len: Int[Array, "B"], chunk_blocks: int) -> "PagedRows":
        rows = positions.shape[0]
        # Keys and values may differ in their last dim (MLA: latent and RoPE key).
        key_shape = (kv.keys.shape[0], rows, *kv.keys.shape[2:])
        value_shape = (kv.values.shape[0], rows, *kv.values.shape[2:])
        # The context loop reads whole chunks: pad the table to a multiple of one (the
        # padding lies past every context_len, so it is never visible).
        pad = -block_tables.shape[1] % chunk_blocks
        block_tables = jnp.pad(block_tables, ((0, 0), (0, pad)))
        return cls(positions=positions, valid=valid, segments=segments,
                   block_tables=block_tables, context_len=context_len,
                   pool_keys=kv.keys, pool_values=kv.values,
                   new_keys=jnp.zeros(key_shape, kv.keys.dtype),
                   new_values=jnp.zeros(value_shape, kv.values.dtype),
                   chunk=rows // block_tables.shape[0], chunk_blocks=chunk_blocks)

    def carry(self) -> Any:
        return self.new_keys, self.new_values

    def with_carry(self, carry: Any) -> "PagedRows":
        return dataclasses.replace(self, new_keys=carry[0], new_values=carry[1])

    def valid_rows(self, rows: jax.Array | None) -> jax.Array | None:
        return self.valid if rows is None else None

    def attend(self, p: LayerParams, layer, h_in: Float[Array, "BC d"],
               rows: Int[Array, "r"] | None, cfg: ModelConfig):
        if rows is not None:
            raise ValueError("paged attention runs every row (rows must be None)")
        q = project_q(p, h_in, self.positions, cfg)
        k, v = project_kv(p, h_in, self.positions, cfg)
        attn_k, attn_v = expand_kv(p, k, v, cfg)
        expand = None if cfg.mla is None else functools.partial(expand_kv, p, cfg=cfg)
        batch = self.context_len.shape[0]
        split = lambda a: a.reshape(batch, self.chunk, *a.shape[1:])   # noqa: E731
        # The pool is gathered per chunk inside the attention, from the whole pool:
        # slicing the layer out first would copy it.
        out = paged_attention(split(q), self.pool_keys, self.pool_values, layer,
                              self.block_tables, self.context_len, attn_k, attn_v,
                              self.segments, split(self.positions), self.valid,
                              self.chunk_blocks, expand=expand,
                              **attention_options(p, layer, cfg))
        kind = dataclasses.replace(self, new_keys=self.new_keys.at[layer].set(k),
                                   new_values=self.new_values.at[layer].set(v))
        return out.reshape(q.shape[0], q.shape[1], -1), kind    # value head dim (MLA: v)

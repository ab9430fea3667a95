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
float32, grouped-query as in :mod:`moejax.attention`. The new keys are read a block of
(query row, key row) pairs at a time: each row with itself, then the rows behind it two
row offsets per iteration, compacted so that a long prompt's rows pay about the causal
half of their row pairs (:func:`new_row_trips` iterations).
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
      may span several consecutive rows of a prefill step; a segment is a run of
      consecutive rows of one id, so an id repeated after another is a new sequence, as
      in a rank-major step whose ranks number their segments from 0), at a position <= the
      query's, valid; read B (query row, key row) pairs per iteration, about the causal
      half of a long prompt's row pairs in all (:func:`_attend_new_rows`,
      :func:`new_row_trips`).

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


def _segment_rows(segments: Int[Array, "B"]) -> tuple[Int[Array, "B"], Int[Array, ""]]:
    """Each row's index in its segment and ``span``, the longest segment's row count
    (rows of padding, segment -1, count for none). A segment is a run of consecutive rows
    of one id: the rows of each segment lie in its run alone, which bounds the cells of
    an iteration by B (:func:`_attend_new_rows`) whatever the ids."""
    row_ids = jnp.arange(segments.shape[0])
    starts = jnp.concatenate([jnp.ones(1, bool), segments[1:] != segments[:-1]])
    local = row_ids - jax.lax.cummax(jnp.where(starts, row_ids, 0))
    return local, jnp.max(jnp.where(segments >= 0, local + 1, 0))


def new_row_trips(segments: Int[Array, "B"]) -> Int[Array, ""]:
    """Iterations of the new-key loop of a step (:func:`_attend_new_rows`), each B
    (query row, key row) blocks of C×C scores: the diagonal, then one per pair of row
    offsets (j, span - j) for j = 1 .. span // 2, ``1 + span // 2`` in all (span: the
    longest segment's row count). One segment of R rows has R(R+1)/2 causal blocks; this
    computes B(1 + R // 2) of them at B = R (within B/2 blocks of the causal count), where
    one row offset per iteration computed B·R. A decode step (one-row segments): 1."""
    return 1 + _segment_rows(segments)[1] // 2


def _attend_new_rows(state: SoftmaxState, queries: Float[Array, "B C n_kv g h"],
                     keys: Float[Array, "B C n_kv h"], values: Float[Array, "B C n_kv hv"],
                     segments: Int[Array, "B"], positions: Int[Array, "B C"],
                     valid: Bool[Array, "B C"], *, window: Window | None = None
                     ) -> Float[Array, "B C n_q hv"]:
    """Fold the step's new keys into ``state`` and finish: row b sees rows b, b-1, ...
    of its own segment (a segment's rows are consecutive), at the causal cost.

    The (query row, key row) cells of a segment lie at row offsets j = 0 .. R-1 (R its
    rows; offset j has R - j cells). Offset 0, the diagonal, is every row with itself: one
    pass over the B rows. Then iteration i = 1 .. span // 2 (span: the longest segment's
    rows) takes offsets i and span - i together (once when they are equal): a segment
    has (R-i)⁺ + (R-span+i)⁺ <= R cells there (span >= R), so the live cells of all
    segments fit in B slots. They are compacted into those slots (a cumsum over the two
    offsets' masks: static shapes), each slot scores its query row's C queries against
    its key row's C keys, and the slot's own softmax over those keys is merged into its
    query row's state: the near offset's slots first, then the far offset's, as each
    holds a query row at most once (the two may share one), so no scatter collides. A
    slot carries its own softmax (not the gathered row state folded by ``add``) so that
    its values product runs once, not once per pass; the merges are elementwise.

    :func:`new_row_trips` iterations of B blocks, against span with one offset per
    iteration: about R(R+1)/2 blocks for one segment spanning the step's R = B rows,
    where one offset per iteration computed R². Rows of other segments cost nothing: a
    step of one-row segments (every decode step) makes one iteration, the diagonal.
    ``window``: keys only at positions ``p_k > p_q - window``."""
    b, c, n_kv, groups, h = queries.shape
    hv = values.shape[-1]
    local, span = _segment_rows(segments)

    def block(q, k, v, pos_q, pos_k, seen):
        """Scores [n, n_kv, g, Cq, Ck] of query rows q [n, C, ...] over key rows k, their
        visibility (``seen`` [n, Ck]: keys the row may see at all; then causal, window)
        and the values product of the probabilities."""
        visible = seen[:, None, :] & (pos_k[:, None, :] <= pos_q[:, :, None])   # [n, Cq, Ck]
        if window is not None:
            visible = visible & in_window(pos_q[:, :, None], pos_k[:, None, :], window)
        scores = jnp.einsum("bckgh,bjkh->bkgcj", q, k, preferred_element_type=jnp.float32)
        return scores, visible[:, None, None], lambda p: jnp.einsum(
            "bkgcj,bjkh->bkgch", p.astype(v.dtype), v, preferred_element_type=jnp.float32)

    def offset_pair(i, state: SoftmaxState) -> SoftmaxState:
        near, far = i, span - i
        # Cells (query row, offset) of both offsets, 2B candidates; the live ones, in
        # order, go to slots 0, 1, ... (at most B of them, see above).
        live = jnp.concatenate([(segments >= 0) & (local >= near),
                                (segments >= 0) & (local >= far) & (far != near)])
        dest = jnp.where(live, jnp.cumsum(live) - 1, b)              # b: dropped
        cell = jnp.zeros(b, jnp.int32).at[dest].set(jnp.arange(2 * b, dtype=jnp.int32),
                                                   mode="drop")
        slot_live = jnp.arange(b) < jnp.sum(live)
        is_near = cell < b
        q_rows = cell % b
        k_rows = jnp.maximum(q_rows - jnp.where(is_near, near, far), 0)
        # local >= offset: the key row is in the query row's segment.
        seen = slot_live[:, None] & valid[k_rows]
        cells = SoftmaxState.empty((b, n_kv, groups, c), hv).add(
            *block(queries[q_rows], keys[k_rows], values[k_rows], positions[q_rows],
                   positions[k_rows], seen))
        for part in (slot_live & is_near, slot_live & ~is_near):
            target = jnp.where(part, q_rows, b)                       # b: dropped
            merged = jax.tree.map(lambda a: a[q_rows], state).merge(cells)
            state = jax.tree.map(lambda a, m: a.at[target].set(m, mode="drop"), state, merged)
        return state

    # The diagonal: every row with itself, no gather.
    state = state.add(*block(queries, keys, values, positions, positions, valid))
    state = jax.lax.fori_loop(1, new_row_trips(segments), offset_pair, state)
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

"""Causal attention within the segments of a packed sequence.

The packer (``moejax.packing``) never lets a segment cross a block boundary of
B tokens, so every block attends only to itself. Inside a block, attention is
causal, so only the lower triangle of the [B, B] score matrix is needed. Two
tilings compute it, chosen from :data:`ATTENTION_TILING` by block size:

* ``triangular``: the block's queries are cut into sub-blocks of ``sub`` rows;
  sub-block i attends to keys [0, (i+1)·sub) only. Unrolled (at most
  ``max_unrolled`` sub-blocks), with an additive segment/causal bias built once
  per forward and shared by every layer. Measured on a 2-core CPU at B=512 it
  is ~3× faster than the full [B, B] product (less work, and the score tiles
  stay in cache).
* ``flash``: for blocks too long to unroll (long prompts), a loop over query
  chunks, each looping over the key chunks at or before it with an online
  softmax; memory is one [heads, chunk, chunk] tile and the mask is built per
  tile from segment ids (no [B, B] bias).

Shapes: T tokens, n_q query heads, n_kv key/value heads, h query/key head dim, hv value
head dim (hv = h usually; hv != h for multi-head latent attention), B the attention block
(``attn_block``), nb = T/B blocks, P rows of :func:`attention_at_rows`, Cp context entries
per block. Scores are scaled by 1/sqrt(h) (a caller that wants another scale pre-scales
its queries).

Options of every attention function here (keyword-only, off when None; off, the
computation is exactly the one without them):

* ``sinks`` [n_q]: attention sinks (GPT-OSS): one logit per query head that joins the
  softmax as an extra column and is then dropped, ``softmax([scores, sink])[:-1]``: it
  only adds exp(sink) to the denominator. Applied in float32 (as the scores).
* ``window``: sliding-window attention: a key at position p_k is visible to a query at
  position p_q only if ``p_q - p_k < window`` (transformers' ``sliding_window_overlay``:
  ``kv_idx > q_idx - sliding_window``; so window 1 is the token itself), on top of the
  segment and causal rules. A Python int or a traced int32 scalar (one compiled layer
  loop may serve layers of different windows: a full-attention layer passes a window
  larger than any context); never branched on. It needs the rows' ``positions`` [T]
  (and, with a context, the context entries' ``ctx_positions`` [nb, Cp]). Positions
  must increase strictly along the rows of a segment.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Float32, Int

MASK_VALUE = -1e30  # finite, so a fully masked tile cannot produce NaN
# The largest window: a Python int above it (e.g. "no window") is clamped to it.
MAX_WINDOW = int(np.iinfo(np.int32).max)

Window = int | np.integer | Int[Array, ""]


def clamp_window(window: Window) -> int | jax.Array:
    """``window`` as an int32-range value (a Python int above the range is clamped)."""
    if isinstance(window, (int, np.integer)):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        return min(int(window), MAX_WINDOW)
    return window


def in_window(query_pos: jax.Array, key_pos: jax.Array, window: Window) -> jax.Array:
    """Sliding-window visibility ``query_pos - key_pos < window`` (broadcast)."""
    return query_pos - key_pos < clamp_window(window)


def _need_positions(positions, window, name: str = "positions") -> None:
    if window is not None and positions is None:
        raise ValueError(f"a sliding window needs {name}")


def group_sinks(sinks: jax.Array | None, n_kv: int) -> jax.Array | None:
    """Sinks [n_q] -> float32 [n_kv, g] (query head i = kv head i // g, as the heads
    are grouped everywhere here)."""
    if sinks is None:
        return None
    return sinks.astype(jnp.float32).reshape(n_kv, -1)


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
    """Softmax over the last axis; with ``sinks`` (broadcasting to ``scores[..., 0]``)
    each row's softmax also has the sink column, which is dropped afterwards:
    exp(s - m) / (sum exp(s - m) + exp(sink - m)), m = max(max s, sink)."""
    if sinks is None:
        return jax.nn.softmax(scores, axis=-1)
    peak = jnp.maximum(scores.max(axis=-1), sinks)
    weights = jnp.exp(scores - peak[..., None])
    total = weights.sum(axis=-1) + jnp.exp(sinks - peak)
    return weights / total[..., None]


@dataclasses.dataclass(frozen=True)
class AttentionTiling:
    """How one block size is computed: ``mode`` "triangular" or "flash", and the tile rows."""

    mode: str
    sub: int


# Tile rows by block size (tuned on CPU with the ablation in docs/PERF.md): sub-blocks of
# 128 rows were best from B=512 up, 64 rows at B=256.
SUB_BLOCK = {256: 64}
DEFAULT_SUB_BLOCK = 128
MAX_UNROLLED = 16        # triangular up to B = 16 · 128 = 2048, flash beyond
FLASH_CHUNK = 512


def tiling_for(block: int) -> AttentionTiling:
    sub = min(block, SUB_BLOCK.get(block, DEFAULT_SUB_BLOCK))
    if block // sub <= MAX_UNROLLED:
        return AttentionTiling("triangular", sub)
    return AttentionTiling("flash", min(block, FLASH_CHUNK))


def segment_bias(segment_ids: Int[Array | np.ndarray, "T"], attn_block: int
                 ) -> Float32[Array, "nb B B"]:
    """Additive bias [T/B, B, B]: 0 where the key is in the query's segment and not after
    it, ``MASK_VALUE`` elsewhere. Padding tokens (segment -1) see each other, so no row
    is empty."""
    seg = segment_ids.reshape(-1, attn_block)
    idx = jnp.arange(attn_block, dtype=jnp.int32)
    visible = (seg[:, :, None] == seg[:, None, :]) & (idx[None, None, :] <= idx[None, :, None])
    return jnp.where(visible, 0.0, MASK_VALUE).astype(jnp.float32)


def attention_bias(segment_ids: Int[Array | np.ndarray, "T"], attn_block: int
                   ) -> Float32[Array, "nb B B"] | None:
    """The bias the chosen tiling needs (None for ``flash``, which masks per tile)."""
    if tiling_for(attn_block).mode == "flash":
        return None
    return segment_bias(segment_ids, attn_block)


def _split_heads(q: jax.Array, k: jax.Array, v: jax.Array, block: int):
    """[T, heads, h] -> Q [nb, n_kv, g, B, h], K [nb, n_kv, B, h], V [nb, n_kv, B, hv]."""
    t, n_q, h = q.shape
    n_kv = k.shape[1]
    nb = t // block
    queries = q.reshape(nb, block, n_kv, n_q // n_kv, h).transpose(0, 2, 3, 1, 4)
    keys = k.reshape(nb, block, n_kv, h).transpose(0, 2, 1, 3)
    values = v.reshape(nb, block, n_kv, v.shape[-1]).transpose(0, 2, 1, 3)
    return queries, keys, values


def _merge_heads(out: jax.Array, dtype) -> jax.Array:
    """[nb, n_kv, g, B, hv] -> [T, n_q, hv]."""
    nb, n_kv, g, block, h = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(nb * block, n_kv * g, h).astype(dtype)


def _attend(queries: jax.Array, keys: jax.Array, values: jax.Array, bias: jax.Array,
            sinks: jax.Array | None = None) -> jax.Array:
    """Q [nb, n_kv, g, q, h], K [nb, n_kv, s, h], V [nb, n_kv, s, hv], bias [nb, q, s],
    sinks [n_kv, g] f32 or None -> [nb, n_kv, g, q, hv] f32."""
    scale = 1.0 / math.sqrt(queries.shape[-1])
    scores = jnp.einsum("bkgqh,bksh->bkgqs", queries, keys,
                        preferred_element_type=jnp.float32) * scale
    probs = softmax_with_sinks(scores + bias[:, None, None],
                               None if sinks is None else sinks[None, :, :, None]
                               ).astype(values.dtype)
    return jnp.einsum("bkgqs,bksh->bkgqh", probs, values, preferred_element_type=jnp.float32)


def _triangular(queries, keys, values, bias, sub: int, sinks=None, positions=None,
                window=None) -> jax.Array:
    """positions [nb, B] (with ``window`` only)."""
    block = queries.shape[3]
    outs = []
    for i in range(block // sub):
        rows, end = slice(i * sub, (i + 1) * sub), (i + 1) * sub
        tile = queries[:, :, :, rows], keys[:, :, :end], values[:, :, :end]
        tile_bias = bias[:, rows, :end]
        if window is not None:
            near = in_window(positions[:, rows, None], positions[:, None, :end], window)
            tile_bias = jnp.where(near, tile_bias, MASK_VALUE)
        outs.append(_attend(*tile, tile_bias, sinks))
    return jnp.concatenate(outs, axis=3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SoftmaxState:
    """A running softmax over key chunks (flash-attention style), per query:
    ``peak`` [..., C] the largest score so far, ``total`` [..., C] the sum of
    exp(score - peak), ``acc`` [..., C, h] the exp-weighted sum of values. The one online
    softmax of moejax: packed attention (:func:`_flash`) and paged attention
    (``moejax.decode.paged``) both fold their key chunks into it."""

    peak: jax.Array
    total: jax.Array
    acc: jax.Array

    @classmethod
    def empty(cls, shape: tuple[int, ...], head_dim: int,
              sinks: jax.Array | None = None) -> "SoftmaxState":
        """No key seen yet; with ``sinks`` (broadcasting to ``shape``) the sink column is:
        peak = sink, total = exp(sink - sink) = 1, acc = 0 (a sink has no value)."""
        if sinks is None:
            return cls(peak=jnp.full(shape, MASK_VALUE, jnp.float32),
                       total=jnp.zeros(shape, jnp.float32),
                       acc=jnp.zeros((*shape, head_dim), jnp.float32))
        return cls(peak=jnp.broadcast_to(sinks.astype(jnp.float32), shape),
                   total=jnp.ones(shape, jnp.float32),
                   acc=jnp.zeros((*shape, head_dim), jnp.float32))

    def add(self, scores: Float[Array, "... C W"], visible: Bool[Array, "..."],
            values_of: Any) -> "SoftmaxState":
        """Fold in one chunk of scores (masked by ``visible``, which broadcasts to them);
        ``values_of(probs)`` gives the chunk's probability-weighted values [..., C, h]."""
        peak = jnp.maximum(self.peak, jnp.max(jnp.where(visible, scores, MASK_VALUE), -1))
        # Masked scores weigh exactly 0 (not exp(MASK - MASK) = 1 in an empty chunk).
        probs = jnp.where(visible, jnp.exp(scores - peak[..., None]), 0.0)
        rescale = jnp.exp(self.peak - peak)
        return SoftmaxState(peak=peak, total=self.total * rescale + probs.sum(-1),
                            acc=self.acc * rescale[..., None] + values_of(probs))

    def merge(self, other: "SoftmaxState") -> "SoftmaxState":
        """The running softmax over both states' keys (disjoint key sets of the same
        queries): each side rescaled to the larger peak. An empty side (peak
        ``MASK_VALUE``, total 0) leaves the other as it is."""
        peak = jnp.maximum(self.peak, other.peak)
        mine, theirs = jnp.exp(self.peak - peak), jnp.exp(other.peak - peak)
        return SoftmaxState(peak=peak, total=self.total * mine + other.total * theirs,
                            acc=self.acc * mine[..., None] + other.acc * theirs[..., None])

    def result(self) -> jax.Array:
        """The attention output [..., C, h] (0 for a query that saw no key)."""
        return self.acc / jnp.maximum(self.total, jnp.finfo(jnp.float32).tiny)[..., None]


def _flash(queries, keys, values, segment_ids, chunk: int, sinks=None, positions=None,
           window=None) -> jax.Array:
    """sinks [n_kv, g] f32 (the softmax starts from the sink: peak = sink, total = 1,
    acc = 0); positions [T] (with ``window`` only). With a window, a query chunk starts
    at the first key chunk that may hold a key in its window: positions increase strictly
    along a segment's rows, so a key more than ``window`` rows back is out of it."""
    nb, n_kv, g, block, h = queries.shape
    hv = values.shape[-1]
    n = block // chunk
    seg = segment_ids.reshape(nb, block)
    pos = None if window is None else positions.reshape(nb, block)
    scale = 1.0 / math.sqrt(h)
    local = jnp.arange(chunk, dtype=jnp.int32)

    def query_chunk(bi):
        b, i = bi // n, bi % n
        q = jax.lax.dynamic_slice_in_dim(queries[b], i * chunk, chunk, axis=2)
        seg_q = jax.lax.dynamic_slice_in_dim(seg[b], i * chunk, chunk)
        row_q = i * chunk + local
        pos_q = None if window is None else jax.lax.dynamic_slice_in_dim(pos[b], i * chunk, chunk)

        def key_chunk(j, state: SoftmaxState) -> SoftmaxState:
            k = jax.lax.dynamic_slice_in_dim(keys[b], j * chunk, chunk, axis=1)
            v = jax.lax.dynamic_slice_in_dim(values[b], j * chunk, chunk, axis=1)
            seg_k = jax.lax.dynamic_slice_in_dim(seg[b], j * chunk, chunk)
            visible = (seg_q[:, None] == seg_k[None, :]) & (j * chunk + local[None, :] <= row_q[:, None])
            if window is not None:
                pos_k = jax.lax.dynamic_slice_in_dim(pos[b], j * chunk, chunk)
                visible = visible & in_window(pos_q[:, None], pos_k[None, :], window)
            s = jnp.einsum("kgqh,ksh->kgqs", q, k, preferred_element_type=jnp.float32) * scale
            return state.add(s, visible, lambda p: jnp.einsum(
                "kgqs,ksh->kgqh", p.astype(v.dtype), v, preferred_element_type=jnp.float32))

        # With sinks, the sink column comes first (SoftmaxState.empty).
        init = SoftmaxState.empty((n_kv, g, chunk), hv,
                                  None if sinks is None else sinks[:, :, None])
        first = 0 if window is None else jnp.maximum(i * chunk - window + 1, 0) // chunk
        return jax.lax.fori_loop(first, i + 1, key_chunk, init).result()

    out = jax.lax.map(query_chunk, jnp.arange(nb * n, dtype=jnp.int32))   # [nb·n, kv, g, c, hv]
    out = out.reshape(nb, n, n_kv, g, chunk, hv).transpose(0, 2, 3, 1, 4, 5)
    return out.reshape(nb, n_kv, g, block, hv)


def packed_attention(q: Float[Array, "T n_q h"], k: Float[Array, "T n_kv h"],
                     v: Float[Array, "T n_kv hv"], segment_ids: Int[Array, "T"],
                     attn_block: int, bias: Float32[Array, "nb B B"] | None = None,
                     tiling: AttentionTiling | None = None, *,
                     positions: Int[Array, "T"] | None = None,
                     sinks: Float[Array, "n_q"] | None = None,
                     window: Window | None = None) -> Float[Array, "T n_q hv"]:
    """Grouped-query causal attention within segments: q [T, n_q, h], k [T, n_kv, h],
    v [T, n_kv, hv] -> [T, n_q, hv]. ``bias`` from :func:`attention_bias` (computed here
    if absent; it never holds the window). ``sinks`` [n_q], ``window`` (needs the rows'
    ``positions`` [T]): see the module docstring."""
    _need_positions(positions, window)
    window = None if window is None else clamp_window(window)
    tiling = tiling or tiling_for(attn_block)
    queries, keys, values = _split_heads(q, k, v, attn_block)
    sinks = group_sinks(sinks, k.shape[1])
    if tiling.mode == "flash":
        out = _flash(queries, keys, values, segment_ids, tiling.sub, sinks, positions, window)
    else:
        if bias is None:
            bias = segment_bias(segment_ids, attn_block)
        block_pos = None if window is None else positions.reshape(-1, attn_block)
        out = _triangular(queries, keys, values, bias, tiling.sub, sinks, block_pos, window)
    return _merge_heads(out, q.dtype)


def attention_at_rows(q: Float[Array, "P n_q h"], k: Float[Array, "T n_kv h"],
                      v: Float[Array, "T n_kv hv"], segment_ids: Int[Array, "T"],
                      rows: Int[Array, "P"], attn_block: int, *,
                      positions: Int[Array, "T"] | None = None,
                      sinks: Float[Array, "n_q"] | None = None,
                      window: Window | None = None) -> Float[Array, "P n_q hv"]:
    """Attention for a few query rows: q [P, n_q, h] (the queries of flat positions
    ``rows`` [P]) over k [T, n_kv, h], v [T, n_kv, hv] -> [P, n_q, hv]. Each row sees the
    keys of its own block (the packer keeps segments inside blocks), masked to its
    segment and causal (and to ``window`` by ``positions`` [T] of every row; ``sinks``:
    module docstring)."""
    _need_positions(positions, window)
    p, n_q, h = q.shape
    n_kv = k.shape[1]
    block_of_row = rows // attn_block
    keys = k.reshape(-1, attn_block, n_kv, h)[block_of_row]          # [P, B, n_kv, h]
    values = v.reshape(-1, attn_block, n_kv, v.shape[-1])[block_of_row]
    key_seg = segment_ids.reshape(-1, attn_block)[block_of_row]       # [P, B]
    local = rows % attn_block
    visible = ((key_seg == segment_ids[rows][:, None])
               & (jnp.arange(attn_block, dtype=rows.dtype)[None, :] <= local[:, None]))
    if window is not None:
        key_pos = positions.reshape(-1, attn_block)[block_of_row]     # [P, B]
        visible = visible & in_window(positions[rows][:, None], key_pos, window)
    return attend_rows(q, keys, values, visible, sinks)


def attend_rows(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array,
                 sinks: jax.Array | None = None) -> jax.Array:
    """q [P, n_q, h] over per-row keys [P, S, n_kv, h] / values [P, S, n_kv, hv] where
    ``visible`` [P, S]; sinks [n_q] or None -> [P, n_q, hv]. Grouped-query, f32 scores
    and weighted sum (the scoring rows here, and the static runtime's one-token decode,
    ``moejax.static.cache.attend_cache``)."""
    p, n_q, h = q.shape
    n_kv = keys.shape[2]
    queries = q.reshape(p, n_kv, n_q // n_kv, h)
    scores = jnp.einsum("pkgh,pskh->pkgs", queries, keys,
                        preferred_element_type=jnp.float32) / math.sqrt(h)
    scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
    sinks = group_sinks(sinks, n_kv)
    probs = softmax_with_sinks(scores, None if sinks is None else sinks[None]
                               ).astype(values.dtype)
    out = jnp.einsum("pkgs,pskh->pkgh", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(p, n_q, values.shape[-1]).astype(q.dtype)


# ------------------------------------------------------------- attention with a KV context
def context_visible(ctx_lo: Int[Array, "*batch c"], ctx_hi: Int[Array, "*batch c"],
                    query_seg: Int[Array, "*batch q"]) -> Bool[Array, "*batch q c"]:
    """[..., c] context segment ranges × [..., q] query segments -> [..., q, c] bool.

    A context entry (one cached token's keys and values) is read by the segments
    ``ctx_lo ≤ s ≤ ctx_hi``: one pool slot serves every sibling of a shared prefix in a
    block once (an unused entry has lo > hi; padding rows, segment -1, see nothing)."""
    q = query_seg[..., :, None]
    return (ctx_lo[..., None, :] <= q) & (q <= ctx_hi[..., None, :]) & (q >= 0)


def context_attention(q: Float[Array, "T n_q h"], k: Float[Array, "T n_kv h"],
                      v: Float[Array, "T n_kv hv"], segment_ids: Int[Array, "T"],
                      attn_block: int, ctx_k: Float[Array, "nb Cp n_kv h"],
                      ctx_v: Float[Array, "nb Cp n_kv hv"], ctx_lo: Int[Array, "nb Cp"],
                      ctx_hi: Int[Array, "nb Cp"], *,
                      positions: Int[Array, "T"] | None = None,
                      ctx_positions: Int[Array, "nb Cp"] | None = None,
                      sinks: Float[Array, "n_q"] | None = None,
                      window: Window | None = None) -> Float[Array, "T n_q hv"]:
    """:func:`packed_attention` where each block also sees a context of cached keys.

    q [T, n_q, h], k [T, n_kv, h], v [T, n_kv, hv]; ctx_k/ctx_v [nb, Cp, n_kv, h/hv]: the
    context keys and values of each attention block (its segments' cached prefixes,
    gathered from the prefix pool, each slot once per block), ctx_lo/ctx_hi [nb, Cp]: the
    range of segments that read each entry. A query sees its segment's context entries
    (all precede it) and, causally, its own segment's rows. Dense per block ([B, Cp + B]
    scores): used only for batches that continue cached prefixes. -> [T, n_q, hv].

    ``window`` needs the rows' ``positions`` [T] and ``ctx_positions`` [nb, Cp], the
    position of each context entry's token (a pool slot does not imply it: the prefix
    cache places a token at position p in slot ``block · 16 + p % 16`` of any block; an
    entry is one token at one position for every segment that reads it). ``sinks``:
    module docstring.
    """
    _need_positions(positions, window)
    _need_positions(ctx_positions, window, "ctx_positions")
    queries, keys, values = _split_heads(q, k, v, attn_block)
    keys = jnp.concatenate([ctx_k.transpose(0, 2, 1, 3), keys], axis=2)
    values = jnp.concatenate([ctx_v.transpose(0, 2, 1, 3), values], axis=2)
    seg = segment_ids.reshape(-1, attn_block)
    ctx_seen = context_visible(ctx_lo, ctx_hi, seg)                    # [nb, B, Cp]
    if window is not None:
        pos = positions.reshape(-1, attn_block)
        ctx_seen = ctx_seen & in_window(pos[:, :, None], ctx_positions[:, None, :], window)
    ctx_bias = jnp.where(ctx_seen, 0.0, MASK_VALUE).astype(jnp.float32)
    own_bias = segment_bias(segment_ids, attn_block)
    if window is not None:
        own_bias = jnp.where(in_window(pos[:, :, None], pos[:, None, :], window), own_bias,
                             MASK_VALUE)
    bias = jnp.concatenate([ctx_bias, own_bias], axis=-1)
    return _merge_heads(_attend(queries, keys, values, bias, group_sinks(sinks, k.shape[1])),
                        q.dtype)


def context_attention_at_rows(q: Float[Array, "P n_q h"], k: Float[Array, "T n_kv h"],
                              v: Float[Array, "T n_kv hv"], segment_ids: Int[Array, "T"],
                              rows: Int[Array, "P"], attn_block: int,
                              ctx_k: Float[Array, "nb Cp n_kv h"],
                              ctx_v: Float[Array, "nb Cp n_kv hv"], ctx_lo: Int[Array, "nb Cp"],
                              ctx_hi: Int[Array, "nb Cp"], *,
                              positions: Int[Array, "T"] | None = None,
                              ctx_positions: Int[Array, "nb Cp"] | None = None,
                              sinks: Float[Array, "n_q"] | None = None,
                              window: Window | None = None) -> Float[Array, "P n_q hv"]:
    """:func:`attention_at_rows` with each block's context (as in
    :func:`context_attention`, options included): q [P, n_q, h] at flat ``rows`` [P]
    -> [P, n_q, hv]."""
    _need_positions(positions, window)
    _need_positions(ctx_positions, window, "ctx_positions")
    p, n_q, h = q.shape
    n_kv = k.shape[1]
    block_of_row = rows // attn_block
    keys = jnp.concatenate([ctx_k[block_of_row],
                            k.reshape(-1, attn_block, n_kv, h)[block_of_row]], axis=1)
    values = jnp.concatenate([ctx_v[block_of_row],
                              v.reshape(-1, attn_block, n_kv, v.shape[-1])[block_of_row]],
                             axis=1)
    row_seg = segment_ids[rows]
    key_seg = segment_ids.reshape(-1, attn_block)[block_of_row]       # [P, B]
    local = rows % attn_block
    own = (key_seg == row_seg[:, None]) & (
        jnp.arange(attn_block, dtype=rows.dtype)[None, :] <= local[:, None])
    ctx = context_visible(ctx_lo[block_of_row], ctx_hi[block_of_row],
                          row_seg[:, None])[:, 0, :]                    # [P, Cp]
    if window is not None:
        row_pos = positions[rows][:, None]                              # [P, 1]
        own = own & in_window(row_pos, positions.reshape(-1, attn_block)[block_of_row], window)
        ctx = ctx & in_window(row_pos, ctx_positions[block_of_row], window)
    visible = jnp.concatenate([ctx, own], axis=1)                       # [P, Cp + B]
    return attend_rows(q, keys, values, visible, sinks)

"""The attention seam of the decoder layer: where keys and values come from and go to.

Every kind is a pytree with one method doing the work,
``attend(p, layer, h_in, rows, cfg) -> (heads [n, n_q, h], kind)``: project the
normed input of one layer, attend, and return itself with its state updated (a pool
or a cache written). ``rows`` (or None) restricts the queries to those rows, with keys
and values still from every row (the last layer at the scoring positions).

The *carry* of a kind is the part of it that a layer changes (pools, caches); the
fused driver threads only that through its loop, so masks and positions stay
constants of the loop body. ``valid_rows`` says which rows are real tokens (the MoE
keeps padding out of the experts).

Kinds:

* :class:`PackedCausal` — scoring: causal attention within the segments of a packed
  batch (``moejax.attention``), blocks of ``attn_block`` tokens;
* :class:`PrefixPooled` — the prefix cache: each block also reads pooled keys/values
  of cached prefixes, and the rows to keep are written to the pool;
* :class:`moejax.decode.paged.PagedRows` — generation: rows over the paged KV pool.

The static-batching runtime's kinds over its dense cache (``PromptToCache``,
``CacheSlots``) live with it, in :mod:`moejax.static.cache`.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax import attention
from moejax.config import ModelConfig
from moejax.layers import LayerParams, attention_options, expand_kv, project_kv, project_q

_STATIC = {"static": True}


def _options(p: LayerParams, layer, cfg: ModelConfig, positions: jax.Array) -> dict[str, Any]:
    """The layer's attention options (sinks, window) with the rows' positions when there
    is a window; {} for the families without them."""
    extra = attention_options(p, layer, cfg)
    if "window" in extra:
        if layer is None:
            raise ValueError(f"{cfg.model_type}: sliding-window attention needs the layer index")
        extra["positions"] = positions
    return extra


def _queries_at(p: LayerParams, h_in: jax.Array, positions: jax.Array, rows: jax.Array | None,
                cfg: ModelConfig) -> jax.Array:
    """Queries of every row, or of ``rows`` only."""
    if rows is None:
        return project_q(p, h_in, positions, cfg)
    return project_q(p, jnp.take(h_in, rows, axis=0), jnp.take(positions, rows), cfg)


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedCausal:
    """Causal attention within segments of a packed batch.

    positions, segment_ids: [T] int32 (segment -1: padding); bias: the attention bias
    of ``segment_ids`` built once and shared by every layer (None for the flash tiling);
    attn_block: tokens per attention block (static).
    """

    positions: jax.Array
    segment_ids: jax.Array
    bias: jax.Array | None
    attn_block: int = dataclasses.field(metadata=_STATIC)

    @classmethod
    def of(cls, positions: Int[Array, "T"], segment_ids: Int[Array, "T"],
           attn_block: int, with_bias: bool = True) -> "PackedCausal":
        """The kind of a packed batch (host arrays are converted: eager callers pass NumPy).
        ``with_bias=False``: for a caller that never runs the packed tiling."""
        positions, segment_ids = jnp.asarray(positions), jnp.asarray(segment_ids)
        bias = attention.attention_bias(segment_ids, attn_block) if with_bias else None
        return cls(positions=positions, segment_ids=segment_ids, attn_block=attn_block,
                   bias=bias)

    def carry(self) -> Any:
        return ()

    def with_carry(self, carry: Any) -> "PackedCausal":
        return self

    def valid_rows(self, rows: jax.Array | None) -> jax.Array | None:
        return None if rows is not None else self.segment_ids >= 0

    def keys_values(self, p: LayerParams, h_in: jax.Array, cfg: ModelConfig):
        return project_kv(p, h_in, self.positions, cfg)

    def attend(self, p: LayerParams, layer, h_in: Float[Array, "T d"],
               rows: Int[Array, "r"] | None, cfg: ModelConfig):
        k, v = self.keys_values(p, h_in, cfg)
        return self.attend_to(p, h_in, k, v, rows, cfg, layer), self

    def attend_to(self, p: LayerParams, h_in: Float[Array, "T d"], k: Float[Array, "T s hk"],
                  v: Float[Array, "T s hv"], rows: Int[Array, "r"] | None,
                  cfg: ModelConfig, layer=None) -> jax.Array:
        """The attention of the (given, stored-form) keys and values: what a kind that
        also stores them calls, so they are projected once. (``layer``: for the family's
        per-layer attention options, :func:`moejax.layers.attention_options`.)"""
        k, v = expand_kv(p, k, v, cfg)
        q = _queries_at(p, h_in, self.positions, rows, cfg)
        extra = _options(p, layer, cfg, self.positions)
        if rows is None:
            return attention.packed_attention(q, k, v, self.segment_ids, self.attn_block,
                                              self.bias, **extra)
        return attention.attention_at_rows(q, k, v, self.segment_ids, rows, self.attn_block,
                                           **extra)


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixContext:
    """Which pool slots a batch reads and writes.

    ctx_slot, ctx_lo, ctx_hi: [nb, Cp] int32 — every attention block lists the pool
    slots its segments continue from, each once, and the range of its segments that read
    each (lo <= segment <= hi; lo > hi: unused); store_row, store_slot: [W] int32 —
    rows whose keys/values are kept, and their pool slots (slot S = dropped);
    ctx_positions: [nb, Cp] int32 or None — the position of each context entry (what a
    sliding window needs; None for a model without one).
    """

    ctx_slot: jax.Array
    ctx_lo: jax.Array
    ctx_hi: jax.Array
    store_row: jax.Array
    store_slot: jax.Array
    ctx_positions: jax.Array | None = None   # [nb, Cp] position of each context entry

    @property
    def reads_pool(self) -> bool:
        """Does any block read the pool? (Static: a batch that only stores has width 0
        and keeps the packed tiling.)"""
        return self.ctx_slot.shape[1] > 0


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixPooled:
    """:class:`PackedCausal` whose blocks also read cached prefix keys/values from a pool
    ``pool_k``/``pool_v`` [L, S, n_kv, h] (S = blocks · block size token slots), and
    whose stored rows are written to it: layer by layer (in place when donated), or — with
    ``defer_writes``, for a fused layer loop — kept in ``stored_k``/``stored_v``
    [L, W, n_kv, h] and written by :meth:`written` after the loop. A loop that both reads
    and writes the pool makes XLA copy the whole pool twice per layer (to keep the reads
    safe); deferred, the loop only reads it (XLA still copies it once per step that reads
    it). A step never reads rows it stores itself (the prefix plan's levels), so the order
    does not change what is read."""

    packed: PackedCausal
    context: PrefixContext
    pool_k: jax.Array
    pool_v: jax.Array
    stored_k: jax.Array | None = None
    stored_v: jax.Array | None = None

    @classmethod
    def of(cls, positions: Int[Array, "T"], segment_ids: Int[Array, "T"], attn_block: int,
           context: PrefixContext, pool_k: Float[Array, "L S n_kv hk"],
           pool_v: Float[Array, "L S n_kv hv"], *, defer_writes: bool = False
           ) -> "PrefixPooled":
        # The context attention masks per block: no bias when the pool is read.
        packed = PackedCausal.of(positions, segment_ids, attn_block,
                                 with_bias=not context.reads_pool)
        stored_k = stored_v = None
        if defer_writes:
            rows = (pool_k.shape[0], context.store_row.shape[0])
            stored_k = jnp.zeros((*rows, *pool_k.shape[2:]), pool_k.dtype)
            stored_v = jnp.zeros((*rows, *pool_v.shape[2:]), pool_v.dtype)
        return cls(packed=packed, context=context, pool_k=pool_k, pool_v=pool_v,
                   stored_k=stored_k, stored_v=stored_v)

    def carry(self) -> Any:
        if self.stored_k is not None:
            return self.stored_k, self.stored_v
        return self.pool_k, self.pool_v

    def with_carry(self, carry: Any) -> "PrefixPooled":
        if self.stored_k is not None:
            return dataclasses.replace(self, stored_k=carry[0], stored_v=carry[1])
        return dataclasses.replace(self, pool_k=carry[0], pool_v=carry[1])

    def written(self) -> tuple[jax.Array, jax.Array]:
        """The pool with this step's stored rows in it (keys, values)."""
        if self.stored_k is None:
            return self.pool_k, self.pool_v
        slots = self.context.store_slot   # slot S: dropped
        return (self.pool_k.at[:, slots].set(self.stored_k, mode="drop"),
                self.pool_v.at[:, slots].set(self.stored_v, mode="drop"))

    def valid_rows(self, rows: jax.Array | None) -> jax.Array | None:
        return self.packed.valid_rows(rows)

    def attend(self, p: LayerParams, layer, h_in: Float[Array, "T d"],
               rows: Int[Array, "r"] | None, cfg: ModelConfig):
        packed, ctx = self.packed, self.context
        k, v = packed.keys_values(p, h_in, cfg)
        if not ctx.reads_pool:
            out = packed.attend_to(p, h_in, k, v, rows, cfg, layer)
        else:
            # Gathered from the pool directly: slicing the layer out first would copy it.
            ctx_k, ctx_v = expand_kv(p, self.pool_k[layer, ctx.ctx_slot],
                                     self.pool_v[layer, ctx.ctx_slot], cfg)
            attn_k, attn_v = expand_kv(p, k, v, cfg)
            extra = _options(p, layer, cfg, packed.positions)
            if "window" in extra:
                if ctx.ctx_positions is None:
                    raise ValueError(f"{cfg.model_type}: sliding-window attention over a "
                                     "prefix context needs its ctx_positions")
                extra["ctx_positions"] = ctx.ctx_positions
            if rows is None or rows.shape[0] >= ctx.ctx_slot.shape[0]:
                # At least one row per block: gathering each row's own context would copy
                # it once per row; attend every row with its block's, then take the rows.
                q = _queries_at(p, h_in, packed.positions, None, cfg)
                out = attention.context_attention(q, attn_k, attn_v, packed.segment_ids,
                                                  packed.attn_block,
                                                  ctx_k, ctx_v, ctx.ctx_lo, ctx.ctx_hi,
                                                  **extra)
                out = out if rows is None else out[rows]
            else:
                q = _queries_at(p, h_in, packed.positions, rows, cfg)
                out = attention.context_attention_at_rows(q, attn_k, attn_v, packed.segment_ids,
                                                          rows,
                                                          packed.attn_block, ctx_k, ctx_v,
                                                          ctx.ctx_lo, ctx.ctx_hi, **extra)
        if self.stored_k is not None:   # kept for written(), after the loop
            return out, dataclasses.replace(
                self, stored_k=self.stored_k.at[layer].set(k[ctx.store_row]),
                stored_v=self.stored_v.at[layer].set(v[ctx.store_row]))
        # O(W) scatter into the layer's pool slots (slot S drops the row).
        pool_k = self.pool_k.at[layer, ctx.store_slot].set(k[ctx.store_row], mode="drop")
        pool_v = self.pool_v.at[layer, ctx.store_slot].set(v[ctx.store_row], mode="drop")
        return out, dataclasses.replace(self, pool_k=pool_k, pool_v=pool_v)

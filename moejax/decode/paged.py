"""The paged KV cache on the device, and attention over block tables.

The cache is one pool of token slots per layer, ``keys``/``values`` [L, S, n_kv, h] with
S = blocks × :data:`BLOCK_SIZE` (16, the prefix cache's block and hash-chain size). A
sequence owns a *block table*: its token at position p lives in slot
``table[p // 16] * 16 + p % 16``. The host owns the tables and the free list
(:mod:`moejax.decode.blocks`); the device only reads and writes slots.

A step runs B rows of C tokens each (C = 1 for decode, a prompt chunk for prefill).
Row b's tokens sit at positions ``context_len[b] + c``; every position below
``context_len[b]`` is already in the pool. The step *reads* the pool and keeps its own
new keys/values apart (the :class:`PagedRows` carry, [L, B·C, n_kv, h]); the host
writes them into the pool afterwards (:func:`write_rows`, one scatter in place). A
layer loop that both read and wrote the pool would make XLA copy the whole pool per
layer; reading only, it copies nothing.

Attention of query (b, c): the pool slots of row b below ``context_len[b]`` and the
step's own rows (b, c') with c' <= c — a softmax over both, in float32, grouped-query
as in :mod:`moejax.attention`.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moejax.attention import MASK_VALUE
from moejax.config import ModelConfig
from moejax.layers import LayerParams, project_kv, project_q
from moejax.prefix_hash import BLOCK_SIZE

_STATIC = {"static": True}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """keys, values: [L, S, n_kv, h], S = num_blocks · BLOCK_SIZE token slots."""

    keys: Float[Array, "L S n_kv h"]
    values: Float[Array, "L S n_kv h"]

    @property
    def num_slots(self) -> int:
        return int(self.keys.shape[1])


def block_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of one block of keys and values over every layer."""
    return 2 * cfg.num_layers * BLOCK_SIZE * cfg.num_kv_heads * cfg.head_dim * itemsize


def empty_paged_kv(cfg: ModelConfig, num_blocks: int, dtype: Any, device: Any = None) -> PagedKV:
    """A zeroed pool of ``num_blocks`` blocks (placed on ``device``: a device or sharding)."""
    shape = (cfg.num_layers, num_blocks * BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    return PagedKV(keys=jnp.zeros(shape, dtype, device=device),
                   values=jnp.zeros(shape, dtype, device=device))


def table_slots(block_tables: Int[Array, "B MB"]) -> Int[Array, "B W"]:
    """Pool slot of every position 0 .. MB·16 - 1 of each row's block table."""
    offsets = jnp.arange(BLOCK_SIZE, dtype=block_tables.dtype)
    slots = block_tables[:, :, None] * BLOCK_SIZE + offsets[None, None, :]
    return slots.reshape(block_tables.shape[0], -1)


def paged_attention(q: Float[Array, "B C n_q h"], pool_keys: Float[Array, "B W n_kv h"],
                    pool_values: Float[Array, "B W n_kv h"], context_len: Int[Array, "B"],
                    new_keys: Float[Array, "B C n_kv h"], new_values: Float[Array, "B C n_kv h"],
                    new_valid: Bool[Array, "B C"]) -> Float[Array, "B C n_q h"]:
    """Attention of each row's C queries over its pooled context (slots < context_len)
    and its own new keys (causal within the row, valid ones only)."""
    b, c, n_q, h = q.shape
    n_kv = pool_keys.shape[2]
    queries = q.reshape(b, c, n_kv, n_q // n_kv, h)
    scale = 1.0 / math.sqrt(h)
    pooled = jnp.einsum("bckgh,bwkh->bkgcw", queries, pool_keys,
                        preferred_element_type=jnp.float32) * scale
    fresh = jnp.einsum("bckgh,bjkh->bkgcj", queries, new_keys,
                       preferred_element_type=jnp.float32) * scale
    in_context = jnp.arange(pool_keys.shape[1])[None, :] < context_len[:, None]      # [B, W]
    causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]                          # [C, C]
    visible_new = causal[None] & new_valid[:, None, :]                                  # [B, C, C]
    pooled = jnp.where(in_context[:, None, None, None, :], pooled, MASK_VALUE)
    fresh = jnp.where(visible_new[:, None, None], fresh, MASK_VALUE)
    probs = jax.nn.softmax(jnp.concatenate([pooled, fresh], axis=-1), axis=-1)
    width = pool_keys.shape[1]
    out = (jnp.einsum("bkgcw,bwkh->bckgh", probs[..., :width].astype(pool_values.dtype),
                      pool_values, preferred_element_type=jnp.float32)
           + jnp.einsum("bkgcj,bjkh->bckgh", probs[..., width:].astype(new_values.dtype),
                        new_values, preferred_element_type=jnp.float32))
    return out.reshape(b, c, n_q, h).astype(q.dtype)


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedRows:
    """The attention kind of a paged step: B rows of ``chunk`` tokens, flattened [B·C].

    positions, valid: [B·C]; context_slots [B, W]: the pool slots of each row's block
    table; context_len [B]: positions already in the pool; pool_keys/values: the pool
    (read only); new_keys/new_values [L, B·C, n_kv, h]: this step's keys and values,
    the carry (written to the pool by :func:`write_rows` after the step)."""

    positions: jax.Array
    valid: jax.Array
    context_slots: jax.Array
    context_len: jax.Array
    pool_keys: jax.Array
    pool_values: jax.Array
    new_keys: jax.Array
    new_values: jax.Array
    chunk: int = dataclasses.field(metadata=_STATIC)

    @classmethod
    def of(cls, kv: PagedKV, positions: Int[Array, "BC"], valid: Bool[Array, "BC"],
           block_tables: Int[Array, "B MB"], context_len: Int[Array, "B"]) -> "PagedRows":
        rows = positions.shape[0]
        shape = (kv.keys.shape[0], rows, *kv.keys.shape[2:])
        return cls(positions=positions, valid=valid, context_slots=table_slots(block_tables),
                   context_len=context_len, pool_keys=kv.keys, pool_values=kv.values,
                   new_keys=jnp.zeros(shape, kv.keys.dtype),
                   new_values=jnp.zeros(shape, kv.values.dtype),
                   chunk=rows // block_tables.shape[0])

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
        batch = self.context_len.shape[0]
        split = lambda a: a.reshape(batch, self.chunk, *a.shape[1:])   # noqa: E731
        # Gathered from the pool directly: slicing the layer out first would copy it.
        pool_k = self.pool_keys[layer, self.context_slots]
        pool_v = self.pool_values[layer, self.context_slots]
        out = paged_attention(split(q), pool_k, pool_v, self.context_len, split(k), split(v),
                              split(self.valid))
        kind = dataclasses.replace(self, new_keys=self.new_keys.at[layer].set(k),
                                   new_values=self.new_values.at[layer].set(v))
        return out.reshape(q.shape), kind


def write_rows(kv: PagedKV, slots: Int[Array, "BC"], new_keys: Float[Array, "L BC n_kv h"],
               new_values: Float[Array, "L BC n_kv h"]) -> PagedKV:
    """The pool with a step's new rows stored at ``slots`` (slot S, past the end: dropped).
    Jitted with the pool donated, the scatter is in place."""
    return PagedKV(keys=kv.keys.at[:, slots].set(new_keys.astype(kv.keys.dtype), mode="drop"),
                   values=kv.values.at[:, slots].set(new_values.astype(kv.values.dtype),
                                                     mode="drop"))


WRITE_ROWS = jax.jit(write_rows, donate_argnums=0)

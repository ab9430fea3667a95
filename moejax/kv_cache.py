"""The KV cache of the generation loop, its shape buckets, and attention over it.

One cache holds the keys and values of every layer, stacked on a leading layer axis:
``keys``, ``values`` [L, B, S, n_kv, h] (layer l's cache is ``keys[l]``, the per-layer
``[batch, max_len, kv_heads, head_dim]`` layout). Row b holds request b's tokens at
their positions 0, 1, ...: prompts are right-padded, so a token's cache slot is its
position and no per-row offset exists. Slots past a row's current length may hold junk
(prefill writes the padding's keys too); attention masks them, and decoding overwrites
them in order.

S (the cache length) and B (the batch) come from :func:`moejax.sizes.bucket`: powers of two, so a
handful of compiled programs serve every batch.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax.attention import MASK_VALUE, Window, group_sinks, in_window, softmax_with_sinks
from moejax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """keys, values: [L, B, S, n_kv, h] in the compute dtype."""

    keys: Float[Array, "L B S n_kv hk"]
    values: Float[Array, "L B S n_kv hv"]

    @property
    def length(self) -> int:
        """S, the number of slots per row."""
        return self.keys.shape[2]


def empty_cache(cfg: ModelConfig, batch: int, length: int, dtype) -> KVCache:
    """Zeroed cache [L, batch, length, n_kv, h]."""
    heads, key_dim, value_dim = cfg.kv_store_dims
    shape = (cfg.num_layers, batch, length, heads)
    return KVCache(keys=jnp.zeros((*shape, key_dim), dtype),
                   values=jnp.zeros((*shape, value_dim), dtype))


def write_prompt(cache: KVCache, layer: int | Int[Array, ""], keys: Float[Array, "B P n_kv hk"],
                 values: Float[Array, "B P n_kv hv"]) -> KVCache:
    """Store layer ``layer``'s prompt keys/values [B, P, n_kv, h] in slots [0, P)."""
    start = (layer, 0, 0, 0, 0)
    return KVCache(
        keys=jax.lax.dynamic_update_slice(cache.keys, keys[None].astype(cache.keys.dtype), start),
        values=jax.lax.dynamic_update_slice(cache.values, values[None].astype(cache.values.dtype),
                                            start))


def write_token(cache: KVCache, layer: int | Int[Array, ""], positions: Int[Array, "B"],
                keys: Float[Array, "B n_kv hk"], values: Float[Array, "B n_kv hv"]) -> KVCache:
    """Store one new token per row: keys/values [B, n_kv, h] at slot ``positions[b]`` [B]."""
    rows = jnp.arange(positions.shape[0])
    return KVCache(keys=cache.keys.at[layer, rows, positions].set(keys.astype(cache.keys.dtype)),
                   values=cache.values.at[layer, rows, positions].set(
                       values.astype(cache.values.dtype)))


def attend_cache(q: Float[Array, "B n_q h"], keys: Float[Array, "B S n_kv h"],
                 values: Float[Array, "B S n_kv hv"], lengths: Int[Array, "B"], *,
                 sinks: Float[Array, "n_q"] | None = None,
                 window: Window | None = None) -> Float[Array, "B n_q hv"]:
    """One query per row over its cached keys: q [B, n_q, h], keys [B, S, n_kv, h], values
    [B, S, n_kv, hv] (one layer), ``lengths`` [B] = valid slots (the query's position + 1)
    -> [B, n_q, hv].

    Grouped-query attention as in :mod:`moejax.attention`: f32 scores, softmax, then the
    weighted sum of values in f32. ``sinks`` [n_q] (extra softmax column per head) and
    ``window`` (slot s = position s is visible when ``lengths - 1 - s < window``): as in
    :mod:`moejax.attention`.
    """
    b, n_q, h = q.shape
    s, n_kv = keys.shape[1], keys.shape[2]
    queries = q.reshape(b, n_kv, n_q // n_kv, h)
    scores = jnp.einsum("bkgh,bskh->bkgs", queries, keys,
                        preferred_element_type=jnp.float32) / math.sqrt(h)
    slot = jnp.arange(s, dtype=lengths.dtype)[None, :]
    visible = slot < lengths[:, None]                                                # [B, S]
    if window is not None:
        visible = visible & in_window(lengths[:, None] - 1, slot, window)
    scores = jnp.where(visible[:, None, None, :], scores, MASK_VALUE)
    sinks = group_sinks(sinks, n_kv)
    probs = softmax_with_sinks(scores, None if sinks is None else sinks[None]
                               ).astype(values.dtype)
    out = jnp.einsum("bkgs,bskh->bkgh", probs, values, preferred_element_type=jnp.float32)
    return out.reshape(b, n_q, values.shape[-1]).astype(q.dtype)

"""The static-batching runtime's dense KV cache, attention over it, and the two
attention kinds that fill and read it (:class:`PromptToCache`, :class:`CacheSlots`).

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
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moejax.attention import Window, attend_rows, in_window
from moejax.attention_kinds import PackedCausal
from moejax.config import ModelConfig
from moejax.layers import LayerParams, attention_options, expand_kv, project_kv, project_q


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
    slot = jnp.arange(keys.shape[1], dtype=lengths.dtype)[None, :]
    visible = slot < lengths[:, None]                                                # [B, S]
    if window is not None:
        visible = visible & in_window(lengths[:, None] - 1, slot, window)
    return attend_rows(q, keys, values, visible, sinks)


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PromptToCache:
    """Generation prefill: right-padded prompts flattened to [B·P] (one prompt per
    attention block of P tokens), attended causally; each layer's keys/values fill the
    prompt slots [0, P) of a KV cache [L, B, S, n_kv, h]."""

    packed: PackedCausal
    cache: KVCache

    @property
    def prompt_len(self) -> int:
        return self.packed.attn_block

    def carry(self) -> Any:
        return self.cache

    def with_carry(self, carry: Any) -> "PromptToCache":
        return dataclasses.replace(self, cache=carry)

    def valid_rows(self, rows: jax.Array | None) -> jax.Array | None:
        return self.packed.valid_rows(rows)

    def attend(self, p: LayerParams, layer, h_in: Float[Array, "T d"],
               rows: Int[Array, "r"] | None, cfg: ModelConfig):
        k, v = self.packed.keys_values(p, h_in, cfg)
        out = self.packed.attend_to(p, h_in, k, v, rows, cfg, layer)
        batch = k.shape[0] // self.prompt_len
        cache = write_prompt(self.cache, layer, k.reshape(batch, self.prompt_len, *k.shape[1:]),
                             v.reshape(batch, self.prompt_len, *v.shape[1:]))
        return out, dataclasses.replace(self, cache=cache)


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheSlots:
    """Decode: one token per row at ``positions`` [B]; its key/value go to the row's
    cache slot first, then it attends over slots [0, position]. ``active`` [B] bool:
    rows still generating (the others are computed but kept out of the experts)."""

    positions: jax.Array
    active: jax.Array
    cache: KVCache

    def carry(self) -> Any:
        return self.cache

    def with_carry(self, carry: Any) -> "CacheSlots":
        return dataclasses.replace(self, cache=carry)

    def valid_rows(self, rows: jax.Array | None) -> Bool[Array, "B"] | None:
        return self.active if rows is None else None

    def attend(self, p: LayerParams, layer, h_in: Float[Array, "B d"],
               rows: Int[Array, "r"] | None, cfg: ModelConfig):
        if rows is not None:
            raise ValueError("decode attention runs every row (rows must be None)")
        q = project_q(p, h_in, self.positions, cfg)
        k, v = project_kv(p, h_in, self.positions, cfg)
        cache = write_token(self.cache, layer, self.positions, k, v)
        keys, values = expand_kv(p, cache.keys[layer], cache.values[layer], cfg)
        extra = attention_options(p, layer, cfg)
        out = attend_cache(q, keys, values, self.positions + 1, **extra)
        return out, dataclasses.replace(self, cache=cache)

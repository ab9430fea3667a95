"""The one KV pool type: keys and values (or MLA's latents) of every layer in token
slots grouped into 16-token blocks, and the optional expert-count signature cache.

Scoring's prefix cache and every generation runtime keep their keys/values in a
:class:`KVPool`: the same layout (``[L, S, n_kv, h]``, slot ``block · 16 + offset``),
the same blocks (kept by :class:`moejax.kv.BlockAllocator`, named by the chain hash of
:mod:`moejax.prefix_hash`), written by :func:`write_rows` (scoring's pooled steps write
in their own program, :mod:`moejax.attention_kinds`). So a pool written by scoring is read
by generation through the same block ids, with no copy (:class:`moejax.kv.KVStore`).

The signature cache (ELDR, optional): ``expert_counts`` [blocks, L, E] int8, one count per
(KV block, MoE layer, expert): how many of the block's tokens have the expert in their
top-k at the layer. :func:`write_rows` keeps it in the same program that writes the
keys/values (a token at offset 0 of a block starts the block afresh), so a block's
counts always describe the tokens it holds, also when a later prompt reuses it from the
prefix cache, and a request's prompt counts are the sum over its blocks
(:func:`sum_block_counts`). A block holds at most 16 tokens and a token names an expert
at most once per layer, so a count never passes 16.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax.config import ModelConfig
from moejax.prefix_hash import BLOCK_SIZE


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVPool:
    """keys, values: [L, S, n_kv, h] (MLA: the latent and the RoPE key, each with its
    own last dim), S = num_blocks · BLOCK_SIZE token slots, block b's token at offset o
    in slot ``b · BLOCK_SIZE + o``; expert_counts: the signature cache
    [num_blocks, L, E] int8, or None (module docstring)."""

    keys: Float[Array, "L S n_kv hk"]
    values: Float[Array, "L S n_kv hv"]
    expert_counts: Int[Array, "NB L E"] | None = None

    @property
    def num_slots(self) -> int:
        return int(self.keys.shape[1])


def block_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """Bytes of one block of keys and values over every layer."""
    return BLOCK_SIZE * cfg.kv_bytes_per_token(itemsize)


def expert_count_bytes(cfg: ModelConfig) -> int:
    """Bytes of one block's signature-cache counts (one int8 per layer and expert)."""
    return cfg.num_layers * cfg.num_experts


def empty_pool(cfg: ModelConfig, num_blocks: int, dtype: Any, device: Any = None,
               expert_counts: bool = False, counts_device: Any = None) -> KVPool:
    """A zeroed pool of ``num_blocks`` blocks (placed on ``device``: a device or sharding),
    with a zeroed signature cache when ``expert_counts`` (on ``counts_device``, default
    ``device``: a pool sharded on its slot axis shards the cache on its block axis)."""
    heads, key_dim, value_dim = cfg.kv_store_dims
    shape = (cfg.num_layers, num_blocks * BLOCK_SIZE, heads)
    counts = (jnp.zeros((num_blocks, cfg.num_layers, cfg.num_experts), jnp.int8,
                        device=device if counts_device is None else counts_device)
              if expert_counts else None)
    return KVPool(keys=jnp.zeros((*shape, key_dim), dtype, device=device),
                  values=jnp.zeros((*shape, value_dim), dtype, device=device),
                  expert_counts=counts)


def write_rows(kv: KVPool, slots: Int[Array, "BC"], new_keys: Float[Array, "L BC n_kv hk"],
               new_values: Float[Array, "L BC n_kv hv"],
               experts: Int[Array, "L BC k"] | None = None) -> KVPool:
    """The pool with a step's new rows stored at ``slots`` (slot S, past the end: dropped),
    and, when the pool keeps a signature cache and ``experts`` (the rows' top-k ids) is
    given, their expert counts added to their blocks'. Jitted with the pool donated, the
    scatters are in place."""
    counts = kv.expert_counts
    if counts is not None and experts is not None:
        counts = count_experts(counts, slots, experts)
    return KVPool(keys=kv.keys.at[:, slots].set(new_keys.astype(kv.keys.dtype), mode="drop"),
                  values=kv.values.at[:, slots].set(new_values.astype(kv.values.dtype),
                                                    mode="drop"),
                  expert_counts=counts)


def count_experts(counts: Int[Array, "NB L E"], slots: Int[Array, "T"],
                  experts: Int[Array, "L T k"]) -> Int[Array, "NB L E"]:
    """``counts`` with each written token's top-k experts counted in its block: a token at
    offset 0 starts its block afresh (blocks fill in order, so that token is the block's
    first since it was allocated); unwritten rows (slot S) count nowhere."""
    num_blocks = counts.shape[0]
    block = slots // BLOCK_SIZE                                 # num_blocks: past the end
    fresh = jnp.where(slots % BLOCK_SIZE == 0, block, num_blocks)
    counts = counts.at[fresh].set(0, mode="drop")
    layers = jnp.arange(experts.shape[0])[:, None, None]
    return counts.at[block[None, :, None], layers, experts].add(
        jnp.ones(experts.shape, counts.dtype), mode="drop")


def sum_block_counts(counts: Int[Array, "NB L E"], tables: Int[Array, "H MB"]
                     ) -> Int[Array, "H L E"]:
    """Each table's raw prompt counts: the sum of its blocks' counts (int32); table
    entries past the pool (>= num_blocks) are padding and add nothing."""
    gathered = jnp.take(counts, tables, axis=0, mode="fill", fill_value=0)
    return gathered.astype(jnp.int32).sum(axis=1)


SUM_BLOCK_COUNTS = jax.jit(sum_block_counts)


WRITE_ROWS = jax.jit(write_rows, donate_argnums=0)

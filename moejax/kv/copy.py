"""Copying KV blocks from one pool to another, on any devices: a gather of the source
blocks' slots, then one scatter into the destination pool (donated). Used where a
sequence's prompt blocks change pools: a prefill engine handing a prompt to a decoder on
another device (``moejax.core.decoders``). Scoring and generation on one device share one
pool (``moejax.kv.store``) and copy nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from moejax.kv.pool import WRITE_ROWS, KVPool
from moejax.kv.blocks import block_slots
from moejax.sizes import bucket
from moejax.prefix_hash import BLOCK_SIZE


def _gather_slots(keys: jax.Array, values: jax.Array, slots: jax.Array
                  ) -> tuple[jax.Array, jax.Array]:
    return keys[:, slots], values[:, slots]


GATHER_SLOTS = jax.jit(_gather_slots)


def copy_blocks(source: Any, source_blocks: Sequence[int], kv: KVPool,
                dest_blocks: Sequence[int], device: Any) -> KVPool:
    """``kv`` (consumed) with blocks ``dest_blocks`` holding the keys/values of
    ``source_blocks`` of the pool ``source`` (keys/values [L, S', n_kv, h], on any device
    or split over ranks; blocks numbered over the whole pool).
    Block counts are padded to a power of two (few compiled shapes): padding reads
    block 0 and writes nowhere. Returns once the source has been read."""
    count = bucket(len(source_blocks), 1)
    read = block_slots(source_blocks, BLOCK_SIZE, count, pad_slot=0)
    write = block_slots(dest_blocks, BLOCK_SIZE, count, pad_slot=kv.num_slots)  # S: dropped
    keys, values = GATHER_SLOTS(source.keys, source.values, read)
    jax.block_until_ready((keys, values))    # the source may be donated once we return
    if isinstance(device, NamedSharding):
        # A pool split over ranks: the rows go to every rank's device, and the write keeps
        # those of the destination blocks' rank (any block count, any rank count).
        device = NamedSharding(device.mesh, PartitionSpec())
    keys, values = jax.device_put((keys, values), device)
    return WRITE_ROWS(kv, write, keys, values)

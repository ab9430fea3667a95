"""The one block allocator (``moejax.kv.BlockAllocator``) that scoring's prefix cache and
generation's paged pool both keep their blocks with, and the pool slot arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.kv import BlockAllocator, OutOfBlocks, block_slots
from moejax.prefix_hash import block_hashes


def test_states_reuse_and_lru_eviction():
    blocks = BlockAllocator(3)
    hashes = block_hashes(np.arange(48), 16)
    assert blocks.match(hashes) == [] and blocks.lookups == 3 and blocks.hits == 0
    a = blocks.allocate(2)
    assert a == [0, 1] and blocks.num_in_use == 2 and blocks.num_available == 1
    assert blocks.name(a[0], hashes[0]) and blocks.name(a[1], hashes[1])
    assert not blocks.name(a[0], hashes[2])        # this block has a name already
    b = blocks.allocate(1)
    assert not blocks.name(b[0], hashes[0])        # that name is another block's
    blocks.release(b)                              # anonymous: free again at once
    blocks.release(a)
    assert blocks.num_cached == 2 and blocks.num_available == 3 and blocks.num_named == 2
    assert blocks.lookup([hashes[0], b"x" * 16]) == [a[0]] and blocks.hits == 0
    assert blocks.match(hashes) == a and blocks.hits == 2 and blocks.lookups == 6
    assert blocks.num_cached == 0 and blocks.refs[a[0]] == 1    # back in use, pinned
    blocks.acquire([a[0]])
    assert blocks.refs[a[0]] == 2
    blocks.release([a[0], a[0], a[1]])             # released a[0] first: the oldest
    fresh = blocks.allocate(2)                     # the free one first, then the oldest
    assert fresh == [b[0], a[0]] and blocks.evictions == 1
    assert blocks.lookup(hashes) == []             # the chain starts with the evicted block
    assert blocks.lookup(hashes[1:2]) == [a[1]]
    with pytest.raises(OutOfBlocks, match="asked for 2 KV blocks, 1 available"):
        blocks.allocate(2)
    assert blocks.num_available == 1               # a refused allocation takes nothing
    blocks.release(fresh)
    with pytest.raises(ValueError, match="released more often"):
        blocks.release([fresh[0]])
    with pytest.raises(ValueError, match="is free: nothing to share"):
        blocks.acquire([fresh[0]])
    with pytest.raises(ValueError, match="not in use"):
        blocks.name(fresh[0], hashes[2])


def test_the_last_freed_block_is_handed_out_first():
    blocks = BlockAllocator(4)
    first = blocks.allocate(4)
    assert first == [0, 1, 2, 3]
    blocks.release([2])
    blocks.release([0])
    assert blocks.allocate(2) == [0, 2]


def test_events_are_recorded_only_when_asked():
    hashes = block_hashes(np.arange(32), 16)
    for record in (True, False):
        blocks = BlockAllocator(1, record_events=record)
        (block,) = blocks.allocate(1)
        blocks.name(block, hashes[0])
        blocks.release([block])
        (again,) = blocks.allocate(1)              # evicts hashes[0]
        blocks.name(again, hashes[1])
        stored, evicted = blocks.drain_events()
        assert (stored, evicted) == (([hashes[0], hashes[1]], [hashes[0]]) if record
                                     else ([], []))
        assert blocks.drain_events() == ([], [])
        assert blocks.evictions == 1


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "3"])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="at least one block"):
        BlockAllocator(bad)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        BlockAllocator(4, bad)


def test_block_slots():
    np.testing.assert_array_equal(block_slots([2, 0], 4), [8, 9, 10, 11, 0, 1, 2, 3])
    np.testing.assert_array_equal(block_slots([1], 2, count=3, pad_slot=99),
                                  [2, 3, 99, 99, 99, 99])
    assert block_slots([], 16).shape == (0,) and block_slots([], 16).dtype == np.int32
    np.testing.assert_array_equal(BlockAllocator(4, 2).slots([3, 1]), [6, 7, 2, 3])
    with pytest.raises(ValueError, match="do not fit a count of 1"):
        block_slots([0, 1], 16, count=1)


def test_forget_names_keeps_what_readers_hold():
    blocks = BlockAllocator(4, record_events=True)
    hashes = block_hashes(np.arange(48), 16)
    held, cached = blocks.allocate(1), blocks.allocate(1)
    blocks.name(held[0], hashes[0])
    blocks.name(cached[0], hashes[1])
    blocks.release(cached)
    blocks.drain_events()
    blocks.forget_names()
    assert blocks.lookup(hashes) == [] and blocks.num_named == 0
    assert blocks.refs[held[0]] == 1 and blocks.num_in_use == 1   # still the reader's
    assert blocks.num_available == 3 and blocks.num_cached == 0
    assert sorted(blocks.drain_events()[1]) == sorted(hashes[:2])
    blocks.release(held)                                           # anonymous: freed
    assert blocks.num_available == 4


def test_reset_forgets_every_block():
    blocks = BlockAllocator(3, record_events=True)
    hashes = block_hashes(np.arange(32), 16)
    a = blocks.allocate(2)
    blocks.name(a[0], hashes[0])
    blocks.drain_events()
    blocks.reset()
    assert blocks.num_in_use == 0 and blocks.num_named == 0 and blocks.allocate(3) == [0, 1, 2]
    assert blocks.drain_events() == ([], [hashes[0]])


def test_events_stay_bounded_without_a_reader():
    """A pool that names and evicts for a long time with nobody draining keeps a few
    pools' worth of events: the net effect, newest evictions last."""
    blocks = BlockAllocator(2, record_events=True)
    hashes = block_hashes(np.arange(16 * 400), 16)
    for digest in hashes:
        [block] = blocks.allocate(1)
        blocks.name(block, digest)
        blocks.release([block])
    stored, evicted = blocks.drain_events()
    assert len(stored) + len(evicted) <= 2 * (4 * 2 + 64)
    assert set(stored) >= {hashes[-1], hashes[-2]}          # what the pool holds now
    assert hashes[-3] in evicted and not set(stored) & set(evicted)


def test_a_store_shares_one_pool_and_its_allocators():
    import jax.numpy as jnp

    from moejax.kv import KVPool, KVStore

    def make():
        return KVPool(keys=jnp.zeros((1, 32, 1, 2)), values=jnp.zeros((1, 32, 1, 2)))

    store = KVStore.single(make, 2)
    first = store.pool
    [block] = store.allocators[0].allocate(1)
    store.reset()
    assert store.epoch == 1 and store.pool is not first
    assert store.allocators[0].num_in_use == 0 and block == 0
    with pytest.raises(ValueError, match="keep 48"):
        KVStore(make, [BlockAllocator(3)])
    with pytest.raises(ValueError, match="at least one block allocator"):
        KVStore(make, [])

"""moejax.packing: placement invariants, shape buckets, unpack, and input validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moejax.model import VocabReadout
from moejax.ops import OpOutput, PrefillOp
from moejax.packing import BucketPolicy, pack, unpack
from moejax.sizes import next_power_of_two, prev_power_of_two


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def make_sequences(lengths, seed=0, vocab=1000, max_positions=1, max_candidates=3,
                   full_vocab=False):
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        num_pos = int(rng.integers(0, max_positions + 1)) if max_positions > 1 else 1
        positions = tuple(sorted(rng.choice(n, size=min(num_pos, n), replace=False).tolist()))
        cands = tuple(tuple(rng.integers(1, vocab, int(rng.integers(1, max_candidates + 1))).tolist())
                      for _ in positions)
        out.append(PrefillOp(key=("seq", i), token_ids=rng.integers(1, vocab, n),
                             score_positions=positions, score_token_ids=cands,
                             full_vocab=full_vocab))
    return out


def check_batches(sequences, hosts, policy):
    """Every invariant of a packing; returns the shape keys."""
    placed = [seq.key for host in hosts for seq in host.sequences]
    assert sorted(placed) == sorted(s.key for s in sequences), "each sequence exactly once"
    assert len(placed) == len(set(placed))
    by_key = {s.key: s for s in sequences}
    keys = []
    for index, host in enumerate(hosts):
        batch, block = host.batch, host.options.attn_block
        tokens = np.asarray(batch.tokens)
        seg = np.asarray(batch.segment_ids)
        pos = np.asarray(batch.positions)
        t = tokens.shape[0]
        assert tokens.dtype == seg.dtype == pos.dtype == np.int32
        assert seg.shape == pos.shape == (t,)
        longest = max(len(s.token_ids) for s in host.sequences)
        # B: power of two, >= min_block and the longest sequence, and tight.
        assert is_power_of_two(block) and block >= policy.min_block and block >= longest
        assert block == max(policy.min_block, next_power_of_two(longest))
        # T: a power-of-two number of blocks, within max_batch_tokens unless one block is
        # already larger (a sequence longer than max_batch_tokens).
        assert t % block == 0 and is_power_of_two(t // block)
        if t > policy.max_batch_tokens:
            assert t == block and block > policy.max_batch_tokens
        # Empty blocks only pad the last batch of a block size, and fill less than half of it.
        empty = sum(not np.any(seg[b * block:(b + 1) * block] >= 0) for b in range(t // block))
        assert 2 * empty < t // block or t == block, f"{empty} empty blocks of {t // block}"
        if empty:
            later = [h for h in hosts[index + 1:] if h.options.attn_block == block]
            assert not later, "only the last batch of a block size is padded with empty blocks"
        # Segments: contiguous, positions 0..n-1, the right tokens, inside one block.
        assert len(host.rows) == len(host.sequences)
        real = 0
        for s_index, seq in enumerate(host.sequences):
            rows = np.nonzero(seg == s_index)[0]
            n = len(seq.token_ids)
            assert len(rows) == n and rows[-1] - rows[0] == n - 1, "segment is contiguous"
            assert rows[0] // block == rows[-1] // block, "segment crosses a block boundary"
            np.testing.assert_array_equal(pos[rows], np.arange(n))
            np.testing.assert_array_equal(tokens[rows], by_key[seq.key].token_ids)
            real += n
        assert real == host.real_tokens == int((seg >= 0).sum())
        assert set(np.unique(seg)) <= set(range(-1, len(host.sequences)))
        # P and C buckets, and where each score row points.
        sp = np.asarray(batch.score_positions)
        ids = np.asarray(batch.score_token_ids)
        num_positions = sum(len(s.score_positions) for s in host.sequences)
        widest = max((len(c) for s in host.sequences for c in s.score_token_ids), default=1)
        assert sp.shape == (max(policy.min_positions, next_power_of_two(num_positions)),)
        assert ids.shape == (sp.shape[0], max(policy.min_candidates, next_power_of_two(widest)))
        assert is_power_of_two(ids.shape[0]) and is_power_of_two(ids.shape[1])
        row = 0
        for s_index, (seq, first) in enumerate(zip(host.sequences, host.rows)):
            assert first == row
            start = np.nonzero(seg == s_index)[0][0]
            for p, cands in zip(seq.score_positions, seq.score_token_ids):
                assert sp[row] == start + p
                np.testing.assert_array_equal(ids[row, :len(cands)], cands)
                assert np.all(ids[row, len(cands):] == 0)
                row += 1
        assert host.options.full_vocab == any(s.full_vocab for s in host.sequences)
        assert host.shape_key == (t, block, sp.shape[0], ids.shape[1], host.options.full_vocab,
                                  0)
        keys.append(host.shape_key)
    # Batches come largest B first; for each B, the block counts are full batches of
    # cap = prev_pow2(max_batch_tokens / B) blocks, then at most one smaller batch.
    blocks = [h.options.attn_block for h in hosts]
    assert blocks == sorted(blocks, reverse=True)
    for b in set(blocks):
        cap = prev_power_of_two(max(1, policy.max_batch_tokens // b))
        counts = [h.batch.tokens.shape[0] // b for h in hosts if h.options.attn_block == b]
        full = [c for c in counts if c == cap]
        rest = counts[len(full):]
        assert counts[:len(full)] == full, counts
        assert len(rest) <= 1 and all(c < cap for c in rest), counts
    return keys


@pytest.mark.parametrize("seed", range(4))
def test_random_packings_keep_invariants(seed):
    rng = np.random.default_rng(100 + seed)
    policy = BucketPolicy(max_batch_tokens=[256, 512, 1000, 4096][seed], min_block=16,
                          min_positions=4, min_candidates=2)
    lengths = rng.integers(1, 300, 120)
    seqs = make_sequences(lengths, seed=seed, max_positions=3, max_candidates=5,
                          full_vocab=bool(seed % 2))
    hosts = pack(seqs, policy)
    check_batches(seqs, hosts, policy)


def test_handpacked_layout():
    policy = BucketPolicy(max_batch_tokens=64, min_block=8, min_positions=2, min_candidates=2)
    seqs = [PrefillOp(key=("seq", i), token_ids=np.arange(1, n + 1), score_positions=(n - 1,),
                      score_token_ids=((1, 2, 3),)) for i, n in enumerate([5, 17, 9, 30])]
    hosts = pack(seqs, policy)
    assert len(hosts) == 1
    host = hosts[0]
    # 30 -> block 0 (2 free); 17 -> block 1; 9, 5 -> best fit: block 1 (17 + 9 + 5 = 31).
    assert host.shape_key == (64, 32, 4, 4, False, 0)
    seg = np.asarray(host.batch.segment_ids)
    assert [s.key[1] for s in host.sequences] == [3, 1, 2, 0]
    np.testing.assert_array_equal(seg[:32], [0] * 30 + [-1] * 2)
    np.testing.assert_array_equal(seg[32:], [1] * 17 + [2] * 9 + [3] * 5 + [-1])
    check_batches(seqs, hosts, policy)


def test_sequence_longer_than_max_batch_tokens():
    policy = BucketPolicy(max_batch_tokens=64, min_block=8)
    # 300 and 260 each open a 512-token block (> max_batch_tokens: one block per batch);
    # the short ones fill the room left in those blocks rather than open new ones.
    seqs = make_sequences([100, 5, 300, 3, 40, 260, 90])
    hosts = pack(seqs, policy)
    check_batches(seqs, hosts, policy)
    assert [h.shape_key[:2] for h in hosts] == [(512, 512), (512, 512)]
    assert sum(h.real_tokens for h in hosts) == 798
    # Alone, a long sequence is a batch of exactly one block.
    (alone,) = pack(make_sequences([65]), policy)
    assert alone.shape_key[:2] == (128, 128)


def test_empty_and_no_score_positions():
    assert pack([], BucketPolicy()) == []
    seqs = [PrefillOp(key="a", token_ids=np.arange(1, 4), score_positions=(),
                      score_token_ids=())]
    (host,) = pack(seqs, BucketPolicy(min_positions=8, min_candidates=2))
    assert host.batch.score_token_ids.shape == (8, 2)
    assert unpack(host, VocabReadout(np.zeros((8, 2)))) == [("a", OpOutput([], None))]


def test_unpack_returns_each_sequences_rows():
    policy = BucketPolicy(max_batch_tokens=128, min_block=8, min_positions=2)
    seqs = make_sequences(np.random.default_rng(3).integers(1, 40, 25), seed=3,
                          max_positions=3, max_candidates=4, full_vocab=True)
    hosts = pack(seqs, policy)
    results = {}
    for host in hosts:
        p, c = host.batch.score_token_ids.shape
        # logits[r, j] encodes (score row, column); lse[r] the score row.
        logits = np.arange(p)[:, None] * 100.0 + np.arange(c)[None, :]
        lse = -np.arange(p, dtype=np.float64)
        for key, out in unpack(host, VocabReadout(logits, lse)):
            results[key] = (host, out.logits, out.logsumexp)
        assert all(r[1] == [] or r[2] is not None for r in results.values())
        assert unpack(host, VocabReadout(logits))[0][1].logsumexp is None
    assert sorted(results) == sorted(s.key for s in seqs)
    for seq in seqs:
        host, per_position, lse_rows = results[seq.key]
        row = host.rows[host.sequences.index(seq)]
        assert len(per_position) == len(seq.score_positions) == len(lse_rows)
        for j, ids in enumerate(seq.score_token_ids):
            np.testing.assert_array_equal(per_position[j], (row + j) * 100.0 + np.arange(len(ids)))
            assert lse_rows[j] == -(row + j)
        # and the row really is this sequence's score position
        sp = np.asarray(host.batch.score_positions)
        seg = np.asarray(host.batch.segment_ids)
        for j in range(len(seq.score_positions)):
            assert host.sequences[seg[sp[row + j]]] is seq


def test_few_distinct_shapes_for_500_random_lengths():
    policy = BucketPolicy(max_batch_tokens=1024, min_block=32, min_positions=8, min_candidates=2)
    rng = np.random.default_rng(7)
    min_len, max_len = 16, 400
    lengths = rng.integers(min_len, max_len + 1, 500)
    seqs = make_sequences(lengths, seed=7, max_candidates=2)
    hosts = pack(seqs, policy)
    keys = check_batches(seqs, hosts, policy)
    # Bound from the policy: B is a power of two in [min_block, block_for(max_len)]
    # (32..512 here); a batch of B has a power-of-two number of blocks up to
    # cap(B) = prev_pow2(max_batch_tokens / B), so B allows log2(cap(B)) + 1 values of T:
    # 6 + 5 + 4 + 3 + 2 = 20 (T, B) pairs. P: one score position per sequence and at most
    # max_batch_tokens / min_len sequences per batch -> powers of two in
    # [8, next_pow2(1024 / 16) = 64]: 4 values. C is 2 (1-2 candidates), full_vocab False.
    block_sizes = [policy.min_block << i for i in range(
        int(math.log2(policy.block_for(max_len) // policy.min_block)) + 1)]
    num_tb = sum(int(math.log2(prev_power_of_two(policy.max_batch_tokens // b))) + 1
                 for b in block_sizes)
    num_p = int(math.log2(next_power_of_two(policy.max_batch_tokens // min_len)
                          // policy.min_positions)) + 1
    assert (len(block_sizes), num_tb, num_p) == (5, 20, 4)
    tb_pairs = {(k[0], k[1]) for k in keys}
    assert len(tb_pairs) <= num_tb
    assert {k[3] for k in keys} == {2} and {k[4] for k in keys} == {False}
    assert len(set(keys)) <= num_tb * num_p
    # In practice far fewer: per B, full batches share one key and the remainder adds at
    # most log2(cap(B)) more (T, B) pairs.
    assert len(set(keys)) <= 16, sorted(set(keys))
    # And the batches are well filled: padding is a modest share of the tokens.
    total = sum(h.batch.tokens.shape[0] for h in hosts)
    assert sum(h.real_tokens for h in hosts) / total > 0.7


# ----------------------------------------------------------------------------- validation
def test_empty_sequence_is_refused():
    with pytest.raises(ValueError, match=r"sequence 'req-7' is empty"):
        PrefillOp(key="req-7", token_ids=np.zeros(0, np.int32), score_positions=(),
                  score_token_ids=())


@pytest.mark.parametrize("position", [5, 17, -1])
def test_score_position_out_of_range_is_refused(position):
    with pytest.raises(ValueError, match=rf"sequence 'req-8'.*\[{position}\].*\[0, 5\)"):
        PrefillOp(key="req-8", token_ids=np.arange(5), score_positions=(0, position),
                  score_token_ids=((1,), (2,)))


def test_mismatched_candidate_lists_are_refused():
    with pytest.raises(ValueError, match=r"sequence 'req-9': 2 score positions but 1"):
        PrefillOp(key="req-9", token_ids=np.arange(5), score_positions=(0, 1),
                  score_token_ids=((1,),))


@pytest.mark.parametrize("kwargs", [dict(max_batch_tokens=0), dict(min_block=-4),
                                    dict(min_positions=1.5), dict(max_batch_tokens=16,
                                                                  min_block=32)])
def test_bad_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        BucketPolicy(**kwargs)


def test_token_buckets():
    assert BucketPolicy(max_batch_tokens=256, min_block=32).token_buckets(100) == [32, 64, 128, 256]

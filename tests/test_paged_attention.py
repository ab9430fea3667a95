"""Paged attention (``moejax.decode.paged.paged_attention``) against a float64 NumPy
reference: rows of several segments (one sequence spanning consecutive rows), pooled
contexts read over several loop iterations, padding rows, grouped-query heads."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

from moejax.decode.paged import BLOCK_SIZE, paged_attention

LAYERS, BLOCKS, N_KV, GROUPS, H = 2, 12, 2, 2, 8


def _reference(q, pool_k, pool_v, layer, tables, context_len, new_k, new_v, segments,
               positions, valid):
    """Per query: softmax over its row's pooled slots below context_len and the step's
    new keys of its segment at positions <= its own (valid ones), in float64."""
    b, c, n_q, h = q.shape
    slots = (tables[:, :, None] * BLOCK_SIZE + np.arange(BLOCK_SIZE)).reshape(len(tables), -1)
    flat_pos, flat_seg = positions.reshape(-1), np.repeat(segments, c)
    out = np.zeros((b, c, n_q, h))
    for row in range(b):
        pooled = slots[row, :context_len[row]]
        for col in range(c):
            fresh = (flat_seg == segments[row]) & (flat_pos <= positions[row, col]) & valid
            for head in range(n_q):
                kv = head // (n_q // N_KV)
                keys = np.concatenate([pool_k[layer, pooled, kv], new_k[fresh, kv]])
                values = np.concatenate([pool_v[layer, pooled, kv], new_v[fresh, kv]])
                if len(keys) == 0:
                    continue
                scores = keys @ q[row, col, head] / np.sqrt(h)
                probs = np.exp(scores - scores.max())
                out[row, col, head] = probs @ values / probs.sum()
    return out


def test_paged_attention_matches_float64_reference():
    rng = np.random.default_rng(0)
    rows, width = 5, 4
    pool_k = rng.standard_normal((LAYERS, BLOCKS * BLOCK_SIZE, N_KV, H))
    pool_v = rng.standard_normal((LAYERS, BLOCKS * BLOCK_SIZE, N_KV, H))
    # Segment 0: rows 0-1 (a 7-token chunk after 37 pooled tokens: three loop iterations
    # of 16 slots); segment 1: row 2 (2 tokens after 5 pooled); segment 2: row 3 (no
    # pooled context); row 4: padding.
    segments = np.array([0, 0, 1, 2, -1], np.int32)
    context_len = np.array([37, 37, 5, 0, 0], np.int32)
    counts = [4, 3, 2, 4, 0]
    tables = np.zeros((rows, 4), np.int32)
    tables[0] = tables[1] = [7, 2, 9, 4]
    tables[2, :1] = [11]
    positions = np.zeros((rows, width), np.int32)
    valid = np.zeros((rows, width), bool)
    positions[0], positions[1, :3] = np.arange(37, 41), np.arange(41, 44)
    positions[2, :2], positions[3] = [5, 6], np.arange(4)
    for row, n in enumerate(counts):
        valid[row, :n] = True
    q = rng.standard_normal((rows, width, N_KV * GROUPS, H))
    new_k = rng.standard_normal((rows * width, N_KV, H))
    new_v = rng.standard_normal((rows * width, N_KV, H))
    layer = 1
    got = paged_attention(
        jnp.asarray(q, jnp.float32), jnp.asarray(pool_k, jnp.float32),
        jnp.asarray(pool_v, jnp.float32), jnp.int32(layer),
        jnp.asarray(tables), jnp.asarray(context_len),
        jnp.asarray(new_k, jnp.float32), jnp.asarray(new_v, jnp.float32),
        jnp.asarray(segments), jnp.asarray(positions), jnp.asarray(valid.reshape(-1)),
        chunk_blocks=1)
    want = _reference(q, pool_k, pool_v, layer, tables, context_len, new_k, new_v, segments,
                      positions, valid.reshape(-1))
    got = np.asarray(got)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[valid], want[valid], rtol=2e-5, atol=2e-5)
    assert np.abs(want[0, 0]).max() > 0.05          # the pooled part carries weight

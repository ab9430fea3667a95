"""The attention options for other model families, against a float64 NumPy reference:
attention sinks (GPT-OSS), sliding windows (a Python int or a traced scalar), a value
head dim other than the query/key one (multi-head latent attention), and the defaults.

Every function of ``moejax.attention`` (both tilings of ``packed_attention``, the at-rows
and prefix-context variants), ``kv_cache.attend_cache`` and ``decode.paged.paged_attention``
runs on tiny random inputs; the reference is written plainly here: per query and head,
softmax over the visible keys' scores (plus the sink logit, whose column is dropped) and
the weighted sum of their values. Visibility: same segment (or a context entry the
segment reads), key position <= query position, and ``p_q - p_k < window``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import attention
from moejax.decode.paged import BLOCK_SIZE, paged_attention
from moejax.static.cache import attend_cache

N_Q, N_KV, H = 4, 2, 8
MLA_H, MLA_HV = 12, 8            # a value head dim other than the query/key one
BIG = 1000                       # a window larger than any context here
TOL = dict(rtol=1e-5, atol=1e-5)


def reference(q, keys, values, sinks=None):
    """float64 attention of q [Q, n_q, h]: query i over its visible keys ``keys[i]``
    [K_i, n_kv, h] and values ``values[i]`` [K_i, n_kv, hv]; ``sinks`` [n_q] or None.
    -> [Q, n_q, hv]."""
    q = np.asarray(q, np.float64)
    n_q, h = q.shape[1:]
    out = np.zeros((len(q), n_q, values[0].shape[-1]))
    for i in range(len(q)):
        k, v = np.asarray(keys[i], np.float64), np.asarray(values[i], np.float64)
        for head in range(n_q):
            kv = head // (n_q // k.shape[1])            # grouped-query heads
            scores = k[:, kv] @ q[i, head] / np.sqrt(h)
            if sinks is not None:
                scores = np.append(scores, np.float64(sinks[head]))
            probs = np.exp(scores - scores.max())
            probs = probs / probs.sum()
            out[i, head] = probs[:len(k)] @ v[:, kv]   # the sink column is dropped
    return out


def near(q_pos, k_pos, window):
    """Sliding-window visibility (transformers: kv_idx > q_idx - sliding_window)."""
    diff = np.asarray(q_pos) - np.asarray(k_pos)
    return np.ones(diff.shape, bool) if window is None else diff < window


# ------------------------------------------------------------------ packed batch layout
# Two attention blocks of 16 rows. Block 0: segment 0 continues a 5-token cached prefix
# (positions 5..11), segment 1 is fresh (0..5), 3 padding rows. Block 1: segments 2 and 3
# are siblings continuing one 3-token prefix (positions 3..12 and 3..6), 2 padding rows.
BLOCK = 16
SEGMENTS = np.array([0] * 7 + [1] * 6 + [-1] * 3 + [2] * 10 + [3] * 4 + [-1] * 2, np.int32)
POSITIONS = np.concatenate([np.arange(5, 12), np.arange(6), np.zeros(3), np.arange(3, 13),
                            np.arange(3, 7), np.zeros(2)]).astype(np.int32)
REAL = np.flatnonzero(SEGMENTS >= 0)
ROWS = np.array([0, 6, 9, 12, 16, 24, 27, 29], np.int32)     # queries of the at-rows variants
# Prefix context: Cp = 8 entries per block, listed out of position order (as pool slots
# are); unused entries have lo > hi.
CP = 8
# Block 0: positions 0..4 read by segment 0; block 1: positions 0..2 read by segments 2-3.
CTX_POS = np.array([[3, 0, 4, 1, 2, 0, 0, 0], [2, 0, 0, 1, 0, 0, 0, 0]], np.int32)
CTX_LO = np.array([[0, 0, 0, 0, 0, 1, 1, 1], [2, 2, 1, 2, 1, 1, 1, 1]], np.int32)
CTX_HI = np.array([[0, 0, 0, 0, 0, 0, 0, 0], [3, 3, 0, 3, 0, 0, 0, 0]], np.int32)


def packed_data(h, hv, seed=0):
    rng = np.random.default_rng(seed)
    t = len(SEGMENTS)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    return dict(q=f(t, N_Q, h) * 1.5, k=f(t, N_KV, h) * 1.5, v=f(t, N_KV, hv),
                ctx_k=f(2, CP, N_KV, h) * 1.5, ctx_v=f(2, CP, N_KV, hv), sinks=f(N_Q) + 1.0)


def packed_reference(d, rows, sinks, window, context):
    """Reference of the queries at flat ``rows``: own segment, causal (rows of a segment
    are at increasing positions), window; with ``context``, the block's context entries
    read by the query's segment too."""
    keys, values = [], []
    for r in rows:
        own = ((SEGMENTS == SEGMENTS[r]) & (np.arange(len(SEGMENTS)) <= r)
               & near(POSITIONS[r], POSITIONS, window))
        k, v = [d["k"][own]], [d["v"][own]]
        if context:
            b = r // BLOCK
            read = ((CTX_LO[b] <= SEGMENTS[r]) & (SEGMENTS[r] <= CTX_HI[b])
                    & near(POSITIONS[r], CTX_POS[b], window))
            k.insert(0, d["ctx_k"][b, read])
            v.insert(0, d["ctx_v"][b, read])
        keys.append(np.concatenate(k))
        values.append(np.concatenate(v))
    return reference(d["q"][rows], keys, values, sinks)


def _packed(tiling):
    def call(d, sinks=None, window=None):
        return attention.packed_attention(
            d["q"], d["k"], d["v"], jnp.asarray(SEGMENTS), BLOCK, tiling=tiling,
            **_options(sinks, window, positions=jnp.asarray(POSITIONS)))[REAL]
    return call, lambda d, sinks, window: packed_reference(d, REAL, sinks, window, False)


def _options(sinks, window, **positions):
    """The keyword options to pass (none at all for the defaults)."""
    out = {}
    if sinks is not None:
        out["sinks"] = sinks
    if window is not None:
        out.update(window=window, **positions)
    return out


def _at_rows(d, sinks=None, window=None):
    return attention.attention_at_rows(
        d["q"][ROWS], d["k"], d["v"], jnp.asarray(SEGMENTS), jnp.asarray(ROWS), BLOCK,
        **_options(sinks, window, positions=jnp.asarray(POSITIONS)))


def _context(d, sinks=None, window=None):
    return attention.context_attention(
        d["q"], d["k"], d["v"], jnp.asarray(SEGMENTS), BLOCK, d["ctx_k"], d["ctx_v"],
        jnp.asarray(CTX_LO), jnp.asarray(CTX_HI),
        **_options(sinks, window, positions=jnp.asarray(POSITIONS),
                   ctx_positions=jnp.asarray(CTX_POS)))[REAL]


def _context_at_rows(d, sinks=None, window=None):
    return attention.context_attention_at_rows(
        d["q"][ROWS], d["k"], d["v"], jnp.asarray(SEGMENTS), jnp.asarray(ROWS), BLOCK,
        d["ctx_k"], d["ctx_v"], jnp.asarray(CTX_LO), jnp.asarray(CTX_HI),
        **_options(sinks, window, positions=jnp.asarray(POSITIONS),
                   ctx_positions=jnp.asarray(CTX_POS)))


# ---------------------------------------------------------------------------- KV cache
CACHE_LEN = np.array([1, 7, 12], np.int32)       # valid slots; the query is at len - 1
CACHE_S = 12


def cache_data(h, hv, seed=1):
    rng = np.random.default_rng(seed)
    b = len(CACHE_LEN)
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    return dict(q=f(b, N_Q, h) * 1.5, k=f(b, CACHE_S, N_KV, h) * 1.5,
                v=f(b, CACHE_S, N_KV, hv), sinks=f(N_Q) + 1.0)


def _cache(d, sinks=None, window=None):
    return attend_cache(d["q"], d["k"], d["v"], jnp.asarray(CACHE_LEN),
                        **_options(sinks, window))


def _cache_reference(d, sinks, window):
    keys, values = [], []
    for b, n in enumerate(CACHE_LEN):
        seen = (np.arange(CACHE_S) < n) & near(n - 1, np.arange(CACHE_S), window)
        keys.append(d["k"][b, seen])
        values.append(d["v"][b, seen])
    return reference(d["q"], keys, values, sinks)


# ------------------------------------------------------------------------ paged attention
# 4 rows of 3 tokens: segment 0 spans rows 0-1 (5 tokens after 37 pooled: 3 blocks, read
# one per loop iteration), segment 1 is row 2 (2 tokens after 17 pooled), row 3 padding.
# Pooled positions are the table order; with a window the loop skips whole chunks.
P_LAYERS, P_BLOCKS, P_LAYER = 2, 8, 1
P_SEG = np.array([0, 0, 1, -1], np.int32)
P_CTX = np.array([37, 37, 17, 0], np.int32)
P_TABLES = np.array([[6, 1, 4, 0], [6, 1, 4, 0], [3, 7, 0, 0], [0, 0, 0, 0]], np.int32)
P_POS = np.array([[37, 38, 39], [40, 41, 0], [17, 18, 0], [0, 0, 0]], np.int32)
P_VALID = np.array([[1, 1, 1], [1, 1, 0], [1, 1, 0], [0, 0, 0]], bool)


def paged_data(h, hv, seed=2):
    rng = np.random.default_rng(seed)
    rows, width = P_POS.shape
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    return dict(q=f(rows, width, N_Q, h) * 1.5,
                pool_k=f(P_LAYERS, P_BLOCKS * BLOCK_SIZE, N_KV, h) * 1.5,
                pool_v=f(P_LAYERS, P_BLOCKS * BLOCK_SIZE, N_KV, hv),
                k=f(rows * width, N_KV, h) * 1.5, v=f(rows * width, N_KV, hv),
                sinks=f(N_Q) + 1.0)


def _paged(d, sinks=None, window=None):
    out = paged_attention(d["q"], d["pool_k"], d["pool_v"], jnp.int32(P_LAYER),
                          jnp.asarray(P_TABLES), jnp.asarray(P_CTX), d["k"], d["v"],
                          jnp.asarray(P_SEG), jnp.asarray(P_POS),
                          jnp.asarray(P_VALID.reshape(-1)), 1, **_options(sinks, window))
    return out[np.nonzero(P_VALID)]


def _paged_reference(d, sinks, window):
    width = P_POS.shape[1]
    flat_seg, flat_pos = np.repeat(P_SEG, width), P_POS.reshape(-1)
    flat_valid = P_VALID.reshape(-1)
    keys, values, queries = [], [], []
    for row, col in zip(*np.nonzero(P_VALID)):
        pos = P_POS[row, col]
        pooled = np.arange(P_CTX[row])
        pooled = pooled[near(pos, pooled, window)]
        slots = P_TABLES[row, pooled // BLOCK_SIZE] * BLOCK_SIZE + pooled % BLOCK_SIZE
        fresh = ((flat_seg == P_SEG[row]) & (flat_pos <= pos) & flat_valid
                 & near(pos, flat_pos, window))
        keys.append(np.concatenate([d["pool_k"][P_LAYER, slots], d["k"][fresh]]))
        values.append(np.concatenate([d["pool_v"][P_LAYER, slots], d["v"][fresh]]))
        queries.append(d["q"][row, col])
    return reference(np.stack(queries), keys, values, sinks)


# ------------------------------------------------------------------------------- cases
KINDS = {
    "packed-triangular": (*_packed(attention.AttentionTiling("triangular", 4)), packed_data),
    "packed-flash": (*_packed(attention.AttentionTiling("flash", 4)), packed_data),
    "packed-auto": (*_packed(None), packed_data),        # tiling_for(16): triangular
    "at-rows": (_at_rows, lambda d, s, w: packed_reference(d, ROWS, s, w, False), packed_data),
    "context": (_context, lambda d, s, w: packed_reference(d, REAL, s, w, True), packed_data),
    "context-at-rows": (_context_at_rows,
                        lambda d, s, w: packed_reference(d, ROWS, s, w, True), packed_data),
    "attend-cache": (_cache, _cache_reference, cache_data),
    "paged": (_paged, _paged_reference, paged_data),
}

# name: (head dims, sinks?, window)
VARIANTS = {
    "defaults": ((H, H), False, None),
    "sinks": ((H, H), True, None),
    "window-1": ((H, H), False, 1),
    "window-3": ((H, H), False, 3),
    "window-big": ((H, H), False, BIG),
    "sinks-window": ((H, H), True, 2),
    "mla": ((MLA_H, MLA_HV), False, None),
    "mla-sinks-window": ((MLA_H, MLA_HV), True, 3),
}


def _inputs(kind, dims):
    data = KINDS[kind][2](*dims)
    return {name: jnp.asarray(a) for name, a in data.items()}, data


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_matches_float64_reference(kind, variant):
    call, want_of, _ = KINDS[kind]
    dims, with_sinks, window = VARIANTS[variant]
    d, raw = _inputs(kind, dims)
    got = np.asarray(jax.jit(lambda d: call(d, sinks=d["sinks"] if with_sinks else None,
                                            window=window))(d))
    want = want_of(raw, raw["sinks"] if with_sinks else None, window)
    assert got.shape == want.shape and got.shape[-1] == dims[1]
    np.testing.assert_allclose(got, want, **TOL)
    if with_sinks or window is not None and window < BIG:
        # The option matters on these inputs: the plain reference is far off.
        plain = want_of(raw, None, None)
        assert np.abs(plain - want).max() > 1e-2


@pytest.mark.parametrize("with_sinks", [False, True], ids=["window", "sinks-window"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_traced_window(kind, with_sinks):
    """One compiled program serves every window (a traced scalar): 1, small, larger than
    the context."""
    call, want_of, _ = KINDS[kind]
    d, raw = _inputs(kind, (H, H))
    sinks = raw["sinks"] if with_sinks else None
    run = jax.jit(lambda d, window: call(d, sinks=d["sinks"] if with_sinks else None,
                                         window=window))
    for window in (1, 3, BIG):
        got = np.asarray(run(d, jnp.int32(window)))
        np.testing.assert_allclose(got, want_of(raw, sinks, window), **TOL,
                                   err_msg=f"window {window}")
    assert run._cache_size() == 1


def test_defaults_are_the_plain_attention():
    """The defaults and an explicit None are one computation (bit for bit), and a window
    beyond every context computes the same attention."""
    d, _ = _inputs("packed-flash", (H, H))
    for tiling in (attention.AttentionTiling("flash", 4),
                   attention.AttentionTiling("triangular", 4)):
        args = (d["q"], d["k"], d["v"], jnp.asarray(SEGMENTS), BLOCK)
        plain = np.asarray(attention.packed_attention(*args, tiling=tiling))
        none = np.asarray(attention.packed_attention(*args, tiling=tiling, sinks=None,
                                                     window=None, positions=None))
        np.testing.assert_array_equal(plain[REAL], none[REAL])
        wide = np.asarray(attention.packed_attention(*args, tiling=tiling, window=2 ** 40,
                                                     positions=jnp.asarray(POSITIONS)))
        np.testing.assert_allclose(wide[REAL], plain[REAL], rtol=1e-6, atol=1e-6)


def test_window_needs_positions():
    d, _ = _inputs("packed-flash", (H, H))
    with pytest.raises(ValueError, match="positions"):
        attention.packed_attention(d["q"], d["k"], d["v"], jnp.asarray(SEGMENTS), BLOCK,
                                   window=4)
    with pytest.raises(ValueError, match="ctx_positions"):
        attention.context_attention(d["q"], d["k"], d["v"], jnp.asarray(SEGMENTS), BLOCK,
                                    d["ctx_k"], d["ctx_v"], jnp.asarray(CTX_LO),
                                    jnp.asarray(CTX_HI), positions=jnp.asarray(POSITIONS),
                                    window=4)

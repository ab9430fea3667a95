"""Paged prefill at the causal cost (issue 43): ``paged_attention``'s new-key loop
(the diagonal, then two row offsets per iteration, compacted into B slots) against a
float64 NumPy reference and against the former one-row-offset-per-iteration loop (kept
here as the "row-offset" reference), on layouts of one or several segments, padding
rows, partial last rows, a window, sinks, a pooled context and hv != h; and its work:
``new_row_trips`` iterations of B row-pair blocks, about B(B+1)/2 for one segment of B
rows where the row-offset loop computed B²."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.attention import SoftmaxState, in_window
from moejax.decode import paged
from moejax.decode.paged import BLOCK_SIZE, new_row_trips, paged_attention

LAYERS, LAYER, N_KV, GROUPS, H = 2, 1, 2, 2, 8
TABLE_BLOCKS, CHUNK_BLOCKS = 4, 2


@dataclasses.dataclass(frozen=True)
class Layout:
    """A step: ``rows`` [per segment, its row count], ``context`` [its pooled tokens],
    ``last`` [the valid tokens of its last row, None: all C], ``padding`` rows after."""

    rows: tuple[int, ...]
    context: tuple[int, ...]
    width: int = 4
    last: tuple[int | None, ...] | None = None
    padding: int = 0


LAYOUTS = {
    # One segment spanning every row: span 8, offsets (1, 7), (2, 6), (3, 5), (4, 4).
    "one-segment": Layout(rows=(8,), context=(0,)),
    "one-segment-context": Layout(rows=(8,), context=(21,)),
    # Odd span, the last pair of offsets distinct.
    "one-segment-odd": Layout(rows=(7,), context=(5,), padding=1),
    # Segments of 3, 1 and 4 rows and two padding rows (span 4).
    "mixed": Layout(rows=(3, 1, 4), context=(17, 3, 0), padding=2),
    # Two segments of the span: offsets (1, 3) fill all B slots.
    "two-full": Layout(rows=(4, 4), context=(9, 30)),
    # Partial last rows.
    "partial": Layout(rows=(5, 2, 1), context=(12, 0, 40), last=(2, 1, 3)),
    # A decode step: one-row segments of one token.
    "decode": Layout(rows=(1,) * 6, context=(3, 17, 33, 0, 48, 9), width=1, padding=2),
}


def build(layout: Layout, hv: int, seed: int = 0) -> dict:
    """The arrays of one step: rows in segment order, each segment's positions running on
    from its pooled context, distinct blocks per segment (a table covers its context)."""
    rng = np.random.default_rng(seed)
    c = layout.width
    b = sum(layout.rows) + layout.padding
    segments = np.full(b, -1, np.int32)
    positions = np.zeros((b, c), np.int32)
    valid = np.zeros((b, c), bool)
    context_len = np.zeros(b, np.int32)
    tables = np.zeros((b, TABLE_BLOCKS), np.int32)
    blocks = rng.permutation(len(layout.rows) * TABLE_BLOCKS).astype(np.int32)
    row = 0
    for s, (n_rows, ctx) in enumerate(zip(layout.rows, layout.context)):
        assert ctx <= TABLE_BLOCKS * BLOCK_SIZE
        last = c if layout.last is None or layout.last[s] is None else layout.last[s]
        tokens = (n_rows - 1) * c + last
        rows = slice(row, row + n_rows)
        segments[rows] = s
        context_len[rows] = ctx
        tables[rows] = blocks[s * TABLE_BLOCKS:(s + 1) * TABLE_BLOCKS]
        flat_pos = np.zeros(n_rows * c, np.int32)
        flat_pos[:tokens] = ctx + np.arange(tokens)
        positions[rows] = flat_pos.reshape(n_rows, c)
        valid[rows] = (np.arange(n_rows * c) < tokens).reshape(n_rows, c)
        row += n_rows
    f = lambda *shape: rng.standard_normal(shape).astype(np.float32)   # noqa: E731
    pool_slots = len(layout.rows) * TABLE_BLOCKS * BLOCK_SIZE
    return dict(q=f(b, c, N_KV * GROUPS, H) * 1.5, pool_k=f(LAYERS, pool_slots, N_KV, H) * 1.5,
                pool_v=f(LAYERS, pool_slots, N_KV, hv), new_k=f(b * c, N_KV, H) * 1.5,
                new_v=f(b * c, N_KV, hv), sinks=f(N_KV * GROUPS) + 1.0, segments=segments,
                positions=positions, valid=valid, context_len=context_len, tables=tables)


def run(d: dict, sinks: bool, window: int | None, fn=paged_attention) -> np.ndarray:
    return np.asarray(fn(
        jnp.asarray(d["q"]), jnp.asarray(d["pool_k"]), jnp.asarray(d["pool_v"]),
        jnp.int32(LAYER), jnp.asarray(d["tables"]), jnp.asarray(d["context_len"]),
        jnp.asarray(d["new_k"]), jnp.asarray(d["new_v"]), jnp.asarray(d["segments"]),
        jnp.asarray(d["positions"]), jnp.asarray(d["valid"].reshape(-1)), CHUNK_BLOCKS,
        sinks=jnp.asarray(d["sinks"]) if sinks else None, window=window))


# ------------------------------------------------------------------- float64 reference
def dense_reference(d: dict, sinks: bool, window: int | None) -> np.ndarray:
    """Per valid query, in float64: one softmax over its row's pooled slots below
    context_len (position = table order) and the step's valid new keys of its segment at
    positions <= its own, all within ``window``; the sink only in the denominator."""
    b, c, n_q, h = d["q"].shape
    hv = d["new_v"].shape[-1]
    flat_seg, flat_pos = np.repeat(d["segments"], c), d["positions"].reshape(-1)
    flat_valid = d["valid"].reshape(-1)

    def near(pq, pk):
        return np.ones(np.shape(pk), bool) if window is None else pq - pk < window

    out = np.zeros((b, c, n_q, hv))
    for row, col in zip(*np.nonzero(d["valid"])):
        pos = d["positions"][row, col]
        pooled = np.arange(d["context_len"][row])
        pooled = pooled[near(pos, pooled)]
        slots = d["tables"][row, pooled // BLOCK_SIZE] * BLOCK_SIZE + pooled % BLOCK_SIZE
        fresh = ((flat_seg == d["segments"][row]) & (flat_pos <= pos) & flat_valid
                 & near(pos, flat_pos))
        for head in range(n_q):
            kv = head // GROUPS
            keys = np.concatenate([d["pool_k"][LAYER, slots, kv], d["new_k"][fresh, kv]])
            values = np.concatenate([d["pool_v"][LAYER, slots, kv], d["new_v"][fresh, kv]])
            scores = keys.astype(np.float64) @ d["q"][row, col, head] / np.sqrt(h)
            peak = scores.max()
            total = np.exp(scores - peak).sum()
            if sinks:
                peak = max(peak, d["sinks"][head])
                total = np.exp(scores - peak).sum() + np.exp(d["sinks"][head] - peak)
            out[row, col, head] = np.exp(scores - peak) @ values / total
    return out


# --------------------------------------------------------------- row-offset reference
def _row_offset_new_rows(state, queries, keys, values, segments, positions, valid, *,
                         window=None):
    """The former new-key loop of ``moejax.decode.paged`` (one row offset j = 0 ..
    span-1 per iteration, every iteration scoring all B rows), kept as a reference."""
    b, c, n_kv, groups, h = queries.shape
    hv = values.shape[-1]
    row_ids = jnp.arange(b)
    first_row = jnp.argmax(segments[None, :] == segments[:, None], axis=1)
    span = jnp.max(jnp.where(segments >= 0, row_ids - first_row + 1, 0))

    def row_offset(j, state):
        source = jnp.maximum(row_ids - j, 0)
        visible = (((row_ids >= j) & (segments[source] == segments))[:, None, None]
                   & (positions[source][:, None, :] <= positions[:, :, None])
                   & valid[source][:, None, :])
        if window is not None:
            visible = visible & in_window(positions[:, :, None], positions[source][:, None, :],
                                          window)
        scores = jnp.einsum("bckgh,bjkh->bkgcj", queries, keys[source],
                            preferred_element_type=jnp.float32)
        return state.add(scores, visible[:, None, None],
                         lambda p: jnp.einsum("bkgcj,bjkh->bkgch",
                                              p.astype(values.dtype), values[source],
                                              preferred_element_type=jnp.float32))

    state = jax.lax.fori_loop(0, span, row_offset, state)
    out = jnp.moveaxis(state.result(), 3, 1)
    return out.reshape(b, c, n_kv * groups, hv)


def row_offset_attention(q, pool_k, pool_v, layer, tables, context_len, new_k, new_v,
                         segments, positions, new_valid, chunk_blocks, *, sinks=None,
                         window=None):
    """Paged attention as it was: the pooled context folded in one piece (the whole
    table; the same softmax as the chunked loop), then the row-offset new-key loop."""
    b, c, n_q, h = q.shape
    hv = new_v.shape[-1]
    queries = q.reshape(b, c, N_KV, GROUPS, h) * (1.0 / math.sqrt(h))
    slots = (tables[:, :, None] * BLOCK_SIZE + jnp.arange(BLOCK_SIZE)).reshape(b, -1)
    keys, values = pool_k[layer, slots], pool_v[layer, slots]           # [B, S, n_kv, *]
    order = jnp.arange(slots.shape[1])
    visible = (order[None, :] < context_len[:, None])[:, None, :]     # [B, 1, S]
    if window is not None:
        visible = visible & in_window(positions[:, :, None], order[None, None, :], window)
    scores = jnp.einsum("bckgh,bwkh->bkgcw", queries, keys, preferred_element_type=jnp.float32)
    group_sinks = None if sinks is None else sinks.reshape(N_KV, GROUPS)[None, :, :, None]
    state = SoftmaxState.empty((b, N_KV, GROUPS, c), hv, group_sinks).add(
        scores, visible[:, None, None],
        lambda p: jnp.einsum("bkgcw,bwkh->bkgch", p, values, preferred_element_type=jnp.float32))
    return _row_offset_new_rows(state, queries, new_k.reshape(b, c, N_KV, h),
                                new_v.reshape(b, c, N_KV, hv), segments, positions,
                                new_valid.reshape(b, c), window=window)


# ------------------------------------------------------------------------------ parity
OPTIONS = {"plain": (False, None), "sinks": (True, None), "window": (False, 6),
           "window-sinks": (True, 3)}


@pytest.mark.parametrize("hv", [H, 12], ids=["hv=h", "hv!=h"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_paged_attention_matches_dense_and_row_offset_references(name, option, hv):
    d = build(LAYOUTS[name], hv, seed=len(name) + hv)
    sinks, window = OPTIONS[option]
    got = run(d, sinks, window)
    assert np.isfinite(got).all()
    valid = d["valid"]
    np.testing.assert_allclose(got[valid], dense_reference(d, sinks, window)[valid],
                               rtol=2e-5, atol=2e-5)
    # Every query (padding and the unused tail of a partial row included): the layer math
    # is unchanged, only which row pairs are scored.
    np.testing.assert_allclose(got, run(d, sinks, window, row_offset_attention),
                               rtol=1e-5, atol=1e-5)


def test_pooled_context_and_earlier_rows_carry_weight():
    """The cases above test something: in "one-segment-context" the last row's output
    moves when the pooled context or the segment's first row is dropped."""
    d = build(LAYOUTS["one-segment-context"], H)
    base = run(d, False, None)[-1]
    no_context = dict(d, context_len=np.zeros_like(d["context_len"]))
    assert np.abs(run(no_context, False, None)[-1] - base).max() > 0.05
    first_row_gone = dict(d, valid=d["valid"].copy())
    first_row_gone["valid"][0] = False
    assert np.abs(run(first_row_gone, False, None)[-1] - base).max() > 0.01


def test_jitted_layouts_of_different_spans():
    """Segments are data (the loop's trip count is dynamic): one jitted function, with a
    traced window, gives layouts of spans 8 and 3 the eager call's result."""
    jitted = jax.jit(paged_attention, static_argnames=("chunk_blocks",))

    def call(*args, **options):
        return jitted(*args[:-1], chunk_blocks=args[-1], **options)

    one, mixed = build(LAYOUTS["one-segment"], H), build(Layout((3, 1, 2), (4, 9, 0), padding=2), H)
    for d in (one, mixed):
        np.testing.assert_allclose(run(d, True, 5, call), run(d, True, 5), rtol=1e-5, atol=1e-5)


def test_a_repeated_id_after_another_is_a_new_segment():
    """Segments are runs of rows: ids 0, 0, 1, 0, 0 (two ranks' rows side by side, each
    numbering its segments from 0) attend as 0, 0, 1, 2, 2."""
    d = build(Layout(rows=(2, 1, 2), context=(6, 0, 11), padding=1), H)
    assert d["segments"].tolist() == [0, 0, 1, 2, 2, -1]
    repeated = dict(d, segments=np.array([0, 0, 1, 0, 0, -1], np.int32))
    np.testing.assert_array_equal(run(repeated, True, None), run(d, True, None))


# -------------------------------------------------------------------------------- work
def test_one_segment_of_sixteen_rows_costs_about_the_causal_blocks(monkeypatch):
    b = 16
    segments = jnp.zeros(b, jnp.int32)
    trips = int(new_row_trips(segments))
    causal = b * (b + 1) // 2                  # 136 (query row, key row) blocks
    assert trips == 1 + b // 2                 # 9, against 16 one offset at a time
    assert trips * b <= 1.15 * causal          # 144 blocks: 1.06×
    assert b * b > 1.8 * causal                # the row-offset loop: 256 blocks, 1.88×

    # The attention loop itself runs new_row_trips(segments) iterations.
    seen = []

    def counting(segments):
        trips = new_row_trips(segments)
        seen.append(int(trips))
        return trips

    monkeypatch.setattr(paged, "new_row_trips", counting)
    d = build(Layout(rows=(b,), context=(0,), width=2), H)
    assert d["segments"].tolist() == [0] * b
    run(d, False, None)
    assert seen == [1 + b // 2]


@pytest.mark.parametrize("segments, trips", [
    ([0, 1, 2, 3, 4, 5, 6, 7], 1),             # decode: the diagonal only
    ([0, 1, 2, -1, -1, -1, -1, -1], 1),        # decode with padding rows
    ([-1] * 8, 1),                             # all padding
    ([0, 0, 1, 2, -1, -1, -1, -1], 2),         # span 2
    ([0, 0, 0, 1, 2, 2, 2, 2, -1, -1], 3),     # span 4
    ([0] * 7 + [1], 4),                        # span 7
])
def test_new_row_trips(segments, trips):
    assert int(new_row_trips(jnp.asarray(segments, jnp.int32))) == trips

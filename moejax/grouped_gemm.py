"""Grouped GEMM over rows sorted by expert, in pure JAX.

``lhs [M, d]`` holds rows grouped by expert (group g is the next
``group_sizes[g]`` rows); ``rhs [E, d, f]`` holds one matrix per expert. The
paths here do only the routed work: a loop over row tiles in which every tile
belongs to one expert (so a tile that would straddle two groups is cut at the
group end by a row mask, and empty groups produce no tile). XLA's
``jax.lax.ragged_dot`` is kept as an option, not the default, because on CPU
(and in released GPU wheels) it lowers to a masked dense product that does E×
the routed work. The Pallas kernel (``kernels_pallas.gmm``) plugs in behind
the same signatures.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

# Rows per tile for the pure-JAX tiled loop, keyed by (platform, hidden size
# bucket). Larger tiles amortise the per-iteration cost of the loop; smaller ones
# waste fewer rows at group ends. Tuned with benchmarks/prefill_cpu.py.
TILE_ROWS = {
    ("cpu", "small"): 128,   # d <= 1024
    ("cpu", "large"): 128,
    ("gpu", "small"): 128,
    ("gpu", "large"): 256,
}


def tile_rows_for(hidden: int, platform: str | None = None) -> int:
    platform = platform or jax.default_backend()
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else "cpu"
    return TILE_ROWS[(platform, "small" if hidden <= 1024 else "large")]


def default_expert_impl(platform: str | None = None) -> str:
    """The expert path used when a config says ``auto``: the fused tiled loop on every
    platform until a faster kernel is measured (see docs/PERF.md)."""
    return "fused_tiles"


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Static-shape description of the tiles covering the groups.

    num_tiles: scalar int32, tiles actually used; tile_group / tile_start /
    tile_end: [max_tiles] int32, expert, first row and end row (exclusive) of each.
    """

    num_tiles: jax.Array
    tile_group: jax.Array
    tile_start: jax.Array
    tile_end: jax.Array


def plan_tiles(group_sizes: jax.Array, num_rows: int, tile_rows: int) -> TilePlan:
    """Split each group into ceil(size / tile_rows) tiles; at most ceil(M/tm) + E tiles."""
    num_groups = group_sizes.shape[0]
    max_tiles = -(-num_rows // tile_rows) + num_groups
    sizes = group_sizes.astype(jnp.int32)
    group_offsets = jnp.cumsum(sizes) - sizes
    tiles_per_group = (sizes + tile_rows - 1) // tile_rows
    first_tile = jnp.cumsum(tiles_per_group) - tiles_per_group
    tile_group = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), tiles_per_group,
                            total_repeat_length=max_tiles)
    index_in_group = jnp.arange(max_tiles, dtype=jnp.int32) - first_tile[tile_group]
    tile_start = group_offsets[tile_group] + index_in_group * tile_rows
    tile_end = group_offsets[tile_group] + sizes[tile_group]
    return TilePlan(num_tiles=jnp.sum(tiles_per_group), tile_group=tile_group,
                    tile_start=tile_start, tile_end=tile_end)


def _tile_loop(lhs: jax.Array, out_cols: int, out_dtype, group_sizes: jax.Array,
               tile_rows: int, tile_fn) -> jax.Array:
    """Run ``tile_fn(x_tile [tm, d], expert) -> [tm, out_cols]`` over every tile and
    write the rows that belong to the tile's group. Rows outside every group stay 0."""
    num_rows = lhs.shape[0]
    plan = plan_tiles(group_sizes, num_rows, tile_rows)
    # Padding lets the last tile of a group slice past the end without clamping.
    lhs_padded = jnp.pad(lhs, ((0, tile_rows), (0, 0)))
    out = jnp.zeros((num_rows + tile_rows, out_cols), out_dtype)
    row_ids = jnp.arange(tile_rows, dtype=jnp.int32)

    def body(t, out):
        start = plan.tile_start[t]
        x_tile = jax.lax.dynamic_slice_in_dim(lhs_padded, start, tile_rows, axis=0)
        y_tile = tile_fn(x_tile, plan.tile_group[t]).astype(out_dtype)
        keep = (start + row_ids < plan.tile_end[t])[:, None]
        current = jax.lax.dynamic_slice_in_dim(out, start, tile_rows, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y_tile, current),
                                                   start, axis=0)

    out = jax.lax.fori_loop(0, plan.num_tiles, body, out)
    return out[:num_rows]


def _expert_matrix(w: jax.Array, expert: jax.Array) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(w, expert, axis=0, keepdims=False)


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        tile_rows: int | None = None) -> jax.Array:
    """Grouped matmul lhs [M, d] × rhs [E, d, f] -> [M, f], f32 accumulation, lhs dtype out."""
    tile_rows = tile_rows or tile_rows_for(lhs.shape[1])

    def tile_fn(x_tile, expert):
        return jnp.dot(x_tile, _expert_matrix(rhs, expert).astype(x_tile.dtype),
                       preferred_element_type=jnp.float32)

    return _tile_loop(lhs, rhs.shape[2], lhs.dtype, group_sizes, tile_rows, tile_fn)


def swiglu(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """One expert's MLP on rows x [n, d] with matrices [d, f], [d, f], [f, d] (f32 accumulation)."""
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
    return jnp.dot(hidden, w_down, preferred_element_type=jnp.float32)


def grouped_swiglu_tiles(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                         group_sizes: jax.Array, tile_rows: int | None = None) -> jax.Array:
    """The whole expert MLP per row tile in one loop: the [tm, f] intermediate never
    leaves the tile. x [M, d]; w_gate, w_up [E, d, f]; w_down [E, f, d] -> [M, d]."""
    tile_rows = tile_rows or tile_rows_for(x.shape[1])
    dtype = x.dtype

    def tile_fn(x_tile, expert):
        return swiglu(x_tile, _expert_matrix(w_gate, expert).astype(dtype),
                      _expert_matrix(w_up, expert).astype(dtype),
                      _expert_matrix(w_down, expert).astype(dtype))

    return _tile_loop(x, w_down.shape[2], dtype, group_sizes, tile_rows, tile_fn)


def group_ids(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """[M] expert id of each row; rows past the last group get E (no expert)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(num_rows), side="right").astype(jnp.int32)


def swiglu_dense(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                 group_sizes: jax.Array) -> jax.Array:
    """Reference: every row through every expert, masked by a one-hot (E× the work)."""
    num_experts = w_gate.shape[0]
    one_hot = jax.nn.one_hot(group_ids(group_sizes, x.shape[0]), num_experts, dtype=jnp.float32)
    per_expert = jax.vmap(lambda g, u, d: swiglu(x, g.astype(x.dtype), u.astype(x.dtype),
                                                 d.astype(x.dtype)))(w_gate, w_up, w_down)
    return jnp.einsum("emd,me->md", per_expert, one_hot).astype(x.dtype)


def ragged_dot_gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """XLA's ragged_dot; rows past sum(group_sizes) come back as zeros."""
    out = jax.lax.ragged_dot(lhs, rhs.astype(lhs.dtype), group_sizes,
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)

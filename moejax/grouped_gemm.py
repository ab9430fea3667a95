"""Grouped GEMM over rows sorted by expert, in pure JAX.

``lhs [M, d]`` holds rows grouped by expert (group g is the next
``group_sizes[g]`` rows); ``rhs [E, d, f]`` holds one matrix per expert. The
paths here do only the routed work: a loop over row tiles in which every tile
belongs to one expert (so a tile that would straddle two groups is cut at the
group end by a row mask, and empty groups produce no tile). XLA's
``jax.lax.ragged_dot`` is kept as an option, not the default, because on CPU
(and in released GPU wheels) it lowers to a masked dense product that does E×
the routed work. The Pallas kernels (``kernels_pallas.gmm``) share the
signatures; :func:`choose_expert_impl` picks among the paths.

The weight stacks may be kept in FP8 (:class:`moejax.fp8_experts.Fp8Experts`,
``weights_dtype="fp8"``): the tile loops and the dense reference dequantize one expert's
matrix where they read it (:func:`moejax.expert_views.expert_matrix`), never the layer.
A stack may also be one layer of every layer's ``[L, E, ...]`` read in place
(:class:`moejax.expert_views.StackLayer`): the same loops read its experts where they lie.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, Integer

from moejax.expert_impl_table import device_of, expert_impl_for, hidden_bucket
from moejax.expert_views import StackLayer, expert_matrices, expert_matrix, is_view, layer_array
from moejax.fp8_experts import Fp8Experts, any_fp8

# Rows per tile for the pure-JAX tiled loop, keyed by (platform, hidden size bucket):
# (full tile rows, remainder tile rows). Each expert's rows run first in full tiles,
# then its remainder in small tiles, so big matmuls do most of the work while at most
# (small - 1) rows per expert are wasted. Measured on a 2-core CPU (d=512, f=256,
# 4K tokens, E=32, k=4): (256, 64) took 0.130 s against 0.144 s for single 128-row tiles.
TILE_ROWS = {
    ("cpu", "small"): (256, 64),   # d <= 1024
    ("cpu", "large"): (256, 64),
    ("gpu", "small"): (256, 64),
    ("gpu", "large"): (256, 64),
}

def tile_rows_for(hidden: int, platform: str | None = None) -> tuple[int, int]:
    """(full tile rows, remainder tile rows) from :data:`TILE_ROWS`."""
    return TILE_ROWS[(device_of(platform or jax.default_backend()), hidden_bucket(hidden))]


def resolve_tile_rows(tile_rows: int | tuple[int, int] | None, hidden: int) -> tuple[int, int]:
    """``None`` -> the table; an int -> one tile size for everything; a pair as given."""
    if tile_rows is None:
        return tile_rows_for(hidden)
    if isinstance(tile_rows, int):
        return tile_rows, tile_rows
    full, rest = tile_rows
    return int(full), int(rest)




def choose_expert_impl(hidden: int, intermediate: int, platform: str | None = None, *,
                       rows: int | None = None, num_experts: int | None = None) -> str:
    """The expert path ``expert_impl: auto`` resolves to, per platform, shape and step size.

    Looked up in the measured table :data:`moejax.expert_impl_table.EXPERT_IMPL_TABLE`
    by device (CPU or GPU), hidden size bucket and rows per expert ``rows /
    num_experts`` (``rows``: the routed rows M = tokens × k, static at trace time):

    * GPU: ``fused_tiles`` for decode-sized steps (up to 2 rows per expert), ``pallas``
      above (kernels_pallas.gmm: fused gate/up kernel, then the grouped GEMM for the
      down projection; routed work only, and unlike ``ragged_dot`` in the released
      wheels it never materializes the dense product). ``pallas`` needs d and f to be
      multiples of ``expert_impl_table.PALLAS_MIN_DIM_MULTIPLE``; other shapes get
      ``fused_tiles``.
    * CPU (and anything else): ``dense`` (every row through every expert, masked) for
      small steps over few experts, where the tile loops' 64-row tiles waste more than
      dense's E× work (the table's ``max_experts`` keeps it off large E); ``fused_tiles``
      otherwise. Pallas runs there only interpreted (a test tool, orders of magnitude
      slower) and ``ragged_dot`` lowers to a masked dense product that does E× the
      routed work (docs/PERF.md).

    With ``rows`` or ``num_experts`` None (a step of unknown size) the table's
    open-ended entry: ``pallas`` on a GPU (``fused_tiles`` where d or f does not fit),
    ``fused_tiles`` elsewhere. ``ragged_dot``, ``gmm`` and ``blocks`` are never chosen
    automatically; any path can be forced with the ``expert_impl`` option.
    """
    return expert_impl_for(platform or jax.default_backend(), hidden, intermediate, rows,
                           num_experts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TilePlan:
    """Static-shape description of the tiles covering the groups.

    num_tiles: scalar int32, tiles actually used; tile_group / tile_start /
    tile_end: [max_tiles] int32, expert, first row and end row (exclusive) of each.
    """

    num_tiles: Int[Array, ""]
    tile_group: Int[Array, "max_tiles"]
    tile_start: Int[Array, "max_tiles"]
    tile_end: Int[Array, "max_tiles"]


def plan_tiles(starts: Int[Array, "E"], sizes: Integer[Array, "E"], max_tiles: int,
               tile_rows: int) -> TilePlan:
    """Cover rows [starts[g], starts[g] + sizes[g]) of each group g with ceil(size / tile_rows)
    tiles; ``max_tiles`` (static) bounds the total."""
    num_groups = sizes.shape[0]
    sizes = sizes.astype(jnp.int32)
    tiles_per_group = (sizes + tile_rows - 1) // tile_rows
    first_tile = jnp.cumsum(tiles_per_group) - tiles_per_group
    tile_group = jnp.repeat(jnp.arange(num_groups, dtype=jnp.int32), tiles_per_group,
                            total_repeat_length=max_tiles)
    index_in_group = jnp.arange(max_tiles, dtype=jnp.int32) - first_tile[tile_group]
    tile_start = starts[tile_group] + index_in_group * tile_rows
    tile_end = starts[tile_group] + sizes[tile_group]
    return TilePlan(num_tiles=jnp.sum(tiles_per_group), tile_group=tile_group,
                    tile_start=tile_start, tile_end=tile_end)


def plan_two_level(group_sizes: Integer[Array, "E"], num_rows: int, full_rows: int,
                   rest_rows: int) -> tuple[TilePlan, TilePlan]:
    """Tiles of ``full_rows`` over each group's first floor(size/full)·full rows, then tiles
    of ``rest_rows`` over the remainder (rows are grouped: group g starts at Σ sizes[<g])."""
    sizes = group_sizes.astype(jnp.int32)
    offsets = jnp.cumsum(sizes) - sizes
    full = (sizes // full_rows) * full_rows
    full_plan = plan_tiles(offsets, full, num_rows // full_rows, full_rows)
    rest_plan = plan_tiles(offsets + full, sizes - full,
                           -(-num_rows // rest_rows) + sizes.shape[0], rest_rows)
    return full_plan, rest_plan


def _run_tiles(lhs_padded: jax.Array, out: jax.Array, plan: TilePlan, tile_rows: int,
               tile_fn) -> jax.Array:
    """One loop over the plan's tiles, writing only the rows inside each tile's group."""
    row_ids = jnp.arange(tile_rows, dtype=jnp.int32)

    def body(t, out):
        start = plan.tile_start[t]
        x_tile = jax.lax.dynamic_slice_in_dim(lhs_padded, start, tile_rows, axis=0)
        y_tile = tile_fn(x_tile, plan.tile_group[t]).astype(out.dtype)
        keep = (start + row_ids < plan.tile_end[t])[:, None]
        current = jax.lax.dynamic_slice_in_dim(out, start, tile_rows, axis=0)
        return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y_tile, current),
                                                   start, axis=0)

    return jax.lax.fori_loop(0, plan.num_tiles, body, out)


def _tile_loop(lhs: jax.Array, out_cols: int, out_dtype, group_sizes: jax.Array,
               tile_rows: tuple[int, int], tile_fn) -> jax.Array:
    """Run ``tile_fn(x_tile [tm, d], expert) -> [tm, out_cols]`` over every tile (full tiles,
    then remainder tiles) and write the rows of the tile's group. Rows outside every
    group stay 0."""
    num_rows = lhs.shape[0]
    full_rows, rest_rows = tile_rows
    pad = max(full_rows, rest_rows)
    # Padding lets the last tile of a group slice past the end without clamping.
    lhs_padded = jnp.pad(lhs, ((0, pad), (0, 0)))
    out = jnp.zeros((num_rows + pad, out_cols), out_dtype)
    full_plan, rest_plan = plan_two_level(group_sizes, num_rows, full_rows, rest_rows)
    for plan, rows in ((full_plan, full_rows), (rest_plan, rest_rows)):
        if plan.tile_group.shape[0]:   # no full tile fits when M < full_rows
            out = _run_tiles(lhs_padded, out, plan, rows, tile_fn)
    return out[:num_rows]


def gmm(lhs: Float[Array, "M d"], rhs: Float[Array, "E d f"] | StackLayer | Fp8Experts,
        group_sizes: Integer[Array, "E"],
        tile_rows: int | tuple[int, int] | None = None) -> Float[Array, "M f"]:
    """Grouped matmul lhs [M, d] × rhs [E, d, f] -> [M, f], f32 accumulation, lhs dtype out
    (an FP8 rhs: each tile's expert dequantized to lhs's dtype)."""
    tile_rows = resolve_tile_rows(tile_rows, lhs.shape[1])

    def tile_fn(x_tile, expert):
        return jnp.dot(x_tile, expert_matrix(rhs, expert, x_tile.dtype),
                       preferred_element_type=jnp.float32)

    return _tile_loop(lhs, rhs.shape[2], lhs.dtype, group_sizes, tile_rows, tile_fn)


def swiglu(x: Float[Array, "n d"], w_gate: Float[Array, "d f"], w_up: Float[Array, "d f"],
           w_down: Float[Array, "f d"]) -> Float[Array, "n d"]:
    """One expert's MLP on rows x [n, d] with matrices [d, f], [d, f], [f, d] (f32 accumulation)."""
    gate = jnp.dot(x, w_gate, preferred_element_type=jnp.float32)
    up = jnp.dot(x, w_up, preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
    return jnp.dot(hidden, w_down, preferred_element_type=jnp.float32)


def grouped_swiglu_tiles(x: Float[Array, "M d"],
                         w_gate: Float[Array, "E d f"] | StackLayer | Fp8Experts,
                         w_up: Float[Array, "E d f"] | StackLayer | Fp8Experts,
                         w_down: Float[Array, "E f d"] | StackLayer | Fp8Experts,
                         group_sizes: Integer[Array, "E"],
                         tile_rows: int | tuple[int, int] | None = None
                         ) -> Float[Array, "M d"]:
    """The whole expert MLP per row tile in one loop: the [tm, f] intermediate never
    leaves the tile. x [M, d]; w_gate, w_up [E, d, f]; w_down [E, f, d] -> [M, d]. FP8
    stacks: the tile's expert is dequantized inside the loop body."""
    tile_rows = resolve_tile_rows(tile_rows, x.shape[1])
    dtype = x.dtype

    def tile_fn(x_tile, expert):
        return swiglu(x_tile, expert_matrix(w_gate, expert, dtype),
                      expert_matrix(w_up, expert, dtype), expert_matrix(w_down, expert, dtype))

    return _tile_loop(x, w_down.shape[2], dtype, group_sizes, tile_rows, tile_fn)


def group_ids(group_sizes: Integer[Array, "E"], num_rows: int) -> Int[Array, "M"]:
    """[M] expert id of each row; rows past the last group get E (no expert)."""
    ends = jnp.cumsum(group_sizes)
    return jnp.searchsorted(ends, jnp.arange(num_rows), side="right").astype(jnp.int32)


def swiglu_dense(x: Float[Array, "M d"], w_gate: Float[Array, "E d f"] | StackLayer | Fp8Experts,
                 w_up: Float[Array, "E d f"] | StackLayer | Fp8Experts,
                 w_down: Float[Array, "E f d"] | StackLayer | Fp8Experts,
                 group_sizes: Integer[Array, "E"]) -> Float[Array, "M d"]:
    """Every row through every expert, masked by a one-hot (E× the work; for a few rows
    against few experts, one batched product beats a loop of tiles). FP8 stacks and
    layers read in place: a loop over the experts, each read (and dequantized) in its
    own iteration, so the layer is never copied whole."""
    num_experts = w_gate.shape[0]
    one_hot = jax.nn.one_hot(group_ids(group_sizes, x.shape[0]), num_experts, dtype=jnp.float32)
    if any_fp8(w_gate, w_up, w_down) or any(map(is_view, (w_gate, w_up, w_down))):
        def add_expert(e, acc):
            y = swiglu(x, expert_matrix(w_gate, e, x.dtype), expert_matrix(w_up, e, x.dtype),
                       expert_matrix(w_down, e, x.dtype))
            return acc + y * one_hot[:, e][:, None]

        out = jax.lax.fori_loop(0, num_experts, add_expert,
                                jnp.zeros((x.shape[0], w_down.shape[2]), jnp.float32))
        return out.astype(x.dtype)
    per_expert = jax.vmap(lambda g, u, d: swiglu(x, g.astype(x.dtype), u.astype(x.dtype),
                                                 d.astype(x.dtype)))(w_gate, w_up, w_down)
    return jnp.einsum("emd,me->md", per_expert, one_hot).astype(x.dtype)


def ragged_dot_gmm(lhs: Float[Array, "M d"], rhs: Float[Array, "E d f"] | StackLayer,
                   group_sizes: Integer[Array, "E"]) -> Float[Array, "M f"]:
    """XLA's ragged_dot; rows past sum(group_sizes) come back as zeros."""
    # ragged_dot takes the layer as one array: a view's layer is copied out (this path
    # is never chosen automatically).
    out = jax.lax.ragged_dot(lhs, layer_array(rhs).astype(lhs.dtype), group_sizes,
                             preferred_element_type=jnp.float32)
    return out.astype(lhs.dtype)


# Rows per block of :func:`swiglu_blocks`: each expert's rows are padded to a multiple of
# this, so up to (BLOCK_ROWS - 1) rows per expert are wasted work.
BLOCK_ROWS = 64


def swiglu_blocks(x: Float[Array, "M d"], w_gate: Float[Array, "E d f"] | StackLayer,
                  w_up: Float[Array, "E d f"] | StackLayer, w_down: Float[Array, "E f d"] | StackLayer,
                  group_sizes: Integer[Array, "E"], block_rows: int = BLOCK_ROWS
                  ) -> Float[Array, "M d"]:
    """SwiGLU experts as one batched matmul over fixed-size row blocks, each of one expert.

    Each group is padded to a multiple of ``block_rows``; block n multiplies by its
    expert's matrices (gathered per block). Unlike the tiled loop this has no dynamic
    trip count, so reverse-mode autodiff works (training uses it), and unlike
    ``ragged_dot`` on CPU it does the routed work plus at most one padded block per
    expert rather than E× the work. Rows past sum(group_sizes) come back as zeros.
    """
    rows, num_experts = x.shape[0], w_gate.shape[0]
    num_blocks = -(-rows // block_rows) + num_experts     # static bound on padded blocks
    sizes = group_sizes.astype(jnp.int32)
    padded_sizes = -(-sizes // block_rows) * block_rows
    padded_starts = jnp.cumsum(padded_sizes) - padded_sizes
    expert = group_ids(sizes, rows)                                          # [M], E = none
    offset = jnp.arange(rows, dtype=jnp.int32) - (jnp.cumsum(sizes) - sizes)[
        jnp.minimum(expert, num_experts - 1)]
    # Rows of no expert go past the end, where the scatter drops them.
    slot = jnp.where(expert < num_experts,
                     padded_starts[jnp.minimum(expert, num_experts - 1)] + offset,
                     num_blocks * block_rows)
    padded = jnp.zeros((num_blocks * block_rows, x.shape[1]), x.dtype).at[slot].set(
        x, mode="drop")
    block_start = jnp.arange(num_blocks, dtype=jnp.int32) * block_rows
    block_expert = jnp.minimum(jnp.searchsorted(jnp.cumsum(padded_sizes), block_start,
                                                side="right"), num_experts - 1)
    blocks = padded.reshape(num_blocks, block_rows, -1)
    gate = jnp.einsum("nbd,ndf->nbf", blocks, expert_matrices(w_gate, block_expert, x.dtype),
                      preferred_element_type=jnp.float32)
    up = jnp.einsum("nbd,ndf->nbf", blocks, expert_matrices(w_up, block_expert, x.dtype),
                    preferred_element_type=jnp.float32)
    hidden = (jax.nn.silu(gate) * up).astype(x.dtype)
    out = jnp.einsum("nbf,nfd->nbd", hidden, expert_matrices(w_down, block_expert, x.dtype),
                     preferred_element_type=jnp.float32)
    out = out.reshape(num_blocks * block_rows, -1)
    y = jnp.take(out, jnp.minimum(slot, num_blocks * block_rows - 1), axis=0)
    return jnp.where((expert < num_experts)[:, None], y, 0.0).astype(x.dtype)

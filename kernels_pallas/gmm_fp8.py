"""Grouped GEMM with FP8 weights dequantized in-kernel (``weights_dtype="fp8"``, issue 41).

The kernels of :mod:`kernels_pallas.gmm` with expert weights kept as float8_e4m3fn
``[E, d, f]`` and one float32 scale per ``block = (b_d, b_f)`` elements, ``scale [E,
ceil(d/b_d), ceil(f/b_f)]`` (DeepSeek-V3 / Qwen3-FP8 block scaling, in moejax's ``[in,
out]`` layout). Same grid (row tiles × column tiles) and group walk: each program
accumulates ``x_rows_of_g · W[g]`` for the groups its row tile meets. The difference is
where a weight tile is read: it is loaded as FP8 (a quarter of the bytes of float32;
the weights may come as FP8 or as its uint8 bytes, reinterpreted in the program) and
dequantized in the program, ``(w.astype(f32) * s).astype(x.dtype)``, with ``s`` the
one scale of the block the tile lies in; then the usual dot, accumulating in float32.
The dequantized tile equals the checkpoint loader's dequantized weights bit for bit
(FP8 value times its block's scale in float32, rounded once), so the kernel computes
the same products as :func:`kernels_pallas.gmm.gmm` on the dequantized-on-load weights.

Tiles align with the scale blocks: ``block_k`` divides ``b_d`` and ``block_n`` divides
``b_f`` (and d and f), so that every weight tile lies in one block and needs one scalar
scale (for the official 128×128 blocks: the tuned tiles, with ``block_n`` cut to 128).
Partial edge blocks need nothing special: the last block's tiles read its own scale.
On NVIDIA GPUs the kernels lower through Pallas's Triton backend (Triton's dot needs
tiles of at least 16: :func:`fits_gpu`); elsewhere they run with ``interpret=True``.
Activations stay in the compute dtype (bf16/f32): FP8 MMA with quantized activations
would be another kernel with other numerics.

``layer=`` (as in :mod:`kernels_pallas.gmm`): the values and the scales are then
``[L, E, ...]`` stacks and the programs read layer ``layer``'s tiles and scales in
place, ``w[layer, group, k, n]`` and ``scale[layer, group, i, j]``; nothing is sliced.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jaxtyping import Array, Float, Float32, Integer, Shaped

from kernels_pallas import tile_table
from kernels_pallas.gmm import GmmTiles, group_products, group_tile_map, split_refs, tiles_for
from kernels_pallas.layer_index import Layer, layer_operand, weight_shape_error

FP8 = jnp.dtype(jnp.float8_e4m3fn)
# The weights may come as FP8 or as its bytes (uint8: how moejax's placement holds them).
WEIGHT_DTYPES = (FP8, jnp.dtype(jnp.uint8))
# Triton's dot needs at least 16 along every dimension.
GPU_MIN_TILE = 16
Block = tuple[int, int]


def _fit(block: int, dim: int) -> int:
    """The largest power of two ≤ ``block`` dividing ``dim`` (≥ 1)."""
    while block > 1 and dim % block:
        block //= 2
    return block


def fits_gpu(depth: int, out_cols: int, block: Block) -> bool:
    """Whether a ``[E, depth, out_cols]`` FP8 stack with ``block`` scales takes tiles of
    at least 16 aligned with its blocks (what the kernel needs on a GPU)."""
    return (math.gcd(depth, block[0]) % GPU_MIN_TILE == 0
            and math.gcd(out_cols, block[1]) % GPU_MIN_TILE == 0)


def fp8_tiles(dtype, depth: int, out_cols: int, num_groups: int, block: Block,
              kernel: str = "gmm", interpret: bool = True, tiles: GmmTiles | None = None
              ) -> GmmTiles:
    """``tiles`` (default: the tuned ones of :func:`kernels_pallas.gmm.tiles_for` for the
    (d, f, E) shape) with ``block_k`` and ``block_n`` cut to divide the scale block and
    d / f; ValueError naming the shape when a GPU run would get tiles under 16."""
    tiles = tiles or tiles_for(dtype, kernel=kernel, shape=(depth, out_cols, num_groups))
    fitted = GmmTiles(block_m=tiles.block_m,
                      block_k=_fit(tiles.block_k, math.gcd(depth, block[0])),
                      block_n=_fit(tiles.block_n, math.gcd(out_cols, block[1])),
                      num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if not interpret and min(fitted.block_k, fitted.block_n) < GPU_MIN_TILE:
        raise ValueError(f"FP8 grouped GEMM on GPU needs tiles of at least {GPU_MIN_TILE} "
                         f"dividing both the {block[0]}x{block[1]} scale blocks and d={depth}, "
                         f"f={out_cols}; got block_k={fitted.block_k}, block_n={fitted.block_n} "
                         "(use expert_impl='fused_tiles')")
    return fitted


def _fp8_products(tile_map_refs, layer_ref, lhs_ref, weight_refs, *, scale_block: Block,
                  **dims) -> list[jax.Array]:
    """:func:`kernels_pallas.gmm.group_products` over (weights, scale) ref pairs, each
    tile dequantized where it is loaded (``W[layer, g]`` where ``layer_ref`` is given), on
    columns [n·block_n, +block_n)."""
    block_k, block_n = dims["block_k"], dims["block_n"]
    first_col = pl.program_id(1) * block_n
    scale_col = first_col // scale_block[1]

    def load(weight, index, kk, dtype):
        w_ref, s_ref = weight
        w = w_ref[(*index, pl.ds(kk * block_k, block_k), pl.ds(first_col, block_n))]
        if w.dtype != FP8:        # bytes: reinterpreted, no arithmetic
            w = jax.lax.bitcast_convert_type(w, FP8)
        s = s_ref[(*index, (kk * block_k) // scale_block[0], scale_col)]
        return (w.astype(jnp.float32) * s).astype(dtype)     # dequantized here

    return group_products(tile_map_refs, layer_ref, lhs_ref, weight_refs, load, **dims)


def _gmm_fp8_kernel(*refs, layered: bool, **dims):
    tile_map_refs, layer_ref, lhs_ref, (w_ref, s_ref), out_ref = split_refs(refs, 2, layered)
    (acc,) = _fp8_products(tile_map_refs, layer_ref, lhs_ref, ((w_ref, s_ref),), **dims)
    out_ref[...] = acc.astype(out_ref.dtype)


def _swiglu_fp8_kernel(*refs, layered: bool, **dims):
    tile_map_refs, layer_ref, lhs_ref, weight_refs, out_ref = split_refs(refs, 4, layered)
    gate_ref, gate_scale_ref, up_ref, up_scale_ref = weight_refs
    gate, up = _fp8_products(tile_map_refs, layer_ref, lhs_ref,
                             ((gate_ref, gate_scale_ref), (up_ref, up_scale_ref)), **dims)
    out_ref[...] = (jax.nn.silu(gate) * up).astype(out_ref.dtype)


def _check(name: str, lhs: jax.Array, group_sizes: jax.Array, block: Block,
           pairs: dict[str, tuple[jax.Array, jax.Array]], layered: bool = False) -> None:
    """ValueError naming what does not fit: lhs, a weight stack or its scale (``pairs``:
    the values' operand name -> (values, scale)), the block. ``layered``: the values and
    scales carry a leading L (the same L)."""
    if lhs.ndim != 2:
        raise ValueError(f"{name}: lhs must be [T, d], got shape {lhs.shape}")
    if (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{name}: block must be two positive integers (b_d, b_f), got {block!r}")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes must be a 1-D integer array, got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    expected = f"{'L, ' if layered else ''}E={group_sizes.shape[0]}, d={lhs.shape[1]}, f"
    for operand, (w, scale) in pairs.items():
        if (w.ndim != 3 + layered or w.shape[-2] != lhs.shape[1]
                or w.shape[-3] != group_sizes.shape[0]):
            raise ValueError(weight_shape_error(name, operand, w.shape, expected, layered))
        if jnp.dtype(w.dtype) not in WEIGHT_DTYPES:
            raise ValueError(f"{name}: weights must be float8_e4m3fn (or its bytes, uint8), "
                             f"got {operand} {w.dtype}")
        grid = (*w.shape[:-2], -(-w.shape[-2] // block[0]), -(-w.shape[-1] // block[1]))
        if tuple(scale.shape) != grid or jnp.dtype(scale.dtype) != jnp.float32:
            raise ValueError(f"{name}: scale must be float32{list(grid)} for weights "
                             f"{operand} {list(w.shape)} in {block[0]}x{block[1]} blocks, got "
                             f"{scale.dtype}{list(scale.shape)}")


def _launch(kernel, lhs: jax.Array, operands: tuple[jax.Array, ...], group_sizes: jax.Array,
            out_cols: int, block: Block, tiles: GmmTiles, interpret: bool,
            layer: jax.Array | None = None) -> jax.Array:
    """Pad the rows to whole tiles, build the tile map and run ``kernel`` over the grid.
    ``layer``: None, or the ``[1]`` int32 index of the layer of ``[L, E, ...]`` operands."""
    num_rows, depth = lhs.shape
    padded_rows = -(-max(num_rows, 1) // tiles.block_m) * tiles.block_m
    num_row_tiles = padded_rows // tiles.block_m
    tile_map = group_tile_map(group_sizes, num_row_tiles, tiles.block_m)
    precision = (jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    body = functools.partial(kernel, block_m=tiles.block_m, block_k=tiles.block_k,
                             block_n=tiles.block_n, depth=depth, scale_block=block,
                             precision=precision, layered=layer is not None)
    everything = (tile_map.visit_lo, tile_map.visit_hi, tile_map.visit_group,
                  tile_map.group_start, tile_map.group_end,
                  *(() if layer is None else (layer,)),
                  jnp.pad(lhs, ((0, padded_rows - num_rows), (0, 0))), *operands)
    # The program indexes every operand itself (the expert is data-dependent, and the
    # Triton backend has no scalar prefetch for index maps): each spec is the whole
    # caller's buffer, so a layered stack's tiles are read in place.
    in_specs = [pl.BlockSpec(a.shape, lambda m, n, _nd=a.ndim: (0,) * _nd) for a in everything]
    compiler_params = None if interpret else pl_triton.CompilerParams(
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    out = pl.pallas_call(
        body, out_shape=jax.ShapeDtypeStruct((padded_rows, out_cols), lhs.dtype),
        grid=(num_row_tiles, out_cols // tiles.block_n), in_specs=in_specs,
        out_specs=pl.BlockSpec((tiles.block_m, tiles.block_n), lambda m, n: (m, n)),
        interpret=interpret, compiler_params=compiler_params,
        name=kernel.__name__.strip("_"))(*everything)
    return out[:num_rows]


def _interpret(interpret: bool | None) -> bool:
    return tile_table.platform_of() != "gpu" if interpret is None else interpret


def gmm_fp8(lhs: Float[Array, "T d"], rhs: Shaped[Array, "*L E d f"],
            rhs_scale: Float32[Array, "*L E kd kf"], group_sizes: Integer[Array, "E"], *,
            block: Block, interpret: bool | None = None, tiles: GmmTiles | None = None,
            layer: Layer | None = None) -> Float[Array, "T f"]:
    """Grouped matmul lhs [T, d] × dequant(rhs [E, d, f] FP8 or its uint8 bytes, rhs_scale)
    -> [T, f] in lhs's dtype (f32 accumulation; rows past sum(group_sizes) are zero).
    ``block``: the (d, f) elements each scale covers. interpret: None = everywhere but on a
    GPU. layer: None, or an int / traced int32 scalar: rhs and rhs_scale are then
    ``[L, E, ...]`` stacks and layer ``layer``'s are read in place (as
    :func:`kernels_pallas.gmm.gmm`'s ``layer``)."""
    layered = layer is not None
    _check("gmm_fp8", lhs, group_sizes, block, {"rhs": (rhs, rhs_scale)}, layered)
    layer_index = layer_operand("gmm_fp8", layer, rhs.shape[0]) if layered else None
    interpret = _interpret(interpret)
    tiles = fp8_tiles(lhs.dtype, lhs.shape[1], rhs.shape[-1], rhs.shape[-3], block, "gmm",
                      interpret, tiles)
    return _launch(_gmm_fp8_kernel, lhs, (rhs, rhs_scale), group_sizes, rhs.shape[-1], block,
                   tiles, interpret, layer_index)


def gmm_swiglu_fp8(lhs: Float[Array, "T d"], w_gate: Shaped[Array, "*L E d f"],
                   gate_scale: Float32[Array, "*L E kd kf"], w_up: Shaped[Array, "*L E d f"],
                   up_scale: Float32[Array, "*L E kd kf"], group_sizes: Integer[Array, "E"], *,
                   block: Block, interpret: bool | None = None, tiles: GmmTiles | None = None,
                   layer: Layer | None = None) -> Float[Array, "T f"]:
    """silu(lhs · dequant(w_gate[g])) * (lhs · dequant(w_up[g])) per group in one kernel
    -> [T, f] in lhs's dtype; arguments as :func:`gmm_fp8` (with ``layer``, all four
    weight operands are ``[L, E, ...]`` stacks of the same L)."""
    layered = layer is not None
    _check("gmm_swiglu_fp8", lhs, group_sizes, block,
           {"w_gate": (w_gate, gate_scale), "w_up": (w_up, up_scale)}, layered)
    if layered and w_gate.shape[0] != w_up.shape[0]:    # one layer index reads both
        raise ValueError(f"gmm_swiglu_fp8: w_gate {list(w_gate.shape)} and w_up "
                         f"{list(w_up.shape)} stack different numbers of layers")
    layer_index = layer_operand("gmm_swiglu_fp8", layer, w_gate.shape[0]) if layered else None
    interpret = _interpret(interpret)
    tiles = fp8_tiles(lhs.dtype, lhs.shape[1], w_gate.shape[-1], w_gate.shape[-3], block,
                      "swiglu", interpret, tiles)
    return _launch(_swiglu_fp8_kernel, lhs, (w_gate, gate_scale, w_up, up_scale), group_sizes,
                   w_gate.shape[-1], block, tiles, interpret, layer_index)

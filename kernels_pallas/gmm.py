"""Grouped GEMM over rows sorted by expert, as a Pallas kernel.

``lhs [T, d]`` holds rows grouped by expert (group g is the next
``group_sizes[g]`` rows, rows past ``sum(group_sizes)`` belong to no group);
``rhs [E, d, f]`` holds one matrix per expert. The grid runs over
(row tiles, column tiles). Each program finds, from the group offsets, the
non-empty groups its row tile meets (usually one; two or more where the tile
straddles a group boundary) and accumulates ``x_rows_of_g · rhs[g]`` for each,
with the other rows masked to zero, so every output element is written exactly
once and empty groups cost nothing. Rows in no group come back as zeros.

Two kernels share that structure:

* :func:`gmm` — ``[T, d] × [E, d, f] -> [T, f]``.
* :func:`gmm_swiglu` — the expert MLP's first half, ``silu(x·W_gate) * (x·W_up)``,
  both products accumulated in one program so the ``[T, f]`` intermediate is
  written once (gate and up never reach memory).
  :func:`gmm_swiglu_stacked` takes the two stacked as ``[E, d, 2f]``.

Inputs may be f32 or bf16; accumulation is f32 (f32 products at full precision,
not TF32). On NVIDIA GPUs the kernels lower through the Triton backend of
Pallas, or — where :mod:`kernels_pallas.gmm_select`'s measured rule says so —
run as the Mosaic GPU ports in :mod:`kernels_pallas.gmm_mosaic` (``backend=``
forces either); elsewhere they run under ``interpret=True`` (slow: for tests).
Tile sizes come from :data:`GMM_TILES` (and :data:`SWIGLU_TILES` for the fused
kernel), keyed by device kind or platform, dtype and optionally the (d, f, E)
shape (:mod:`kernels_pallas.tile_table`).

One layer of a stack: every entry point takes ``layer=`` (a Python int or a traced int32
scalar). The weights are then ``[L, E, d, f]`` and the kernel computes with layer
``layer``'s experts, reading their tiles in place: the layer index is one more operand
the programs load (as they load the tile map), and the program indexes
``w[layer, group, k-tile, n-tile]``. A decode step that loops over layers inside one
program thus never has XLA materialize ``w[layer]`` (a copy of a whole layer's experts
per layer per step).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton
from jaxtyping import Array, Float, Int, Integer

from kernels_pallas import gmm_select, tile_table
from kernels_pallas.layer_index import Layer, layer_operand, weight_shape_error

# kernels_pallas.gmm_mosaic is imported where a Mosaic kernel runs, not here: importing
# Mosaic GPU changes os.environ (see kernels_pallas.mosaic_tiles), and it costs ~0.7 s.


@dataclasses.dataclass(frozen=True)
class GmmTiles:
    """Block sizes (powers of two, as Triton needs) and Triton launch settings.

    block_m rows × block_n columns per program; block_k is the reduction step.
    """

    block_m: int
    block_k: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_k", "block_n"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GmmTiles.{name} must be a power of two, got {value}")


# Keyed as in kernels_pallas.tile_table: (device kind prefix or platform, dtype[, (d, f, E)]).
# The CPU entries only matter for interpret-mode tests: large blocks keep the number of
# interpreted programs small. The GPU float32 entry is untuned (float32 is the parity
# path, not the fast one).
_H100_GMM = GmmTiles(block_m=128, block_k=64, block_n=256, num_warps=8, num_stages=3)
_HALF = ("bfloat16", "float16")
_H100_AND_OTHER_GPUS = ("NVIDIA H100", "gpu")
GMM_TILES: dict[tuple, GmmTiles] = {
    # bf16/f16: fastest of benchmarks/gmm.py --sweep-tiles on an H100 (2026-11-22; Qwen3-30B-A3B
    # and Mixtral expert shapes at 16K tokens: 1.46x and 1.61x the m128_n128 tiles used before).
    # An H200 uses these H100 entries (tile_table.STAND_INS); other GPUs fall back to the
    # platform entry, the same tiles, until swept.
    **tile_table.entries(_H100_AND_OTHER_GPUS, _HALF, _H100_GMM),
    ("gpu", "float32"): GmmTiles(block_m=64, block_k=32, block_n=64, num_warps=4, num_stages=3),
    **tile_table.entries(("cpu",), (*_HALF, "float32"),
                         GmmTiles(block_m=64, block_k=64, block_n=128)),
}


# The fused gate/up kernel keeps two accumulators and streams two weight tiles, so it
# needs about twice the shared memory of the plain GEMM at the same tiles: m128_n256 asks
# an H100 for 256 KiB (it has 227). Entries here override GMM_TILES for that kernel;
# m128_n128 with 4 stages was fastest on the Qwen3 expert shape (1.30x 3 stages) and
# within 3% of the best on Mixtral's (H100 sweep, 2026-11-22).
_H100_SWIGLU = GmmTiles(block_m=128, block_k=64, block_n=128, num_warps=8, num_stages=4)
SWIGLU_TILES: dict[tuple, GmmTiles] = tile_table.entries(_H100_AND_OTHER_GPUS, _HALF,
                                                         _H100_SWIGLU)
KERNELS = ("gmm", "swiglu")


def _platform() -> str:
    return tile_table.platform_of()


def tiles_for(dtype, platform: str | None = None, kernel: str = "gmm", *,
              device_kind: str | None = None, shape: tile_table.Shape | None = None
              ) -> GmmTiles:
    """The tuned tiles for a dtype on a platform (``gpu`` / ``cpu``; default: this one),
    for the plain grouped GEMM (``kernel="gmm"``) or the fused gate/up kernel
    (``"swiglu"``): the most specific entry for the device kind (default: this machine's
    where the platform is this one) and (d, f, E) shape."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNELS}")
    where = dict(device_kind=device_kind, platform=platform or _platform(), shape=shape)
    tiles = tile_table.lookup(SWIGLU_TILES, dtype, **where) if kernel == "swiglu" else None
    tiles = tiles or tile_table.lookup(GMM_TILES, dtype, **where)
    if tiles is None:
        raise ValueError(f"no grouped-GEMM tiles for {jnp.dtype(dtype).name} on "
                         f"{where['platform']}; known: {sorted(GMM_TILES)}")
    return tiles


def _fit_block(block: int, dim: int) -> int:
    """The largest power of two ≤ ``block`` dividing ``dim`` (≥ 1)."""
    while block > 1 and dim % block:
        block //= 2
    return block


def _pad_to(dim: int, multiple: int) -> int:
    return -(-dim // multiple) * multiple


# Which layer of a stacked [L, E, ...] expert weight a kernel reads: a Python int or a
# traced integer scalar (a decode step's loop counter).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GroupTileMap:
    """Which groups each row tile meets, in the compact form the kernels read.

    visit_lo, visit_hi: [R] int32 (R = num_row_tiles) — the tile meets the non-empty groups
    ``visit_group[visit_lo:visit_hi]``; visit_group: [E] int32, the non-empty groups
    in order (padded with 0); group_start, group_end: [E] int32 row range of each group.
    """

    visit_lo: Int[Array, "R"]
    visit_hi: Int[Array, "R"]
    visit_group: Int[Array, "E"]
    group_start: Int[Array, "E"]
    group_end: Int[Array, "E"]


def group_tile_map(group_sizes: Integer[Array, "E"], num_row_tiles: int,
                   block_m: int) -> GroupTileMap:
    """Map row tiles to the non-empty groups they intersect (all static shapes)."""
    sizes = group_sizes.astype(jnp.int32)
    num_groups = sizes.shape[0]
    group_end = jnp.cumsum(sizes)
    group_start = group_end - sizes
    nonempty = sizes > 0
    tile_first = jnp.arange(num_row_tiles, dtype=jnp.int32)[:, None] * block_m
    # Non-empty groups are contiguous and ordered, so those ending at or before a tile's
    # first row precede its visits, and those starting before its end row bound them.
    visit_lo = jnp.sum(nonempty & (group_end <= tile_first), axis=1, dtype=jnp.int32)
    visit_hi = jnp.sum(nonempty & (group_start < tile_first + block_m), axis=1, dtype=jnp.int32)
    (visit_group,) = jnp.nonzero(nonempty, size=num_groups, fill_value=0)
    return GroupTileMap(visit_lo=visit_lo, visit_hi=visit_hi,
                        visit_group=visit_group.astype(jnp.int32),
                        group_start=group_start, group_end=group_end)


def expert_index(layer_ref):
    """The leading index of expert ``group``'s matrix in a weight ref: ``(group,)`` for
    ``[E, ...]`` weights (``layer_ref`` None), ``(layer, group)`` for an ``[L, E, ...]``
    stack, with the layer loaded once per program from its ``[1]`` ref."""
    if layer_ref is None:
        return lambda group: (group,)
    layer = layer_ref[0]
    return lambda group: (layer, group)


def split_refs(refs, num_weights: int, layered: bool):
    """A kernel's refs, in the order the launchers pass them: the five tile-map refs, the
    layer ref (where ``layered``), lhs, ``num_weights`` weight refs, then the output.
    Returns (tile-map refs, layer ref or None, lhs ref, weight refs, output ref)."""
    tile_map_refs, rest = refs[:5], refs[5:]
    layer_ref, rest = (rest[0], rest[1:]) if layered else (None, rest)
    lhs_ref, weight_refs, (out_ref,) = rest[0], rest[1:1 + num_weights], rest[1 + num_weights:]
    return tile_map_refs, layer_ref, lhs_ref, weight_refs, out_ref


def group_products(tile_map_refs, layer_ref, lhs_ref, weights, load_tile, *, block_m: int,
                   block_k: int, block_n: int, depth: int, precision) -> list[jax.Array]:
    """In one program: Σ over the groups meeting this row tile of masked x · W for each of
    ``weights``, W's [block_k, block_n] tile at reduction step kk read by ``load_tile(weight,
    index, kk, dtype)`` (``index``: ``(g,)``, or ``(layer, g)`` where ``layer_ref`` is
    given; the tile in x's ``dtype``). The kernels differ only in that hook (plain
    weights here, FP8 dequantized in :mod:`kernels_pallas.gmm_fp8`). Returns one
    [block_m, block_n] f32 each."""
    lo_ref, hi_ref, visit_ref, start_ref, end_ref = tile_map_refs
    m = pl.program_id(0)
    first_row = m * block_m
    rows = first_row + jnp.arange(block_m, dtype=jnp.int32)
    expert = expert_index(layer_ref)

    def visit(v, accs):
        group = visit_ref[v]
        in_group = ((rows >= start_ref[group]) & (rows < end_ref[group]))[:, None]

        def k_step(kk, accs):
            x = lhs_ref[pl.ds(first_row, block_m), pl.ds(kk * block_k, block_k)]
            x = jnp.where(in_group, x, jnp.zeros_like(x))
            return tuple(acc + jnp.dot(x, load_tile(weight, expert(group), kk, x.dtype),
                                       preferred_element_type=jnp.float32, precision=precision)
                         for acc, weight in zip(accs, weights))

        return jax.lax.fori_loop(0, depth // block_k, k_step, accs)

    zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in weights)
    return list(jax.lax.fori_loop(lo_ref[m], hi_ref[m], visit, zeros))


def _column_tiles(block_k: int, block_n: int):
    """The plain weights' tile loader: ``weight`` = (ref, column offset); columns
    [n·block_n + offset, +block_n)."""
    n = pl.program_id(1)

    def load(weight, index, kk, dtype):
        ref, offset = weight
        w = ref[(*index, pl.ds(kk * block_k, block_k), pl.ds(n * block_n + offset, block_n))]
        # A layered stack is not cast up front (that would copy all L layers): each tile
        # is cast here, to the same values.
        return w if w.dtype == dtype else w.astype(dtype)

    return load


def _products(tile_map_refs, layer_ref, lhs_ref, rhs_refs, rhs_col_offsets, **dims):
    load = _column_tiles(dims["block_k"], dims["block_n"])
    return group_products(tile_map_refs, layer_ref, lhs_ref,
                          tuple(zip(rhs_refs, rhs_col_offsets)), load, **dims)


def _gmm_kernel(*refs, layered: bool, **dims):
    tile_map_refs, layer_ref, lhs_ref, (rhs_ref,), out_ref = split_refs(refs, 1, layered)
    (acc,) = _products(tile_map_refs, layer_ref, lhs_ref, (rhs_ref,), (0,), **dims)
    out_ref[...] = acc.astype(out_ref.dtype)


def _swiglu_kernel(*refs, layered: bool, up_col_offset: int, **dims):
    tile_map_refs, layer_ref, lhs_ref, (gate_ref, up_ref), out_ref = split_refs(refs, 2, layered)
    gate, up = _products(tile_map_refs, layer_ref, lhs_ref, (gate_ref, up_ref),
                               (0, up_col_offset), **dims)
    out_ref[...] = (jax.nn.silu(gate) * up).astype(out_ref.dtype)


def _check_operands(name: str, lhs: jax.Array, group_sizes: jax.Array,
                    weights: dict[str, jax.Array], layered: bool = False) -> None:
    """ValueError naming the operand that does not fit: lhs [T, d], each weight [E, d, f]
    (``[L, E, d, f]`` where ``layered``), group_sizes [E] integer."""
    if lhs.ndim != 2:
        raise ValueError(f"{name}: lhs must be [T, d], got shape {lhs.shape}")
    expected = f"{'L, ' if layered else ''}E, d={lhs.shape[1]}, f"
    for operand, w in weights.items():
        if w.ndim != 3 + layered or w.shape[-2] != lhs.shape[1]:
            raise ValueError(weight_shape_error(name, operand, w.shape, expected, layered))
        if w.shape[-3] != group_sizes.shape[0]:
            raise ValueError(f"{name}: {w.shape[-3]} expert matrices but group_sizes has "
                             f"{group_sizes.shape[0]} entries ({operand} {list(w.shape)})")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes must be a 1-D integer array, got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")


def _resolve(lhs: jax.Array, out_cols: int, tiles: GmmTiles | None,
             interpret: bool | None, kernel: str = "gmm", num_groups: int | None = None
             ) -> tuple[GmmTiles, bool]:
    shape = (lhs.shape[1], out_cols, num_groups) if num_groups else None
    tiles = tiles or tiles_for(lhs.dtype, kernel=kernel, shape=shape)
    if interpret is None:
        interpret = _platform() != "gpu"
    depth = lhs.shape[1]
    tiles = dataclasses.replace(tiles, block_k=_fit_block(tiles.block_k, depth),
                                block_n=_fit_block(tiles.block_n, out_cols))
    # Triton's dot needs at least 16 along each dimension.
    if not interpret and min(tiles.block_k, tiles.block_n) < 16:
        raise ValueError(f"grouped GEMM on GPU needs d and f divisible by 16, got d={depth}, "
                         f"f={out_cols}; use the pure-JAX path (expert_impl='fused_tiles')")
    return tiles, interpret


def _drop_initial_output(kernel, *refs, **kwargs):
    """Kernel adapter when the output aliases a caller's buffer: that buffer arrives as one
    more input ref, which the kernel never reads (it overwrites every element)."""
    kernel(*refs[:-2], refs[-1], **kwargs)


def _launch(kernel, lhs: jax.Array, weights: tuple[jax.Array, ...], group_sizes: jax.Array,
            out_cols: int, tiles: GmmTiles, interpret: bool, out: jax.Array | None,
            layer: jax.Array | None = None, **kernel_kwargs) -> jax.Array:
    """Pad the rows to whole tiles, build the tile map and run ``kernel`` over the grid.

    ``layer``: None for ``[E, ...]`` weights, else the ``[1]`` int32 index
    (:func:`layer_operand`) of the layer of ``[L, E, ...]`` stacks to read."""
    num_rows, depth = lhs.shape
    padded_rows = _pad_to(max(num_rows, 1), tiles.block_m)
    if out is not None and (out.shape != (num_rows, out_cols) or out.dtype != lhs.dtype):
        raise ValueError(f"out must be {lhs.dtype}[{num_rows}, {out_cols}], got "
                         f"{out.dtype}{list(out.shape)}")
    lhs_padded = jnp.pad(lhs, ((0, padded_rows - num_rows), (0, 0)))
    num_row_tiles = padded_rows // tiles.block_m
    tile_map = group_tile_map(group_sizes, num_row_tiles, tiles.block_m)
    if layer is None:
        weights = tuple(w.astype(lhs.dtype) for w in weights)
    # (a layered stack keeps its dtype: casting it here would copy all L layers, the copy
    # layer= exists to avoid; the program casts each tile it reads instead)
    precision = (jax.lax.Precision.HIGHEST if lhs.dtype == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    body = functools.partial(kernel, block_m=tiles.block_m, block_k=tiles.block_k,
                             block_n=tiles.block_n, depth=depth, precision=precision,
                             layered=layer is not None, **kernel_kwargs)

    # The program indexes these itself: the expert (and so the weight block) is
    # data-dependent within one program, and Pallas's Triton backend has no scalar
    # prefetch to feed an index map. A whole-array spec is a pointer to the caller's
    # buffer (the whole [L, E, d, f] stack when layered), so the program's
    # w[layer, group, k, n] tile reads are in place: nothing is sliced out first.
    def whole(array):
        return pl.BlockSpec(array.shape, lambda m, n, _nd=array.ndim: (0,) * _nd)

    operands = (tile_map.visit_lo, tile_map.visit_hi, tile_map.visit_group,
                tile_map.group_start, tile_map.group_end,
                *(() if layer is None else (layer,)), lhs_padded, *weights)
    in_specs = [whole(a) for a in operands]
    out_spec = pl.BlockSpec((tiles.block_m, tiles.block_n), lambda m, n: (m, n))
    aliases = {}
    if out is not None:
        body = functools.partial(_drop_initial_output, body)
        aliases = {len(operands): 0}
        operands += (jnp.pad(out, ((0, padded_rows - num_rows), (0, 0)),
                             constant_values=jnp.nan if jnp.issubdtype(out.dtype, jnp.floating)
                             else 0),)
        in_specs.append(out_spec)
    compiler_params = None if interpret else pl_triton.CompilerParams(
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    out = pl.pallas_call(
        body,
        out_shape=jax.ShapeDtypeStruct((padded_rows, out_cols), lhs.dtype),
        grid=(num_row_tiles, out_cols // tiles.block_n),
        in_specs=in_specs,
        out_specs=out_spec,
        input_output_aliases=aliases,
        interpret=interpret,
        compiler_params=compiler_params,
        name=getattr(kernel, "__name__", "gmm").strip("_"),
    )(*operands)
    return out[:num_rows]


def _mosaic_backend(backend: str | None, lhs: jax.Array, out_cols: int, num_groups: int,
                    tiles: GmmTiles | None, interpret: bool | None, kernel: str = "gmm",
                    weights: tuple[jax.Array, ...] = (), layered: bool = False):
    """The Mosaic GPU tiles when this call runs the Mosaic kernel, else None (Triton).

    ``backend=None`` follows :func:`kernels_pallas.gmm_select.choose_backend` (and stays on
    Triton where the call pins Triton tiles or interpret mode, the Mosaic tiles do not
    divide d and f, or a layered stack is not in lhs's dtype: the Mosaic kernel cannot cast
    a tile it loads by TMA, and casting the stack would copy every layer); ``"mosaic"``
    insists, and the Mosaic kernel says why it cannot."""
    if backend not in (None, *gmm_select.BACKENDS):
        raise ValueError(f"unknown grouped-GEMM backend {backend!r}; choose one of "
                         f"{gmm_select.BACKENDS} or None (the measured rule)")
    if backend is None:
        if tiles is not None or interpret or gmm_select.choose_backend(lhs.dtype) != "mosaic":
            return None
    elif backend == "triton":
        return None
    mosaic_tiles = gmm_select.mosaic_tiles_for(lhs.dtype, kernel=kernel,
                                               shape=(lhs.shape[1], out_cols, num_groups))
    fits = lhs.shape[1] % mosaic_tiles.block_k == 0 and out_cols % mosaic_tiles.block_n == 0
    fits = fits and not (layered and any(w.dtype != lhs.dtype for w in weights))
    if not fits and backend is None:
        return None
    return mosaic_tiles          # (a forced misfit: the Mosaic kernel refuses it by name)


def _mosaic_interpret(interpret: bool | None):
    """This module's ``interpret`` (None: off a GPU) as the Mosaic kernels take it."""
    if interpret is None:
        return None
    from kernels_pallas import gmm_mosaic

    return gmm_mosaic.interpret_params() if interpret else False


def gmm(lhs: Float[Array, "T d"], rhs: Float[Array, "*L E d f"],
        group_sizes: Integer[Array, "E"], *, interpret: bool | None = None,
        tiles: GmmTiles | None = None, out: Float[Array, "T f"] | None = None,
        backend: str | None = None, layer: Layer | None = None) -> Float[Array, "T f"]:
    """Grouped matmul: lhs [T, d] (rows sorted by group) × rhs [E, d, f] -> [T, f].

    group_sizes [E] int: rows of each group, in order; rows past their sum are zero in
    the output. f32 accumulation; output in lhs's dtype (rhs is cast to it).
    interpret: None = interpret everywhere but on a GPU. tiles: override the table.
    out: optional [T, f] buffer the Triton kernel writes into (donated; every element is
    overwritten, which the tests check by passing NaNs; the Mosaic kernel returns a new
    array of the same values). backend: ``"triton"``, ``"mosaic"``
    (:mod:`kernels_pallas.gmm_mosaic`) or None, the measured rule of
    :mod:`kernels_pallas.gmm_select`. layer: None, or an int / traced int32 scalar: rhs is
    then a stack ``[L, E, d, f]`` and the product uses ``rhs[layer]``, read in place (the
    same result as ``gmm(lhs, rhs[layer], ...)`` without the copy of the slice; indexed as
    ``rhs[layer]`` is: negative from the end, a traced index clamped into range).
    """
    layered = layer is not None
    _check_operands("gmm", lhs, group_sizes, {"rhs": rhs}, layered)
    layer_index = layer_operand("gmm", layer, rhs.shape[0]) if layered else None
    out_cols, num_groups = rhs.shape[-1], rhs.shape[-3]
    mosaic_tiles = _mosaic_backend(backend, lhs, out_cols, num_groups, tiles, interpret,
                                   weights=(rhs,), layered=layered)
    if mosaic_tiles is not None:
        from kernels_pallas import gmm_mosaic

        return gmm_mosaic.gmm_mosaic(lhs, rhs, group_sizes, tiles=mosaic_tiles,
                                     interpret=_mosaic_interpret(interpret), layer=layer)
    tiles, interpret = _resolve(lhs, out_cols, tiles, interpret, num_groups=num_groups)
    return _launch(_gmm_kernel, lhs, (rhs,), group_sizes, out_cols, tiles, interpret, out,
                   layer_index)


def gmm_swiglu(lhs: Float[Array, "T d"], w_gate: Float[Array, "*L E d f"],
               w_up: Float[Array, "*L E d f"], group_sizes: Integer[Array, "E"], *,
               interpret: bool | None = None, tiles: GmmTiles | None = None,
               out: Float[Array, "T f"] | None = None, backend: str | None = None,
               layer: Layer | None = None) -> Float[Array, "T f"]:
    """silu(lhs · w_gate[g]) * (lhs · w_up[g]) per group in one kernel.

    lhs [T, d]; w_gate, w_up [E, d, f] -> [T, f] in lhs's dtype; rows past
    sum(group_sizes) are zero. interpret, tiles, out, backend, layer: as in :func:`gmm`
    (with ``layer``, w_gate and w_up are both ``[L, E, d, f]`` stacks).
    """
    layered = layer is not None
    _check_operands("gmm_swiglu", lhs, group_sizes, {"w_gate": w_gate, "w_up": w_up}, layered)
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gmm_swiglu: w_gate {w_gate.shape} and w_up {w_up.shape} differ")
    layer_index = layer_operand("gmm_swiglu", layer, w_gate.shape[0]) if layered else None
    out_cols, num_groups = w_gate.shape[-1], w_gate.shape[-3]
    mosaic_tiles = _mosaic_backend(backend, lhs, out_cols, num_groups, tiles, interpret,
                                   kernel="swiglu", weights=(w_gate, w_up), layered=layered)
    if mosaic_tiles is not None:
        from kernels_pallas import gmm_mosaic

        return gmm_mosaic.gmm_swiglu_mosaic(lhs, w_gate, w_up, group_sizes, tiles=mosaic_tiles,
                                            interpret=_mosaic_interpret(interpret),
                                            layer=layer)
    tiles, interpret = _resolve(lhs, out_cols, tiles, interpret, kernel="swiglu",
                                num_groups=num_groups)
    return _launch(_swiglu_kernel, lhs, (w_gate, w_up), group_sizes, out_cols, tiles,
                   interpret, out, layer_index, up_col_offset=0)


def gmm_swiglu_stacked(lhs: Float[Array, "T d"], w_gate_up: Float[Array, "*L E d two_f"],
                       group_sizes: Integer[Array, "E"], *,
                       interpret: bool | None = None, tiles: GmmTiles | None = None,
                       out: Float[Array, "T f"] | None = None, backend: str | None = None,
                       layer: Layer | None = None) -> Float[Array, "T f"]:
    """:func:`gmm_swiglu` over stacked weights w_gate_up [E, d, 2f] (gate columns first,
    then up), read in place: the kernel takes up's columns at an offset of f. layer: as in
    :func:`gmm` (w_gate_up then ``[L, E, d, 2f]``)."""
    layered = layer is not None
    _check_operands("gmm_swiglu_stacked", lhs, group_sizes, {"w_gate_up": w_gate_up}, layered)
    if w_gate_up.shape[-1] % 2:
        raise ValueError(f"gmm_swiglu_stacked: w_gate_up's last dim must be 2f, got "
                         f"{w_gate_up.shape[-1]}")
    layer_index = (layer_operand("gmm_swiglu_stacked", layer, w_gate_up.shape[0]) if layered
                   else None)
    out_cols, num_groups = w_gate_up.shape[-1] // 2, w_gate_up.shape[-3]
    mosaic_tiles = _mosaic_backend(backend, lhs, out_cols, num_groups, tiles, interpret,
                                   kernel="swiglu", weights=(w_gate_up,), layered=layered)
    if mosaic_tiles is not None:
        from kernels_pallas import gmm_mosaic

        return gmm_mosaic.gmm_swiglu_stacked_mosaic(lhs, w_gate_up, group_sizes,
                                                    tiles=mosaic_tiles,
                                                    interpret=_mosaic_interpret(interpret),
                                                    layer=layer)
    tiles, interpret = _resolve(lhs, out_cols, tiles, interpret, kernel="swiglu",
                                num_groups=num_groups)
    return _launch(_swiglu_kernel, lhs, (w_gate_up, w_gate_up), group_sizes, out_cols, tiles,
                   interpret, out, layer_index, up_col_offset=out_cols)

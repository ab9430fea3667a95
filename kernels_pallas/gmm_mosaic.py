"""Grouped GEMM and the fused gate/up kernel in Pallas Mosaic GPU (TMA loads, WGMMA).

Same contract as :mod:`kernels_pallas.gmm` (rows ``[T, d]`` sorted by group, one
matrix per group in ``[E, d, f]``, rows past ``sum(group_sizes)`` zero, f32
accumulation), for bf16/f16 on Hopper. JAX 0.11 deprecates Pallas's Triton
backend; these are the ports, chosen over the Triton kernels by the measured rule
in :mod:`kernels_pallas.gmm_select`.

Schedule: :func:`kernels_pallas.tile_schedule.work_items` with a tail — every
work item is one group's rows within one ``block_m`` row tile (a tile that
straddles a boundary is one item per group), and the rows past the groups are
items of a sentinel group whose output is zeros. A persistent loop over the SMs
(``plgpu.nd_loop``) walks (item, column tile) pairs; each pair pipelines the
reduction over ``d`` (``plgpu.emit_pipeline``: TMA copies of the ``[block_m,
block_k]`` row block and ``[block_k, block_n]`` weight block into shared memory,
``max_concurrent_steps`` in flight, WGMMA into a register accumulator), then
stores only its own rows. TMA stores take static shapes, so a partial row range
of ``r`` rows is stored as one copy per set bit of ``r`` (at most log2(block_m)+1
copies), each of a power-of-two height.

``layer=`` (as in :mod:`kernels_pallas.gmm`): the weights are ``[L, E, d, f]`` stacks
and each work item pipelines from ``w.at[layer, group]``, a view of the caller's stack
(the layer index is one more GMEM operand, loaded once per program like the schedule's
entries): TMA reads the layer's blocks in place. The stack must already be in lhs's
dtype (a TMA-loaded tile cannot be cast on the way, and casting the stack would copy
every layer).

Off a GPU the kernels run under Mosaic GPU's interpret mode (:func:`interpret_params`:
a CPU simulation of shared memory, TMA and WGMMA): slow, for tests at small shapes only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Integer

from kernels_pallas.layer_index import Layer, layer_operand, weight_shape_error
from kernels_pallas.mosaic_tiles import (ACCUMULATOR_REGISTERS, DEFAULT_TILES,  # noqa: F401
                                         H100_SMS, HOPPER_SMEM_BYTES, SUPPORTED_DTYPES,
                                         WARPGROUP_THREADS, WGMMA_ROWS, MosaicTiles)
from kernels_pallas.tile_schedule import work_items

# Row blocks are whole WGMMA M tiles (64 rows per warpgroup instruction); the reduction
# step is one 128-byte swizzle row of bf16/f16 (64 elements).
@dataclasses.dataclass(frozen=True)
class _Shape:
    num_rows: int       # padded to whole row tiles
    depth: int
    out_cols: int
    num_groups: int
    num_items: int


def _check(name: str, lhs: jax.Array, group_sizes: jax.Array, tiles: MosaicTiles,
           out_cols: int, accumulators: int, weights: dict[str, jax.Array],
           layered: bool = False) -> None:
    """ValueError naming what the kernel cannot take: lhs, a weight operand (``weights``:
    name -> array; ``[L, E, d, f]`` where ``layered``), group_sizes, the tiles."""
    if lhs.ndim != 2:
        raise ValueError(f"{name}: lhs must be [T, d], got shape {lhs.shape}")
    if jnp.dtype(lhs.dtype).name not in SUPPORTED_DTYPES:
        raise ValueError(f"{name}: the Mosaic GPU kernels take {SUPPORTED_DTYPES}, got "
                         f"{lhs.dtype} (float32 runs on the Triton kernel or XLA)")
    expected = f"{'L, ' if layered else ''}E={group_sizes.shape[0]}, d={lhs.shape[1]}, f"
    for operand, w in weights.items():
        if (w.ndim != 3 + layered or w.shape[-2] != lhs.shape[1]
                or w.shape[-3] != group_sizes.shape[0]):
            raise ValueError(weight_shape_error(name, operand, w.shape, expected, layered))
        if layered and w.dtype != lhs.dtype:
            raise ValueError(f"{name}: with layer=, {operand} must already be lhs's "
                             f"{jnp.dtype(lhs.dtype).name}, got {w.dtype} (TMA loads a tile "
                             f"as stored, and casting the stack would copy all "
                             f"{w.shape[0]} layers)")
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"{name}: group_sizes must be a 1-D integer array, got "
                         f"{group_sizes.dtype}{list(group_sizes.shape)}")
    if lhs.shape[1] % tiles.block_k:
        raise ValueError(f"{name}: d={lhs.shape[1]} must be a multiple of block_k="
                         f"{tiles.block_k}")
    if out_cols % tiles.block_n:
        raise ValueError(f"{name}: f={out_cols} must be a multiple of block_n={tiles.block_n}")
    if tiles.accumulator_registers(accumulators) > ACCUMULATOR_REGISTERS:
        raise ValueError(f"{name}: {accumulators} accumulator(s) of [{tiles.block_m}, "
                         f"{tiles.block_n}] f32 need {tiles.accumulator_registers(accumulators)}"
                         f" registers per thread, over the {ACCUMULATOR_REGISTERS} budgeted; "
                         f"use smaller tiles")


def _store_rows(acc: jax.Array, out_gmem, first_row, row_lo, rows, col, *, block_m: int,
                block_n: int) -> None:
    """Store rows ``[row_lo, row_lo + rows)`` of the ``[block_m, block_n]`` block ``acc`` to
    ``out_gmem`` at ``first_row + row_lo``, column block ``col``: one TMA copy per set bit
    of ``rows``, largest first (TMA copies have static shapes)."""

    def scope(out_smem):
        out_smem[...] = acc.astype(out_smem.dtype)
        plgpu.commit_smem()
        offset = row_lo
        height = block_m
        while height >= 1:
            @pl.when((rows & height) != 0)
            def _store(height=height, offset=offset):
                plgpu.copy_smem_to_gmem(
                    out_smem.at[pl.ds(offset, height)],
                    out_gmem.at[pl.ds(first_row + offset, height),
                                pl.ds(col * block_n, block_n)])
            offset = offset + (rows & height)
            height //= 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, plgpu.SMEM((block_m, block_n), out_gmem.dtype))


def _accumulate(lhs_gmem, weight_blocks, tile, col_blocks, *, shape: _Shape,
                tiles: MosaicTiles) -> list[jax.Array]:
    """Σ_k lhs[tile rows, k] · w[k, col block] for each (weight ref, column block) pair,
    pipelined over k -> one f32 ``[block_m, block_n]`` array per weight."""
    bm, bk, bn = tiles.block_m, tiles.block_k, tiles.block_n

    def scope(*accs):
        def step(_, x_smem, *w_smems):
            for acc, w_smem in zip(accs, w_smems):
                plgpu.wgmma(acc, x_smem, w_smem)

        specs = [plgpu.BlockSpec((bm, bk), lambda k: (tile, k), delay_release=1)]
        specs += [plgpu.BlockSpec((bk, bn), functools.partial(lambda k, c: (k, c), c=c),
                                  delay_release=1) for c in col_blocks]
        plgpu.emit_pipeline(step, grid=(shape.depth // bk,), in_specs=specs,
                            max_concurrent_steps=tiles.stages)(lhs_gmem, *weight_blocks)
        return tuple(acc[...] for acc in accs)

    return list(pl.run_scoped(scope, *(plgpu.ACC((bm, bn)) for _ in weight_blocks)))


def _kernel_body(group_gmem, tile_gmem, lo_gmem, rows_gmem, *refs, shape: _Shape,
                 tiles: MosaicTiles, epilogue: str, up_col_block: int, layered: bool):
    """The persistent loop over (work item, column tile). ``refs``: the ``[1]`` layer ref
    (where ``layered``), lhs, the weight refs, then the output ref. ``epilogue``:
    ``"gmm"`` (one product) or ``"swiglu"`` (silu(gate)·up, gate and up from the two
    weight refs, up's column blocks offset by ``up_col_block``)."""
    layer_gmem, refs = (refs[0], refs[1:]) if layered else (None, refs)
    lhs_gmem, *weight_refs, out_gmem = refs
    col_tiles = shape.out_cols // tiles.block_n
    # An expert's matrix: a view of the stack (the layer's when layered), never a copy.
    layer = layer_gmem[0] if layered else None
    expert = (lambda w, g: w.at[g]) if layer is None else (lambda w, g: w.at[layer, g])

    @plgpu.nd_loop((shape.num_items * col_tiles,), collective_axes="sm")
    def _(info):
        item, col = plgpu.planar_snake(info.index[0], (shape.num_items, col_tiles), 1,
                                       tiles.grid_block_n)
        rows = rows_gmem[item]
        group = group_gmem[item]
        tile = tile_gmem[item]
        store = functools.partial(_store_rows, out_gmem=out_gmem, first_row=tile * tiles.block_m,
                                  row_lo=lo_gmem[item], rows=rows, col=col,
                                  block_m=tiles.block_m, block_n=tiles.block_n)

        @pl.when((rows > 0) & (group == shape.num_groups))
        def _tail():              # rows past the groups: zeros, no product
            store(jnp.zeros((tiles.block_m, tiles.block_n), jnp.float32))

        @pl.when((rows > 0) & (group < shape.num_groups))
        def _products():
            weights = [expert(w, group) for w in weight_refs]
            if epilogue == "gmm":
                (acc,) = _accumulate(lhs_gmem, weights, tile, (col,), shape=shape, tiles=tiles)
            else:
                gate, up = _accumulate(lhs_gmem, weights, tile, (col, col + up_col_block),
                                       shape=shape, tiles=tiles)
                acc = jax.nn.sigmoid(gate) * gate * up
            store(acc)


def _launch(lhs: jax.Array, weights: tuple[jax.Array, ...], group_sizes: jax.Array,
            out_cols: int, tiles: MosaicTiles, epilogue: str, up_col_block: int,
            num_sms: int, interpret, layer: jax.Array | None = None) -> jax.Array:
    """Pad the rows, build the work-item schedule and run the persistent kernel. ``layer``:
    None, or the ``[1]`` int32 index of the layer of ``[L, E, d, f]`` weight stacks."""
    num_rows = lhs.shape[0]
    padded_rows = max(-(-num_rows // tiles.block_m), 1) * tiles.block_m
    lhs_padded = jnp.pad(lhs, ((0, padded_rows - num_rows), (0, 0)))
    schedule = work_items(group_sizes, num_rows, tiles.block_m, tail=True)
    shape = _Shape(num_rows=padded_rows, depth=lhs.shape[1], out_cols=out_cols,
                   num_groups=group_sizes.shape[0], num_items=schedule.group.shape[0])
    body = functools.partial(_kernel_body, shape=shape, tiles=tiles, epilogue=epilogue,
                             up_col_block=up_col_block, layered=layer is not None)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((padded_rows, out_cols), lhs.dtype),
        grid=(num_sms,), grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=interpret,
    )
    out = kernel(schedule.group, schedule.tile, schedule.row_lo, schedule.rows,
                 *(() if layer is None else (layer,)), lhs_padded,
                 *(w.astype(lhs.dtype) for w in weights))
    return out[:num_rows]


def interpret_params():
    """Mosaic GPU's interpret mode (a CPU simulation of shared memory, TMA and WGMMA).

    Not exported by ``jax.experimental.pallas`` in JAX 0.10–0.11, hence the private
    import; the tests use it to run these kernels on machines without a GPU.
    """
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
    return InterpretGPUParams()


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def _defaults(tiles: MosaicTiles | None, num_sms: int | None, interpret, kernel: str):
    """Tiles, the persistent grid (one program per SM on a GPU) and the interpret mode
    (off a GPU: simulate)."""
    tiles = tiles or DEFAULT_TILES[kernel]
    if num_sms is None:
        num_sms = getattr(jax.devices()[0], "core_count", None) if _on_gpu() else 2
    if interpret is None:
        interpret = None if _on_gpu() else interpret_params()
    return tiles, int(num_sms or H100_SMS), interpret


def gmm_mosaic(lhs: Float[Array, "T d"], rhs: Float[Array, "*L E d f"],
               group_sizes: Integer[Array, "E"], *, tiles: MosaicTiles | None = None,
               num_sms: int | None = None, interpret=None, layer: Layer | None = None
               ) -> Float[Array, "T f"]:
    """Grouped matmul lhs [T, d] (rows sorted by group) × rhs [E, d, f] -> [T, f].

    bf16/f16; f32 accumulation; output in lhs's dtype; rows past sum(group_sizes) are
    zero. tiles: :class:`MosaicTiles`; num_sms: programs of the persistent loop (default:
    the GPU's SM count); interpret: None = simulate off a GPU, else Pallas's interpret
    argument. layer: None, or an int / traced int32 scalar: rhs is then an
    ``[L, E, d, f]`` stack in lhs's dtype and ``rhs[layer]`` is read in place (indexed as
    in :func:`kernels_pallas.gmm.gmm`).
    """
    tiles, num_sms, interpret = _defaults(tiles, num_sms, interpret, "gmm")
    layered = layer is not None
    _check("gmm_mosaic", lhs, group_sizes, tiles, rhs.shape[-1], 1, {"rhs": rhs}, layered)
    layer_index = layer_operand("gmm_mosaic", layer, rhs.shape[0]) if layered else None
    return _launch(lhs, (rhs,), group_sizes, rhs.shape[-1], tiles, "gmm", 0, num_sms,
                   interpret, layer_index)


def gmm_swiglu_mosaic(lhs: Float[Array, "T d"], w_gate: Float[Array, "*L E d f"],
                      w_up: Float[Array, "*L E d f"], group_sizes: Integer[Array, "E"], *,
                      tiles: MosaicTiles | None = None, num_sms: int | None = None,
                      interpret=None, layer: Layer | None = None) -> Float[Array, "T f"]:
    """silu(lhs · w_gate[g]) * (lhs · w_up[g]) per group in one kernel; as
    :func:`gmm_mosaic` otherwise (with ``layer``, both are ``[L, E, d, f]`` stacks)."""
    tiles, num_sms, interpret = _defaults(tiles, num_sms, interpret, "swiglu")
    if w_gate.shape != w_up.shape:
        raise ValueError(f"gmm_swiglu_mosaic: w_gate {w_gate.shape} and w_up {w_up.shape} "
                         f"differ")
    layered = layer is not None
    _check("gmm_swiglu_mosaic", lhs, group_sizes, tiles, w_gate.shape[-1], 2,
           {"w_gate": w_gate, "w_up": w_up}, layered)
    layer_index = layer_operand("gmm_swiglu_mosaic", layer, w_gate.shape[0]) if layered else None
    return _launch(lhs, (w_gate, w_up), group_sizes, w_gate.shape[-1], tiles, "swiglu", 0,
                   num_sms, interpret, layer_index)


def gmm_swiglu_stacked_mosaic(lhs: Float[Array, "T d"],
                              w_gate_up: Float[Array, "*L E d two_f"],
                              group_sizes: Integer[Array, "E"], *,
                              tiles: MosaicTiles | None = None, num_sms: int | None = None,
                              interpret=None, layer: Layer | None = None
                              ) -> Float[Array, "T f"]:
    """:func:`gmm_swiglu_mosaic` over stacked weights [E, d, 2f] (gate columns, then up),
    read in place: up's column blocks start f / block_n blocks in. layer: as in
    :func:`gmm_mosaic` (w_gate_up then ``[L, E, d, 2f]``)."""
    tiles, num_sms, interpret = _defaults(tiles, num_sms, interpret, "swiglu")
    layered = layer is not None
    if w_gate_up.ndim != 3 + layered or w_gate_up.shape[-1] % 2:
        raise ValueError(f"gmm_swiglu_stacked_mosaic: w_gate_up must be "
                         f"[{'L, ' if layered else ''}E, d, 2f], got {w_gate_up.shape}")
    out_cols = w_gate_up.shape[-1] // 2
    _check("gmm_swiglu_stacked_mosaic", lhs, group_sizes, tiles, out_cols, 2,
           {"w_gate_up": w_gate_up}, layered)
    layer_index = (layer_operand("gmm_swiglu_stacked_mosaic", layer, w_gate_up.shape[0])
                   if layered else None)
    return _launch(lhs, (w_gate_up, w_gate_up), group_sizes, out_cols, tiles, "swiglu",
                   out_cols // tiles.block_n, num_sms, interpret, layer_index)

"""The Mosaic GPU grouped GEMM and fused gate/up kernel (kernels_pallas.gmm_mosaic), their
group-aware work-item schedule (kernels_pallas.tile_schedule), the tile tables and the
measured Triton-or-Mosaic rule: float64 references in Mosaic GPU's interpret mode, and
the lowering for CUDA, on this CPU-only machine."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gmm as kernels
from kernels_pallas import gmm_mosaic, gmm_select, tile_schedule, tile_table
from kernels_pallas.gmm_mosaic import MosaicTiles
from test_gmm_kernel import np_gmm

SMALL = MosaicTiles(block_m=64, block_n=64, block_k=64, stages=2)


def np_swiglu(x: np.ndarray, w_gate: np.ndarray, w_up: np.ndarray, sizes) -> np.ndarray:
    gate, up = np_gmm(x, w_gate, sizes), np_gmm(x, w_up, sizes)
    return gate / (1.0 + np.exp(-gate)) * up


def operands(seed: int, rows: int, d: int, f: int, groups: int, dtype="bfloat16"):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, d)), dtype)
    w = jnp.asarray(rng.standard_normal((3, groups, d, f)) / np.sqrt(d), dtype)
    return x, w[0], w[1], w[2]


def as64(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a, jnp.float32), np.float64)


def assert_close_bf16(got, want):
    # bf16 output: 8 bits of mantissa, so ~2^-8 of each element's magnitude plus the
    # products' own rounding; the float64 reference sees the same bf16 inputs.
    got = as64(got)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2 * scale)


# ------------------------------------------------------------------ the schedule
def brute_force_items(sizes: list[int], num_rows: int, block_m: int, tail: bool):
    """Every (group, tile, row_lo, rows) by walking the rows one at a time."""
    owner = []
    for g, n in enumerate(sizes):
        owner += [g] * n
    if tail:
        owner += [len(sizes)] * (num_rows - len(owner))
    items = []
    for tile in range(-(-num_rows // block_m)):
        rows = owner[tile * block_m:(tile + 1) * block_m]
        for g in sorted(set(rows)):
            lo = rows.index(g)
            items.append((g, tile, lo, rows.count(g)))
    return items


@pytest.mark.parametrize("sizes,num_rows,block_m,tail", [
    ([0, 5, 3, 0, 9, 1], 22, 4, True),
    ([0, 5, 3, 0, 9, 1], 18, 4, False),
    ([8, 8], 16, 8, True),          # boundaries on tile edges: no straddling item
    ([0, 0, 0], 10, 4, True),       # every row is tail
    ([0, 0, 0], 10, 4, False),      # nothing at all
    ([1] * 9, 9, 4, False),         # more groups than tiles
])
def test_work_items_match_a_row_by_row_walk(sizes, num_rows, block_m, tail):
    items = tile_schedule.work_items(jnp.asarray(sizes, jnp.int32), num_rows, block_m, tail)
    count = int(items.count)
    got = list(zip(*(np.asarray(a)[:count].tolist()
                     for a in (items.group, items.tile, items.row_lo, items.rows))))
    assert got == brute_force_items(sizes, num_rows, block_m, tail)
    assert np.all(np.asarray(items.rows)[count:] == 0)
    assert items.group.shape[0] == tile_schedule.max_work_items(num_rows, len(sizes), block_m,
                                                               tail)


def test_work_items_fit_their_static_bound_on_random_sizes():
    rng = np.random.default_rng(3)
    for _ in range(20):
        groups = int(rng.integers(1, 40))
        sizes = rng.multinomial(int(rng.integers(0, 500)), np.ones(groups) / groups)
        items = tile_schedule.work_items(jnp.asarray(sizes, jnp.int32), 512, 64, tail=True)
        rows = np.asarray(items.rows)
        assert rows.sum() == 512                       # every row exactly once
        cost = tile_schedule.schedule_cost(np.append(sizes, 512 - sizes.sum()), 64)
        assert int(items.count) == cost.items


def test_schedule_cost_counts_straddling_and_padding():
    # Groups of 100, 28 and 0 rows in tiles of 64: rows [0,100) touch tiles 0-1, rows
    # [100,128) tile 1 again -> 3 items = 192 rows computed for 128 useful.
    cost = tile_schedule.schedule_cost(np.array([100, 28, 0]), 64)
    assert (cost.items, cost.useful_rows, cost.computed_rows) == (3, 128, 192)
    assert cost.waste == pytest.approx(1 - 128 / 192)
    padded = tile_schedule.schedule_cost(np.array([100, 28, 0]), 64, schedule="padded")
    assert (padded.items, padded.computed_rows) == (3, 192)
    with pytest.raises(ValueError, match="unknown schedule"):
        tile_schedule.schedule_cost(np.array([1]), 64, schedule="persistent")
    with pytest.raises(ValueError, match="counts >= 0"):
        tile_schedule.schedule_cost(np.array([-1]), 64)


# ------------------------------------------------------------------ the kernels
@pytest.mark.parametrize("sizes,rows", [
    ([70, 0, 100], 200),     # a straddling boundary, an empty group, 30 tail rows
    ([64, 64, 0], 128),      # boundaries on tile edges, no tail
    ([0, 0, 5], 37),         # fewer rows than a tile
])
def test_gmm_mosaic_matches_float64_reference(sizes, rows):
    x, w, _, _ = operands(0, rows, 128, 128, len(sizes))
    got = gmm_mosaic.gmm_mosaic(x, w, jnp.asarray(sizes, jnp.int32), tiles=SMALL)
    want = np_gmm(as64(x), as64(w), np.array(sizes))
    assert got.shape == (rows, 128) and got.dtype == jnp.bfloat16
    assert_close_bf16(got, want)
    assert np.all(as64(got)[sum(sizes):] == 0.0)          # tail rows are written as zeros


def test_swiglu_mosaic_separate_and_stacked_match_float64_reference():
    sizes = np.array([30, 90, 0, 41])
    x, w_gate, w_up, _ = operands(1, 192, 64, 128, len(sizes))
    want = np_swiglu(as64(x), as64(w_gate), as64(w_up), sizes)
    separate = gmm_mosaic.gmm_swiglu_mosaic(x, w_gate, w_up, jnp.asarray(sizes, jnp.int32),
                                            tiles=SMALL)
    stacked = gmm_mosaic.gmm_swiglu_stacked_mosaic(
        x, jnp.concatenate([w_gate, w_up], axis=2), jnp.asarray(sizes, jnp.int32), tiles=SMALL)
    assert_close_bf16(separate, want)
    np.testing.assert_array_equal(as64(stacked), as64(separate))


def test_mosaic_equals_the_triton_kernel_through_the_backend_switch():
    sizes = np.array([10, 50, 68])
    x, w, _, _ = operands(2, 128, 64, 128, len(sizes))
    group_sizes = jnp.asarray(sizes, jnp.int32)
    triton = kernels.gmm(x, w, group_sizes, backend="triton")
    mosaic = kernels.gmm(x, w, group_sizes, backend="mosaic", interpret=True)
    swiglu_triton = kernels.gmm_swiglu(x, w, w, group_sizes, backend="triton")
    swiglu_mosaic = kernels.gmm_swiglu(x, w, w, group_sizes, backend="mosaic", interpret=True)
    # Both accumulate in f32 and round once to bf16: they may differ by one bf16 step.
    np.testing.assert_allclose(as64(mosaic), as64(triton), rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(as64(swiglu_mosaic), as64(swiglu_triton), rtol=1e-2, atol=1e-2)
    # With no backend named, the Triton kernel runs (no measurement has put Mosaic anywhere).
    np.testing.assert_array_equal(as64(kernels.gmm(x, w, group_sizes)), as64(triton))


def test_kernels_refuse_what_they_cannot_run(typechecks_off):
    x, w, _, _ = operands(3, 64, 64, 64, 2)
    sizes = jnp.asarray([32, 32], jnp.int32)
    with pytest.raises(ValueError, match="take .*bfloat16.*float32"):
        gmm_mosaic.gmm_mosaic(x.astype(jnp.float32), w, sizes, tiles=SMALL)
    with pytest.raises(ValueError, match="f=64 must be a multiple of block_n=128"):
        gmm_mosaic.gmm_mosaic(x, w, sizes, tiles=MosaicTiles(block_m=64, block_n=128))
    with pytest.raises(ValueError, match=r"weights must be \[E=3"):
        gmm_mosaic.gmm_mosaic(x, w, jnp.asarray([1, 1, 1], jnp.int32), tiles=SMALL)
    with pytest.raises(ValueError, match="block_m must be a multiple of 64"):
        MosaicTiles(block_m=96)
    with pytest.raises(ValueError, match="stages must be >= 2"):
        MosaicTiles(stages=1)
    with pytest.raises(ValueError, match="unknown grouped-GEMM backend 'cutlass'"):
        kernels.gmm(x, w, sizes, backend="cutlass")


def lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_mosaic_kernels_lower_for_nvidia_gpus():
    """Mosaic GPU lowers to MLIR in Python (no GPU needed), so CPU CI catches a kernel that
    would not lower; the PTX compile itself needs the GPU."""
    x = jax.ShapeDtypeStruct((300, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 256, 384), jnp.bfloat16)
    stacked = jax.ShapeDtypeStruct((8, 256, 768), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    for name, kernel, fn, args in (
            ("gmm", "gmm", gmm_mosaic.gmm_mosaic, (x, w, sizes)),
            ("swiglu", "swiglu", gmm_mosaic.gmm_swiglu_mosaic, (x, w, w, sizes)),
            ("stacked", "swiglu", gmm_mosaic.gmm_swiglu_stacked_mosaic, (x, stacked, sizes))):
        tiles = gmm_select.mosaic_tiles_for(jnp.bfloat16, kernel=kernel, platform="gpu")
        compiled = dict(interpret=False, num_sms=132, tiles=tiles)
        text = lower_for_cuda(functools.partial(fn, **compiled), *args)
        assert "custom_call @mosaic_gpu" in text, name
        assert "triton" not in text, name


def test_mosaic_tiles_fit_a_hopper_block_and_its_registers():
    for kernel, accumulators in (("gmm", 1), ("swiglu", 2)):
        for dtype in gmm_mosaic.SUPPORTED_DTYPES:
            tiles = gmm_select.mosaic_tiles_for(dtype, kernel=kernel, platform="gpu")
            item = jnp.dtype(dtype).itemsize
            assert tiles.smem_bytes(item, accumulators) <= gmm_mosaic.HOPPER_SMEM_BYTES
            assert tiles.accumulator_registers(accumulators) <= gmm_mosaic.ACCUMULATOR_REGISTERS
    # Two 128×128 f32 accumulators in one warpgroup would need 256 registers per thread.
    x, w, _, _ = operands(4, 64, 64, 128, 2)
    with pytest.raises(ValueError, match="need 256 registers per thread"):
        gmm_mosaic.gmm_swiglu_mosaic(x, w, w, jnp.asarray([32, 32], jnp.int32),
                                     tiles=MosaicTiles(block_m=128, block_n=128))
    with pytest.raises(ValueError, match="unknown kernel"):
        gmm_select.mosaic_tiles_for(jnp.bfloat16, kernel="down")


# ------------------------------------------------------------------ tables and the rule
def test_tile_lookup_prefers_shape_then_device_kind_then_platform():
    table = {("gpu", "bfloat16"): "platform",
             ("NVIDIA H", "bfloat16"): "short kind",
             ("NVIDIA H100", "bfloat16"): "kind",
             ("NVIDIA H100", "bfloat16", (2048, 768, 128)): "kind+shape",
             ("gpu", "float32"): "f32"}
    find = functools.partial(tile_table.lookup, table, platform="gpu")
    assert find("bfloat16", device_kind="NVIDIA H100 80GB HBM3") == "kind"
    assert find("bfloat16", device_kind="NVIDIA H100 80GB HBM3",
                shape=(2048, 768, 128)) == "kind+shape"
    assert find("bfloat16", device_kind="NVIDIA H200", shape=(2048, 768, 128)) == "short kind"
    assert find("bfloat16", device_kind="NVIDIA A100-SXM4-80GB") == "platform"
    assert find("float16", device_kind="NVIDIA H100") is None
    assert tile_table.lookup(table, "bfloat16", platform="cpu", device_kind="cpu") is None


def test_an_h200_uses_the_h100_entries_until_it_has_its_own():
    shape = (2048, 768, 128)
    table = {("gpu", "bfloat16"): "platform", ("gpu", "float32"): "f32 platform",
             ("NVIDIA H100", "bfloat16"): "h100",
             ("NVIDIA H100", "bfloat16", shape): "h100+shape"}
    find = functools.partial(tile_table.lookup, platform="gpu", device_kind="NVIDIA H200")
    assert tile_table.stand_in("NVIDIA H200") == "NVIDIA H100"
    assert tile_table.stand_in("NVIDIA H100 80GB HBM3") is None
    assert find(table, "bfloat16") == "h100"
    assert find(table, "bfloat16", shape=shape) == "h100+shape"
    assert find(table, "float32") == "f32 platform"      # the H100 has none either
    assert find({**table, ("NVIDIA H200", "bfloat16"): "h200"}, "bfloat16") == "h200"
    # the real tables: Triton tiles and the measured-backend rule follow the H100's
    h200 = kernels.tiles_for("bfloat16", platform="gpu", device_kind="NVIDIA H200")
    assert h200 == kernels.tiles_for("bfloat16", platform="gpu", device_kind="NVIDIA H100")
    assert gmm_select.choose_backend("bfloat16", platform="gpu", device_kind="NVIDIA H200",
                                     table={("NVIDIA H100", "bfloat16"): "mosaic"}) == "mosaic"


def test_triton_tiles_are_keyed_by_device_kind():
    h100 = kernels.tiles_for("bfloat16", platform="gpu", device_kind="NVIDIA H100 80GB HBM3")
    other = kernels.tiles_for("bfloat16", platform="gpu", device_kind="NVIDIA L4")
    assert (h100.block_m, h100.block_n) == (128, 256) and other == h100
    swiglu = kernels.tiles_for("bfloat16", platform="gpu", kernel="swiglu",
                               device_kind="NVIDIA H100 80GB HBM3")
    assert swiglu.block_n == 128
    assert kernels.tiles_for("float32", platform="cpu").block_m == 64


def test_backend_rule_picks_mosaic_only_where_measured():
    measured = {("NVIDIA H100", "bfloat16"): "mosaic"}
    choose = functools.partial(gmm_select.choose_backend, table=measured)
    assert choose("bfloat16", device_kind="NVIDIA H100 80GB HBM3", platform="gpu") == "mosaic"
    assert choose("float16", device_kind="NVIDIA H100 80GB HBM3", platform="gpu") == "triton"
    assert choose("bfloat16", device_kind="NVIDIA A100", platform="gpu") == "triton"
    assert choose("bfloat16", device_kind="cpu", platform="cpu") == "triton"
    assert choose("float32", device_kind="NVIDIA H100", platform="gpu",
                  table={("gpu", "float32"): "mosaic"}) == "triton"   # no f32 WGMMA path
    with pytest.raises(ValueError, match="not one of"):
        choose("bfloat16", device_kind="NVIDIA H100", platform="gpu",
               table={("gpu", "bfloat16"): "cuda"})
    # Every entry of the shipped table must name a real backend.
    assert set(gmm_select.MEASURED_BACKENDS.values()) <= set(gmm_select.BACKENDS)

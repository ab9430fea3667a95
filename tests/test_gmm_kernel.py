"""The Pallas grouped-GEMM kernels (interpreted on CPU) against a float64 NumPy reference,
and their lowering for NVIDIA GPUs (Triton), checked on this CPU-only machine."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gmm as kernels
from moejax import grouped_gemm, moe

SMALL_TILES = kernels.GmmTiles(block_m=16, block_k=32, block_n=32)
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def np_gmm(x: np.ndarray, w: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """float64 reference; rows past sum(sizes) are zero."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    out = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for group, size in enumerate(sizes):
        out[start:start + size] = x[start:start + size] @ w[group]
        start += size
    return out


def np_silu(z: np.ndarray) -> np.ndarray:
    return z / (1.0 + np.exp(-z))


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def operands(seed: int, rows: int, d: int, f: int, sizes, dtype: str):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    w = (rng.standard_normal((len(sizes), d, f)) / np.sqrt(d)).astype(np.float32)
    w2 = (rng.standard_normal((len(sizes), d, f)) / np.sqrt(d)).astype(np.float32)
    # The reference sees exactly the (rounded) values the kernel gets.
    cast = lambda a: np.asarray(jnp.asarray(a, dtype).astype(jnp.float32))
    return cast(x), cast(w), cast(w2), np.asarray(sizes, np.int32)


def poisoned(rows: int, cols: int, dtype: str) -> jax.Array:
    return jnp.full((rows, cols), jnp.nan, dtype)


@functools.partial(jax.jit, static_argnames=("dtype",))
def run_gmm(x, w, sizes, dtype):
    out = poisoned(x.shape[0], w.shape[2], dtype)
    return kernels.gmm(x.astype(dtype), w.astype(dtype), sizes, tiles=SMALL_TILES, out=out)


@functools.partial(jax.jit, static_argnames=("dtype",))
def run_swiglu(x, w_gate, w_up, sizes, dtype):
    out = poisoned(x.shape[0], w_gate.shape[2], dtype)
    return kernels.gmm_swiglu(x.astype(dtype), w_gate.astype(dtype), w_up.astype(dtype),
                              sizes, tiles=SMALL_TILES, out=out)


CASES = {
    # rows not a multiple of the 16-row tile, empty groups (first, middle, last), groups of
    # 1–3 rows so one tile straddles several groups, and 9 trailing rows in no group.
    "mixed": (75, [0, 9, 1, 0, 3, 2, 30, 21, 0]),
    "one_expert_all": (40, [0, 0, 40, 0]),
    "all_empty": (24, [0, 0, 0]),
    "single_row": (1, [0, 1]),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_gmm_matches_float64_reference(case, dtype):
    rows, sizes = CASES[case]
    x, w, _, sizes = operands(1, rows, 64, 96, sizes, dtype)
    got = np.asarray(run_gmm(x, w, sizes, dtype).astype(jnp.float32))
    assert got.shape == (rows, 96)
    assert not np.isnan(got).any(), "a tile of the output was never written"
    want = np_gmm(x, w, sizes)
    assert np.all(got[sizes.sum():] == 0.0), "rows in no group must be zero"
    if np.abs(want).max() > 0:
        assert rel_err(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_matches_float64_reference(dtype):
    rows, sizes = CASES["mixed"]
    x, w_gate, w_up, sizes = operands(2, rows, 64, 96, sizes, dtype)
    got = np.asarray(run_swiglu(x, w_gate, w_up, sizes, dtype).astype(jnp.float32))
    assert not np.isnan(got).any(), "a tile of the output was never written"
    want = np_silu(np_gmm(x, w_gate, sizes)) * np_gmm(x, w_up, sizes)
    assert rel_err(got, want) <= TOLERANCE[dtype]


def test_random_group_sizes_many_draws():
    rng = np.random.default_rng(3)
    for draw in range(4):
        num_groups = int(rng.integers(2, 9))
        sizes = rng.integers(0, 12, num_groups) * (rng.random(num_groups) < 0.7)
        rows = int(sizes.sum() + rng.integers(0, 20))
        x, w, _, sizes = operands(10 + draw, rows, 32, 64, sizes, "float32")
        got = np.asarray(run_gmm(x, w, sizes, "float32"))
        assert rel_err(got, np_gmm(x, w, sizes)) <= 1e-5, (draw, sizes.tolist(), rows)


def test_stacked_gate_up_equals_separate():
    rows, sizes = CASES["mixed"]
    x, w_gate, w_up, sizes = operands(4, rows, 64, 96, sizes, "float32")
    separate = kernels.gmm_swiglu(jnp.asarray(x), jnp.asarray(w_gate), jnp.asarray(w_up),
                                  jnp.asarray(sizes), tiles=SMALL_TILES)
    stacked = kernels.gmm_swiglu_stacked(jnp.asarray(x),
                                         jnp.concatenate([w_gate, w_up], axis=2),
                                         jnp.asarray(sizes), tiles=SMALL_TILES)
    np.testing.assert_array_equal(np.asarray(stacked), np.asarray(separate))


def test_default_tiles_and_pure_jax_reference_agree():
    """The kernel with the table's tiles (blocks shrunk to divide d=48, f=80) against the
    pure-JAX tiled grouped GEMM of moejax.grouped_gemm."""
    rows, sizes = CASES["mixed"]
    x, w, _, sizes = operands(5, rows, 48, 80, sizes, "float32")
    got = kernels.gmm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    reference = grouped_gemm.gmm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), tile_rows=8)
    np.testing.assert_allclose(np.asarray(got), np.asarray(reference), rtol=1e-5, atol=1e-5)


def test_group_tile_map_lists_the_groups_each_tile_meets():
    # Groups: rows [0,5) g0, g1 empty, [5,6) g2, [6,20) g3, rows 20.. in no group; tiles of 8.
    tile_map = kernels.group_tile_map(jnp.array([5, 0, 1, 14]), num_row_tiles=4, block_m=8)
    visits = [np.asarray(tile_map.visit_group)[lo:hi].tolist()
              for lo, hi in zip(np.asarray(tile_map.visit_lo), np.asarray(tile_map.visit_hi))]
    assert visits == [[0, 2, 3], [3], [3], []]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_kernels_lower_for_nvidia_gpus(dtype):
    """The Pallas → Triton and Pallas → Mosaic GPU lowerings run in Python, so CPU-only CI
    still catches kernels that would not lower for a GPU (the final compile needs the GPU
    itself). Mosaic GPU takes 2-byte dtypes only."""
    x = jax.ShapeDtypeStruct((200, 256), dtype)
    w = jax.ShapeDtypeStruct((8, 256, 384), dtype)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    marks = {"triton": "__gpu$xla.gpu.triton", "mosaic": "custom_call @mosaic_gpu"}
    backends = ("triton", "mosaic") if dtype == "bfloat16" else ("triton",)
    for backend in backends:
        for fn, weights in ((kernels.gmm, (w,)), (kernels.gmm_swiglu, (w, w))):
            lowered = jax.jit(functools.partial(fn_gpu, fn, backend)).trace(
                x, *weights, sizes).lower(lowering_platforms=("cuda",))
            assert marks[backend] in lowered.as_text(), (backend, fn.__name__)


def fn_gpu(fn, backend, x, *weights_and_sizes):
    *weights, sizes = weights_and_sizes
    if backend == "mosaic":      # the Mosaic kernel's own table (tiles= pins Triton's)
        return fn(x, *weights, sizes, interpret=False, backend="mosaic")
    kernel = "swiglu" if fn is kernels.gmm_swiglu else "gmm"
    tiles = kernels.tiles_for(x.dtype, platform="gpu", kernel=kernel)
    return fn(x, *weights, sizes, interpret=False, tiles=tiles, backend="triton")


def test_bad_inputs_are_named(typechecks_off):
    x = jnp.zeros((8, 32))
    w = jnp.zeros((4, 32, 64))
    with pytest.raises(ValueError, match=r"lhs must be \[T, d\]"):
        kernels.gmm(jnp.zeros(8), w, jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="d=32"):
        kernels.gmm(x, jnp.zeros((4, 16, 64)), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="4 expert matrices but group_sizes has 3"):
        kernels.gmm(x, w, jnp.zeros(3, jnp.int32))
    with pytest.raises(ValueError, match="integer"):
        kernels.gmm(x, w, jnp.zeros(4))
    with pytest.raises(ValueError, match="differ"):
        kernels.gmm_swiglu(x, w, jnp.zeros((4, 32, 32)), jnp.zeros(4, jnp.int32))
    with pytest.raises(ValueError, match="divisible by 16"):
        kernels.gmm(jnp.zeros((8, 24)), jnp.zeros((4, 24, 64)), jnp.zeros(4, jnp.int32),
                    interpret=False)
    with pytest.raises(ValueError, match="power of two"):
        kernels.GmmTiles(block_m=24, block_k=32, block_n=32)
    with pytest.raises(ValueError, match=r"out must be float32\[8, 64\]"):
        kernels.gmm(x, w, jnp.zeros(4, jnp.int32), out=jnp.zeros((8, 32)))


def test_dispatch_rule():
    assert grouped_gemm.choose_expert_impl(2048, 768, platform="gpu") == "pallas"
    assert grouped_gemm.choose_expert_impl(2048, 100, platform="gpu") == "fused_tiles"
    assert grouped_gemm.choose_expert_impl(2048, 768, platform="cpu") == "fused_tiles"


def test_moe_expert_compute_pallas_equals_fused_tiles():
    rng = np.random.default_rng(6)
    sizes = np.array([7, 0, 19, 3, 0, 11], np.int32)
    x = rng.standard_normal((48, 32)).astype(np.float32)     # 8 rows in no group
    w_gate, w_up = (rng.standard_normal((2, 6, 32, 64)) / 6).astype(np.float32)
    w_down = (rng.standard_normal((6, 64, 32)) / 8).astype(np.float32)
    w_gate, w_up, w_down = jnp.asarray(w_gate), jnp.asarray(w_up), jnp.asarray(w_down)
    perm = moe.Permutation(x_sorted=jnp.asarray(x), order=jnp.arange(48, dtype=jnp.int32),
                           group_sizes=jnp.asarray(sizes))
    pallas = moe.expert_compute(perm, w_gate, w_up, w_down, impl="pallas")
    tiles = moe.expert_compute(perm, w_gate, w_up, w_down, impl="fused_tiles", tile_rows=8)
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(tiles), rtol=1e-5, atol=1e-5)
    assert np.all(np.asarray(pallas)[sizes.sum():] == 0.0)


def test_swiglu_tiles_fit_a_hopper_block():
    """The fused kernel double-buffers two weight tiles and holds two accumulators; its GPU
    tiles must stay under the 227 KiB of shared memory an H100 block may use (n256 tiles
    asked for 256 KiB there and failed)."""
    for dtype in ("bfloat16", "float16"):
        t = kernels.tiles_for(dtype, platform="gpu", kernel="swiglu")
        item = jnp.dtype(dtype).itemsize
        staged = t.num_stages * (t.block_m * t.block_k + 2 * t.block_k * t.block_n) * item
        assert staged <= 227 * 1024, (dtype, t, staged)
    with pytest.raises(ValueError, match="unknown kernel"):
        kernels.tiles_for("bfloat16", platform="gpu", kernel="down")


def test_gmm_benchmark_quick_sweep_writes_its_keys(tmp_path):
    """benchmarks/gmm.py --quick --sweep-tiles: the skipped paths are named, the table's
    tiles are among the swept ones, and both kernels report a best tile."""
    import json

    from benchmarks import gmm as bench   # namespace package under the repo root

    out = tmp_path / "gmm.json"
    figures = bench.main(["--quick", "--sweep-tiles", "--repeats", "1",
                          "--skip", "dense_onehot,jax_tiles", "--json", str(out)])
    assert json.loads(out.read_text()).keys() == figures.keys()
    assert "tiny_256_jax_tiles_tflops" not in figures
    assert figures["tiny_256_pallas_over_ragged_dot"] > 0
    for kernel in ("pallas", "swiglu_pallas"):
        best = figures[f"tiny_256_{kernel}_best_tiles"]
        assert re.fullmatch(r"m\d+_k\d+_n\d+_w\d+_s\d+", best)
        assert figures[f"tiny_256_{kernel}_best_over_table"] >= 1.0
    # No GPU here: the Mosaic kernel is not timed, so the best backend is Triton's.
    assert "tiny_256_mosaic_tflops" not in figures
    assert figures["tiny_256_best_backend"] == "triton"
    assert figures["tiny_256_best_fraction_of_matmul"] == pytest.approx(
        figures["tiny_256_pallas_tflops"] / figures["matmul_tflops"])
    assert 0.0 <= figures["tiny_256_padded_waste"] < 1.0
    assert 0.0 <= figures["tiny_256_work_item_waste"] < 1.0
    with pytest.raises(SystemExit):
        bench.main(["--quick", "--skip", "ragged_dot"])

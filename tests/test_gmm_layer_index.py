"""``layer=`` on the Pallas grouped-GEMM kernels (issue 43, part 1): with the expert weights
stacked ``[L, E, ...]`` and a layer index (a traced int32 under ``jax.jit``, as a decode
step's loop over layers passes it), each kernel reads that layer's tiles in place and
computes exactly what it computes on the slice ``w[layer]``. Interpret mode on CPU
(Triton's interpreter, Mosaic GPU's simulation), and the lowering for CUDA, where the
lowered program must hold no slice of the stack: the kernel's operand is the stack itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import gmm as kernels
from kernels_pallas import gmm_fp8, gmm_mosaic, gmm_select
from kernels_pallas.gmm_mosaic import MosaicTiles

# Interpret-mode kernels: as slow as the other kernel modules (conftest.SLOW_MODULES).
pytestmark = pytest.mark.slow

NUM_LAYERS = 3
TILES = kernels.GmmTiles(block_m=16, block_k=32, block_n=32)
# Uneven groups: empty ones first, in the middle and last, groups of 1–3 rows so one
# 16-row tile straddles several, and 9 trailing rows in no group.
ROWS, SIZES = 75, (0, 9, 1, 0, 3, 2, 30, 21, 0)
MOSAIC_TILES = MosaicTiles(block_m=64, block_n=64, block_k=64, stages=2)
MOSAIC_ROWS, MOSAIC_SIZES = 150, (70, 0, 60)       # a straddling boundary, 20 tail rows


def stack(rng, shape, dtype) -> jax.Array:
    """A random [L, E, d, f] stack whose layers differ (so reading the wrong one shows)."""
    return jnp.asarray(rng.standard_normal((NUM_LAYERS, *shape)) / np.sqrt(shape[-2]), dtype)


def assert_each_layer_equals_its_slice(layered, sliced, *args, layers=range(NUM_LAYERS)):
    """``layered(*args, layer)`` against ``sliced(*args, layer)`` (the kernel on
    ``w[layer]``), both jitted with the layer a traced argument: bit for bit, every layer;
    and (for the default layers 0, 1, 2) distinct layers give distinct outputs (the index
    is really used)."""
    layered, sliced = jax.jit(layered), jax.jit(sliced)
    outputs = []
    for layer in layers:
        got = np.asarray(layered(*args, jnp.int32(layer)).astype(jnp.float32))
        want = np.asarray(sliced(*args, jnp.int32(layer)).astype(jnp.float32))
        assert not np.isnan(got).any(), f"layer {layer}: a tile of the output was never written"
        np.testing.assert_array_equal(got, want, err_msg=f"layer {layer}")
        outputs.append(got)
    if layers == range(NUM_LAYERS):
        assert not np.array_equal(outputs[0], outputs[1])
    return outputs


# ------------------------------------------------------------------ Triton (interpreted)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gmm_reads_the_layer_in_place(dtype):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((ROWS, 64)), dtype)
    w = stack(rng, (len(SIZES), 64, 96), dtype)
    sizes = jnp.asarray(SIZES, jnp.int32)
    poisoned = jnp.full((ROWS, 96), jnp.nan, dtype)     # out= must be overwritten everywhere

    def layered(x, w, sizes, layer):
        return kernels.gmm(x, w, sizes, tiles=TILES, out=poisoned, layer=layer)

    def sliced(x, w, sizes, layer):
        return kernels.gmm(x, w[layer], sizes, tiles=TILES, out=poisoned)

    outputs = assert_each_layer_equals_its_slice(layered, sliced, x, w, sizes)
    assert all(np.all(out[sum(SIZES):] == 0.0) for out in outputs)
    if dtype == "float32":
        # Indexed as w[layer] is: negative from the end; a traced index out of range clamps
        # (both read layer 2 here).
        assert_each_layer_equals_its_slice(layered, sliced, x, w, sizes, layers=(-1, 5))
        np.testing.assert_array_equal(
            np.asarray(kernels.gmm(x, w, sizes, tiles=TILES, layer=-2)),
            np.asarray(kernels.gmm(x, w[-2], sizes, tiles=TILES)))   # a Python int


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_swiglu_separate_and_stacked_read_the_layer_in_place(dtype):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((ROWS, 64)), dtype)
    w_gate, w_up = (stack(rng, (len(SIZES), 64, 96), dtype) for _ in range(2))
    w_gate_up = jnp.concatenate([w_gate, w_up], axis=-1)          # [L, E, d, 2f]
    sizes = jnp.asarray(SIZES, jnp.int32)
    separate = assert_each_layer_equals_its_slice(
        lambda x, g, u, s, layer: kernels.gmm_swiglu(x, g, u, s, tiles=TILES, layer=layer),
        lambda x, g, u, s, layer: kernels.gmm_swiglu(x, g[layer], u[layer], s, tiles=TILES),
        x, w_gate, w_up, sizes)
    stacked = assert_each_layer_equals_its_slice(
        lambda x, gu, s, layer: kernels.gmm_swiglu_stacked(x, gu, s, tiles=TILES, layer=layer),
        lambda x, gu, s, layer: kernels.gmm_swiglu_stacked(x, gu[layer], s, tiles=TILES),
        x, w_gate_up, sizes)
    np.testing.assert_array_equal(np.stack(stacked), np.stack(separate))


def test_a_layered_stack_in_another_dtype_is_cast_per_tile_to_the_same_values():
    """A float32 stack with bfloat16 rows: the kernel casts each tile it reads (casting the
    stack up front would copy all L layers); the values equal the sliced layer cast whole."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((ROWS, 64)), jnp.bfloat16)
    w = stack(rng, (len(SIZES), 64, 96), jnp.float32)
    assert_each_layer_equals_its_slice(
        lambda x, w, s, layer: kernels.gmm(x, w, s, tiles=TILES, layer=layer),
        lambda x, w, s, layer: kernels.gmm(x, w[layer], s, tiles=TILES),
        x, w, jnp.asarray(SIZES, jnp.int32))


# ------------------------------------------------------------------ FP8 (interpreted)
def fp8_stack(rng, shape, block) -> tuple[jax.Array, jax.Array]:
    """Random FP8 values [L, E, d, f] (as the uint8 bytes moejax's placement holds) and
    float32 block scales [L, E, ceil(d/b_d), ceil(f/b_f)]."""
    values = jnp.asarray(rng.standard_normal((NUM_LAYERS, *shape)) * 8, jnp.float8_e4m3fn)
    grid = (-(-shape[1] // block[0]), -(-shape[2] // block[1]))
    scale = rng.uniform(0.01, 0.1, (NUM_LAYERS, shape[0], *grid)).astype(np.float32)
    return jax.lax.bitcast_convert_type(values, jnp.uint8), jnp.asarray(scale)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_kernels_read_the_layer_and_its_scales_in_place(dtype):
    """32x64 scale blocks cut at d=80, f=96: partial edge blocks along both axes."""
    rng = np.random.default_rng(3)
    block = (32, 64)
    x = jnp.asarray(rng.standard_normal((ROWS, 80)), dtype)
    (gate, gate_scale), (up, up_scale) = (fp8_stack(rng, (len(SIZES), 80, 96), block)
                                          for _ in range(2))
    sizes = jnp.asarray(SIZES, jnp.int32)
    kw = dict(block=block, interpret=True, tiles=TILES)
    assert_each_layer_equals_its_slice(
        lambda x, w, s, sizes, layer: gmm_fp8.gmm_fp8(x, w, s, sizes, layer=layer, **kw),
        lambda x, w, s, sizes, layer: gmm_fp8.gmm_fp8(x, w[layer], s[layer], sizes, **kw),
        x, gate, gate_scale, sizes)
    assert_each_layer_equals_its_slice(
        lambda x, g, gs, u, us, sizes, layer: gmm_fp8.gmm_swiglu_fp8(
            x, g, gs, u, us, sizes, layer=layer, **kw),
        lambda x, g, gs, u, us, sizes, layer: gmm_fp8.gmm_swiglu_fp8(
            x, g[layer], gs[layer], u[layer], us[layer], sizes, **kw),
        x, gate, gate_scale, up, up_scale, sizes)


# ------------------------------------------------------------------ Mosaic GPU (simulated)
def test_mosaic_kernels_read_the_layer_in_place():
    """bfloat16 only (the Mosaic kernels take 2-byte dtypes), in Mosaic GPU's interpret
    mode: the three Mosaic entry points, and gmm's backend switch passing layer= on."""
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.standard_normal((MOSAIC_ROWS, 64)), jnp.bfloat16)
    w_gate, w_up = (stack(rng, (len(MOSAIC_SIZES), 64, 128), jnp.bfloat16) for _ in range(2))
    sizes = jnp.asarray(MOSAIC_SIZES, jnp.int32)
    kw = dict(tiles=MOSAIC_TILES)
    plain = assert_each_layer_equals_its_slice(
        lambda x, w, s, layer: gmm_mosaic.gmm_mosaic(x, w, s, layer=layer, **kw),
        lambda x, w, s, layer: gmm_mosaic.gmm_mosaic(x, w[layer], s, **kw),
        x, w_gate, sizes)
    assert all(np.all(out[sum(MOSAIC_SIZES):] == 0.0) for out in plain)
    separate = assert_each_layer_equals_its_slice(
        lambda x, g, u, s, layer: gmm_mosaic.gmm_swiglu_mosaic(x, g, u, s, layer=layer, **kw),
        lambda x, g, u, s, layer: gmm_mosaic.gmm_swiglu_mosaic(x, g[layer], u[layer], s, **kw),
        x, w_gate, w_up, sizes)
    stacked = assert_each_layer_equals_its_slice(
        lambda x, gu, s, layer: gmm_mosaic.gmm_swiglu_stacked_mosaic(x, gu, s, layer=layer,
                                                                     **kw),
        lambda x, gu, s, layer: gmm_mosaic.gmm_swiglu_stacked_mosaic(x, gu[layer], s, **kw),
        x, jnp.concatenate([w_gate, w_up], axis=-1), sizes)
    np.testing.assert_array_equal(np.stack(stacked), np.stack(separate))
    switched = jax.jit(lambda x, w, s, layer: kernels.gmm(x, w, s, backend="mosaic",
                                                          interpret=True, layer=layer))
    np.testing.assert_array_equal(
        np.asarray(switched(x, w_gate, sizes, jnp.int32(2)).astype(jnp.float32)),
        np.asarray(gmm_mosaic.gmm_mosaic(x, w_gate[2], sizes).astype(jnp.float32)))


# ------------------------------------------------------------------ lowering for CUDA
def lower_for_cuda(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def test_layered_kernels_lower_for_nvidia_gpus_with_no_slice_of_the_stack():
    """Every layered entry point lowers for CUDA (Triton; Mosaic GPU for the bf16 ones),
    and the lowered program holds no dynamic_slice: the kernel's operand is the whole
    ``[3, 8, 256, 384]`` stack. The sliced call, lowered the same way, does hold one (the
    copy this removes)."""
    x = jax.ShapeDtypeStruct((200, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((NUM_LAYERS, 8, 256, 384), jnp.bfloat16)
    w_gate_up = jax.ShapeDtypeStruct((NUM_LAYERS, 8, 256, 768), jnp.bfloat16)
    fp8 = jax.ShapeDtypeStruct((NUM_LAYERS, 8, 256, 384), jnp.uint8)
    scale = jax.ShapeDtypeStruct((NUM_LAYERS, 8, 2, 3), jnp.float32)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    layer = jax.ShapeDtypeStruct((), jnp.int32)
    triton = {kernel: dict(interpret=False, backend="triton",
                           tiles=kernels.tiles_for(jnp.bfloat16, platform="gpu", kernel=kernel))
              for kernel in ("gmm", "swiglu")}
    mosaic = {kernel: dict(interpret=False, num_sms=132,
                           tiles=gmm_select.mosaic_tiles_for(jnp.bfloat16, kernel=kernel))
              for kernel in ("gmm", "swiglu")}
    fp8_kw = dict(block=(128, 128), interpret=False)
    cases = {
        "gmm": (kernels.gmm, triton["gmm"], (x, w, sizes)),
        "gmm_swiglu": (kernels.gmm_swiglu, triton["swiglu"], (x, w, w, sizes)),
        "gmm_swiglu_stacked": (kernels.gmm_swiglu_stacked, triton["swiglu"],
                               (x, w_gate_up, sizes)),
        "gmm_fp8": (gmm_fp8.gmm_fp8, fp8_kw, (x, fp8, scale, sizes)),
        "gmm_swiglu_fp8": (gmm_fp8.gmm_swiglu_fp8, fp8_kw, (x, fp8, scale, fp8, scale, sizes)),
        "gmm_mosaic": (gmm_mosaic.gmm_mosaic, mosaic["gmm"], (x, w, sizes)),
        "gmm_swiglu_mosaic": (gmm_mosaic.gmm_swiglu_mosaic, mosaic["swiglu"], (x, w, w, sizes)),
        "gmm_swiglu_stacked_mosaic": (gmm_mosaic.gmm_swiglu_stacked_mosaic, mosaic["swiglu"],
                                      (x, w_gate_up, sizes)),
    }
    for name, (fn, kw, args) in cases.items():
        text = lower_for_cuda(lambda *a, fn=fn, kw=kw: fn(*a[:-1], layer=a[-1], **kw),
                              *args, layer)
        mark = "custom_call @mosaic_gpu" if "mosaic" in name else "__gpu$xla.gpu.triton"
        assert mark in text, name
        assert "dynamic_slice" not in text, f"{name}: a slice of the stack was materialized"
        assert "tensor<3x8x256x" in text, f"{name}: the kernel does not take the whole stack"
    sliced = lower_for_cuda(lambda x, w, s, layer: kernels.gmm(x, w[layer], s, **triton["gmm"]),
                            x, w, sizes, layer)
    assert "dynamic_slice" in sliced


# ------------------------------------------------------------------ refusals
def test_layer_refusals_name_the_operand_and_the_shape(typechecks_off):
    x = jnp.zeros((8, 32))
    w = jnp.zeros((NUM_LAYERS, 4, 32, 64))
    sizes = jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match=r"gmm: layer 3 is out of range for a stack of 3"):
        kernels.gmm(x, w, sizes, layer=3)
    with pytest.raises(ValueError, match=r"layer must be an int or an integer scalar"):
        kernels.gmm(x, w, sizes, layer=jnp.float32(1))
    with pytest.raises(ValueError, match=r"layer must be an int or an integer scalar"):
        kernels.gmm(x, w, sizes, layer=jnp.zeros(2, jnp.int32))
    with pytest.raises(ValueError, match=r"weights must be \[L, E, d=32, f\], got rhs "
                                         r"\[4, 32, 64\] \(with layer= the weights are a stack"):
        kernels.gmm(x, w[0], sizes, layer=0)
    with pytest.raises(ValueError, match=r"weights must be \[E, d=32, f\], got rhs "
                                         r"\[3, 4, 32, 64\] \(pass layer="):
        kernels.gmm(x, w, sizes)
    with pytest.raises(ValueError, match=r"got w_up \[3, 4, 16, 64\]"):
        kernels.gmm_swiglu(x, w, jnp.zeros((NUM_LAYERS, 4, 16, 64)), sizes, layer=0)
    with pytest.raises(ValueError, match=r"4 expert matrices but group_sizes has 3 entries "
                                         r"\(w_gate_up \[3, 4, 32, 64\]\)"):
        kernels.gmm_swiglu_stacked(x, w, jnp.zeros(3, jnp.int32), layer=0)

    values = jnp.zeros((NUM_LAYERS, 4, 32, 64), jnp.uint8)
    scale = jnp.zeros((NUM_LAYERS, 4, 1, 1), jnp.float32)
    block = (32, 64)
    with pytest.raises(ValueError, match=r"gmm_fp8: scale must be float32\[3, 4, 1, 1\] for "
                                         r"weights rhs \[3, 4, 32, 64\]"):
        gmm_fp8.gmm_fp8(x, values, scale[0], sizes, block=block, layer=0)
    with pytest.raises(ValueError, match=r"gmm_fp8: weights must be \[L, E=4, d=32, f\]"):
        gmm_fp8.gmm_fp8(x, values[0], scale[0], sizes, block=block, layer=0)
    with pytest.raises(ValueError, match="stack different numbers of layers"):
        gmm_fp8.gmm_swiglu_fp8(x, values, scale, values[:2], scale[:2], sizes, block=block,
                               layer=0)

    bf16 = jnp.zeros((64, 64), jnp.bfloat16)
    stack = jnp.zeros((NUM_LAYERS, 2, 64, 64), jnp.float32)
    with pytest.raises(ValueError, match=r"gmm_mosaic: with layer=, rhs must already be lhs's "
                                         r"bfloat16, got float32"):
        gmm_mosaic.gmm_mosaic(bf16, stack, jnp.zeros(2, jnp.int32), tiles=MOSAIC_TILES,
                              layer=0)
    with pytest.raises(ValueError, match=r"w_gate_up must be \[L, E, d, 2f\]"):
        gmm_mosaic.gmm_swiglu_stacked_mosaic(bf16, stack[0], jnp.zeros(2, jnp.int32),
                                             tiles=MOSAIC_TILES, layer=0)


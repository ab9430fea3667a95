"""``weights_dtype="fp8"``: the routed experts of an FP8 block-scaled checkpoint kept in FP8
on the device, dequantized where the expert compute reads them (issue 41, the part a CPU
can check).

The tiny FP8 checkpoints are built by ``test_fp8_checkpoint.make_pair`` (transformers'
classes, rewritten into the official FP8 layout): a Qwen3-MoE with non-square 12x16 blocks
(``[out, in]``: moejax's ``(in, out)`` block is (16, 12); hidden 40 and expert width 24
leave partial edge blocks along both axes) and a DeepSeek-V3 with the official 128x128
blocks (hidden 160, expert width 48: partial again; a dense first layer, a shared
expert). The FP8-kept path must give the logits of the dequantized-on-load path on the
same checkpoint: the dequantized expert (tile) is the loader's dequantized weight bit for
bit, so the two differ only in how XLA schedules the same arithmetic.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernels_pallas import gmm_fp8
from moejax import checkpoint as ck
from moejax import fp8, moe
from moejax import model as mdl
from moejax.fp8_experts import Fp8Experts, dequantize_blocks

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hf_family_models import build_family_model  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from test_fp8_checkpoint import V, make_pair, rel_err, rewrite  # noqa: E402

EXPERT_KEYS = ("w_gate", "w_up", "w_down")
# float32: identical arithmetic on identical weights (same dequantized values): ~1e-5
# relative is the float32 budget of a different fusion order. bfloat16: the weights are
# again identical (each FP8 value times its scale, rounded once to bf16, on both paths),
# but bf16 activations let a reordering move a logit by a bf16 ulp of a value near 1:
# log-probabilities within 2e-2 absolute (the bound the backends' bf16 parity uses).
F32_RTOL = 1e-5
BF16_LOGPROB_ATOL = 2e-2


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(FP8 directory, dequantized twin) of a Qwen3-MoE with 12x16 blocks."""
    hf = build_family_model("qwen3_moe", seed=4, hidden_size=40, moe_intermediate_size=24)
    fp8_dir, twin_dir, _ = make_pair(hf, tmp_path_factory.mktemp("qwen3_moe"), (12, 16))
    return fp8_dir, twin_dir


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """(FP8 directory, dequantized twin) of a DeepSeek-V3 with 128x128 blocks."""
    hf = build_family_model("deepseek_v3", seed=5, hidden_size=160, moe_intermediate_size=48,
                            intermediate_size=96)
    fp8_dir, twin_dir, _ = make_pair(hf, tmp_path_factory.mktemp("deepseek_v3"), (128, 128))
    return fp8_dir, twin_dir


def packed(ids: list[int]) -> mdl.PackedBatch:
    n = len(ids)
    return mdl.PackedBatch(tokens=np.array(ids, np.int32), positions=np.arange(n, dtype=np.int32),
                           segment_ids=np.zeros(n, np.int32),
                           score_positions=np.zeros(1, np.int32),
                           score_token_ids=np.zeros((1, 1), np.int32))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


# ----------------------------------------------------------------------------- loading
def test_loader_keeps_the_stored_fp8_values_and_transposed_scales(qwen3):
    """The expert leaves are the checkpoint's FP8 bytes and scale grid, turned to [in, out];
    every other param is what the dequantizing load gives; dequantizing the kept experts
    gives the dequantizing load's experts exactly."""
    fp8_dir, _ = qwen3
    cfg, params, _ = ck.load_model_dir(fp8_dir, "float32", weights_dtype="fp8")
    auto_cfg, auto, _ = ck.load_model_dir(fp8_dir, "float32")
    assert cfg.expert_fp8_block == (16, 12) and auto_cfg.expert_fp8_block is None
    layers = params["layers"]
    E = cfg.num_experts
    assert layers["w_gate"].dtype == ml_dtypes.float8_e4m3fn
    assert layers["w_gate_scale"].shape == (cfg.num_layers, E, 3, 2)      # ceil(40/16), ceil(24/12)
    assert layers["w_down_scale"].shape == (cfg.num_layers, E, 2, 4)      # ceil(24/16), ceil(40/12)
    stored = load_file(os.path.join(fp8_dir, "model.safetensors"))
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    raw = stored[name].view(torch.uint8).numpy()
    np.testing.assert_array_equal(layers["w_down"][1, 5].view(np.uint8), raw.T)
    np.testing.assert_array_equal(layers["w_down_scale"][1, 5],
                                  stored[name + "_scale_inv"].numpy().T)
    for key in EXPERT_KEYS:
        got = np.asarray(dequantize_blocks(jnp.asarray(layers[key]),
                                           jnp.asarray(layers[f"{key}_scale"]),
                                           cfg.expert_fp8_block, jnp.float32))
        np.testing.assert_array_equal(got, auto["layers"][key])
    rest = {k for k in layers if k not in EXPERT_KEYS and not k.endswith("_scale")}
    assert rest == set(auto["layers"]) - set(EXPERT_KEYS)
    for key in rest:
        np.testing.assert_array_equal(layers[key], auto["layers"][key])


# ----------------------------------------------------------------------------- logits
@pytest.mark.parametrize("which, impls", [("qwen3", ("fused_tiles", "gmm", "dense", "pallas")),
                                          ("deepseek", ("fused_tiles",))])
def test_fp8_kept_logits_equal_the_dequantized_on_load_logits(which, impls, request):
    """float32: every expert implementation that takes FP8 weights gives the dequantized
    path's logits to 1e-5 (relative); bfloat16 (fused_tiles): log-probabilities within
    the stated bound."""
    fp8_dir, _ = request.getfixturevalue(which)
    ids = [int(t) for t in np.random.default_rng(11).integers(3, V, 14)]
    batch = packed(ids)
    for dtype in ("float32", "bfloat16"):
        cfg, params, _ = ck.load_model_dir(fp8_dir, dtype, weights_dtype="fp8")
        auto_cfg, auto, _ = ck.load_model_dir(fp8_dir, dtype)
        for impl in impls if dtype == "float32" else ("fused_tiles",):
            opts = mdl.ForwardOptions(attn_block=len(ids), expert_impl=impl)
            got = np.asarray(mdl.full_logits(params, batch, cfg, opts), np.float64)
            want = np.asarray(mdl.full_logits(auto, batch, auto_cfg, opts), np.float64)
            if dtype == "float32":
                err = rel_err(got, want)
                print(f"{which} {impl} float32: relative logit error {err:.2e}")
                assert err <= F32_RTOL, (impl, err)
            else:
                err = float(np.max(np.abs(log_softmax(got) - log_softmax(want))))
                print(f"{which} {impl} bfloat16: max log-prob difference {err:.2e}")
                assert err <= BF16_LOGPROB_ATOL, err


def test_scorer_with_fp8_experts_reports_a_quarter_of_the_expert_bytes(qwen3):
    """The Scorer (resident backend) scores with FP8 experts: the log-probs of the
    dequantized path, ``info`` says weights_dtype, and the memory report counts FP8 values
    plus float32 scales: a quarter of the float32 experts, plus the scales."""
    from serving import Scorer

    fp8_dir, _ = qwen3
    requests = [{"id": "a", "prompt_token_ids": [5, 9, 17, 33, 4],
                 "candidate_token_ids": [[7], [8, 9]]},
                {"id": "b", "prompt_token_ids": [3, 100, 64],
                 "candidate_token_ids": [[11, 12, 13], [90]]}]
    scorers = {w: Scorer(fp8_dir, dtype="float32", weights_dtype=w, compilation_cache="off")
               for w in ("auto", "fp8")}
    scores = {w: [x for r in s.score(requests) for x in r.logprobs] for w, s in scorers.items()}
    assert rel_err(scores["fp8"], scores["auto"]) <= F32_RTOL
    cfg = scorers["fp8"].config
    L, E, d, f = cfg.num_layers, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    values = L * E * 3 * d * f
    scales = 4 * L * E * (2 * math.ceil(d / 16) * math.ceil(f / 12)
                          + math.ceil(f / 16) * math.ceil(d / 12))
    memory = {w: s.info["memory"] for w, s in scorers.items()}
    print(f"expert bytes: float32 {memory['auto']['expert_weight_bytes']}, "
          f"fp8 {memory['fp8']['expert_weight_bytes']} ({values} values + {scales} scales)")
    assert scorers["fp8"].info["weights_dtype"] == "fp8"
    assert memory["auto"]["expert_weight_bytes"] == 4 * values
    assert memory["fp8"]["expert_weight_bytes"] == values + scales
    assert memory["fp8"]["dense_weight_bytes"] == memory["auto"]["dense_weight_bytes"]


def test_generator_with_fp8_experts_decodes_the_same_tokens(qwen3):
    from serving import Generator

    fp8_dir, _ = qwen3
    requests = [{"id": i, "prompt_token_ids": p, "max_new_tokens": 4}
                for i, p in enumerate(([5, 9, 17, 33, 4], [3, 100, 64, 7, 7, 21]))]
    tokens = {w: [r.token_ids for r in Generator(fp8_dir, dtype="float32", weights_dtype=w,
                                                 compilation_cache="off").generate(requests)]
              for w in ("auto", "fp8")}
    assert tokens["fp8"] == tokens["auto"] and all(len(t) == 4 for t in tokens["fp8"])


# ----------------------------------------------------------------------------- the kernel
def quantized_stack(rng, shape: tuple[int, int, int], block: tuple[int, int]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 values [E, in, out], float32 scales) of a random stack, quantized as the
    checkpoints are (in their [out, in] orientation, then transposed)."""
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 3, (shape[0], 1, 1))
    q, scale = fp8.quantize_block_fp8(w.swapaxes(1, 2), (block[1], block[0]))
    return np.ascontiguousarray(q.swapaxes(1, 2)), np.ascontiguousarray(scale.swapaxes(1, 2))


def reference_dequantized(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """float64: element (i, j) of each matrix times scale[i // b_in, j // b_out]."""
    rows, cols = q.shape[-2:]
    expanded = scale[:, np.arange(rows)[:, None] // block[0], np.arange(cols)[None, :] // block[1]]
    return q.astype(np.float64) * expanded.astype(np.float64)


def grouped_reference(x: np.ndarray, weights: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """float64 grouped matmul: rows of group g times weights[g]; rows in no group zero."""
    out = np.zeros((x.shape[0], weights.shape[2]))
    ends = np.cumsum(sizes)
    for g, (start, end) in enumerate(zip(ends - sizes, ends)):
        out[start:end] = x[start:end].astype(np.float64) @ weights[g]
    return out


@pytest.mark.parametrize("dtype, rtol", [("float32", 2e-6), ("bfloat16", 1e-2)])
def test_pallas_fp8_kernels_equal_a_float64_reference(dtype, rtol):
    """Interpret mode: gmm_fp8 and gmm_swiglu_fp8 against float64 NumPy on the dequantized
    weights, with 32x64 (in, out) blocks cut at d=80, f=96 (partial edge blocks along both
    axes), groups straddling row tiles, an empty group and rows in no group. bfloat16: the
    inputs are rounded to bf16 first; the bound is bf16's relative precision."""
    rng = np.random.default_rng(3)
    E, d, f, T, block = 4, 80, 96, 70, (32, 64)
    sizes = np.array([21, 0, 30, 12], np.int32)                 # 63 rows in groups, 7 in none
    x = rng.standard_normal((T, d)).astype(np.float32)
    x_in = jnp.asarray(x, dtype)
    x64 = np.asarray(x_in.astype(jnp.float32), np.float64)
    gate, up, down = (quantized_stack(rng, shape, block) for shape in ((E, d, f), (E, d, f),
                                                                       (E, f, d)))
    tiles = gmm_fp8.GmmTiles(block_m=16, block_k=64, block_n=64)
    got = gmm_fp8.gmm_fp8(x_in, jnp.asarray(gate[0]), jnp.asarray(gate[1]), jnp.asarray(sizes),
                          block=block, interpret=True, tiles=tiles)
    want = grouped_reference(x64, reference_dequantized(*gate, block), sizes)
    assert got.dtype == jnp.dtype(dtype) and got.shape == (T, f)
    assert not np.any(np.asarray(got, np.float32)[sizes.sum():])
    errors = {"gmm_fp8": rel_err(got.astype(jnp.float32), want)}

    hidden = gmm_fp8.gmm_swiglu_fp8(x_in, jnp.asarray(gate[0]), jnp.asarray(gate[1]),
                                    jnp.asarray(up[0]), jnp.asarray(up[1]), jnp.asarray(sizes),
                                    block=block, interpret=True, tiles=tiles)
    g = grouped_reference(x64, reference_dequantized(*gate, block), sizes)
    u = grouped_reference(x64, reference_dequantized(*up, block), sizes)
    want_hidden = g / (1 + np.exp(-g)) * u
    errors["gmm_swiglu_fp8"] = rel_err(hidden.astype(jnp.float32), want_hidden)
    out = gmm_fp8.gmm_fp8(hidden, jnp.asarray(down[0]), jnp.asarray(down[1]), jnp.asarray(sizes),
                          block=block, interpret=True, tiles=tiles)
    want_out = grouped_reference(np.asarray(hidden.astype(jnp.float32), np.float64),
                                 reference_dequantized(*down, block), sizes)
    errors["gmm_fp8 (down)"] = rel_err(out.astype(jnp.float32), want_out)
    print(f"{dtype}: relative errors against float64 {errors}")
    assert max(errors.values()) <= rtol, errors


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, rtol", [("float32", 1e-5), ("bfloat16", 1e-2)])
def test_compiled_fp8_kernels_equal_a_float64_reference_on_a_gpu(dtype, rtol):
    """The Triton kernels compiled for the GPU (``interpret=False``; the test above runs
    them interpreted) against float64 NumPy, with the official 128x128 blocks, the weights
    both as FP8 and as their bytes (how the resident placement holds them)."""
    rng = np.random.default_rng(4)
    E, d, f, T, block = 8, 256, 384, 300, (128, 128)
    sizes = np.array([40, 0, 77, 3, 60, 50, 1, 49], np.int32)      # 280 rows in groups
    x_in = jnp.asarray(rng.standard_normal((T, d)).astype(np.float32), dtype)
    x64 = np.asarray(x_in.astype(jnp.float32), np.float64)
    gate, up = quantized_stack(rng, (E, d, f), block), quantized_stack(rng, (E, d, f), block)
    want = grouped_reference(x64, reference_dequantized(*gate, block), sizes)
    for values in (jnp.asarray(gate[0]), jnp.asarray(gate[0].view(np.uint8))):
        got = gmm_fp8.gmm_fp8(x_in, values, jnp.asarray(gate[1]), jnp.asarray(sizes),
                              block=block, interpret=False)
        assert rel_err(got.astype(jnp.float32), want) <= rtol
    g, u = want, grouped_reference(x64, reference_dequantized(*up, block), sizes)
    hidden = gmm_fp8.gmm_swiglu_fp8(x_in, jnp.asarray(gate[0]), jnp.asarray(gate[1]),
                                    jnp.asarray(up[0]), jnp.asarray(up[1]), jnp.asarray(sizes),
                                    block=block, interpret=False)
    assert rel_err(hidden.astype(jnp.float32), g / (1 + np.exp(-g)) * u) <= rtol


def test_fp8_tiles_align_with_the_scale_blocks():
    """block_k divides the block's rows and d, block_n its columns and f; on a GPU a shape
    that leaves tiles under 16 is refused by name (and ``auto`` does not pick the kernel)."""
    tiles = gmm_fp8.fp8_tiles(jnp.bfloat16, 7168, 2048, 256, (128, 128), interpret=False,
                              tiles=gmm_fp8.GmmTiles(block_m=128, block_k=64, block_n=256))
    assert (tiles.block_k, tiles.block_n) == (64, 128)
    assert gmm_fp8.fits_gpu(7168, 2048, (128, 128)) and not gmm_fp8.fits_gpu(40, 24, (16, 12))
    with pytest.raises(ValueError, match=r"at least 16 dividing both the 16x12 scale blocks "
                                         r"and d=40, f=24"):
        gmm_fp8.fp8_tiles(jnp.bfloat16, 40, 24, 8, (16, 12), interpret=False)


def test_fp8_kernels_lower_for_nvidia_gpus():
    """The Pallas -> Triton lowering runs in Python, so this CPU-only jaxlib checks that
    the FP8 kernels lower for CUDA (FP8 loads, the scalar scale load, the in-kernel
    dequantize); compiling the Triton IR to a GPU binary needs a GPU."""
    x = jax.ShapeDtypeStruct((200, 256), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((8, 256, 384), jnp.float8_e4m3fn)
    scale = jax.ShapeDtypeStruct((8, 2, 3), jnp.float32)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    kw = dict(block=(128, 128), interpret=False)
    for fn, args in ((functools.partial(gmm_fp8.gmm_fp8, **kw), (x, w, scale, sizes)),
                     (functools.partial(gmm_fp8.gmm_swiglu_fp8, **kw),
                      (x, w, scale, w, scale, sizes))):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "__gpu$xla.gpu.triton" in text


# ----------------------------------------------------------------------------- memory
def test_no_dequantized_copy_of_a_layer_is_made():
    """Compiled temporaries of the expert stage over one layer whose FP8 experts are
    6 MiB (16 experts, d=512, f=256; dequantized: 8 MiB per matrix in float32): the paths
    that take FP8 hold activations and a few expert slabs (0.5 MiB each), less than one
    dequantized matrix stack; dequantizing the layer up front (the control) holds three.
    The stacks come as the resident placement holds them, FP8 bytes
    (``moejax.fp8_experts.device_bits``)."""
    E, d, f, M, block = 16, 512, 256, 256, (128, 128)
    stack = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.uint8)
    scale = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    args = (jax.ShapeDtypeStruct((M, d), jnp.float32), jax.ShapeDtypeStruct((E,), jnp.int32),
            stack((E, d, f)), scale((E, 4, 2)), stack((E, d, f)), scale((E, 4, 2)),
            stack((E, f, d)), scale((E, 2, 4)))
    layer_matrix = E * d * f * 4

    def experts(impl, up_front, x, sizes, g, gs, u, us, dn, ds):
        weights = [Fp8Experts(v, s, block) for v, s in ((g, gs), (u, us), (dn, ds))]
        if up_front:
            weights = [w.dequantized(jnp.float32) for w in weights]
        perm = moe.Permutation(x_sorted=x, order=jnp.arange(M, dtype=jnp.int32),
                               group_sizes=sizes)
        return moe.expert_compute(perm, *weights, impl=impl)

    def temporaries(impl, up_front=False):
        compiled = jax.jit(functools.partial(experts, impl, up_front)).lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    for impl in ("fused_tiles", "gmm", "dense", "pallas"):
        temp = temporaries(impl)
        print(f"{impl}: temporaries {temp / 2**20:.2f} MiB (one dequantized matrix stack "
              f"{layer_matrix / 2**20:.0f} MiB)")
        assert temp < layer_matrix, (impl, temp)
    control = temporaries("fused_tiles", up_front=True)
    print(f"dequantized up front: temporaries {control / 2**20:.2f} MiB")
    assert control >= 3 * layer_matrix


# ----------------------------------------------------------------------------- refusals
def test_refusals_name_what_is_wrong(qwen3, tmp_path):
    from moejax.backends import make_backend
    from moejax.backends.base import BackendError
    from serving.generation_options import GeneratorOptions
    from serving.options import ScorerOptions

    fp8_dir, twin_dir = qwen3
    with pytest.raises(ck.CheckpointError, match=re.escape(
            "weights_dtype='fp8' keeps an FP8 checkpoint's expert weights in FP8, but this "
            "checkpoint is not FP8")):
        ck.load_model_dir(twin_dir, weights_dtype="fp8")
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        ScorerOptions(weights_dtype="fp16")
    for backend, work in (("offload", "host stacks"), ("async_ep", "all-gathering the scale"),
                          ("tp", "scale-block boundaries")):
        with pytest.raises(ValueError, match=f"backend '{backend}' does not serve "
                                             f"weights_dtype='fp8'.*only 'resident'.*{work}"):
            ScorerOptions(weights_dtype="fp8", backend=backend)
    with pytest.raises(ValueError, match="expert_impl 'ragged_dot' takes whole expert stacks"):
        ScorerOptions(weights_dtype="fp8", expert_impl="ragged_dot")
    with pytest.raises(ValueError, match=r"fused steps on one resident decoder; it does not "
                                         r"take batching='static'$"):
        GeneratorOptions(weights_dtype="fp8", batching="static")
    with pytest.raises(ValueError, match=r"does not take step='layerwise', decoders"):
        GeneratorOptions(weights_dtype="fp8", step="layerwise", decoders=2)
    with pytest.raises(ValueError, match=r"does not take runtime='mu_queue'"):
        GeneratorOptions(weights_dtype="fp8", runtime="mu_queue")
    with pytest.raises(ValueError, match="backend 'offload' does not serve"):
        GeneratorOptions(weights_dtype="fp8", backend="offload")

    cfg, params, _ = ck.load_model_dir(fp8_dir, weights_dtype="fp8")
    with pytest.raises(BackendError, match="backend 'offload' does not serve weights_dtype"):
        make_backend("offload", cfg, params)
    perm = moe.Permutation(x_sorted=jnp.zeros((4, 40)), order=jnp.arange(4, dtype=jnp.int32),
                           group_sizes=jnp.array([4] + [0] * 7, jnp.int32))
    stacks = [Fp8Experts(jnp.asarray(params["layers"][k][0]),
                         jnp.asarray(params["layers"][f"{k}_scale"][0]), cfg.expert_fp8_block)
              for k in EXPERT_KEYS]
    with pytest.raises(ValueError, match="'blocks' does not take expert weights kept in FP8"):
        moe.expert_compute(perm, *stacks, impl="blocks")

    # An expert left in bfloat16 (its module not converted): nothing to keep for it.
    bf16 = "model.layers.0.mlp.experts.2.up_proj.weight"

    def unconvert(tensors):
        scale = tensors.pop(bf16 + "_scale_inv").numpy()
        q = tensors[bf16].view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        dequantized = reference_dequantized(q.T[None], scale.T[None], (16, 12))[0].T
        tensors[bf16] = torch.tensor(np.ascontiguousarray(dequantized), dtype=torch.bfloat16)

    mixed = rewrite(fp8_dir, tmp_path / "mixed", unconvert, quantization_config={
        "quant_method": "fp8", "weight_block_size": [12, 16],
        "modules_to_not_convert": ["model.layers.0.mlp.experts.2.up_proj"]})
    ck.load_model_dir(mixed)                              # dequantized on load: fine
    with pytest.raises(ck.CheckpointError, match=re.escape(
            f"keeps every routed expert in FP8 (F8_E4M3 with block scales): {bf16} is stored "
            "as BF16, not F8_E4M3")):
        ck.load_model_dir(mixed, weights_dtype="fp8")
    per_channel = rewrite(fp8_dir, tmp_path / "null_block", lambda t: None, quantization_config={
        "quant_method": "fp8", "weight_block_size": None})
    with pytest.raises(ck.CheckpointError, match="weight_block_size is null"):
        ck.load_model_dir(per_channel, weights_dtype="fp8")


def test_command_line_flag():
    from serving.cli.options import add_model_options, scorer_options

    parser = argparse.ArgumentParser()
    add_model_options(parser)
    assert scorer_options(parser.parse_args(["--weights-dtype", "fp8"]))["weights_dtype"] == "fp8"
    assert scorer_options(parser.parse_args([]))["weights_dtype"] is None      # the default
    with pytest.raises(SystemExit):
        parser.parse_args(["--weights-dtype", "fp16"])


def test_gpu_benchmark_runs_on_cpu_shapes():
    """``benchmarks/fp8_weights.py``, the prepared GPU measurement (speed and log-probs of
    FP8-kept experts against their bf16 twin), runs end to end on tiny shapes here: on the
    same weights the two sides agree exactly off a GPU."""
    from benchmarks import fp8_weights

    figures = fp8_weights.main(["--quick"])
    assert "qwen3_pallas_failed" not in figures and "model_fp8_failed" not in figures
    assert figures["qwen3_pallas_fp8_rel_diff"] <= 1e-6
    assert figures["qwen3_fused_tiles_fp8_rel_diff"] <= 1e-6
    assert figures["model_max_logprob_diff"] <= 1e-5 and figures["model_argmax_agreement"] == 1
    assert 4 * (figures["model_expert_bytes_fp8"] - 4 * 2 * 8 * 3) == \
        figures["model_expert_bytes_bf16"]       # float32 here: 4 bytes against 1, + scales


def test_moejax_info_shows_what_fp8_experts_hold(qwen3, capsys):
    """`moejax info --weights-dtype fp8`: the serving bytes are the backend's (FP8 experts
    and their scales), not the parameter count times the dtype's size."""
    import json

    from serving import cli

    fp8_dir, _ = qwen3
    shown = {}
    for weights in ("auto", "fp8"):
        capsys.readouterr()
        assert cli.main(["info", "--model", fp8_dir, "--dtype", "float32",
                         "--weights-dtype", weights]) == 0
        info = json.loads(capsys.readouterr().out)
        shown[weights] = info["weights"]
        memory = info["memory"]
    assert shown["auto"]["serving_dtype"] == "float32"
    assert shown["fp8"]["serving_dtype"].startswith("float32, routed experts float8_e4m3fn")
    assert shown["fp8"]["serving_bytes"] == (memory["dense_weight_bytes"]
                                             + memory["expert_weight_bytes"])
    assert shown["fp8"]["serving_bytes"] < shown["auto"]["serving_bytes"] / 2

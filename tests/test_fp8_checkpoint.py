"""FP8 block-scaled checkpoints (issue 41): the official on-disk layout, read and
dequantized on load (``moejax.fp8``, ``moejax.checkpoint``), against transformers.

Tiny DeepSeek-V3 (MLA, one dense layer, shared expert; 128x128 blocks, hidden 160 so
edge blocks are partial) and Qwen3-MoE (32x32 blocks, hidden 40, expert width 24:
partial edges again) models are built with transformers' own classes and saved; then
their safetensors are rewritten into the layout of DeepSeek-V3/R1 and Qwen3 ``-FP8``:
the attention, MLP, shared- and routed-expert projections as ``F8_E4M3`` with a float32
``<name>_scale_inv`` ``[ceil(out/b0), ceil(in/b1)]`` beside each, every other tensor
(embeddings, norms, lm_head, router, ``e_score_correction_bias``) as BF16, and
config.json's ``quantization_config``. Beside each FP8 directory goes its dequantized
twin: the same tensors as float32, the FP8 ones dequantized by a float64 NumPy
reference written here. transformers loads the twin (its own reader) and is the
reference for the logits; moejax must read the FP8 directory into exactly the twin's
params.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np
import pytest

from moejax import checkpoint as ck
from moejax import fp8

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_family_models import build_family_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
V = 128
RTOL = 1e-4
# The linear layers the official FP8 releases quantize: attention (q/k/v/o, MLA's
# q_a/q_b/kv_a_proj_with_mqa/kv_b), dense MLPs, shared and routed experts. Not the
# router (``mlp.gate.weight``), embeddings, norms or lm_head.
QUANTIZED = re.compile(r"(_proj|_proj_with_mqa)\.weight$")
QWEN3_NOT_CONVERTED = ["lm_head", "mlp.gate"]


# ----------------------------------------------------------------------------- references
def reference_dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """Element (i, j) of ``q [..., R, C]`` times ``scale[..., i // b0, j // b1]``, in
    float64 (exact: an FP8 value has 4 significant bits, a float32 scale 24), rounded
    once to float32."""
    rows, cols = q.shape[-2:]
    expanded = scale[..., np.arange(rows)[:, None] // block[0],
                     np.arange(cols)[None, :] // block[1]]
    return (q.astype(np.float64) * expanded.astype(np.float64)).astype(np.float32)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


# ----------------------------------------------------------------------------- directories
def write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(path, "tokenizer.json"))


def as_torch(array: np.ndarray) -> "torch.Tensor":
    """A NumPy array (FP8 and bfloat16 from ml_dtypes included) as a torch tensor."""
    if array.dtype == ml_dtypes.float8_e4m3fn:
        return torch.from_numpy(array.view(np.uint8)).view(torch.float8_e4m3fn)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def save_tensors(path: str, tensors: dict[str, np.ndarray], shards: int = 1) -> None:
    """``model.safetensors`` (with the safetensors library), or ``shards`` files and an
    index; sharded, every scale goes to the last shard, away from its weight."""
    tensors = {k: as_torch(v) for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    names = sorted(tensors)
    files = {n: f"model-{(i % (shards - 1)) + 1:05d}-of-{shards:05d}.safetensors"
             for i, n in enumerate(n for n in names if not n.endswith("_scale_inv"))}
    files |= {n: f"model-{shards:05d}-of-{shards:05d}.safetensors"
              for n in names if n.endswith("_scale_inv")}
    for file in sorted(set(files.values())):
        save_file({n: tensors[n] for n in names if files[n] == file}, os.path.join(path, file),
                  metadata={"format": "pt"})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": files}, fh)


def edit_config(path: str, **changes) -> None:
    with open(os.path.join(path, "config.json")) as fh:
        config = json.load(fh)
    config.update(changes)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=2)


def make_pair(hf, root: Path, block: tuple[int, int], *, shards: int = 1,
              **quantization) -> tuple[str, str, dict[str, np.ndarray]]:
    """(FP8 directory, dequantized float32 twin, the twin's tensors) of the model ``hf``."""
    source, fp8_dir, twin_dir = (str(root / n) for n in ("source", "fp8", "dequantized"))
    hf.save_pretrained(source)
    stored = {k: v.numpy() for k, v in load_file(os.path.join(source, "model.safetensors")).items()}
    quantized, twin = {}, {}
    for name, weight in stored.items():
        if QUANTIZED.search(name):
            q, scale = fp8.quantize_block_fp8(weight, block)
            quantized[name], quantized[name + "_scale_inv"] = q, scale
            twin[name] = reference_dequantize(q, scale, block)
            assert np.max(np.abs(twin[name] - weight)) > 0        # really quantized
        else:
            quantized[name] = weight.astype(ml_dtypes.bfloat16)
            twin[name] = quantized[name].astype(np.float32)
    for path, tensors in ((fp8_dir, quantized), (twin_dir, twin)):
        os.makedirs(path)
        for side_file in ("config.json", "generation_config.json"):
            shutil.copy(os.path.join(source, side_file), path)
        save_tensors(path, tensors, shards if path == fp8_dir else 1)
        write_tokenizer(path)
    edit_config(fp8_dir, quantization_config={
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(block), **quantization})
    return fp8_dir, twin_dir, twin


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """DeepSeek-V3, 128x128 blocks, hidden 160 (partial edge blocks), two shards."""
    hf = build_family_model("deepseek_v3", seed=5, hidden_size=160, moe_intermediate_size=48,
                            intermediate_size=96)
    return make_pair(hf, tmp_path_factory.mktemp("deepseek_v3"), (128, 128), shards=2)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3-MoE, 32x32 blocks, hidden 40 and expert width 24 (partial edge blocks), with
    the module list a Qwen3 FP8 config may carry."""
    hf = build_family_model("qwen3_moe", seed=4, hidden_size=40, moe_intermediate_size=24)
    return make_pair(hf, tmp_path_factory.mktemp("qwen3_moe"), (32, 32),
                     modules_to_not_convert=QWEN3_NOT_CONVERTED)


def rewrite(source: str, dest: Path, edit: Callable[[dict], None], **config) -> str:
    """A single-file copy of ``source`` whose tensors went through ``edit``."""
    shutil.copytree(source, dest)
    tensors = {k: v for k, v in load_file(os.path.join(dest, "model.safetensors")).items()}
    edit(tensors)
    save_file(tensors, os.path.join(dest, "model.safetensors"), metadata={"format": "pt"})
    if config:
        edit_config(str(dest), **config)
    return str(dest)


def assert_params_equal(got, want, prefix: str = "") -> None:
    assert got.keys() == want.keys()
    for key in want:
        if isinstance(want[key], dict):
            assert_params_equal(got[key], want[key], f"{prefix}{key}.")
        else:
            assert got[key].dtype == want[key].dtype, prefix + key
            np.testing.assert_array_equal(got[key], want[key], err_msg=prefix + key)


# ----------------------------------------------------------------------------- moejax.fp8
@pytest.mark.parametrize("shape, block", [((256, 384), (128, 128)), ((160, 96), (128, 128)),
                                          ((3, 40, 70), (32, 32)), ((5, 7), (2, 3))],
                         ids=["whole", "partial", "stack", "tiny"])
@pytest.mark.parametrize("fmt", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_block_dequantize_equals_float64_reference(shape, block, fmt):
    rng = np.random.default_rng(len(shape) * 100 + shape[-1])
    weight = (rng.standard_normal(shape).astype(np.float32)
              * rng.uniform(0.01, 3.0, shape[:-1] + (1,)))     # rows of unlike magnitude
    q, scale = fp8.quantize_block_fp8(weight, block, fmt)
    assert q.dtype == fmt and scale.dtype == np.float32
    assert scale.shape == (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    want = reference_dequantize(q, scale, block)
    np.testing.assert_array_equal(fp8.dequantize_block_fp8(q, scale, block), want)
    np.testing.assert_array_equal(fp8.dequantize_fp8(q, scale, block), want)
    as_f64 = fp8.dequantize_fp8(q, scale, block, np.float64)
    assert as_f64.dtype == np.float64
    np.testing.assert_array_equal(as_f64.astype(np.float32), want)     # exact in both
    bf16 = fp8.dequantize_fp8(q, scale, block, ml_dtypes.bfloat16)
    assert bf16.dtype == ml_dtypes.bfloat16
    np.testing.assert_allclose(bf16.astype(np.float32), want, rtol=2 ** -8, atol=0)


def test_quantizer_is_the_official_convention():
    """scale_inv = max|w| / 448 per block (so the block's largest weight becomes ±448,
    and dequantizing *multiplies*), an all-zero block gets scale 1, and every weight
    comes back within half an E4M3 step (16 at 256..448) of its block's scale."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((200, 150)).astype(np.float32)
    weight[128:, 128:] = 0.0
    q, scale = fp8.quantize_block_fp8(weight, (128, 128))
    amax = np.array([[np.abs(weight[:128, :128]).max(), np.abs(weight[:128, 128:]).max()],
                     [np.abs(weight[128:, :128]).max(), 0.0]], np.float32)
    np.testing.assert_array_equal(scale, np.where(amax > 0, amax / np.float32(448.0), 1.0))
    top = np.unravel_index(np.argmax(np.abs(weight[:128, :128])), (128, 128))
    assert abs(float(q[top])) == fp8.E4M3_MAX
    assert not np.any(q[128:, 128:].astype(np.float32))
    back = fp8.dequantize_block_fp8(q, scale, (128, 128))
    step = reference_dequantize(np.full(q.shape, 16.0, ml_dtypes.float8_e4m3fn), scale, (128, 128))
    assert np.all(np.abs(back - weight) <= step) and np.max(np.abs(back - weight)) > 0


@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["scalar", "one"])
def test_per_tensor_scale(scale_shape):
    rng = np.random.default_rng(1)
    q = rng.standard_normal((48, 20)).astype(ml_dtypes.float8_e4m3fn)
    scale = np.full(scale_shape, 0.0371, np.float32)
    want = (q.astype(np.float64) * np.float64(np.float32(0.0371))).astype(np.float32)
    np.testing.assert_array_equal(fp8.dequantize_tensor_fp8(q, scale), want)
    np.testing.assert_array_equal(fp8.dequantize_fp8(q, scale, (128, 128)), want)
    assert fp8.scale_layout(q.shape, scale_shape, (128, 128), "w").kind == "tensor"
    stack = np.stack([q, q[::-1]])                      # one scale per expert: [E] or [E, 1, 1]
    per_expert = np.array([0.5, 0.25], np.float32)
    for shape in ((2,), (2, 1, 1)):
        got = fp8.dequantize_fp8(stack, per_expert.reshape(shape), (128, 128))
        np.testing.assert_array_equal(got, np.stack([q.astype(np.float32) * 0.5,
                                                     q[::-1].astype(np.float32) * 0.25]))


@pytest.mark.parametrize("column", [True, False], ids=["out-1", "out"])
def test_per_channel_scale(column):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((48, 20)).astype(np.float32) * rng.uniform(0.1, 5, (48, 1))
    q, scale = fp8.quantize_block_fp8(weight, (1, 20))          # one scale per output row
    assert scale.shape == (48, 1)
    scale = scale if column else scale[:, 0]
    want = (q.astype(np.float64) * np.asarray(scale, np.float64).reshape(48, 1)).astype(np.float32)
    np.testing.assert_array_equal(fp8.dequantize_channel_fp8(q, scale), want)
    np.testing.assert_array_equal(fp8.dequantize_fp8(q, scale, (128, 128)), want)
    assert fp8.scale_layout(q.shape, scale.shape, (128, 128), "w").kind == "channel"


def test_misshapen_scale_names_tensor_and_shapes():
    with pytest.raises(ck.CheckpointError, match=re.escape(
            "x.weight_scale_inv: scale of shape (2, 2) does not fit FP8 weight x.weight of "
            "shape (160, 96): expected (2, 1) (128x128 blocks)")):
        fp8.scale_layout((160, 96), (2, 2), (128, 128), "x.weight")
    with pytest.raises(ck.CheckpointError, match=r"shape \(2, 2\).*shape \(160, 96\)"):
        fp8.dequantize_block_fp8(np.zeros((160, 96), ml_dtypes.float8_e4m3fn),
                                 np.ones((2, 2), np.float32))
    with pytest.raises(ck.CheckpointError, match="only matrices"):
        fp8.scale_layout((96,), (1,), (128, 128), "n.weight")


def test_scheme_from_quantization_config():
    where = "m/config.json"
    official = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": [128, 128]}
    assert fp8.scheme_from_config(official, where) == fp8.Fp8Scheme((128, 128))
    assert fp8.scheme_from_config({"quant_method": "fp8"}, where).block == (128, 128)
    assert fp8.scheme_from_config({"quant_method": "fp8", "weight_block_size": None},
                                  where).block is None
    alias = fp8.scheme_from_config({"quant_method": "fp8", "ignored_layers": ["lm_head"]}, where)
    assert (alias.not_converted, alias.not_converted_field) == (("lm_head",), "ignored_layers")
    assert fp8.scheme_from_config({"quant_method": "mxfp4"}, where) is None
    assert fp8.scheme_from_config(None, where) is None
    for bad, field in (({"weight_block_size": [128]}, "weight_block_size"),
                       ({"weight_block_size": [128, 0]}, "weight_block_size"),
                       ({"fmt": "e3m4"}, "fmt"), ({"activation_scheme": "lazy"}, "activation"),
                       ({"expert_dtype": "fp4"}, "expert_dtype"),
                       ({"modules_to_not_convert": "lm_head"}, "modules_to_not_convert")):
        with pytest.raises(ck.CheckpointError, match=f"^{where}: quantization_config.{field}"):
            fp8.scheme_from_config({**official, **bad}, where)


def test_modules_to_not_convert_matching():
    """transformers' should_convert_module: a prefix up to a module boundary, or a suffix."""
    match = fp8.not_converted_pattern
    assert match("model.layers.1.mlp.gate.weight", QWEN3_NOT_CONVERTED) == "mlp.gate"
    assert match("model.layers.1.mlp.experts.0.gate_proj.weight", QWEN3_NOT_CONVERTED) is None
    assert match("lm_head.weight", QWEN3_NOT_CONVERTED) == "lm_head"
    assert match("model.layers.1.self_attn.q_proj.weight", ["model.layers.1"]) == "model.layers.1"
    assert match("model.layers.11.self_attn.q_proj.weight", ["model.layers.1"]) is None
    assert match("model.layers.11.self_attn.q_proj.weight", [r"model.layers.\d+.self_attn"])


# ----------------------------------------------------------------------------- loading
def our_logits(cfg, params, ids: list[int]) -> np.ndarray:
    from moejax import model as mdl

    n = len(ids)
    batch = mdl.PackedBatch(tokens=np.array(ids, np.int32), positions=np.arange(n, dtype=np.int32),
                            segment_ids=np.zeros(n, np.int32),
                            score_positions=np.zeros(1, np.int32),
                            score_token_ids=np.zeros((1, 1), np.int32))
    return np.asarray(mdl.full_logits(params, batch, cfg, mdl.ForwardOptions(attn_block=n)))


def transformers_model(twin_dir: str):
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        twin_dir, output_loading_info=True, dtype=torch.float32, attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return hf.eval()


@pytest.mark.parametrize("which", ["deepseek", "qwen3"])
def test_fp8_checkpoint_equals_transformers_on_the_dequantized_weights(which, request):
    """moejax reads the FP8 directory into exactly the dequantized twin's params, and its
    logits equal transformers' on the twin."""
    fp8_dir, twin_dir, _ = request.getfixturevalue(which)
    cfg, params, _ = ck.load_model_dir(fp8_dir, "float32")
    assert_params_equal(params, ck.load_hf_params(twin_dir, ck.load_model_config(twin_dir)))
    ids = [int(t) for t in np.random.default_rng(11).integers(3, V, 14)]
    with torch.no_grad():
        want = transformers_model(twin_dir)(torch.tensor([ids])).logits[0].numpy()
    err = rel_err(our_logits(cfg, params, ids), want)
    print(f"{which}: max relative logit error {err:.2e}")
    assert err <= RTOL, f"relative error {err:.2e}"


def test_fp8_greedy_generation_equals_transformers(qwen3):
    from serving import Generator

    fp8_dir, twin_dir, _ = qwen3
    prompts = [[int(t) for t in np.random.default_rng(s).integers(3, V, n)]
               for s, n in ((21, 7), (22, 10))]
    results = Generator(fp8_dir, dtype="float32", compilation_cache="off").generate(
        [{"id": i, "prompt_token_ids": p, "max_new_tokens": 4} for i, p in enumerate(prompts)])
    hf = transformers_model(twin_dir)
    for p, result in zip(prompts, results):
        assert result.error is None, result.error
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False,
                              pad_token_id=0)
        assert result.token_ids == [int(t) for t in out[0, len(p):]]


def test_bfloat16_serving_dtype_rounds_the_dequantized_weights(qwen3):
    fp8_dir, twin_dir, _ = qwen3
    cfg = ck.load_model_config(fp8_dir)
    got = ck.load_hf_params(fp8_dir, cfg, "bfloat16")
    want = ck.load_hf_params(twin_dir, cfg, "float32")
    assert got["layers"]["wq"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["layers"]["w_down"],
                                  want["layers"]["w_down"].astype(ml_dtypes.bfloat16))


def test_fused_fp8_experts(qwen3, tmp_path):
    """Fused expert stacks stored as FP8 (``experts.gate_up_proj [E, 2f, d]`` with scales
    ``[E, ceil(2f/32), ceil(d/32)]``: a block spans the gate/up boundary; ``down_proj``
    alike) read as the per-expert layout does: the dequantized stacks, split and
    transposed."""
    fp8_dir, _, twin = qwen3
    cfg = ck.load_model_config(fp8_dir)
    E, f = cfg.num_experts, cfg.moe_intermediate_size
    dequantized: dict[str, np.ndarray] = {}

    def fuse(tensors):
        for i in cfg.moe_layers:
            p = f"model.layers.{i}.mlp.experts."
            per_expert = {}
            for kind in ("gate_proj", "up_proj", "down_proj"):
                for e in range(E):
                    del tensors[f"{p}{e}.{kind}.weight"], tensors[f"{p}{e}.{kind}.weight_scale_inv"]
                per_expert[kind] = np.stack([twin[f"{p}{e}.{kind}.weight"] for e in range(E)])
            for name, w in ((p + "gate_up_proj", np.concatenate(
                    [per_expert["gate_proj"], per_expert["up_proj"]], axis=1)),
                            (p + "down_proj", per_expert["down_proj"])):
                q, scale = fp8.quantize_block_fp8(w, (32, 32))
                assert scale.shape == (E, -(-w.shape[1] // 32), -(-w.shape[2] // 32))
                tensors[name], tensors[name + "_scale_inv"] = as_torch(q), as_torch(scale)
                dequantized[name] = reference_dequantize(q, scale, (32, 32))

    params = ck.load_hf_params(rewrite(fp8_dir, tmp_path / "fused", fuse), cfg)
    for i in cfg.moe_layers:
        gate_up = dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        down = dequantized[f"model.layers.{i}.mlp.experts.down_proj"]
        np.testing.assert_array_equal(params["layers"]["w_gate"][i], gate_up[:, :f].swapaxes(1, 2))
        np.testing.assert_array_equal(params["layers"]["w_up"][i], gate_up[:, f:].swapaxes(1, 2))
        np.testing.assert_array_equal(params["layers"]["w_down"][i], down.swapaxes(1, 2))


def test_per_tensor_and_per_channel_scales_in_a_checkpoint(qwen3, tmp_path):
    """``weight_block_size: null``: attention with one ``weight_scale`` each (shape []),
    experts with per-channel ``weight_scale [out, 1]`` (both multiply), and static
    activation scales (``input_scale``, unused: activations stay in the serving dtype)."""
    fp8_dir, twin_dir, _ = qwen3
    cfg = ck.load_model_config(fp8_dir)
    twin = load_file(os.path.join(twin_dir, "model.safetensors"))
    want: dict[str, np.ndarray] = {}

    def requantize(tensors):
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            del tensors[name]
        for name in [n for n in tensors if QUANTIZED.search(n)]:
            w = twin[name].numpy()
            per_tensor = ".self_attn." in name
            q, scale = fp8.quantize_block_fp8(w, w.shape if per_tensor else (1, w.shape[1]))
            scale = scale.reshape(()) if per_tensor else scale
            module = fp8.module_of(name)
            tensors[name], tensors[module + ".weight_scale"] = as_torch(q), as_torch(scale)
            tensors[module + ".input_scale"] = torch.tensor(1.0)
            want[name] = (q.astype(np.float64) * scale.astype(np.float64)).astype(np.float32)

    variant = rewrite(fp8_dir, tmp_path / "variants", requantize, quantization_config={
        "quant_method": "fp8", "activation_scheme": "static", "weight_block_size": None})
    params = ck.load_hf_params(variant, cfg)
    assert ck.stored_weights(variant)["dtype"] == \
        "float8_e4m3fn, per-channel scales, per-tensor scales"
    np.testing.assert_array_equal(params["layers"]["wq"][1],
                                  want["model.layers.1.self_attn.q_proj.weight"].T)
    np.testing.assert_array_equal(params["layers"]["w_down"][0, 3],
                                  want["model.layers.0.mlp.experts.3.down_proj.weight"].T)


def test_stored_weights_from_the_headers(deepseek):
    """What `moejax info` reports as stored: the FP8 weights with their scale layout, and
    every tensor's bytes by dtype (over both shards), read from the headers."""
    fp8_dir, twin_dir, twin = deepseek
    stored = ck.stored_weights(fp8_dir)
    assert stored["dtype"] == "float8_e4m3fn, 128x128 block scales"
    quantized = [n for n in twin if QUANTIZED.search(n)]
    scales = sum(4 * int(np.prod(fp8.block_grid(twin[n].shape, (128, 128)))) for n in quantized)
    assert stored["bytes_by_dtype"] == {
        "float8_e4m3fn": sum(twin[n].size for n in quantized),
        "bfloat16": sum(2 * a.size for n, a in twin.items() if n not in quantized),
        "float32": scales}
    assert stored["bytes"] == sum(stored["bytes_by_dtype"].values())
    assert ck.stored_weights(twin_dir) == {
        "dtype": "float32", "bytes": sum(4 * a.size for a in twin.values()),
        "bytes_by_dtype": {"float32": sum(4 * a.size for a in twin.values())}}


# ----------------------------------------------------------------------------- refusals
SCALED = "model.layers.1.self_attn.q_proj.weight"


def _drop_scale(tensors):
    tensors.pop(SCALED + "_scale_inv")


def _widen_scale(tensors):
    tensors[SCALED + "_scale_inv"] = torch.ones(1, 3)


def _add_scale(tensors):
    tensors[SCALED + "_scale"] = torch.ones(())


@pytest.mark.parametrize("change, message", [
    (_drop_scale, f"missing {SCALED}_scale_inv (the scale of FP8 weight {SCALED})"),
    (_widen_scale, f"{SCALED}_scale_inv: scale of shape (1, 3) does not fit FP8 weight "
                   f"{SCALED} of shape (32, 40): expected (1, 2) (32x32 blocks)"),
    (_add_scale, f"FP8 weight {SCALED} has two scale tensors ({SCALED}_scale_inv and "
                 f"{SCALED}_scale)")], ids=["missing", "misshapen", "two"])
def test_a_scale_missing_misshapen_or_doubled_is_named(qwen3, tmp_path, change, message):
    bad = rewrite(qwen3[0], tmp_path / "bad", change)
    with pytest.raises(ck.CheckpointError, match=re.escape(message)):
        ck.load_model_dir(bad)


def test_fp8_weights_without_an_fp8_config_are_refused(qwen3, tmp_path):
    bad = rewrite(qwen3[0], tmp_path / "bad", lambda t: None, quantization_config=None)
    first = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(ck.CheckpointError, match=re.escape(f": {first} (F8_E4M3); ")) as info:
        ck.load_model_dir(bad)
    assert str(info.value).endswith("stored as FP8, but config.json has no quantization_config "
                                    "with quant_method 'fp8' to say how its scales apply")


def test_fp8_weight_in_a_module_not_to_convert_is_refused(qwen3, tmp_path):
    bad = rewrite(qwen3[0], tmp_path / "bad", lambda t: None, quantization_config={
        "quant_method": "fp8", "weight_block_size": [32, 32],
        "ignored_layers": ["model.layers.1.self_attn"]})
    with pytest.raises(ck.CheckpointError, match=re.escape(
            f"{SCALED} is stored as F8_E4M3, but quantization_config.ignored_layers lists its "
            f"module ('model.layers.1.self_attn')")):
        ck.load_model_dir(bad)


def test_scale_of_an_unquantized_weight_is_unused(qwen3, tmp_path):
    """A scale beside a bf16 weight (the router) is a tensor no param uses: refused."""
    router = "model.layers.0.mlp.gate.weight"
    bad = rewrite(qwen3[0], tmp_path / "bad",
                  lambda t: t.__setitem__(router + "_scale_inv", torch.ones(1, 2)))
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{router}_scale_inv")):
        ck.load_model_dir(bad)


# ----------------------------------------------------------------------------- command line
def moejax(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)


def test_moejax_score_and_info_on_an_fp8_directory(qwen3, tmp_path, capsys):
    """`moejax score --model <fp8 dir>` (a subprocess) gives the log-probabilities of the
    dequantized float32 twin; `moejax info` shows stored and serving dtypes and bytes."""
    from serving import cli

    fp8_dir, twin_dir, _ = qwen3
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt_token_ids": [5, 9, 17, 33, 4],
                               "candidate_token_ids": [[7], [8, 9]]}) + "\n"
                   + json.dumps({"id": "b", "prompt_token_ids": [3, 100, 64],
                                 "candidate_token_ids": [[11, 12, 13], [90]]}) + "\n")
    out_fp8, out_twin = tmp_path / "fp8.jsonl", tmp_path / "twin.jsonl"
    done = moejax("score", str(src), "-o", str(out_fp8), "--model", fp8_dir, "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert cli.main(["score", str(src), "-o", str(out_twin), "--model", twin_dir,
                     "--dtype", "float32"]) == 0
    got = [json.loads(line) for line in out_fp8.read_text().splitlines()]
    want = [json.loads(line) for line in out_twin.read_text().splitlines()]
    assert [r["id"] for r in got] == ["a", "b"] and all(r["error"] is None for r in got)
    err = rel_err([x for r in got for x in r["logprobs"]], [x for r in want for x in r["logprobs"]])
    assert err <= RTOL, f"relative error {err:.2e}"

    capsys.readouterr()
    assert cli.main(["info", "--model", fp8_dir, "--dtype", "float32"]) == 0
    weights = json.loads(capsys.readouterr().out)["weights"]
    from moejax.param_layout import num_params

    file = os.path.join(fp8_dir, "model.safetensors")
    with open(file, "rb") as fh:                        # the data section: after the header
        data = os.path.getsize(file) - 8 - int.from_bytes(fh.read(8), "little")
    assert weights == {"stored_dtype": "float8_e4m3fn, 32x32 block scales",
                       "stored_bytes": data,
                       "stored_bytes_by_dtype": weights["stored_bytes_by_dtype"],
                       "serving_dtype": "float32",
                       "serving_bytes": num_params(ck.load_model_config(fp8_dir)) * 4}
    assert set(weights["stored_bytes_by_dtype"]) == {"float8_e4m3fn", "bfloat16", "float32"}
    assert sum(weights["stored_bytes_by_dtype"].values()) == data


def test_a_deepseek_v3_fp8_checkpoint_scores_and_generates_through_the_cli(deepseek, tmp_path):
    """The issue's bar: the official layout of a DeepSeek-V3-shaped checkpoint, through
    `moejax score` and `moejax generate`, against transformers on the dequantized twin:
    log-probabilities within 1e-4 relative, the same greedy tokens."""
    from serving import cli

    fp8_dir, twin_dir, _ = deepseek
    prompt, candidates = [5, 9, 17, 33, 4, 60], [[7], [8, 9]]
    src = tmp_path / "score.jsonl"
    src.write_text(json.dumps({"prompt_token_ids": prompt, "candidate_token_ids": candidates,
                               "normalize": "vocab"}) + "\n")
    out = tmp_path / "scores.jsonl"
    assert cli.main(["score", str(src), "-o", str(out), "--model", fp8_dir,
                     "--dtype", "float32"]) == 0
    (got,) = [json.loads(line) for line in out.read_text().splitlines()]
    hf = transformers_model(twin_dir)
    want = []
    for candidate in candidates:
        ids = prompt + candidate
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
        want.append(sum(logp[len(prompt) - 1 + j, t] for j, t in enumerate(candidate)))
    assert rel_err(got["logprobs"], want) <= RTOL, (got["logprobs"], want)
    gen_src, gen_out = tmp_path / "generate.jsonl", tmp_path / "generated.jsonl"
    gen_src.write_text(json.dumps({"prompt_token_ids": prompt, "max_new_tokens": 4}) + "\n")
    assert cli.main(["generate", str(gen_src), "-o", str(gen_out), "--model", fp8_dir,
                     "--dtype", "float32"]) == 0
    (generated,) = [json.loads(line) for line in gen_out.read_text().splitlines()]
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                             pad_token_id=0)
    assert generated["token_ids"] == [int(t) for t in greedy[0, len(prompt):]]

"""MXFP4 decoding/encoding (moejax.mxfp4): against a spec-level reference decoder, hand-worked
bytes, transformers' own dequantization and its GPT-OSS loading path."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from moejax.mxfp4 import (FP4_E2M1_VALUES, dequantize_expert_tensor, dequantize_mxfp4,
                          quantize_mxfp4)

ROOT = Path(__file__).resolve().parent.parent
BF16 = np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------- reference
def _ref_e2m1(code: int) -> float:
    """One FP4 E2M1 code from the OCP MX spec: sign | 2-bit exponent (bias 1) | 1-bit mantissa."""
    sign = -1.0 if code & 0b1000 else 1.0
    exp, man = (code >> 1) & 0b11, code & 0b1
    if exp == 0:  # subnormal: 0.m * 2**(1 - bias)
        return sign * (man / 2.0) * 2.0 ** (1 - 1)
    return sign * (1.0 + man / 2.0) * 2.0 ** (exp - 1)


def _ref_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float64, element by element: byte j of a group holds elements 2j (low nibble), 2j+1."""
    *lead, g, b = blocks.shape
    out = np.empty((*lead, g, 2 * b), np.float64)
    for idx in np.ndindex(*lead, g):
        s = int(scales[idx])
        scale = math.nan if s == 255 else 2.0 ** (s - 127)
        for j in range(b):
            byte = int(blocks[idx + (j,)])
            out[idx + (2 * j,)] = _ref_e2m1(byte & 0xF) * scale
            out[idx + (2 * j + 1,)] = _ref_e2m1(byte >> 4) * scale
    return out.reshape(*lead, g * 2 * b)


def _random(shape_lead: tuple[int, ...], g: int, lo: int = 100, hi: int = 150, seed: int = 0,
            b: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, (*shape_lead, g, b), dtype=np.uint8),
            rng.integers(lo, hi + 1, (*shape_lead, g), dtype=np.uint8))


# ----------------------------------------------------------------------------- decoding
def test_value_table_matches_spec():
    ref = np.array([_ref_e2m1(c) for c in range(16)])
    np.testing.assert_array_equal(FP4_E2M1_VALUES, ref)
    assert FP4_E2M1_VALUES.dtype == np.float32
    assert np.array_equal(np.signbit(FP4_E2M1_VALUES), np.arange(16) >= 8)  # -0.0 at code 8


def test_matches_reference_decoder_float32_and_float64():
    blocks, scales = _random((3, 2), 3, seed=1)  # scale bytes 100..150
    scales[0, 0, :] = [100, 150, 127]
    ref = _ref_decode(blocks, scales)
    out32 = dequantize_mxfp4(blocks, scales)
    assert out32.dtype == np.float32 and out32.shape == (3, 2, 96)
    np.testing.assert_array_equal(out32, ref.astype(np.float32))
    np.testing.assert_array_equal(np.signbit(out32), np.signbit(ref))  # -0.0 kept
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, "float64"), ref)


def test_every_scale_byte_and_code_in_float64():
    # All 256 scale bytes (2**-127 .. 2**127, then NaN) against all 256 bytes: exact in float64.
    blocks = np.tile(np.arange(256, dtype=np.uint8).reshape(1, 16, 16), (256, 1, 1))
    scales = np.tile(np.arange(256, dtype=np.uint8)[:, None], (1, 16))
    out = dequantize_mxfp4(blocks, scales, np.float64)
    ref = _ref_decode(blocks[::17], scales[::17])  # python reference on a subsample of scales
    np.testing.assert_array_equal(out[::17], ref)
    assert np.isnan(out[255]).all() and not np.isnan(out[:255]).any()
    assert out.shape == (256, 512)
    assert out[0, 2] == 2.0 ** -128 and out[254, -1] == -6 * 2.0 ** 127


def test_hand_worked_bytes():
    # 0x21: low nibble 1 -> +0.5 comes first, high nibble 2 -> +1.0; scale 127 -> 2**0.
    # 0xF7: low 7 -> +6, high F -> -6; scale 128 -> x2.
    # 0x98: low 8 -> -0.0, high 9 -> -0.5; scale 126 -> x0.5.
    # 0x3A: low A -> -1.0, high 3 -> +1.5; scale 0 -> 2**-127 (float32 subnormal, exact).
    blocks = np.array([0x21, 0xF7, 0x98, 0x3A], np.uint8).reshape(4, 1, 1)  # 4 rows, G=1, B=1
    scales = np.array([127, 128, 126, 0], np.uint8).reshape(4, 1)
    out = dequantize_mxfp4(blocks, scales)
    expect = np.array([[0.5, 1.0], [12.0, -12.0], [-0.0, -0.25],
                       [-(2.0 ** -127), 1.5 * 2.0 ** -127]], np.float32)
    np.testing.assert_array_equal(out, expect)
    assert np.signbit(out[2, 0]) and out[3, 0] != 0
    # Each group of the row gets its own scale: G=2 groups of one byte 0x21.
    row = dequantize_mxfp4(np.array([[0x21], [0x21]], np.uint8), np.array([129, 125], np.uint8))
    np.testing.assert_array_equal(row, [2.0, 4.0, 0.125, 0.25])
    # Scale byte 255 is NaN; a float32 result past the range is inf.
    nan_inf = dequantize_mxfp4(np.full((2, 1, 1), 0x77, np.uint8),
                               np.array([255, 254], np.uint8).reshape(2, 1))
    assert np.isnan(nan_inf[0]).all() and np.isposinf(nan_inf[1]).all()


def test_bfloat16_is_float32_cast_and_chunking_is_invisible():
    blocks, scales = _random((4, 5), 3, seed=2)
    full = dequantize_mxfp4(blocks, scales, rows_per_chunk=10**9)
    bf = dequantize_mxfp4(blocks, scales, "bfloat16")
    assert bf.dtype == BF16
    np.testing.assert_array_equal(bf.view(np.uint16), full.astype(BF16).view(np.uint16))
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, ml_dtypes.bfloat16).view(np.uint16),
                                  bf.view(np.uint16))
    for chunk in (1, 7, 16):
        np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, rows_per_chunk=chunk), full)
        np.testing.assert_array_equal(
            dequantize_mxfp4(blocks, scales, "bfloat16", rows_per_chunk=chunk).view(np.uint16),
            bf.view(np.uint16))
    with np.errstate(over="ignore"):  # float16 overflows at these scales: inf on both sides
        np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, np.float16),
                                      full.astype(np.float16))


def test_any_number_of_leading_axes():
    blocks, scales = _random((2, 3, 2), 2, seed=3)
    ref = _ref_decode(blocks, scales).astype(np.float32)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks, scales, rows_per_chunk=5), ref)
    np.testing.assert_array_equal(dequantize_mxfp4(blocks[0, 0, 0], scales[0, 0, 0]), ref[0, 0, 0])


def test_bfloat16_output_has_no_whole_float32_copy():
    blocks, scales = _random((256,), 64, seed=4, b=16)  # 524288 elements: bf16 1 MiB, f32 2 MiB
    tracemalloc.start()
    try:
        out = dequantize_mxfp4(blocks, scales, "bfloat16", rows_per_chunk=256)
        peak = tracemalloc.get_traced_memory()[1]
        out_t = dequantize_expert_tensor("down_proj", blocks[None], scales[None], "bfloat16",
                                         rows_per_chunk=256)
        peak_t = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.nbytes == 1 << 20
    assert peak < out.nbytes + (256 << 10), peak  # output + small chunk temporaries
    assert peak_t < out.nbytes * 2 + (256 << 10), peak_t  # both outputs alive at that point
    np.testing.assert_array_equal(out_t[0].view(np.uint16), out.T.view(np.uint16))


# ----------------------------------------------------------------------------- expert layout
@pytest.mark.parametrize("kind", ["gate_up_proj", "down_proj"])
def test_expert_tensor_is_transposed_decode(kind):
    e, rows, g = 3, 6, 2  # on disk [E, out, in/32, 16] -> parameter [E, in, out]
    blocks, scales = _random((e, rows), g, seed=5)
    flat = dequantize_mxfp4(blocks, scales)
    for dtype, chunk in (("float32", 1), ("float32", 10**6), ("bfloat16", 3)):
        out = dequantize_expert_tensor(kind, blocks, scales, dtype, rows_per_chunk=chunk)
        assert out.shape == (e, g * 32, rows) and out.flags.c_contiguous
        np.testing.assert_array_equal(out.astype(np.float32),
                                      flat.astype(dtype).astype(np.float32).transpose(0, 2, 1))


def test_agrees_with_transformers_dequantization():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    for kind, (rows, g) in {"gate_up_proj": (8, 3), "down_proj": (6, 1)}.items():
        blocks, scales = _random((4, rows), g, seed=6)
        for tdt, dt in ((torch.float32, "float32"), (torch.bfloat16, "bfloat16")):
            theirs = hf.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                                   dtype=tdt).float().numpy()
            ours = dequantize_expert_tensor(kind, blocks, scales, dt)
            assert ours.shape == theirs.shape == (4, g * 32, rows)
            np.testing.assert_array_equal(ours.astype(np.float32), theirs)


def test_transformers_gpt_oss_loading_path(tmp_path):
    """An MXFP4 GPT-OSS checkpoint loaded by transformers (dequantize=True) holds exactly
    dequantize_expert_tensor's tensors as GptOssExperts.gate_up_proj / down_proj."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import save_file

    n_exp, hidden, inter = 4, 96, 32  # non-square so a missing/extra transpose cannot pass
    cfg = transformers.GptOssConfig(
        vocab_size=32, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=n_exp,
        num_experts_per_tok=2, layer_types=["full_attention"])
    torch.manual_seed(0)
    state = {k: v.detach().clone().contiguous()
             for k, v in transformers.GptOssForCausalLM(cfg).state_dict().items()}
    on_disk = {"gate_up_proj": _random((n_exp, 2 * inter), hidden // 32, 110, 140, seed=7),
               "down_proj": _random((n_exp, hidden), inter // 32, 110, 140, seed=8)}
    prefix = "model.layers.0.mlp.experts."
    for kind, (blocks, scales) in on_disk.items():
        del state[prefix + kind]
        state[prefix + kind + "_blocks"] = torch.from_numpy(blocks)
        state[prefix + kind + "_scales"] = torch.from_numpy(scales)
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = cfg.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "config.json").write_text(json.dumps(config))

    model = transformers.GptOssForCausalLM.from_pretrained(
        tmp_path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32)
    experts = model.model.layers[0].mlp.experts
    expected_shapes = {"gate_up_proj": (n_exp, hidden, 2 * inter), "down_proj": (n_exp, inter, hidden)}
    for kind, (blocks, scales) in on_disk.items():
        loaded = getattr(experts, kind).detach().numpy()
        ours = dequantize_expert_tensor(kind, blocks, scales)
        assert ours.shape == loaded.shape == expected_shapes[kind]
        np.testing.assert_array_equal(ours, loaded)


# ----------------------------------------------------------------------------- encoding
def test_round_trip_exact_for_representable_values():
    blocks, scales = _random((5,), 4, seed=9)
    x = dequantize_mxfp4(blocks, scales, np.float64)
    np.testing.assert_array_equal(dequantize_mxfp4(*quantize_mxfp4(x), np.float64), x)
    # When every group reaches |6| the scale is forced, so the bytes themselves come back.
    blocks[..., 0] = (blocks[..., 0] & 0xF0) | 0x7
    x = dequantize_mxfp4(blocks, scales, np.float64)
    qb, qs = quantize_mxfp4(x)
    np.testing.assert_array_equal(qb, blocks)
    np.testing.assert_array_equal(qs, scales)


def test_quantize_picks_minimal_scale_and_nearest_value():
    rng = np.random.default_rng(10)
    x = rng.standard_normal((6, 128)) * 10.0 ** rng.integers(-20, 20, (6, 1))
    blocks, scales = quantize_mxfp4(x)
    assert blocks.shape == (6, 4, 16) and scales.shape == (6, 4)
    k = scales.astype(np.int64) - 127
    amax = np.abs(x.reshape(6, 4, 32)).max(-1)
    assert np.all(amax <= 6 * 2.0 ** k) and np.all(amax > 6 * 2.0 ** (k - 1))
    q = dequantize_mxfp4(blocks, scales, np.float64).reshape(6, 4, 32)
    grid = FP4_E2M1_VALUES.astype(np.float64)[None, None, None, :] * 2.0 ** k[..., None, None]
    xb = x.reshape(6, 4, 32)
    best = np.abs(xb[..., None] - grid).min(-1)
    np.testing.assert_array_equal(np.abs(xb - q), best)  # nearest representable value
    bound = np.maximum(0.25 * np.abs(xb), 0.25 * 2.0 ** k[..., None])  # half a step of E2M1
    assert np.all(np.abs(xb - q) <= bound)


def test_quantize_ties_signs_zero_and_saturation():
    # Ties go to the even code (mantissa bit 0); 6 fixes the scale at 2**0.
    x = np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.0, -5.0, 0.1]], np.float64)
    x = np.pad(x, ((0, 0), (0, 32 - x.shape[1])))
    blocks, scales = quantize_mxfp4(x)
    assert scales.tolist() == [[127]]
    q = dequantize_mxfp4(blocks, scales, np.float64)[0, :12]
    np.testing.assert_array_equal(q, [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -0.0, -4.0, 0.0])
    assert np.signbit(q[8]) and np.signbit(q[9])
    # Codes (low nibble first): 0|2, 2|4, 4|6, 6|7, 8|8 (two -0), E|0 (-4, then 0.1 -> +0).
    assert blocks[0, 0, :6].tolist() == [0x20, 0x42, 0x64, 0x76, 0x88, 0x0E]
    zero_b, zero_s = quantize_mxfp4(np.zeros((2, 32)))
    assert zero_s.tolist() == [[127], [127]] and not zero_b.any()
    big_b, big_s = quantize_mxfp4(np.full((1, 32), 1e40))  # past 6 * 2**127: saturates to 6
    assert big_s.tolist() == [[254]] and (big_b == 0x77).all()
    tiny_b, tiny_s = quantize_mxfp4(np.full((1, 32), 2.0 ** -140))  # below 2**-127 * 0.25: zero
    assert tiny_s.tolist() == [[0]] and not tiny_b.any()
    custom_b, custom_s = quantize_mxfp4(np.arange(16.0).reshape(2, 8) / 4, block=8)
    assert custom_b.shape == (2, 1, 4) and custom_s.shape == (2, 1)


# ----------------------------------------------------------------------------- errors
def test_errors_name_the_tensor():
    blocks, scales = _random((2, 3), 4)
    name = "model.layers.0.mlp.experts.down_proj"
    cases = [
        (blocks.astype(np.int8), scales, "blocks must be uint8, got int8"),
        (blocks.astype(np.float32), scales, "blocks must be uint8, got float32"),
        (blocks, scales.astype(np.int32), "scales must be uint8, got int32"),
        (blocks, scales[:1], "leading shapes differ"),
        (blocks, scales[None], "leading shapes differ"),
        (blocks, scales[..., :3], "scales group axis 3 does not match blocks' group axis G=4"),
        (blocks[..., 0], scales, "leading shapes differ"),
        (blocks.tolist(), scales, "blocks must be a NumPy array"),
        (blocks[0, 0, 0], np.array(1, np.uint8), "blocks must be [..., G, B]"),
    ]
    for b, s, msg in cases:
        with pytest.raises(ValueError, match=r"^" + name.replace(".", r"\.") + ": ") as err:
            dequantize_mxfp4(b, s, name=name)
        assert msg in str(err.value), (msg, str(err.value))
    with pytest.raises(ValueError, match="leading shapes differ") as err:
        dequantize_mxfp4(blocks, scales[:1])
    assert not str(err.value).startswith(":")
    with pytest.raises(ValueError, match=f"{name}: output dtype must be one of"):
        dequantize_mxfp4(blocks, scales, np.int8, name=name)
    with pytest.raises(ValueError, match=f"{name}: unsupported output dtype 'nope'"):
        dequantize_mxfp4(blocks, scales, "nope", name=name)
    with pytest.raises(ValueError, match="rows_per_chunk must be >= 1"):
        dequantize_mxfp4(blocks, scales, rows_per_chunk=0)


def test_expert_errors():
    blocks, scales = _random((2, 3), 1)
    with pytest.raises(ValueError, match="kind must be one of"):
        dequantize_expert_tensor("up_proj", blocks, scales)
    with pytest.raises(ValueError, match="gate_up_proj: gate_up_proj needs an even row count"):
        dequantize_expert_tensor("gate_up_proj", blocks, scales)
    with pytest.raises(ValueError, match="down_proj: expert blocks must be \\[E, R, G, B\\]"):
        dequantize_expert_tensor("down_proj", blocks[0], scales[0])
    with pytest.raises(ValueError, match="layers.3.down: scales must be uint8"):
        dequantize_expert_tensor("down_proj", blocks, scales.astype(np.int64), name="layers.3.down")
    with pytest.raises(ValueError, match="multiple of block=32"):
        quantize_mxfp4(np.zeros((2, 48)))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_mxfp4(np.full((1, 32), np.inf))
    with pytest.raises(ValueError, match="even size"):
        quantize_mxfp4(np.zeros((1, 30)), block=3)


def test_module_imports_neither_jax_nor_torch():
    code = "import sys, moejax.mxfp4; print(sorted({'jax', 'torch'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

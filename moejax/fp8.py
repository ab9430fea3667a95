"""FP8 weights as DeepSeek-V3/R1, Kimi-K2 and the Qwen3 ``-FP8`` releases store them.

On disk (safetensors) a quantized linear weight ``W [out, in]`` (or a fused expert stack
``[E, out, in]``) is an ``F8_E4M3`` tensor (``F8_E5M2`` where a release uses it) and beside
it a float scale tensor named ``<weight name>_scale_inv``. config.json says how:
``quantization_config: {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}``. The scale has one entry per block of
``weight_block_size`` (rows, cols): shape ``[ceil(out/128), ceil(in/128)]``, the last
block of a row or column partial when a dimension is not a multiple of the block.

The dequantized weight is the FP8 value (exact in float32) *times* the scale of its
block. The name ``scale_inv`` says what the *quantizer* divided by being inverted:
DeepSeek's ``weight_dequant`` kernel computes ``x * s`` with ``s`` the ``scale_inv``
tensor, transformers' ``Fp8Dequantize`` multiplies by ``weight_scale_inv``, and vLLM's
block-FP8 path multiplies by it too ("the weight_scale_inv name is intentional for
deepseekv3"). The per-tensor and per-channel variants (vLLM's serialized per-tensor FP8
and compressed-tensors' ``weight_scale`` of shape ``[]``/``[1]`` or ``[out, 1]``/``[out]``)
multiply as well: ``weight_scale`` and ``weight_scale_inv`` both *multiply*; nothing on
disk is divided by.

Only matrices are quantized: embeddings, norms, ``lm_head``, router gates and
``e_score_correction_bias`` stay bf16/f32, as do the modules a Qwen3 FP8 config lists in
``modules_to_not_convert`` (alias ``ignored_layers``). The reader decides per tensor from
its stored dtype; those lists are checked against it.

Host-memory: :func:`dequantize_fp8` works through a tensor a few rows at a time, so
dequantizing holds one output tensor plus a bounded float32 chunk.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping, Sequence

import ml_dtypes
import numpy as np

from moejax.safetensors_io import CheckpointError

# safetensors codes of FP8 weights, and the codes a scale may be stored as.
FP8_CODES: dict[str, np.dtype] = {"F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
                                  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}
SCALE_CODES = ("F32", "BF16", "F16")
# ``fmt`` of a quantization_config -> the dtype of its weights.
FORMATS: dict[str, np.dtype] = {"e4m3": FP8_CODES["F8_E4M3"], "e5m2": FP8_CODES["F8_E5M2"]}
E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)    # 448
# transformers' FineGrainedFP8Config default when config.json gives no weight_block_size.
DEFAULT_BLOCK = (128, 128)
# Scale-tensor suffixes, in the order they are looked for (both multiply: module docstring).
SCALE_SUFFIXES = ("_scale_inv", "_scale")
# Elements dequantized per step: bounds the float32 temporaries (16 MiB each).
_CHUNK_ELEMENTS = 1 << 22

Block = tuple[int, int]


# =========================================================================== scheme
@dataclasses.dataclass(frozen=True)
class Fp8Scheme:
    """The ``quantization_config`` of an FP8 checkpoint, checked.

    ``block`` is ``weight_block_size`` (None: per-tensor or per-channel scales);
    ``not_converted`` the module patterns left unquantized, from the field
    ``not_converted_field`` (``modules_to_not_convert``, or its alias ``ignored_layers``)."""

    block: Block | None = DEFAULT_BLOCK
    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    not_converted: tuple[str, ...] = ()
    not_converted_field: str = "modules_to_not_convert"


def _choice(config: Mapping[str, Any], key: str, allowed: Sequence[str], default: str,
            where: str) -> str:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, str) or value.lower() not in allowed:
        raise CheckpointError(f"{where}: quantization_config.{key} must be one of "
                              f"{', '.join(allowed)}, got {value!r}")
    return value.lower()


def _block_size(config: Mapping[str, Any], where: str) -> Block | None:
    if "weight_block_size" not in config:
        return DEFAULT_BLOCK
    value = config["weight_block_size"]
    if value is None:
        return None
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value)):
        raise CheckpointError(f"{where}: quantization_config.weight_block_size must be two "
                              f"positive integers [rows, cols] or null, got {value!r}")
    return int(value[0]), int(value[1])


def _module_patterns(config: Mapping[str, Any], where: str) -> tuple[tuple[str, ...], str]:
    """(patterns, the field they came from): ``modules_to_not_convert``, else its alias
    ``ignored_layers`` (as transformers reads them)."""
    key = "modules_to_not_convert" if config.get("modules_to_not_convert") is not None \
        else "ignored_layers"
    value = config.get(key)
    if value is None:
        return (), "modules_to_not_convert"
    if not isinstance(value, list) or not all(isinstance(p, str) for p in value):
        raise CheckpointError(f"{where}: quantization_config.{key} must be a list of module "
                              f"names, got {value!r}")
    return tuple(value), key


def scheme_from_config(quantization_config: Any, where: str) -> Fp8Scheme | None:
    """The :class:`Fp8Scheme` of a config.json's ``quantization_config``; None when there
    is none or it is another method (GPT-OSS's ``mxfp4`` is read from its tensor names).

    Refused (CheckpointError naming ``where`` and the field): a malformed block size,
    an unknown ``fmt``/``activation_scheme``/``scale_fmt``, FP4 experts (DeepSeek-V4)."""
    if not isinstance(quantization_config, Mapping):
        return None
    if quantization_config.get("quant_method") != "fp8":
        return None
    config = quantization_config
    _choice(config, "scale_fmt", ("float", "ue8m0"), "float", where)  # ue8m0: powers of 2
    if _choice(config, "expert_dtype", ("fp8", "fp4"), "fp8", where) != "fp8":
        raise CheckpointError(f"{where}: quantization_config.expert_dtype 'fp4' (FP4-packed "
                              "experts) is not supported")
    patterns, field = _module_patterns(config, where)
    return Fp8Scheme(block=_block_size(config, where),
                     fmt=_choice(config, "fmt", tuple(FORMATS), "e4m3", where),
                     activation_scheme=_choice(config, "activation_scheme",
                                               ("dynamic", "static"), "dynamic", where),
                     not_converted=patterns, not_converted_field=field)


def module_of(tensor_name: str) -> str:
    """The module a weight belongs to: ``a.b.q_proj.weight`` -> ``a.b.q_proj``, a fused
    ``a.mlp.experts.gate_up_proj`` -> ``a.mlp.experts``."""
    return tensor_name.rsplit(".", 1)[0]


def not_converted_pattern(tensor_name: str, patterns: Sequence[str]) -> str | None:
    """The ``modules_to_not_convert`` pattern naming ``tensor_name``'s module, or None.

    transformers' matching (``should_convert_module``): the pattern matches the module
    name from its start up to a module boundary (``layers.1`` matches ``layers.1.mlp``,
    not ``layers.11``; regular expressions allowed), or is a suffix of it."""
    module = module_of(tensor_name)
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for pattern in patterns:
        try:
            matched = re.match(rf"(?:{pattern}){boundary}", module) is not None
        except re.error:
            matched = False
        if matched or module.endswith(pattern):
            return pattern
    return None


def scale_name_of(weight_name: str, names: set[str] | frozenset[str]) -> str:
    """The scale tensor of an FP8 weight: ``<name>_scale_inv`` or ``<name>_scale``. When
    neither exists, ``<name>_scale_inv`` (so that the refusal names the usual one); both
    existing is refused (which one to apply would be a guess)."""
    present = [weight_name + suffix for suffix in SCALE_SUFFIXES if weight_name + suffix in names]
    if len(present) > 1:
        raise CheckpointError(f"FP8 weight {weight_name} has two scale tensors "
                              f"({' and '.join(present)}); expected one")
    return present[0] if present else weight_name + SCALE_SUFFIXES[0]


# =========================================================================== scale layouts
@dataclasses.dataclass(frozen=True)
class ScaleLayout:
    """How a scale tensor covers its weight ``[..., rows, cols]``: ``kind`` ("block",
    "channel" or "tensor") and the block each scale entry covers (a channel: (1, cols))."""

    kind: str
    block: Block

    def describe(self) -> str:
        if self.kind == "block":
            return f"{self.block[0]}x{self.block[1]} block scales"
        return f"per-{self.kind} scales"


def block_grid(weight_shape: Sequence[int], block: Block) -> tuple[int, ...]:
    """The block-scale shape of a weight: leading axes, then ``ceil(rows/b0), ceil(cols/b1)``."""
    *lead, rows, cols = weight_shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def scale_layout(weight_shape: Sequence[int], scale_shape: Sequence[int], block: Block | None,
                 name: str, scale_name: str | None = None) -> ScaleLayout:
    """Which accepted form ``scale_shape`` has for an FP8 weight of ``weight_shape``
    (``[out, in]`` or ``[..., out, in]``), or CheckpointError naming both tensors and
    shapes and the forms expected. Forms, in the order tried: the ``block`` grid;
    per-channel ``[..., out]``/``[..., out, 1]``; per-tensor ``[]``/``[1]`` (or one per
    leading index: ``[...]``, ``[..., 1]``, ``[..., 1, 1]``)."""
    weight_shape, scale_shape = tuple(weight_shape), tuple(scale_shape)
    scale_name = scale_name or name + SCALE_SUFFIXES[0]
    if len(weight_shape) < 2:
        raise CheckpointError(f"{name}: FP8 weight of shape {weight_shape}: only matrices "
                              "(or stacks of them) are stored as FP8")
    *lead, rows, cols = weight_shape
    lead = tuple(lead)
    if block is not None and scale_shape == block_grid(weight_shape, block):
        return ScaleLayout("block", block)
    if scale_shape in (lead + (rows,), lead + (rows, 1)):
        return ScaleLayout("channel", (1, cols))
    per_tensor = {(), (1,)} | ({lead, lead + (1,), lead + (1, 1)} if lead else {(1, 1)})
    if scale_shape in per_tensor:
        return ScaleLayout("tensor", (rows, cols))
    forms = ([f"{block_grid(weight_shape, block)} ({block[0]}x{block[1]} blocks)"]
             if block is not None else [])
    forms += [f"{lead + (rows, 1)} or {lead + (rows,)} (per channel)", "() or (1,) (per tensor)"]
    raise CheckpointError(f"{scale_name}: scale of shape {scale_shape} does not fit FP8 weight "
                          f"{name} of shape {weight_shape}: expected {'; '.join(forms)}")


# =========================================================================== dequantize
def _work_dtype(dtype: np.dtype) -> np.dtype:
    """float64 output is computed in float64, anything else in float32 (exact there: an
    FP8 value times a float32 scale, rounded once)."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _dequantize_grid(weight: np.ndarray, grid: np.ndarray, block: Block,
                     dtype: np.dtype) -> np.ndarray:
    """``weight [..., R, C]`` times ``grid [..., ceil(R/b0), ceil(C/b1)]`` expanded over
    ``block``, as a new ``dtype`` array, one matrix of a stack at a time (``grid`` may be
    a broadcast view)."""
    out = np.empty(weight.shape, dtype)
    for index in np.ndindex(weight.shape[:-2]):
        _dequantize_matrix(weight[index], grid[index], block, out[index])
    return out


def _dequantize_matrix(weight: np.ndarray, grid: np.ndarray, block: Block,
                       out: np.ndarray) -> None:
    """One matrix of :func:`_dequantize_grid`, whole row blocks at a time, so the float32
    temporaries stay near ``_CHUNK_ELEMENTS`` whatever the matrix."""
    rows, cols = weight.shape
    work = _work_dtype(out.dtype)
    step = block[0] * max(1, _CHUNK_ELEMENTS // (max(1, cols) * block[0]))
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        scales = grid[start // block[0]:-(-stop // block[0]), :].astype(work)
        scales = np.repeat(np.repeat(scales, block[0], axis=0)[:stop - start],
                           block[1], axis=1)[:, :cols]
        out[start:stop] = weight[start:stop].astype(work) * scales


def dequantize_fp8(weight: np.ndarray, scale: np.ndarray, block: Block | None = DEFAULT_BLOCK,
                   dtype: Any = np.float32, *, name: str = "weight",
                   scale_name: str | None = None) -> np.ndarray:
    """An FP8 ``weight [..., out, in]`` times its ``scale`` (block, per-channel or
    per-tensor: :func:`scale_layout`) as ``dtype``, chunk by chunk."""
    dtype = np.dtype(dtype)
    weight, scale = np.asarray(weight), np.asarray(scale)
    if weight.dtype not in FP8_CODES.values():
        raise CheckpointError(f"{name}: expected an FP8 weight, got {weight.dtype}")
    layout = scale_layout(weight.shape, scale.shape, block, name, scale_name)
    *lead, rows, cols = weight.shape
    if layout.kind == "block":
        grid = scale
    elif layout.kind == "channel":
        grid = scale.reshape(*lead, rows, 1)
    else:   # one scale per leading index (or for all): broadcast down the rows
        one = scale.reshape(*(lead if scale.size > 1 else [1] * len(lead)), 1, 1)
        grid = np.broadcast_to(one, (*lead, rows, 1))
    return _dequantize_grid(weight, grid, layout.block if layout.kind == "block" else (1, cols),
                            dtype)


def dequantize_block_fp8(weight_fp8: np.ndarray, scale_inv: np.ndarray,
                         block: Block = DEFAULT_BLOCK, dtype: Any = np.float32) -> np.ndarray:
    """Block-scaled FP8 (DeepSeek's ``weight_dequant``): each ``block`` of ``weight_fp8``
    times its entry of ``scale_inv [..., ceil(out/b0), ceil(in/b1)]`` (edge blocks partial)."""
    weight_fp8, scale_inv = np.asarray(weight_fp8), np.asarray(scale_inv)
    if scale_inv.shape != block_grid(weight_fp8.shape, block):
        raise CheckpointError(f"block scales of shape {scale_inv.shape} do not fit an FP8 weight "
                              f"of shape {weight_fp8.shape}: expected "
                              f"{block_grid(weight_fp8.shape, block)} for {block} blocks")
    return _dequantize_grid(weight_fp8, scale_inv, block, np.dtype(dtype))


def dequantize_channel_fp8(weight_fp8: np.ndarray, scale: np.ndarray,
                           dtype: Any = np.float32) -> np.ndarray:
    """Per-output-channel FP8: row ``r`` times ``scale[r]`` (``scale [out]`` or ``[out, 1]``)."""
    weight_fp8 = np.asarray(weight_fp8)
    *lead, rows, _ = weight_fp8.shape
    if np.shape(scale) not in ((*lead, rows), (*lead, rows, 1)):
        raise CheckpointError(f"per-channel scale of shape {np.shape(scale)} does not fit an "
                              f"FP8 weight of shape {weight_fp8.shape}")
    return dequantize_fp8(weight_fp8, scale, None, dtype)


def dequantize_tensor_fp8(weight_fp8: np.ndarray, scale: np.ndarray | float,
                          dtype: Any = np.float32) -> np.ndarray:
    """Per-tensor FP8: every element times the one ``scale`` (shape ``[]`` or ``[1]``)."""
    scale = np.asarray(scale, np.float32) if np.isscalar(scale) else np.asarray(scale)
    if scale.size != 1:
        raise CheckpointError(f"per-tensor scale of shape {scale.shape} holds {scale.size} "
                              "values, expected one")
    return dequantize_fp8(weight_fp8, scale.reshape(()), None, dtype)


# =========================================================================== quantize
def quantize_block_fp8(weight: np.ndarray, block: Block = DEFAULT_BLOCK,
                       fp8_dtype: Any = ml_dtypes.float8_e4m3fn) -> tuple[np.ndarray, np.ndarray]:
    """``(fp8 weight, scale_inv)`` of a float ``weight [..., out, in]``, as the official
    checkpoints are laid out (the tests' reference quantizer): per block, ``scale =
    max|w| / fp8_max`` (1 for an all-zero block) stored as ``scale_inv`` (float32), and the
    weight ``w / scale`` rounded to nearest-even FP8. Dequantizing multiplies by it back.
    ``block`` may exceed the weight (one scale for it all) or be ``(1, in)`` (per channel)."""
    weight = np.asarray(weight, np.float32)
    fp8_dtype = np.dtype(fp8_dtype)
    fp8_max = float(ml_dtypes.finfo(fp8_dtype).max)
    *lead, rows, cols = weight.shape
    grid = block_grid(weight.shape, block)
    pad = [(0, 0)] * len(lead) + [(0, grid[-2] * block[0] - rows), (0, grid[-1] * block[1] - cols)]
    tiles = np.pad(np.abs(weight), pad).reshape(*lead, grid[-2], block[0], grid[-1], block[1])
    amax = tiles.max(axis=(-3, -1))
    scale_inv = np.where(amax > 0, amax / np.float32(fp8_max), np.float32(1.0)).astype(np.float32)
    expanded = np.repeat(np.repeat(scale_inv, block[0], -2)[..., :rows, :], block[1],
                         -1)[..., :cols]
    quantized = np.clip(weight / expanded, -fp8_max, fp8_max).astype(fp8_dtype)
    return quantized, scale_inv

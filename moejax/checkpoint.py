"""Weights in and out of moejax: Hugging Face safetensors in, orbax checkpoints both ways.

The params pytree (the contract with the model code) is described in
``moejax.param_layout``: every layer stacked on a leading ``L`` axis and every matrix
stored ``[in, out]`` (the transpose of the ``[out, in]`` HF ``nn.Linear`` weight).

Reading goes through ``moejax.safetensors_io`` (a memory-mapped reader written from the
format description): each stacked param is allocated once and filled slice by slice, so
the host never holds a second full copy of the model.

Accepted HF spellings: per-expert ``mlp.experts.M.{gate,up,down}_proj.weight`` (qwen3_moe)
or ``block_sparse_moe.experts.M.{w1,w3,w2}.weight`` (mixtral), and the fused form transformers
5 holds in memory, ``experts.gate_up_proj [E, 2f, d]`` (gate rows first, then up) and
``experts.down_proj [E, d, f]``, both ``[out, in]`` per expert; Mixtral's MoE block may be
prefixed ``block_sparse_moe.`` or ``mlp.``.

FP8 checkpoints (config.json ``quantization_config.quant_method == "fp8"``: DeepSeek-V3/R1,
Kimi-K2, Qwen3 ``-FP8``): every tensor of the plan stored as ``F8_E4M3``/``F8_E5M2`` is paired
with its ``<name>_scale_inv`` (or ``<name>_scale``) and dequantized on load, tensor by tensor,
into the serving dtype (``moejax.fp8``); the other tensors load as they are. With
``weights_dtype="fp8"`` (:func:`load_model_dir`, :func:`fp8_kept_config`) the routed experts
are not dequantized: their FP8 values and block scales are written as they are stored
(transposed to ``[in, out]``) into the layout of ``moejax.fp8_experts``.

Strictness: a checkpoint tensor that no param consumes (say a ``shared_expert`` of a
Qwen2-MoE, or the scale of a weight that is not stored as FP8) means the checkpoint is not
the architecture the config describes, and dropping it would give silently wrong outputs, so
:func:`load_hf_params` raises :class:`CheckpointError` for it (``strict=False`` turns that
into a warning). Rotary ``inv_freq`` buffers, and ``lm_head.weight`` of a model with tied
embeddings, are ignored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import warnings
from typing import Any, Callable, Mapping

import numpy as np

from moejax import fp8
from moejax.config import MAX_CONFIG_BYTES, ModelConfig, load_config, regular_file_problem
from moejax.mla_shape import HF_TENSOR_NAMES, mla_param_shapes
from moejax.mxfp4 import dequantize_expert_tensor
from moejax.param_layout import EXPERT_KEYS, Params, param_shapes, shape_problems
# Re-exported so that callers need one module for checkpoint I/O.
from moejax.safetensors_io import (INDEX_FILE, SAFETENSORS_DTYPES, SINGLE_FILE,  # noqa: F401
                                   WEIGHT_CODES, CheckpointError, CheckpointReader,
                                   SafetensorsFile, read_safetensors_header, resolve_dtype,
                                   write_safetensors)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "config.json"
PARAMS_SUBDIR = "params"
# Written last by convert_checkpoint: its presence is what makes a directory "converted".
CONVERTED_MARKER = "moejax_checkpoint.json"
CONVERTED_FORMAT_VERSION = 1
# How the routed experts are held: "auto" dequantizes an FP8 checkpoint on load into the
# serving dtype (as every other checkpoint is held); "fp8" keeps them in FP8 with their
# block scales (moejax.fp8_experts).
WEIGHTS_DTYPES = ("auto", "fp8")
# Small side files of a HF directory that are worth carrying into a converted one.
_SIDE_FILES = ("tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


# Buffers some exporters store although they are computed from the config.
_IGNORABLE = (re.compile(r"(^|\.)rotary_emb\.inv_freq$"),)


# =========================================================================== HF -> params
def expected_param_shapes(cfg: ModelConfig) -> Params:
    """The params pytree of ``cfg`` with shape tuples as leaves (``moejax.param_layout``)."""
    return param_shapes(cfg)


Transform = Callable[[np.ndarray], np.ndarray]


def _same(a: np.ndarray) -> np.ndarray:
    return a


def _swap(a: np.ndarray) -> np.ndarray:
    """HF ``[..., out, in]`` -> moejax ``[..., in, out]`` (a view, no copy)."""
    return np.swapaxes(a, -1, -2)


@dataclasses.dataclass(frozen=True)
class _Write:
    key: tuple[str, ...]          # path in the params pytree, e.g. ("layers", "w_gate")
    index: tuple[int, ...]        # leading indices of the slice to fill, e.g. (layer, expert)
    transform: Transform          # HF tensor -> that slice
    # An FP8 expert kept in FP8: its block-scale grid -> the slice of the scale leaf, given
    # the checkpoint's (rows, cols) block. None: ``transform`` (axes swapped, nothing cut).
    scale_transform: Callable[[np.ndarray, tuple[int, int]], np.ndarray] | None = None


@dataclasses.dataclass(frozen=True)
class _Fp8Pair:
    """The tensors beside an FP8 weight: its scale, and static-activation ``input_scale``
    tensors that are read by nobody (moejax computes activations in the serving dtype,
    as transformers does when it dequantizes)."""

    scale: str
    unused: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Slot:
    """One HF tensor: its expected on-disk shape and the param slices it fills."""

    name: str
    shape: tuple[int, ...]
    writes: tuple[_Write, ...]
    # MXFP4 (GPT-OSS): ``name`` is the uint8 ``<kind>_blocks`` tensor, paired with the
    # scales tensor (kind, scales name, scales shape); dequantized on load
    # (``moejax.mxfp4.dequantize_expert_tensor``) before the writes see it.
    mxfp4: tuple[str, str, tuple[int, ...]] | None = None
    # FP8: ``name`` is stored F8_E4M3/F8_E5M2, dequantized with this pair's scale
    # (``moejax.fp8.dequantize_fp8``) before the writes see it (set by _pair_fp8_scales).
    fp8: _Fp8Pair | None = None

    @property
    def names(self) -> tuple[str, ...]:
        """The checkpoint tensors this slot reads (or, for input scales, accounts for)."""
        if self.mxfp4 is not None:
            return (self.name, self.mxfp4[1])
        if self.fp8 is not None:
            return (self.name, self.fp8.scale, *self.fp8.unused)
        return (self.name,)


def _moe_prefix(cfg: ModelConfig, layer: str, names: set[str]) -> str:
    """Mixtral checkpoints say ``block_sparse_moe``; transformers 5 in-memory names say ``mlp``."""
    candidates = ("block_sparse_moe", "mlp") if cfg.model_type == "mixtral" else ("mlp",)
    for candidate in candidates:
        if f"{layer}{candidate}.gate.weight" in names:
            return f"{layer}{candidate}."
    return f"{layer}{candidates[0]}."  # so a missing-tensor message names the usual form


def _expert_slots(cfg: ModelConfig, i: int, moe: str, names: set[str]) -> list[_Slot]:
    """Expert weights of layer ``i``, per expert or in the fused 3-D form (either per pair).

    Fused, as transformers 5 holds them in memory: ``experts.gate_up_proj [E, 2f, d]`` (rows
    ``:f`` gate, ``f:`` up, each ``[out, in]``) and ``experts.down_proj [E, d, f]``.
    """
    E, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate, up, down = ("w1", "w3", "w2") if cfg.model_type == "mixtral" else \
        ("gate_proj", "up_proj", "down_proj")
    slots = []
    fused_gate_up, fused_down = f"{moe}experts.gate_up_proj", f"{moe}experts.down_proj"
    if fused_gate_up in names:    # kept in FP8: the scale grid is cut f // block rows in
        slots.append(_Slot(fused_gate_up, (E, 2 * f, d), (
            _Write(("layers", "w_gate"), (i,), lambda a: _swap(a[:, :f]),
                   lambda s, block: _swap(s[:, :f // block[0]])),
            _Write(("layers", "w_up"), (i,), lambda a: _swap(a[:, f:]),
                   lambda s, block: _swap(s[:, f // block[0]:])))))
    else:
        for e in range(E):
            slots.append(_Slot(f"{moe}experts.{e}.{gate}.weight", (f, d),
                               (_Write(("layers", "w_gate"), (i, e), _swap),)))
            slots.append(_Slot(f"{moe}experts.{e}.{up}.weight", (f, d),
                               (_Write(("layers", "w_up"), (i, e), _swap),)))
    if fused_down in names:
        slots.append(_Slot(fused_down, (E, d, f), (_Write(("layers", "w_down"), (i,), _swap),)))
    else:
        for e in range(E):
            slots.append(_Slot(f"{moe}experts.{e}.{down}.weight", (d, f),
                               (_Write(("layers", "w_down"), (i, e), _swap),)))
    return slots


def _gpt_oss_expert_slots(cfg: ModelConfig, i: int, moe: str, names: set[str]) -> list[_Slot]:
    """GPT-OSS's experts of layer ``i``: ``experts.gate_up_proj [E, d, 2f]`` ([in, out],
    gate at the even output columns, up at the odd ones) and ``experts.down_proj
    [E, f, d]``, or their MXFP4 pairs ``<proj>_blocks``/``_scales`` (``[E, out, in/32,
    16]`` / ``[E, out, in/32]``); the biases ``gate_up_proj_bias [E, 2f]`` (interleaved
    alike) and ``down_proj_bias [E, d]``."""
    E, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    gate_up, down = f"{moe}experts.gate_up_proj", f"{moe}experts.down_proj"
    gate_up_writes = (_Write(("layers", "w_gate"), (i,), lambda a: a[..., ::2]),
                      _Write(("layers", "w_up"), (i,), lambda a: a[..., 1::2]))
    down_writes = (_Write(("layers", "w_down"), (i,), _same),)

    def matrix(name: str, kind: str, shape: tuple[int, ...], out: int, inner: int,
               writes: tuple[_Write, ...]) -> _Slot:
        if f"{name}_blocks" in names or f"{name}_scales" in names:
            groups = inner // 32 if inner % 32 == 0 else inner / 32   # a bad width: named
            return _Slot(f"{name}_blocks", (E, out, groups, 16), writes,
                         mxfp4=(kind, f"{name}_scales", (E, out, groups)))
        return _Slot(name, shape, writes)

    return [
        matrix(gate_up, "gate_up_proj", (E, d, 2 * f), 2 * f, d, gate_up_writes),
        _Slot(f"{gate_up}_bias", (E, 2 * f), (
            _Write(("layers", "b_gate"), (i,), lambda a: a[..., ::2]),
            _Write(("layers", "b_up"), (i,), lambda a: a[..., 1::2]))),
        matrix(down, "down_proj", (E, f, d), d, f, down_writes),
        _Slot(f"{down}_bias", (E, d), (_Write(("layers", "b_down"), (i,), _same),)),
    ]


def _attention_slots(cfg: ModelConfig, i: int) -> list[_Slot]:
    """Layer ``i``'s attention tensors: q/k/v/o (with biases, q/k norms) or MLA's."""
    d, h = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * h, cfg.num_kv_heads * h
    p = f"model.layers.{i}."

    def slot(name: str, shape: tuple[int, ...], key: str, transform: Transform) -> _Slot:
        return _Slot(p + name, shape, (_Write(("layers", key), (i,), transform),))

    if cfg.mla is not None:
        # HF names: moejax.mla_shape.HF_TENSOR_NAMES; matrices [out, in] on disk.
        return [slot(HF_TENSOR_NAMES[key], shape[::-1] if len(shape) == 2 else shape, key,
                     _swap if len(shape) == 2 else _same)
                for key, shape in mla_param_shapes(cfg.mla, d).items()]
    slots = [
        slot("self_attn.q_proj.weight", (q, d), "wq", _swap),
        slot("self_attn.k_proj.weight", (kv, d), "wk", _swap),
        slot("self_attn.v_proj.weight", (kv, d), "wv", _swap),
        slot("self_attn.o_proj.weight", (d, q), "wo", _swap),
    ]
    if cfg.qkv_bias:
        slots += [slot("self_attn.q_proj.bias", (q,), "bq", _same),
                  slot("self_attn.k_proj.bias", (kv,), "bk", _same),
                  slot("self_attn.v_proj.bias", (kv,), "bv", _same)]
    if cfg.o_bias:
        slots.append(slot("self_attn.o_proj.bias", (d,), "bo", _same))
    if cfg.attention_sinks:
        slots.append(slot("self_attn.sinks", (cfg.num_heads,), "sinks", _same))
    if cfg.qk_norm:
        q_norm, k_norm = ((q,), (kv,)) if cfg.qk_norm_over_heads else ((h,), (h,))
        slots.append(slot("self_attn.q_norm.weight", q_norm, "q_norm", _same))
        slots.append(slot("self_attn.k_norm.weight", k_norm, "k_norm", _same))
    return slots


def _mlp_slots(prefix: str, i: int, width: int, d: int) -> list[_Slot]:
    """A SwiGLU MLP ``{prefix}{gate,up,down}_proj`` of ``width`` into the first ``width``
    columns (rows of down) of the layer's resident MLP stack (the rest stays zero)."""
    cols = (i, slice(None), slice(0, width))
    rows = (i, slice(0, width), slice(None))
    return [_Slot(f"{prefix}gate_proj.weight", (width, d), (_Write(("layers", "mlp_gate"), cols, _swap),)),
            _Slot(f"{prefix}up_proj.weight", (width, d), (_Write(("layers", "mlp_up"), cols, _swap),)),
            _Slot(f"{prefix}down_proj.weight", (d, width), (_Write(("layers", "mlp_down"), rows, _swap),))]


def _shared_expert_prefix(cfg: ModelConfig, moe: str) -> str:
    return f"{moe}shared_expert." if cfg.model_type == "qwen2_moe" else f"{moe}shared_experts."


def _layer_slots(cfg: ModelConfig, i: int, names: set[str]) -> list[_Slot]:
    d, E = cfg.hidden_size, cfg.num_experts
    p = f"model.layers.{i}."
    slots = [
        _Slot(p + "input_layernorm.weight", (d,), (_Write(("layers", "attn_norm"), (i,), _same),)),
        _Slot(p + "post_attention_layernorm.weight", (d,),
              (_Write(("layers", "mlp_norm"), (i,), _same),)),
    ] + _attention_slots(cfg, i)
    moe = _moe_prefix(cfg, p, names)
    if i in cfg.dense_layers:
        # No router, no experts: those stay zero (the layer routes with weight 0).
        return slots + _mlp_slots(f"{p}mlp.", i, cfg.dense_intermediate_size, d)
    if cfg.model_type == "gpt_oss":
        return slots + [
            _Slot(f"{moe}router.weight", (E, d), (_Write(("layers", "router"), (i,), _swap),)),
            _Slot(f"{moe}router.bias", (E,), (_Write(("layers", "router_bias"), (i,), _same),)),
        ] + _gpt_oss_expert_slots(cfg, i, moe, names)
    slots.append(_Slot(f"{moe}gate.weight", (E, d), (_Write(("layers", "router"), (i,), _swap),)))
    if cfg.score_correction_bias:
        slots.append(_Slot(f"{moe}gate.e_score_correction_bias", (E,),
                           (_Write(("layers", "score_bias"), (i,), _same),)))
    if cfg.shared_intermediate_size:
        slots += _mlp_slots(_shared_expert_prefix(cfg, moe), i, cfg.shared_intermediate_size, d)
    if cfg.shared_expert_gate:
        slots.append(_Slot(f"{moe}shared_expert_gate.weight", (1, d),
                           (_Write(("layers", "shared_gate"), (i,), lambda a: a[0]),)))
    return slots + _expert_slots(cfg, i, moe, names)


LM_HEAD, SCORE_HEAD = "lm_head.weight", "score.weight"


def hf_tensor_plan(cfg: ModelConfig, names: set[str]) -> list[_Slot]:
    """Every HF tensor ``cfg`` needs, given the tensor ``names`` a checkpoint holds.

    ``names`` only chooses between equivalent spellings (fused or per-expert experts,
    ``block_sparse_moe`` or ``mlp``); what is missing is reported by :func:`load_hf_params`.
    """
    V, d = cfg.vocab_size, cfg.hidden_size
    slots = [_Slot("model.embed_tokens.weight", (V, d), (_Write(("embed",), (), _same),)),
             _Slot("model.norm.weight", (d,), (_Write(("final_norm",), (), _same),))]
    if cfg.num_labels:     # a sequence classifier: its score head instead of the LM head
        slots.append(_Slot(SCORE_HEAD, (cfg.num_labels, d), (_Write(("score",), (), _swap),)))
    elif not cfg.tie_word_embeddings:
        slots.append(_Slot(LM_HEAD, (V, d), (_Write(("lm_head",), (), _swap),)))
    for i in range(cfg.num_layers):
        slots.extend(_layer_slots(cfg, i, names))
    return slots


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    if cfg.tie_word_embeddings and name == "lm_head.weight":
        return True  # some exporters write the tied head anyway; the embedding is the truth
    return any(pattern.search(name) for pattern in _IGNORABLE)


def _listing(items: list[str], limit: int = 8) -> str:
    shown = "; ".join(items[:limit])
    return shown + (f"; ... and {len(items) - limit} more" if len(items) > limit else "")


def _head_hint(reader: CheckpointReader, cfg: ModelConfig) -> str:
    """What a checkpoint missing its output head holds instead (or that it holds neither)."""
    wanted = SCORE_HEAD if cfg.num_labels else LM_HEAD
    if wanted in reader.names or (cfg.tie_word_embeddings and not cfg.num_labels):
        return ""
    other = LM_HEAD if cfg.num_labels else SCORE_HEAD
    if other in reader.names:
        kind = ("a language model's head: config.json's architectures should not name a "
                "*ForSequenceClassification" if cfg.num_labels else
                "a sequence classifier's head: config.json's architectures should name its "
                "*ForSequenceClassification class")
        return f" (it holds {other}, {kind})"
    return (f" (it has neither {LM_HEAD}, a language model's head, nor {SCORE_HEAD}, a "
            f"sequence classifier's: no output head)")


@dataclasses.dataclass(frozen=True)
class _Wanted:
    """A tensor the plan reads: its expected shape (None: an FP8 scale, whose accepted
    shapes ``moejax.fp8.scale_layout`` decides), allowed dtype codes, and what it is for
    (said when it is missing; default: its shape)."""

    name: str
    shape: tuple[int, ...] | None
    codes: tuple[str, ...]
    role: str = ""


def _wanted(plan: list[_Slot]) -> list[_Wanted]:
    """Every tensor read: MXFP4 pairs are uint8 and FP8 weights F8_* with a float scale
    (both dequantized on load), every other weight a float."""
    out = []
    for s in plan:
        if s.mxfp4 is not None:
            out += [_Wanted(s.name, s.shape, ("U8",)), _Wanted(s.mxfp4[1], s.mxfp4[2], ("U8",))]
        elif s.fp8 is not None:
            out += [_Wanted(s.name, s.shape, tuple(fp8.FP8_CODES)),
                    _Wanted(s.fp8.scale, None, fp8.SCALE_CODES,
                            f"the scale of FP8 weight {s.name}")]
        else:
            out.append(_Wanted(s.name, s.shape, WEIGHT_CODES))
    return out


def _fp8_scale_problems(reader: CheckpointReader, plan: list[_Slot],
                        scheme: fp8.Fp8Scheme | None) -> list[str]:
    """Each FP8 scale whose shape fits none of its weight's accepted forms, named."""
    problems = []
    for s in plan:
        if s.fp8 is None or scheme is None:
            continue
        try:
            fp8.scale_layout(reader.info(s.name).shape, reader.info(s.fp8.scale).shape,
                             scheme.block, s.name, s.fp8.scale)
        except CheckpointError as exc:
            problems.append(str(exc))
    return problems


def _validate(reader: CheckpointReader, cfg: ModelConfig, plan: list[_Slot], strict: bool,
              scheme: fp8.Fp8Scheme | None = None) -> None:
    """Check names, shapes and dtypes before any data is read, and report all problems at once."""
    where = reader.model_dir
    wanted = _wanted(plan)
    missing = [f"{w.name} ({w.role or f'expected shape {w.shape}'})" for w in wanted
               if w.name not in reader.names]
    if missing:
        raise CheckpointError(f"{where}: checkpoint lacks {len(missing)} tensor(s) the config "
                              f"needs: missing {_listing(missing)}{_head_hint(reader, cfg)}")
    wrong = [f"{w.name}: expected shape {w.shape}, found {reader.info(w.name).shape}"
             for w in wanted if w.shape is not None and reader.info(w.name).shape != w.shape]
    wrong += _fp8_scale_problems(reader, plan, scheme)
    if wrong:
        raise CheckpointError(_listing(wrong) + f" (in {where})")
    unscaled = [f"{w.name} ({reader.info(w.name).dtype})" for w in wanted
                if w.codes == WEIGHT_CODES and reader.info(w.name).dtype in fp8.FP8_CODES]
    if unscaled:
        raise CheckpointError(f"{where}: {_listing(unscaled)} stored as FP8, but "
                              f"{CONFIG_FILE} has no quantization_config with quant_method "
                              "'fp8' to say how its scales apply")
    bad_dtype = [f"{w.name} ({reader.info(w.name).dtype})"
                 + ("" if w.codes == WEIGHT_CODES else f", expected {'/'.join(w.codes)}")
                 for w in wanted if reader.info(w.name).dtype not in w.codes]
    if bad_dtype:
        raise CheckpointError(f"{where}: moejax loads F16/BF16/F32 weights, FP8 weights with "
                              "their scales (quant_method 'fp8') and GPT-OSS's MXFP4 expert "
                              f"pairs as uint8; other quantized formats are not supported: "
                              f"{_listing(bad_dtype)}")
    used = {name for s in plan for name in s.names}
    extra = sorted(n for n in reader.names - used if not _ignorable(n, cfg))
    if extra:
        message = (f"{where}: checkpoint has {len(extra)} tensor(s) the {cfg.model_type} config "
                   f"does not use (wrong config or unsupported architecture?): {_listing(extra)}")
        if strict:
            raise CheckpointError(message)
        warnings.warn(message, stacklevel=3)


# =========================================================================== FP8
def read_fp8_scheme(model_dir: str | os.PathLike) -> fp8.Fp8Scheme | None:
    """The FP8 ``quantization_config`` of ``model_dir/config.json`` (``moejax.fp8``), or
    None: no config.json, no quantization_config, or another method. The file gets the
    checks :func:`moejax.config.load_config` gives it (regular file, size bound)."""
    path = os.path.join(os.fspath(model_dir), CONFIG_FILE)
    if not os.path.exists(path):
        return None
    problem = regular_file_problem(path)
    if problem or os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise CheckpointError(f"{path}: {problem or 'larger than a model config may be'}")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        return None
    return fp8.scheme_from_config(data.get("quantization_config"), path)


def _pair_fp8_scales(reader: CheckpointReader, plan: list[_Slot],
                     scheme: fp8.Fp8Scheme | None) -> list[_Slot]:
    """``plan`` with every tensor stored as FP8 paired with its scale (as MXFP4 pairs
    blocks with scales). Without an FP8 scheme nothing is paired (:func:`_validate` then
    refuses the FP8 tensors by name). An FP8 weight in a module the scheme leaves
    unconverted (``modules_to_not_convert``) is refused: the config and the tensors
    disagree about what was quantized."""
    if scheme is None:
        return plan
    out = []
    for slot in plan:
        if (slot.mxfp4 is not None or slot.name not in reader.names
                or reader.info(slot.name).dtype not in fp8.FP8_CODES):
            out.append(slot)
            continue
        pattern = fp8.not_converted_pattern(slot.name, scheme.not_converted)
        if pattern is not None:
            raise CheckpointError(f"{reader.model_dir}: {slot.name} is stored as "
                                  f"{reader.info(slot.name).dtype}, but quantization_config."
                                  f"{scheme.not_converted_field} lists its module "
                                  f"({pattern!r})")
        input_scale = f"{fp8.module_of(slot.name)}.input_scale"
        unused = (input_scale,) if input_scale in reader.names else ()
        out.append(dataclasses.replace(
            slot, fp8=_Fp8Pair(fp8.scale_name_of(slot.name, reader.names), unused)))
    return out


# Layer and expert indices in checkpoint names: ``model.layers.I.``, per-expert
# ``model.layers.I.{mlp,block_sparse_moe}.experts.E.`` and the fused stacks whose first
# axis is the experts (``experts.gate_up_proj`` [E, ...], GPT-OSS's ``_blocks`` too).
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_INDEX = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
_FUSED_EXPERTS = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\."
                            r"(?:gate_up_proj|down_proj)(?:_blocks|_scales|_bias)?$")


def _checkpoint_layers(names: set[str]) -> int:
    """Layers the checkpoint holds tensors for: the highest ``model.layers.I`` + 1."""
    return max((int(m.group(1)) + 1 for m in map(_LAYER_INDEX.match, names) if m), default=0)


def _checkpoint_experts(reader: CheckpointReader) -> tuple[int | None, str]:
    """(experts per layer in the checkpoint, the tensor it was read from); (None, "") for
    a checkpoint without expert tensors. Per-expert names: the highest index + 1; fused
    stacks: their first axis (the largest, should layers disagree: one is then named)."""
    per_expert = [(int(m.group(1)) + 1, m.string) for m in map(_EXPERT_INDEX.match, reader.names)
                  if m]
    if per_expert:
        return max(per_expert)
    fused = [(reader.info(name).shape[0], name) for name in reader.names
             if _FUSED_EXPERTS.match(name) and reader.info(name).shape]
    return max(fused) if fused else (None, "")


def check_counts_against_checkpoint(reader: CheckpointReader, cfg: ModelConfig) -> None:
    """Refuse a config that asks for more layers or experts than the checkpoint holds,
    before the per-layer, per-expert tensor plan is built from those counts (a corrupt
    ``"num_experts": 1000000000`` once grew that plan for minutes). Reads names and
    header shapes only. Fewer than the checkpoint holds is left to :func:`_validate`,
    which names the tensors no param uses (or, with ``strict=False``, warns)."""
    where = os.path.join(reader.model_dir, CONFIG_FILE)
    layers = _checkpoint_layers(reader.names)
    if cfg.num_layers > layers:
        raise CheckpointError(f"{where}: num_hidden_layers is {cfg.num_layers}, but the "
                              f"checkpoint in {reader.model_dir} holds tensors for {layers} "
                              f"layer(s) (model.layers.0 to model.layers.{layers - 1})"
                              if layers else
                              f"{where}: num_hidden_layers is {cfg.num_layers}, but the "
                              f"checkpoint in {reader.model_dir} holds no model.layers.* "
                              f"tensors")
    if not cfg.moe_layers:
        return
    experts, source = _checkpoint_experts(reader)
    if experts is None:
        raise CheckpointError(f"{where}: the config has {cfg.num_experts} experts per MoE "
                              f"layer, but the checkpoint in {reader.model_dir} holds no "
                              f"expert tensors (neither experts.N.* nor fused experts.*_proj)")
    if cfg.num_experts > experts:
        raise CheckpointError(f"{where}: the config has {cfg.num_experts} experts per MoE "
                              f"layer, but the checkpoint in {reader.model_dir} holds "
                              f"{experts} (from {source})")


def _allocate(shapes: Any, dtype: np.dtype, kept: Mapping[str, np.dtype] | None = None) -> Any:
    # Zeroed: the parts no tensor fills (a dense layer's experts and router, the padding
    # of the resident MLP stack) must be 0. np.zeros maps untouched pages lazily.
    # ``kept``: leaves of another dtype (FP8 experts and their scales) by name.
    if isinstance(shapes, dict):
        return {key: (np.zeros(value, kept[key]) if kept and key in kept
                      else _allocate(value, dtype, kept)) for key, value in shapes.items()}
    return np.zeros(shapes, dtype)


def load_hf_params(model_dir: str | os.PathLike, cfg: ModelConfig,
                   dtype: str | np.dtype = "float32", *, strict: bool = True) -> Params:
    """Load a HF safetensors checkpoint into the moejax params layout (numpy, ``dtype``).

    Each stacked param is allocated once and filled from the memory-mapped tensors, so peak
    host memory is one copy of the params (plus page cache); quantized tensors (FP8, MXFP4)
    add one dequantized tensor at a time. Raises :class:`CheckpointError` naming the tensor
    for missing tensors (an FP8 weight's scale too), wrong shapes (a scale's too), non-float
    weights (FP8 ones without an FP8 quantization_config among them), and (with
    ``strict``, the default; otherwise a warning) tensors the config does not use; and,
    before any of that is planned, a layer or expert count that is not the checkpoint's
    (:func:`check_counts_against_checkpoint`).
    """
    target = resolve_dtype(dtype)
    reader = CheckpointReader(model_dir)
    scheme = read_fp8_scheme(model_dir)
    check_counts_against_checkpoint(reader, cfg)
    plan = _pair_fp8_scales(reader, hf_tensor_plan(cfg, reader.names), scheme)
    _validate(reader, cfg, plan, strict, scheme)
    kept = None
    if cfg.expert_fp8_block is not None:      # weights_dtype="fp8": see fp8_kept_config
        _check_fp8_kept(reader, cfg, plan, scheme)
        kept = {**{k: fp8.FP8_CODES["F8_E4M3"] for k in EXPERT_KEYS},
                **{f"{k}_scale": np.dtype(np.float32) for k in EXPERT_KEYS}}
    params = _allocate(expected_param_shapes(cfg), target, kept)
    for slot in plan:
        source = reader.get(slot.name)
        if kept and _is_expert_slot(slot):     # FP8 values and block scales as stored
            _write_fp8_kept(params, slot, source, reader.get(slot.fp8.scale), scheme.block)
            continue
        if slot.mxfp4 is not None:     # one tensor at a time, straight to [E, in, out]
            kind, scales, _ = slot.mxfp4
            source = dequantize_expert_tensor(kind, np.ascontiguousarray(source),
                                              np.ascontiguousarray(reader.get(scales)),
                                              dtype=target, name=slot.name)
        elif slot.fp8 is not None:     # one tensor at a time, in the serving dtype
            source = fp8.dequantize_fp8(source, reader.get(slot.fp8.scale), scheme.block,
                                        target, name=slot.name, scale_name=slot.fp8.scale)
        for write in slot.writes:
            leaf = params
            for key in write.key:
                leaf = leaf[key]
            leaf[write.index] = write.transform(source)  # numpy casts to ``target`` here
    return params


# =========================================================================== FP8 kept
def _is_expert_slot(slot: _Slot) -> bool:
    """Whether ``slot`` fills the routed experts' matrices (``w_gate``/``w_up``/``w_down``)."""
    return any(write.key in _EXPERT_PATHS for write in slot.writes)


_EXPERT_PATHS = frozenset(("layers", name) for name in EXPERT_KEYS)


def fp8_kept_config(model_dir: str | os.PathLike, cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with the routed experts kept in FP8 (``weights_dtype="fp8"``): its
    ``expert_fp8_block`` is the checkpoint's ``weight_block_size`` (rows, cols of the
    ``[out, in]`` tensors) as moejax's (in, out). CheckpointError naming the directory
    when there is nothing to keep that way: no FP8 quantization_config, per-tensor or
    per-channel scales, experts with biases (GPT-OSS)."""
    where = os.fspath(model_dir)
    scheme = read_fp8_scheme(model_dir)
    if scheme is None:
        raise CheckpointError(f"{where}: weights_dtype='fp8' keeps an FP8 checkpoint's expert "
                              f"weights in FP8, but this checkpoint is not FP8 ({CONFIG_FILE} "
                              "has no quantization_config with quant_method 'fp8'): nothing "
                              "to keep; use weights_dtype='auto'")
    if scheme.block is None:
        raise CheckpointError(f"{where}: weights_dtype='fp8' keeps block-scaled FP8 experts; "
                              "this checkpoint's quantization_config.weight_block_size is null "
                              "(per-tensor or per-channel scales); use weights_dtype='auto'")
    if cfg.expert_bias or cfg.swiglu_limit is not None:
        raise CheckpointError(f"{where}: weights_dtype='fp8' does not serve {cfg.model_type} "
                              "experts (expert biases, clamped SwiGLU); use "
                              "weights_dtype='auto'")
    return dataclasses.replace(cfg, expert_fp8_block=(scheme.block[1], scheme.block[0]))


def _check_fp8_kept(reader: CheckpointReader, cfg: ModelConfig, plan: list[_Slot],
                    scheme: fp8.Fp8Scheme | None) -> None:
    """Every routed-expert tensor of ``plan`` must be stored F8_E4M3 with block scales of
    ``cfg.expert_fp8_block`` (a fused gate/up stack cut between two blocks, too): refused
    otherwise, naming the tensors."""
    block = None if scheme is None else scheme.block
    if block is None or (block[1], block[0]) != cfg.expert_fp8_block:
        raise CheckpointError(f"{reader.model_dir}: the config keeps experts in FP8 with "
                              f"{cfg.expert_fp8_block} (in, out) blocks, but the checkpoint's "
                              f"weight_block_size is {block}")
    problems = []
    for slot in plan:
        if not _is_expert_slot(slot):
            continue
        stored = reader.info(slot.name).dtype
        if slot.fp8 is None or stored != "F8_E4M3":
            problems.append(f"{slot.name} is stored as {stored}, not F8_E4M3")
            continue
        layout = fp8.scale_layout(reader.info(slot.name).shape,
                                  reader.info(slot.fp8.scale).shape, block, slot.name,
                                  slot.fp8.scale)
        if layout.kind != "block":
            problems.append(f"{slot.fp8.scale} holds {layout.describe()}, not "
                            f"{block[0]}x{block[1]} block scales")
        elif slot.name.endswith("experts.gate_up_proj") and cfg.moe_intermediate_size % block[0]:
            problems.append(f"{slot.name}: its gate and up rows meet inside a {block[0]}-row "
                            f"scale block (moe_intermediate_size {cfg.moe_intermediate_size})")
    if problems:
        raise CheckpointError(f"{reader.model_dir}: weights_dtype='fp8' keeps every routed "
                              f"expert in FP8 (F8_E4M3 with block scales): {_listing(problems)}; "
                              "use weights_dtype='auto'")


def _write_fp8_kept(params: Params, slot: _Slot, values: np.ndarray, scale: np.ndarray,
                    block: tuple[int, int]) -> None:
    """An expert tensor's FP8 values into its param slices, and its block scales (as
    float32) into the ``*_scale`` leaves, both turned to ``[in, out]``."""
    scale = np.asarray(scale, np.float32)
    layers = params["layers"]
    for write in slot.writes:
        name = write.key[-1]
        layers[name][write.index] = write.transform(values)
        to_scale = write.scale_transform or (lambda s, _block, w=write: w.transform(s))
        layers[f"{name}_scale"][write.index] = to_scale(scale, block)


# =========================================================================== orbax
def _tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    if isinstance(tree, Mapping):
        return {key: _tree_map(fn, value) for key, value in tree.items()}
    return fn(tree)


def save_params(params: Params, out_dir: str | os.PathLike, *, overwrite: bool = False) -> str:
    """Save a params pytree (numpy or jax arrays) as an orbax checkpoint at ``out_dir``."""
    import orbax.checkpoint as ocp  # imported here: pulls in jax, which readers do not need

    path = os.path.abspath(os.fspath(out_dir))  # orbax insists on absolute paths
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(path, params, force=overwrite)
        checkpointer.wait_until_finished()  # StandardCheckpointer saves asynchronously
    finally:
        checkpointer.close()
    return path


def restore_params(out_dir: str | os.PathLike, dtype: str | np.dtype | None = None) -> Params:
    """Restore a :func:`save_params` checkpoint as numpy arrays, cast to ``dtype`` while reading
    (``None`` keeps the saved dtypes). Shapes are those saved."""
    import orbax.checkpoint as ocp

    path = os.path.abspath(os.fspath(out_dir))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no orbax checkpoint at {path}")
    target_dtype = None if dtype is None else resolve_dtype(dtype)
    checkpointer = ocp.StandardCheckpointer()
    try:
        metadata = checkpointer.metadata(path)
        tree = getattr(getattr(metadata, "item_metadata", metadata), "tree", metadata)
        # numpy leaves ask orbax for numpy results (jax arrays would land on one device);
        # broadcast zero-stride placeholders carry shape and dtype without allocating.
        target = _tree_map(lambda m: np.broadcast_to(
            np.zeros((), m.dtype if target_dtype is None else target_dtype), tuple(m.shape)),
            tree)
        return checkpointer.restore(path, target)
    finally:
        checkpointer.close()


# =========================================================================== model dirs
def load_model_config(model_dir: str | os.PathLike) -> ModelConfig:
    """``load_config`` of a model directory, with the file named when it cannot be read:
    ``json``'s own message ("Expecting value: line 2 column 1") names only a position.
    Raises :class:`CheckpointError` (a ValueError)."""
    path = os.fspath(model_dir)
    file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    try:
        return load_config(path)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{file}: invalid JSON: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{file}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} "
                              f"at offset {exc.start})") from None
    except RecursionError:
        raise CheckpointError(f"{file}: invalid JSON: nested too deeply") from None


def load_tokenizer(model_dir: str | os.PathLike):
    """``tokenizers.Tokenizer`` from ``model_dir/tokenizer.json`` (or that file's path).

    A file that ``tokenizers`` cannot read raises :class:`CheckpointError` naming it (the
    library's own exception is a bare ``Exception`` with a position but no file name)."""
    from tokenizers import Tokenizer

    path = os.fspath(model_dir)
    if os.path.isdir(path) or not path.endswith(".json"):
        path = os.path.join(path, TOKENIZER_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no tokenizer at {path}: moejax needs a Hugging Face "
                                "'tokenizers' JSON file (tokenizer.json) next to config.json")
    problem = regular_file_problem(path)   # a FIFO would block the reader for ever
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - tokenizers raises plain Exception
        raise CheckpointError(f"{path}: not a valid Hugging Face tokenizer file: "
                              f"{exc}") from None


def is_converted_dir(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a finished :func:`convert_checkpoint` output."""
    path = os.fspath(path)
    return (os.path.isfile(os.path.join(path, CONVERTED_MARKER))
            and os.path.isfile(os.path.join(path, CONFIG_FILE))
            and os.path.isdir(os.path.join(path, PARAMS_SUBDIR)))


def convert_checkpoint(model_dir: str | os.PathLike, out_dir: str | os.PathLike,
                       dtype: str | np.dtype = "bfloat16", *, overwrite: bool = False) -> str:
    """Convert a HF model directory once into ``out_dir`` (config.json, tokenizer.json, params/).

    ``model_dir`` is a directory (resolve a built-in model's name first with
    :func:`moejax.model_dirs.resolve_model_dir`, as ``moejax convert`` does). The output is
    built in a temporary sibling directory and renamed into place, so an interrupted
    conversion never leaves a directory that :func:`is_converted_dir` accepts. Returns the
    absolute ``out_dir``.
    """
    model_dir = os.fspath(model_dir)
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    target = resolve_dtype(dtype)
    cfg = load_model_config(model_dir)
    tokenizer_path = os.path.join(model_dir, TOKENIZER_FILE)
    load_tokenizer(model_dir)  # fail before the expensive part if it is missing or broken
    params = load_hf_params(model_dir, cfg, target)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.tmp-", dir=parent)
    try:
        shutil.copyfile(os.path.join(model_dir, CONFIG_FILE), os.path.join(tmp, CONFIG_FILE))
        shutil.copyfile(tokenizer_path, os.path.join(tmp, TOKENIZER_FILE))
        for name in _SIDE_FILES:
            if os.path.isfile(os.path.join(model_dir, name)):
                shutil.copyfile(os.path.join(model_dir, name), os.path.join(tmp, name))
        save_params(params, os.path.join(tmp, PARAMS_SUBDIR))
        with open(os.path.join(tmp, CONVERTED_MARKER), "w", encoding="utf-8") as fh:
            json.dump({"format_version": CONVERTED_FORMAT_VERSION, "dtype": target.name,
                       "source": os.path.abspath(model_dir)}, fh, indent=2)
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only
        if os.path.exists(out_dir):  # overwrite=True
            shutil.rmtree(out_dir)
        os.rename(tmp, out_dir)
    finally:
        if os.path.exists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def stored_weights(model_dir: str | os.PathLike) -> dict[str, Any]:
    """What a model directory stores, for ``moejax info``: ``dtype`` (FP8 weights with their
    scales' layout, "float8_e4m3fn, 128x128 block scales"; GPT-OSS's MXFP4 experts; else the
    dtype holding the most bytes), ``bytes`` and ``bytes_by_dtype`` (largest first). Read
    from the safetensors headers alone; a converted directory reports its params' dtype and
    the bytes of its params files."""
    path = os.fspath(model_dir)
    if is_converted_dir(path):
        with open(os.path.join(path, CONVERTED_MARKER), encoding="utf-8") as fh:
            dtype = str(json.load(fh).get("dtype"))
        params_dir = os.path.join(path, PARAMS_SUBDIR)
        total = sum(os.path.getsize(os.path.join(root, f))
                    for root, _, files in os.walk(params_dir) for f in files)
        return {"dtype": f"{dtype} (converted)", "bytes": total, "bytes_by_dtype": {dtype: total}}
    reader = CheckpointReader(path)
    by_dtype: dict[str, int] = {}
    for name in reader.names:
        info = reader.info(name)
        key = SAFETENSORS_DTYPES[info.dtype].name
        by_dtype[key] = by_dtype.get(key, 0) + info.end - info.start
    by_dtype = dict(sorted(by_dtype.items(), key=lambda item: -item[1]))
    return {"dtype": _stored_dtype(reader, read_fp8_scheme(path), by_dtype),
            "bytes": sum(by_dtype.values()), "bytes_by_dtype": by_dtype}


def _stored_dtype(reader: CheckpointReader, scheme: fp8.Fp8Scheme | None,
                  by_dtype: dict[str, int]) -> str:
    """The words for what the weights are stored as (see :func:`stored_weights`)."""
    quantized = sorted(n for n in reader.names if reader.info(n).dtype in fp8.FP8_CODES)
    if quantized:
        dtypes = sorted({SAFETENSORS_DTYPES[reader.info(n).dtype].name for n in quantized})
        layouts = set()
        for name in quantized:
            scale = fp8.scale_name_of(name, reader.names)
            if scale in reader.names:
                layouts.add(fp8.scale_layout(reader.info(name).shape, reader.info(scale).shape,
                                             scheme.block if scheme else None, name,
                                             scale).describe())
        return ", ".join(dtypes + sorted(layouts))
    if any(n.endswith("_blocks") and reader.info(n).dtype == "U8" for n in reader.names):
        floats = [d for d in by_dtype if d != "uint8"]
        return "mxfp4 experts (uint8 blocks, E8M0 scales)" + (f", other weights {floats[0]}"
                                                              if floats else "")
    return next(iter(by_dtype), "none")


def _check_shapes(params: Params, cfg: ModelConfig, where: str) -> None:
    problems = shape_problems(params, cfg)
    if problems:
        raise CheckpointError(f"{where}: params do not match config.json: {_listing(problems)}")


def load_model_dir(path: str | os.PathLike, dtype: str | np.dtype = "float32",
                   weights_dtype: str = "auto"):
    """``(cfg, params, tokenizer)`` from a HF model directory or a converted one.

    ``params`` are numpy arrays of ``dtype`` in the layout of the module docstring.
    ``weights_dtype`` (:data:`WEIGHTS_DTYPES`): "fp8" keeps an FP8 checkpoint's routed
    experts in FP8 with their block scales (``cfg.expert_fp8_block`` set; see
    :func:`fp8_kept_config` for what is refused).
    """
    path = os.fspath(path)
    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no model directory at {path}")
    cfg = load_model_config(path)
    tokenizer = load_tokenizer(path)
    if weights_dtype == "fp8":
        if is_converted_dir(path):
            raise CheckpointError(f"{path}: weights_dtype='fp8' keeps the expert weights of "
                                  "an FP8 Hugging Face checkpoint; a converted directory holds "
                                  "dequantized params (serve the FP8 checkpoint itself)")
        cfg = fp8_kept_config(path, cfg)
    if is_converted_dir(path):
        params = restore_params(os.path.join(path, PARAMS_SUBDIR), dtype)
        _check_shapes(params, cfg, path)
    else:
        params = load_hf_params(path, cfg, dtype)
    return cfg, params, tokenizer

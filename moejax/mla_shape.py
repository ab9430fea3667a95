"""The shape of a Multi-head Latent Attention layer (DeepSeek-V2/V3), read from a config.

No JAX import: ``moejax.config`` builds an :class:`MLAShape` when it reads a DeepSeek
``config.json``; the math is in ``moejax.mla``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# Our name -> the tensor under ``model.layers.{i}.`` (matrices stored transposed here).
HF_TENSOR_NAMES = {
    "wq": "self_attn.q_proj.weight",
    "wq_a": "self_attn.q_a_proj.weight",
    "q_a_norm": "self_attn.q_a_layernorm.weight",
    "wq_b": "self_attn.q_b_proj.weight",
    "wkv_a": "self_attn.kv_a_proj_with_mqa.weight",
    "kv_a_norm": "self_attn.kv_a_layernorm.weight",
    "wkv_b": "self_attn.kv_b_proj.weight",
    "wo": "self_attn.o_proj.weight",
}


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN rope scaling (``rope_type: yarn``), as transformers' ``_compute_yarn_parameters``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None   # explicit cos/sin factor (else from the mscales)
    truncate: bool = True                   # floor/ceil the correction range


@dataclasses.dataclass(frozen=True)
class MLAShape:
    """Shape and rotary settings of one MLA layer (see :func:`mla_shape_from_hf`)."""

    n_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    yarn: YarnScaling | None = None

    def __post_init__(self) -> None:
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def yarn_scaling(rope: Mapping[str, Any], hf: Mapping[str, Any]) -> YarnScaling:
    """The :class:`YarnScaling` of a ``rope_type: yarn`` block ``rope`` of config ``hf``."""
    return YarnScaling(
        factor=float(rope["factor"]),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings")
                                             or hf["max_position_embeddings"]),
        beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
        attention_factor=rope.get("attention_factor"), truncate=rope.get("truncate", True))


def mla_shape_from_hf(hf: Mapping[str, Any]) -> MLAShape:
    """An :class:`MLAShape` from a ``deepseek_v2`` / ``deepseek_v3`` config dict (config.json
    or ``PretrainedConfig.to_dict()``): ``rope_parameters`` (transformers 5) or
    ``rope_theta`` + ``rope_scaling`` (4.x and the released checkpoints)."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if rope_type not in ("default", "yarn"):
        raise ValueError(f"unsupported rope type for MLA: {rope_type!r}")
    yarn = yarn_scaling(rope, hf) if rope_type == "yarn" else None
    # V2 always rotates interleaved pairs (complex form); V3 has a switch, default on.
    interleave = hf.get("model_type") == "deepseek_v2" or bool(hf.get("rope_interleave", True))
    return MLAShape(n_heads=int(hf["num_attention_heads"]), q_lora_rank=hf.get("q_lora_rank"),
                    kv_lora_rank=int(hf["kv_lora_rank"]), qk_nope_head_dim=int(hf["qk_nope_head_dim"]),
                    qk_rope_head_dim=int(hf["qk_rope_head_dim"]), v_head_dim=int(hf["v_head_dim"]),
                    rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), rope_theta=float(theta),
                    rope_interleave=interleave, yarn=yarn)


def mla_param_shapes(shape: MLAShape, hidden_size: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of one layer's MLA params (no leading L axis); ``wq`` replaces
    ``wq_a``/``q_a_norm``/``wq_b`` when there is no query LoRA (DeepSeek-V2-Lite)."""
    d, heads, qk = hidden_size, shape.n_heads, shape.qk_head_dim
    if shape.q_lora_rank is None:
        out: dict[str, tuple[int, ...]] = {"wq": (d, heads * qk)}
    else:
        r = shape.q_lora_rank
        out = {"wq_a": (d, r), "q_a_norm": (r,), "wq_b": (r, heads * qk)}
    out["wkv_a"] = (d, shape.kv_lora_rank + shape.qk_rope_head_dim)
    out["kv_a_norm"] = (shape.kv_lora_rank,)
    out["wkv_b"] = (shape.kv_lora_rank, heads * (shape.qk_nope_head_dim + shape.v_head_dim))
    out["wo"] = (heads * shape.v_head_dim, d)
    return out

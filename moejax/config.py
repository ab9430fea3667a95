"""Model configuration read from a Hugging Face ``config.json`` (or a YAML shape
file in ``configs/models/``), plus the FLOP accounting of DESIGN.md.

The FLOP model is what the scheduler charges requests with and what MFU is
measured against, so it counts *useful* work only: the k routed experts of a
token (not the E a dense product would touch), attention over the keys a token
actually sees, and the LM head only at scoring positions.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral")


class ConfigError(ValueError):
    """A model config that moejax cannot serve, with the reason."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one MoE decoder.

    Attributes use the notation of DESIGN.md: d = hidden_size, L = num_layers,
    n_q / n_kv = query / key-value heads, h = head_dim, E = num_experts,
    k = num_experts_per_tok, f = moe_intermediate_size, V = vocab_size.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    qk_norm: bool
    rms_norm_eps: float
    rope_theta: float
    max_context: int
    tie_word_embeddings: bool

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "max_context")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(_unsupported_type_message(self.model_type))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                              f"num_key_value_heads ({self.num_kv_heads})")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                              f"number of experts ({self.num_experts})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")

    # ----------------------------------------------------------------- FLOPs
    @property
    def linear_flops_per_layer(self) -> int:
        """Forward FLOPs of one token through one layer's matmuls (no attention scores).

        q/k/v projections + output projection + router + k routed SwiGLU experts.
        """
        d, h = self.hidden_size, self.head_dim
        qkv = 2 * d * (self.num_heads * h + 2 * self.num_kv_heads * h)
        out = 2 * self.num_heads * h * d
        router = 2 * d * self.num_experts
        experts = self.num_experts_per_tok * 6 * d * self.moe_intermediate_size
        return qkv + out + router + experts

    @property
    def linear_flops_per_token(self) -> int:
        """F_lin: one token through every layer's matmuls."""
        return self.num_layers * self.linear_flops_per_layer

    def attention_flops(self, context: int) -> int:
        """F_att(c): one token attending over ``context`` keys in every layer (QK^T and PV)."""
        return self.num_layers * 4 * self.num_heads * self.head_dim * context

    def attention_flops_range(self, first: int, last: int) -> int:
        """Σ_{i=first..last} F_att(i), in closed form (0 when last < first)."""
        if last < first:
            return 0
        count = last - first + 1
        return self.num_layers * 4 * self.num_heads * self.head_dim * (first + last) * count // 2

    def head_flops(self, num_candidates: int | None = None) -> int:
        """F_head at one scoring position: full vocabulary, or only ``num_candidates`` columns."""
        columns = self.vocab_size if num_candidates is None else num_candidates
        return 2 * self.hidden_size * columns

    def request_flops(self, prefix: int, suffix: int = 0, cached: int = 0,
                      scoring_positions: int = 1, num_candidates: int | None = None) -> int:
        """ΔW of seed Eq. (2): a request with ``prefix`` + ``suffix`` tokens on an engine that
        already holds ``cached`` prefix tokens (0 ≤ cached ≤ prefix)."""
        if not 0 <= cached <= prefix:
            raise ValueError(f"cached ({cached}) must lie in [0, prefix={prefix}]")
        if suffix < 0:
            raise ValueError(f"suffix must be >= 0, got {suffix}")
        f_lin = self.linear_flops_per_token
        prefix_work = (prefix - cached) * f_lin + self.attention_flops_range(cached + 1, prefix)
        suffix_work = suffix * f_lin + self.attention_flops_range(prefix + 1, prefix + suffix)
        return prefix_work + suffix_work + scoring_positions * self.head_flops(num_candidates)

    def sequence_flops(self, length: int, scoring_positions: int = 1,
                       num_candidates: int | None = None) -> int:
        """Useful FLOPs of one packed sequence of ``length`` tokens (causal attention)."""
        return self.request_flops(length, 0, 0, scoring_positions, num_candidates)

    # ----------------------------------------------------------------- bytes
    def expert_bytes_per_layer(self, bytes_per_param: int) -> int:
        """Bytes of one layer's routed experts (gate, up, down for all E experts)."""
        return 3 * self.num_experts * self.hidden_size * self.moe_intermediate_size * bytes_per_param

    def num_params(self) -> int:
        d, h, L = self.hidden_size, self.head_dim, self.num_layers
        attn = d * h * (2 * self.num_heads + 2 * self.num_kv_heads)
        norms = 2 * d + (2 * h if self.qk_norm else 0)
        moe = d * self.num_experts + 3 * self.num_experts * d * self.moe_intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * d
        return self.vocab_size * d + L * (attn + norms + moe) + d + head

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _unsupported_type_message(model_type: Any) -> str:
    return (f"unsupported model_type {model_type!r}: moejax supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}")


def _rope_theta(hf: Mapping[str, Any]) -> float:
    """transformers 5.x writes ``rope_parameters``; 4.x wrote ``rope_theta`` / ``rope_scaling``."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for block in (params, scaling):
        rope_type = block.get("rope_type", block.get("type", "default"))
        if rope_type not in (None, "default"):
            raise ConfigError(f"rope type {rope_type!r} is not supported (only default RoPE)")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


def _require(hf: Mapping[str, Any], *names: str) -> Any:
    for name in names:
        if name in hf and hf[name] is not None:
            return hf[name]
    raise ConfigError(f"config.json lacks {' / '.join(names)}")


def from_hf_dict(hf: Mapping[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the contents of a Hugging Face ``config.json``."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(_unsupported_type_message(model_type))
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
    if hf.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported")
    num_layers = int(_require(hf, "num_hidden_layers"))
    if model_type == "qwen3_moe":
        dense = list(hf.get("mlp_only_layers") or [])
        step = int(hf.get("decoder_sparse_step", 1) or 1)
        if dense or step != 1:
            raise ConfigError("qwen3_moe with dense layers (mlp_only_layers / "
                              "decoder_sparse_step != 1) is not supported: every layer must be MoE")
        num_experts = _require(hf, "num_experts", "num_local_experts")
        intermediate = _require(hf, "moe_intermediate_size")
        norm_topk = bool(hf.get("norm_topk_prob", False))
        qk_norm = True
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    else:  # mixtral: softmax over the top-k logits == renormalised top-k of the full softmax
        num_experts = _require(hf, "num_local_experts", "num_experts")
        intermediate = _require(hf, "intermediate_size")
        norm_topk = True
        qk_norm = False
        sliding = hf.get("sliding_window")
    hidden = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    head_dim = hf.get("head_dim") or hidden // heads
    max_context = int(hf.get("max_position_embeddings") or 32768)
    if sliding:
        # Within the window, sliding-window attention is plain causal attention; longer
        # prompts are refused rather than computed with the wrong mask.
        max_context = min(max_context, int(sliding))
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        num_experts=int(num_experts),
        num_experts_per_tok=int(_require(hf, "num_experts_per_tok")),
        moe_intermediate_size=int(intermediate),
        norm_topk_prob=norm_topk,
        qk_norm=qk_norm,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(hf),
        max_context=max_context,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read a model config from a HF model directory, a ``config.json`` or a YAML shape file."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model config at {path}")
    with open(path, encoding="utf-8") as fh:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(fh)
        else:
            data = json.load(fh)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    try:
        return from_hf_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None

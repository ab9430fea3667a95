"""Model configuration read from a Hugging Face ``config.json`` (or a YAML shape
file such as ``moejax/demo/configs/demo.yaml``), plus the FLOP accounting of DESIGN.md.

The FLOP model is what the scheduler charges requests with and what MFU is
measured against, so it counts *useful* work only: the k routed experts of a
token (not the E a dense product would touch), attention over the keys a token
actually sees, and the LM head only at scoring positions.
"""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from typing import Any, Mapping

from moejax.mla_shape import MLAShape, YarnScaling, mla_shape_from_hf, yarn_scaling

SUPPORTED_MODEL_TYPES = ("qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "deepseek_v3",
                         "deepseek_v2", "gpt_oss")
ROUTER_SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2_sum")


class ConfigError(ValueError):
    """A model config that moejax cannot serve, with the reason."""


# ----------------------------------------------------------------------------- size limits
# Upper bounds on the sizes a config may give. Each lies well above the large open models
# named beside it (1.6x for the context, 4x or more for the rest). They exist because the
# loader plans work per layer and per expert, and the engine sizes tables per position,
# from these numbers before any weight is read: a corrupt or hostile config.json
# ("num_experts": 1000000000) grew memory for minutes instead of being refused (issue 37).
MAX_LAYERS = 1024               # Llama 3.1 405B: 126 layers; DeepSeek-V3: 61
MAX_EXPERTS = 4096              # routed experts per layer; Kimi K2: 384; DeepSeek-V3: 256
MAX_HIDDEN_SIZE = 65536         # also bounds MLA ranks; Llama 3.1 405B: 16384
MAX_INTERMEDIATE_SIZE = 262144  # an MLP's width; Llama 3.1 405B: 53248
MAX_HEADS = 1024                # attention heads; DeepSeek-V3, Llama 3.1 405B: 128
MAX_HEAD_DIM = 4096             # a head's width; Gemma: 256
MAX_VOCAB_SIZE = 1 << 22        # 4,194,304 tokens; Gemma 3: 262,144
MAX_CONTEXT = 1 << 24           # 16,777,216 positions; Llama 4 Scout: 10M

# ModelConfig's sizes and their bounds (the same ones from_hf_dict applies to the
# config.json fields they come from).
SIZE_LIMITS: dict[str, int] = {
    "vocab_size": MAX_VOCAB_SIZE, "hidden_size": MAX_HIDDEN_SIZE, "num_layers": MAX_LAYERS,
    "num_heads": MAX_HEADS, "num_kv_heads": MAX_HEADS, "head_dim": MAX_HEAD_DIM,
    "num_experts": MAX_EXPERTS, "num_experts_per_tok": MAX_EXPERTS,
    "moe_intermediate_size": MAX_INTERMEDIATE_SIZE, "max_context": MAX_CONTEXT,
}


def is_int(value: Any) -> bool:
    """A JSON/YAML integer: a Python int that is not a bool (``1e9`` and ``128.0`` are
    floats in JSON, and a size written so is a mistake, not a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def size_problem(value: Any, low: int, high: int) -> str | None:
    """Why ``value`` is not an integer in [low, high], or None when it is."""
    if not is_int(value):
        hint = "; write sizes without a decimal point or exponent" \
            if isinstance(value, float) else ""
        return f"must be an integer, got {value!r} ({type(value).__name__}{hint})"
    if value > high:
        return (f"must be an integer in [{low}, {high}], got {value} (moejax's bound, well "
                f"above the largest open models: a corrupt config?)")
    if value < low:
        return f"must be an integer in [{low}, {high}], got {value}"
    return None


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
               (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def regular_file_problem(path: str) -> str | None:
    """Why ``path`` (followed through symlinks) is not a regular file, or None when it is;
    a missing path raises FileNotFoundError. Asked before opening a model file: opening a
    FIFO blocks until a writer comes, a device may never end."""
    mode = os.stat(path).st_mode
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _FILE_KINDS if test(mode)), "not a regular file")
    return f"is {kind}, not a regular file"


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
    # ---- attention variants (defaults: Qwen3-MoE / Mixtral)
    qk_norm_over_heads: bool = False     # OLMoE: q/k norm over all heads at once, not per head
    qkv_bias: bool = False               # Qwen2-MoE: biases on the q, k, v projections
    clip_qkv: float | None = None        # OLMoE option: clamp q, k, v to [-c, c]
    mla: MLAShape | None = None          # DeepSeek: multi-head latent attention
    # ---- routing variants
    router_scoring: str = "softmax"      # "sigmoid": DeepSeek-V3
    score_correction_bias: bool = False  # DeepSeek-V3 e_score_correction_bias (choice only)
    n_group: int = 1                     # group-limited top-k: E experts in n_group groups,
    topk_group: int = 1                  # experts chosen from the topk_group best groups
    group_score: str = "max"             # a group's score: its best expert or top-2 sum
    routed_scaling_factor: float = 1.0
    # ---- resident MLPs: shared experts (every MoE layer) and dense layers (no experts)
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False     # Qwen2-MoE: sigmoid(x · g) scales the shared expert
    dense_layers: tuple[int, ...] = ()
    dense_intermediate_size: int = 0
    # ---- GPT-OSS pieces (defaults: absent)
    rope_yarn: YarnScaling | None = None  # YaRN frequencies and cos/sin factor (rotate-half)
    attention_sinks: bool = False        # per-head sink logit joining each softmax ("sinks")
    o_bias: bool = False                 # bias on the attention output projection ("bo")
    sliding_window: int = 0              # window of the layers in ``sliding_layers``
    sliding_layers: tuple[int, ...] = ()  # layers with sliding-window attention
    router_bias: bool = False            # bias added to the router logits ("router_bias")
    expert_bias: bool = False            # biases of the routed experts (b_gate/b_up/b_down)
    swiglu_limit: float | None = None    # clamped SwiGLU: (clip(up)+1)·g·sigmoid(alpha·g),
    swiglu_alpha: float = 1.702          # g = min(gate, limit) (None: plain silu SwiGLU)
    # ---- a sequence classifier (``*ForSequenceClassification``): its ``score`` head of
    # num_labels outputs replaces the LM head (0: a language model)
    num_labels: int = 0
    id2label: tuple[str, ...] = ()       # label names, by output index
    problem_type: str = ""               # transformers' single_label_classification,
                                         # multi_label_classification or regression
    # ---- how the routed experts are held (set by the loader, never read from config.json):
    # float8_e4m3fn with one float32 scale per block of (in, out) elements of each
    # [in, out] matrix (``weights_dtype="fp8"``, ``moejax.fp8_experts``); None: in the
    # serving dtype. Part of the config because it changes the params pytree (the scale
    # leaves, ``param_layout.EXPERT_SCALE_KEYS``) and the compiled programs.
    expert_fp8_block: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        for name, high in SIZE_LIMITS.items():   # bounds: see MAX_LAYERS & co.
            problem = size_problem(getattr(self, name), 1, high)
            if problem:
                raise ConfigError(f"{name} {problem}")
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
        if self.router_scoring not in ROUTER_SCORINGS:
            raise ConfigError(f"router_scoring must be one of {ROUTER_SCORINGS}, "
                              f"got {self.router_scoring!r}")
        if self.group_score not in GROUP_SCORES:
            raise ConfigError(f"group_score must be one of {GROUP_SCORES}, got {self.group_score!r}")
        if self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"group-limited routing needs n_group ({self.n_group}) dividing "
                              f"the {self.num_experts} experts and 1 <= topk_group "
                              f"({self.topk_group}) <= n_group")
        if self.num_experts_per_tok > self.topk_group * (self.num_experts // self.n_group):
            raise ConfigError(f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds the "
                              f"experts of the topk_group={self.topk_group} groups")
        bad = [i for i in self.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"dense layer indices {bad} lie outside [0, {self.num_layers})")
        if self.dense_layers and self.dense_intermediate_size <= 0:
            raise ConfigError("dense layers need a positive dense_intermediate_size "
                              "(config.json: intermediate_size)")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ConfigError("shared_expert_gate without a shared expert")
        if self.mla is not None and self.qk_norm:
            raise ConfigError("multi-head latent attention has no q/k norm")
        if self.sliding_layers and self.sliding_window <= 0:
            raise ConfigError("sliding_layers need a positive sliding_window")
        bad = [i for i in self.sliding_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"sliding layer indices {bad} lie outside [0, {self.num_layers})")
        if self.problem_type not in ("", *PROBLEM_TYPES):
            raise ConfigError(f"problem_type must be one of {PROBLEM_TYPES}, got "
                              f"{self.problem_type!r}")
        block = self.expert_fp8_block
        if block is not None and (not isinstance(block, tuple) or len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"expert_fp8_block must be two positive integers (in, out) or "
                              f"None, got {block!r}")
        if self.num_labels and len(self.id2label) != self.num_labels:
            raise ConfigError(f"id2label names {len(self.id2label)} labels, num_labels is "
                              f"{self.num_labels}")

    # ----------------------------------------------------------------- layers
    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers with routed experts (every layer but the dense ones)."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    @property
    def resident_mlp_size(self) -> int:
        """Width of the per-layer resident MLP stack (shared experts and dense layers' MLPs
        share one stack, zero-padded to the wider of the two: a zero column adds nothing)."""
        dense = self.dense_intermediate_size if self.dense_layers else 0
        return max(self.shared_intermediate_size, dense)

    # ----------------------------------------------------------------- KV layout
    @property
    def kv_store_dims(self) -> tuple[int, int, int]:
        """What a KV cache holds per token and layer: (heads, key dim, value dim). MLA
        stores its compressed latent as the "key" and the shared RoPE key as the "value"
        (one head); the others store per-head keys and values."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank, self.mla.qk_rope_head_dim
        return self.num_kv_heads, self.head_dim, self.head_dim

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of KV cache per token over every layer."""
        heads, key_dim, value_dim = self.kv_store_dims
        return self.num_layers * heads * (key_dim + value_dim) * itemsize

    @property
    def attention_dims(self) -> tuple[int, int, int]:
        """(query heads, q/k head dim, value head dim) of the attention itself."""
        if self.mla is not None:
            return self.mla.n_heads, self.mla.qk_head_dim, self.mla.v_head_dim
        return self.num_heads, self.head_dim, self.head_dim

    # ----------------------------------------------------------------- FLOPs
    @property
    def linear_flops_per_layer(self) -> int:
        """Forward FLOPs of one token through one layer's matmuls (no attention scores).

        Attention projections + output projection, then for an MoE layer the router, the
        k routed SwiGLU experts and the shared experts; for a dense layer its MLP.
        (The MoE part of a dense layer is 0: :meth:`layer_linear_flops` per layer.)
        """
        return self.attention_linear_flops + self.moe_linear_flops

    @property
    def attention_linear_flops(self) -> int:
        """One token through one layer's attention projections (q, k, v or MLA's, and o)."""
        d, h = self.hidden_size, self.head_dim
        if self.mla is not None:
            m, heads = self.mla, self.mla.n_heads
            if m.q_lora_rank is None:
                q = d * heads * m.qk_head_dim
            else:
                q = d * m.q_lora_rank + m.q_lora_rank * heads * m.qk_head_dim
            kv = d * (m.kv_lora_rank + m.qk_rope_head_dim)
            # Each token's latent is expanded to per-head keys/values once: the useful
            # work (this implementation re-expands cached latents each step; not counted).
            kv += m.kv_lora_rank * heads * (m.qk_nope_head_dim + m.v_head_dim)
            return 2 * (q + kv + heads * m.v_head_dim * d)
        qkv = 2 * d * (self.num_heads * h + 2 * self.num_kv_heads * h)
        return qkv + 2 * self.num_heads * h * d

    @property
    def moe_linear_flops(self) -> int:
        """One token through one MoE layer's router, routed and shared experts."""
        d = self.hidden_size
        router = 2 * d * self.num_experts
        experts = self.num_experts_per_tok * 6 * d * self.moe_intermediate_size
        shared = 6 * d * self.shared_intermediate_size + (2 * d if self.shared_expert_gate else 0)
        return router + experts + shared

    def layer_linear_flops(self, layer: int) -> int:
        """One token through layer ``layer``'s matmuls (dense layers: attention + MLP)."""
        if layer in self.dense_layers:
            return self.attention_linear_flops + 6 * self.hidden_size * self.dense_intermediate_size
        return self.linear_flops_per_layer

    @property
    def linear_flops_per_token(self) -> int:
        """F_lin: one token through every layer's matmuls."""
        return sum(self.layer_linear_flops(i) for i in range(self.num_layers))

    @property
    def _score_value_dims(self) -> int:
        """n_q·(h_qk + h_v): per key, the FLOPs/2 of QK^T and PV over every head."""
        heads, qk, v = self.attention_dims
        return heads * (qk + v)

    def attention_flops(self, context: int) -> int:
        """F_att(c): one token attending over ``context`` keys in every layer (QK^T and PV)."""
        return self.num_layers * 2 * self._score_value_dims * context

    def attention_flops_range(self, first: int, last: int) -> int:
        """Σ_{i=first..last} F_att(i), in closed form (0 when last < first)."""
        if last < first:
            return 0
        count = last - first + 1
        return self.num_layers * 2 * self._score_value_dims * (first + last) * count // 2

    @property
    def head_size(self) -> int:
        """Outputs of the model's head: the vocabulary, or a classifier's labels."""
        return self.num_labels or self.vocab_size

    def head_flops(self, num_candidates: int | None = None) -> int:
        """F_head at one scoring position: full head (vocabulary or labels), or only
        ``num_candidates`` columns."""
        columns = self.head_size if num_candidates is None else num_candidates
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


def _gpt_oss_theta(hf: Mapping[str, Any]) -> float:
    params = dict(hf.get("rope_scaling") or {})
    params.update(hf.get("rope_parameters") or {})
    theta = params.get("rope_theta", hf.get("rope_theta"))
    if theta is None:
        raise ConfigError("config has neither rope_parameters.rope_theta nor rope_theta")
    return float(theta)


_MISSING = object()


def _size(hf: Mapping[str, Any], names: str | tuple[str, ...], high: int, *, low: int = 1,
          default: Any = _MISSING) -> Any:
    """The first of the fields ``names`` that config.json sets (null counts as unset), as
    an integer in [low, high]; ``default`` when none is set (else ConfigError). Checked
    here, before anything is built per layer, expert or position from it."""
    names = (names,) if isinstance(names, str) else names
    for name in names:
        value = hf.get(name)
        if value is not None:
            problem = size_problem(value, low, high)
            if problem:
                raise ConfigError(f"field {name!r} {problem}")
            return value
    if default is _MISSING:
        raise ConfigError(f"config.json lacks {' / '.join(names)}")
    return default


def _layer_list(hf: Mapping[str, Any], name: str, num_layers: int) -> list[int]:
    """A config.json list of layer indices (``mlp_only_layers``), each in [0, num_layers)."""
    value = hf.get(name) or []
    if not isinstance(value, list):
        raise ConfigError(f"field {name!r} must be a list of layer indices, got {value!r}")
    for i, index in enumerate(value):
        problem = size_problem(index, 0, num_layers - 1)
        if problem:
            raise ConfigError(f"field {name!r}[{i}] {problem}")
    return value


def _dense_layers(hf: Mapping[str, Any], model_type: str, num_layers: int) -> tuple[int, ...]:
    """The layers without routed experts, as transformers decides them."""
    if model_type in ("qwen3_moe", "qwen2_moe"):
        only = set(_layer_list(hf, "mlp_only_layers", num_layers))
        step = _size(hf, "decoder_sparse_step", MAX_LAYERS, default=1)
        return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    if model_type in ("deepseek_v3", "deepseek_v2"):
        first = _size(hf, "first_k_dense_replace", MAX_LAYERS, low=0, default=0)
        if _size(hf, "moe_layer_freq", MAX_LAYERS, default=1) != 1:
            raise ConfigError("moe_layer_freq != 1 is not supported (transformers ignores it too)")
        return tuple(range(min(first, num_layers)))
    return ()


def _refuse(hf: Mapping[str, Any], model_type: str) -> None:
    """Options moejax does not implement for this family: refused, never approximated."""
    if hf.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {hf.get('hidden_act')!r} is not supported (only silu)")
    if model_type == "gpt_oss":
        _refuse_gpt_oss(hf)
        return
    if model_type != "olmoe" and hf.get("attention_bias"):
        raise ConfigError(f"{model_type}: attention_bias=true is not supported")
    if model_type == "olmoe" and hf.get("attention_bias"):
        raise ConfigError("olmoe: attention_bias=true is not supported")
    if model_type == "qwen2_moe" and hf.get("use_sliding_window"):
        raise ConfigError("qwen2_moe: use_sliding_window=true is not supported")
    if model_type == "deepseek_v2" and hf.get("topk_method", "greedy") not in (
            "greedy", "group_limited_greedy"):
        raise ConfigError(f"deepseek_v2: topk_method {hf.get('topk_method')!r} is not supported "
                          "(greedy, group_limited_greedy)")
    if model_type in ("deepseek_v3", "deepseek_v2") and hf.get("mlp_bias"):
        raise ConfigError(f"{model_type}: mlp_bias=true is not supported")


GPT_OSS_LAYER_TYPES = ("sliding_attention", "full_attention")


def _refuse_gpt_oss(hf: Mapping[str, Any]) -> None:
    """GPT-OSS options moejax does not implement."""
    bad = sorted({t for t in (hf.get("layer_types") or []) if t not in GPT_OSS_LAYER_TYPES})
    if bad:
        raise ConfigError(f"gpt_oss: layer_types {bad} are not supported "
                          f"({', '.join(GPT_OSS_LAYER_TYPES)})")
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    rope_type = rope.get("rope_type", rope.get("type")) or "default"
    if rope_type not in ("default", "yarn"):
        raise ConfigError(f"gpt_oss: rope type {rope_type!r} is not supported (default, yarn)")
    if float(rope.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise ConfigError("gpt_oss: partial_rotary_factor != 1 is not supported")
    if rope_type == "yarn" and rope.get("factor") is None:
        raise ConfigError("gpt_oss: yarn rope without a factor is not supported")
    layers = _size(hf, "num_hidden_layers", MAX_LAYERS)
    if "sliding_attention" in (hf.get("layer_types") or ["sliding_attention"]) \
            and not hf.get("sliding_window"):
        raise ConfigError("gpt_oss: sliding_attention layers without a sliding_window are "
                          "not supported")
    if hf.get("layer_types") is not None and len(hf["layer_types"]) != layers:
        raise ConfigError(f"gpt_oss: layer_types lists {len(hf['layer_types'])} layers, "
                          f"num_hidden_layers is {layers}")


def _gpt_oss(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The GPT-OSS fields of :class:`ModelConfig` (after :func:`_refuse_gpt_oss`)."""
    layers = _size(hf, "num_hidden_layers", MAX_LAYERS)
    types = hf.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                      for i in range(layers)]
    window = _size(hf, "sliding_window", MAX_CONTEXT, low=0, default=0)
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    yarn = None
    if (rope.get("rope_type", rope.get("type")) or "default") == "yarn":
        yarn = yarn_scaling(rope, hf)
    bias = bool(hf.get("attention_bias", True))
    return dict(norm_topk_prob=True, router_bias=True, expert_bias=True, rope_yarn=yarn,
                attention_sinks=True, qkv_bias=bias, o_bias=bias, sliding_window=window,
                sliding_layers=sliding,
                swiglu_limit=float(7.0 if hf.get("swiglu_limit") is None
                                   else hf["swiglu_limit"]),
                swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702))


MLA_SIZES = {"q_lora_rank": MAX_HIDDEN_SIZE, "kv_lora_rank": MAX_HIDDEN_SIZE,
             "qk_nope_head_dim": MAX_HEAD_DIM, "qk_rope_head_dim": MAX_HEAD_DIM,
             "v_head_dim": MAX_HEAD_DIM}


def _check_mla_sizes(hf: Mapping[str, Any]) -> None:
    """Type and bound of multi-head latent attention's sizes (q_lora_rank may be null:
    no query compression)."""
    for name, high in MLA_SIZES.items():
        _size(hf, name, high, default=None)


def _routing(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """Router scoring, top-k normalization, groups and scaling of each family."""
    if model_type == "gpt_oss":   # softmax over the top-k (biased) logits
        return dict(norm_topk_prob=True)
    if model_type == "mixtral":   # softmax over the top-k logits == renormalised top-k
        return dict(norm_topk_prob=True)
    if model_type in ("qwen3_moe", "qwen2_moe", "olmoe"):
        return dict(norm_topk_prob=bool(hf.get("norm_topk_prob", False)))
    scaling = float(hf.get("routed_scaling_factor", 1.0) or 1.0)
    if model_type == "deepseek_v3":
        return dict(norm_topk_prob=bool(hf.get("norm_topk_prob", True)), router_scoring="sigmoid",
                    score_correction_bias=True,
                    n_group=_size(hf, "n_group", MAX_EXPERTS, default=1),
                    topk_group=_size(hf, "topk_group", MAX_EXPERTS, default=1),
                    group_score="top2_sum", routed_scaling_factor=scaling)
    # deepseek_v2: softmax scores, never renormalised (transformers' router ignores
    # norm_topk_prob), optionally group-limited by each group's best expert.
    grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
    return dict(norm_topk_prob=False,
                n_group=_size(hf, "n_group", MAX_EXPERTS, default=1) if grouped else 1,
                topk_group=_size(hf, "topk_group", MAX_EXPERTS, default=1) if grouped else 1,
                group_score="max",
                routed_scaling_factor=scaling)


def from_hf_dict(hf: Mapping[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from the contents of a Hugging Face ``config.json``."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(_unsupported_type_message(model_type))
    # Every size is checked (type and bound) before anything is built from it: a layer
    # list of num_hidden_layers entries, say, or the loader's per-expert tensor plan.
    num_layers = _size(hf, "num_hidden_layers", MAX_LAYERS)
    _refuse(hf, model_type)
    hidden = _size(hf, "hidden_size", MAX_HIDDEN_SIZE)
    heads = _size(hf, "num_attention_heads", MAX_HEADS)
    dense = _dense_layers(hf, model_type, num_layers)
    extra: dict[str, Any] = dict(_routing(hf, model_type))
    sliding = None
    if model_type == "gpt_oss":
        num_experts = _size(hf, ("num_local_experts", "num_experts"), MAX_EXPERTS)
        intermediate = _size(hf, "intermediate_size", MAX_INTERMEDIATE_SIZE)
        extra.update(_gpt_oss(hf))
    elif model_type == "mixtral":
        num_experts = _size(hf, ("num_local_experts", "num_experts"), MAX_EXPERTS)
        intermediate = _size(hf, "intermediate_size", MAX_INTERMEDIATE_SIZE)
        sliding = _size(hf, "sliding_window", MAX_CONTEXT, low=0, default=None)
    elif model_type in ("deepseek_v3", "deepseek_v2"):
        num_experts = _size(hf, ("n_routed_experts", "num_local_experts"), MAX_EXPERTS)
        intermediate = _size(hf, "moe_intermediate_size", MAX_INTERMEDIATE_SIZE)
        _check_mla_sizes(hf)
        try:
            extra["mla"] = mla_shape_from_hf(hf)
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{model_type}: multi-head latent attention: {exc}") from None
        shared = _size(hf, "n_shared_experts", MAX_EXPERTS, low=0, default=0)
        extra["shared_intermediate_size"] = shared * intermediate
        if extra["shared_intermediate_size"] > MAX_INTERMEDIATE_SIZE:
            raise ConfigError(f"n_shared_experts ({shared}) x moe_intermediate_size "
                              f"({intermediate}) exceeds {MAX_INTERMEDIATE_SIZE}")
    else:
        num_experts = _size(hf, ("num_experts", "num_local_experts"), MAX_EXPERTS)
        intermediate = _size(hf, ("moe_intermediate_size", "intermediate_size")
                             if model_type != "olmoe" else "intermediate_size",
                             MAX_INTERMEDIATE_SIZE)
        if model_type == "qwen3_moe" and hf.get("use_sliding_window"):
            sliding = _size(hf, "sliding_window", MAX_CONTEXT, low=0, default=None)
    if model_type == "qwen2_moe":
        extra["qkv_bias"] = bool(hf.get("qkv_bias", True))
        shared = _size(hf, "shared_expert_intermediate_size", MAX_INTERMEDIATE_SIZE, low=0,
                       default=0)
        extra.update(shared_intermediate_size=shared, shared_expert_gate=shared > 0)
    if model_type == "olmoe":
        extra["qk_norm_over_heads"] = True
        clip = hf.get("clip_qkv")
        extra["clip_qkv"] = None if clip is None else float(clip)
    if dense:
        extra.update(dense_layers=dense,
                     dense_intermediate_size=_size(hf, "intermediate_size",
                                                   MAX_INTERMEDIATE_SIZE))
    extra.update(_classifier(hf))
    head_dim = _size(hf, "head_dim", MAX_HEAD_DIM, default=hidden // heads)
    if "mla" in extra:   # head_dim of the rotary part; q/k/v dims come from the MLA shape
        head_dim = extra["mla"].qk_rope_head_dim
    max_context = _size(hf, "max_position_embeddings", MAX_CONTEXT, default=32768)
    if sliding:
        # Within the window, sliding-window attention is plain causal attention; longer
        # prompts are refused rather than computed with the wrong mask.
        max_context = min(max_context, sliding)
    return ModelConfig(
        model_type=model_type,
        vocab_size=_size(hf, "vocab_size", MAX_VOCAB_SIZE),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=_size(hf, "num_key_value_heads", MAX_HEADS, default=heads),
        head_dim=head_dim,
        num_experts=num_experts,
        num_experts_per_tok=_size(hf, "num_experts_per_tok", MAX_EXPERTS),
        moe_intermediate_size=intermediate,
        qk_norm=model_type in ("qwen3_moe", "olmoe"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=(extra["mla"].rope_theta if "mla" in extra
                    else _gpt_oss_theta(hf) if model_type == "gpt_oss" else _rope_theta(hf)),
        max_context=max_context,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        **extra,
    )


CLASSIFIER_SUFFIX = "ForSequenceClassification"
PROBLEM_TYPES = ("single_label_classification", "multi_label_classification", "regression")


def _classifier(hf: Mapping[str, Any]) -> dict[str, Any]:
    """A ``*ForSequenceClassification`` architecture's head: its label count, names and
    problem type ({} for a language model). transformers' defaults: ``num_labels`` from
    ``id2label`` (2 when neither is given), names ``LABEL_i``."""
    architectures = hf.get("architectures") or ()
    if not any(isinstance(a, str) and a.endswith(CLASSIFIER_SUFFIX) for a in architectures):
        return {}
    names = hf.get("id2label")
    if names is not None:
        if not isinstance(names, Mapping) or not all(
                isinstance(k, (str, int)) and str(k).isdigit() for k in names):
            raise ConfigError("id2label must map label indices (\"0\", \"1\", ...) to names")
        names = {int(k): str(v) for k, v in names.items()}
    count = _size({"num_labels": hf.get("num_labels", len(names) if names else 2)},
                  "num_labels", MAX_VOCAB_SIZE)
    names = names or {i: f"LABEL_{i}" for i in range(count)}
    if sorted(names) != list(range(count)):
        raise ConfigError(f"id2label must name the labels 0..{count - 1} (num_labels "
                          f"{count}), got indices {sorted(names)}")
    problem = hf.get("problem_type") or ""
    return {"num_labels": count, "id2label": tuple(names[i] for i in range(count)),
            "problem_type": problem}


# A config.json is a few KB; one past this is not a config (and is not read into memory).
MAX_CONFIG_BYTES = 16 << 20


def _check_config_file(path: str) -> None:
    """Refuse what must not be opened or read whole: a FIFO (open blocks for ever), a
    device, a directory, a file of more than MAX_CONFIG_BYTES."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no model config at {path}")
    problem = regular_file_problem(path)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    size = os.path.getsize(path)
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: {size} bytes, more than a model config's limit of "
                          f"{MAX_CONFIG_BYTES} (moejax.config.MAX_CONFIG_BYTES)")


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read a model config from a HF model directory, a ``config.json`` or a YAML shape file.

    Every size is checked for type (an integer: not a float such as ``128.5`` or ``1e9``,
    not a bool) and against its bound (``MAX_LAYERS`` & co.) before anything is built
    from it; a non-regular file (a FIFO, a device) is refused unopened. Errors
    (:class:`ConfigError`) name the file, the field and the value."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    _check_config_file(path)
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

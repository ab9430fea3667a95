"""The shape of an MoE decoder as the cost models see it, and Qwen3-30B-A3B's.

One definition for every cost model that prices a model it does not run (the offloaded
decode step model ``moejax.prefetch.step_model``, the pipeline model
``moejax.pipeline_sim``, the AsyncMoE H100 cost table ``moejax.asyncmoe.costs``): layer
and expert counts, the widths the weight and KV-cache byte counts follow from, and the
byte counts themselves. Every expert is a SwiGLU MLP (gate, up, down); attention is GQA
with q/k/v/o projections and no biases.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """An MoE decoder: layers, routed experts per layer, experts per token, hidden size,
    one expert's intermediate size, query heads, KV heads, head dim, vocabulary, and the
    bytes of one weight / cache element (2: bf16)."""

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            # bool is an int subclass; True as a layer count is a caller's mistake.
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field.name} must be a positive int, "
                                 f"got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"ModelShape.top_k={self.top_k} exceeds num_experts="
                             f"{self.num_experts}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape.num_heads={self.num_heads} is not a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")

    @property
    def expert_bytes(self) -> int:
        """One SwiGLU expert: gate and up [hidden, inter], down [inter, hidden]."""
        return 3 * self.hidden_size * self.expert_intermediate * self.dtype_bytes

    @property
    def layer_expert_bytes(self) -> int:
        """Every routed expert of one layer."""
        return self.num_experts * self.expert_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        """K and V of one token at one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def attention_weight_count(self) -> int:
        """Weights of one layer's q and o (hidden x heads·head_dim each) and k and v
        (hidden x kv_heads·head_dim each) projections."""
        q_and_o = 2 * self.hidden_size * self.num_heads * self.head_dim
        k_and_v = 2 * self.hidden_size * self.num_kv_heads * self.head_dim
        return q_and_o + k_and_v

    @property
    def attention_weight_bytes(self) -> int:
        """Bytes of one layer's q, k, v and o projections."""
        return self.attention_weight_count * self.dtype_bytes

    @property
    def router_weight_count(self) -> int:
        """Weights of one layer's router (hidden x experts)."""
        return self.hidden_size * self.num_experts

    @property
    def non_expert_weight_count(self) -> int:
        """Weights of one layer outside its experts: the attention projections and the
        router (norms are negligible and not counted)."""
        return self.attention_weight_count + self.router_weight_count

    @property
    def lm_head_weight_count(self) -> int:
        """Weights of the LM head (vocab x hidden)."""
        return self.vocab_size * self.hidden_size


QWEN3_30B_A3B = ModelShape(num_layers=48, num_experts=128, top_k=8, hidden_size=2048,
                           expert_intermediate=768, num_heads=32, num_kv_heads=4,
                           head_dim=128, vocab_size=151936, dtype_bytes=2)
"""Qwen3-30B-A3B, from its public config.json on the Hugging Face hub: 48 layers
(num_hidden_layers), 128 experts (num_experts), 8 per token (num_experts_per_tok), hidden
2048, moe_intermediate_size 768, 32 query / 4 KV heads of head_dim 128, vocab_size 151936,
bf16 weights. One expert is 9.44 MB, one layer's experts 1.21 GB."""

"""Tiny random Hugging Face models of every MoE family moejax serves, built with
transformers' own classes (the reference implementation of each family).

Shapes are tiny (vocab 128, hidden 32, 4 query / 2 key-value heads of dim 8 where the
family has GQA, 8 experts, top-2, expert width 16) and the weights are made robust as in
``hf_tiny_models``: top-k routing is discontinuous, so router weights are scaled ×20 (router
logits well separated: float32 rounding cannot flip an expert choice), norm weights are
perturbed (a norm mix-up shows), q/k projections ×4 and expert weights ×2 (attention and the
MoE output weigh enough in the logits for a mistake there to show). On top of that every
bias and correction term a family has is set non-zero (transformers initialises most of
them to zero, which would hide a missing or misplaced term):

* q/k/v projection biases ``self_attn.{q,k,v}_proj.bias`` (Qwen2-MoE ``qkv_bias``, GPT-OSS
  ``attention_bias``: N(0, 0.1)) and GPT-OSS's ``self_attn.o_proj.bias`` (N(0, 0.02): biases
  added to the residual stream stay at the embeddings' scale, or one constant vector
  decides every position's argmax),
* GPT-OSS attention sinks ``self_attn.sinks`` (N(0, 1)), router bias ``mlp.router.bias``
  (N(0, 1)) and expert biases ``mlp.experts.gate_up_proj_bias`` (N(0, 0.1)) /
  ``mlp.experts.down_proj_bias`` (N(0, 0.02)); its ``swiglu_limit`` is 0.5 (real: 7) so
  the SwiGLU clamps bite,
* DeepSeek-V3 ``mlp.gate.e_score_correction_bias`` (a buffer: N(0, 0.3), comparable to the
  spread of the sigmoid scores, so it changes expert choices but not the weights),
* Qwen2-MoE ``mlp.shared_expert_gate.weight`` (N(0, 0.5)); shared experts and dense MLPs
  are scaled ×2 like the routed experts,
* DeepSeek-V3 uses its own YaRN RoPE (factor 40, mscale 1); GPT-OSS its default YaRN.

Import only after ``pytest.importorskip`` of torch and transformers.
"""

from __future__ import annotations

import torch
import transformers

V, D, HEADS, KV_HEADS, HEAD_DIM, E, K, F = 128, 32, 4, 2, 8, 8, 2, 16
DENSE_F = 24          # intermediate size of dense layers and of Qwen2-MoE's shared expert
BOS, EOS = 1, 2       # every family gets in-vocabulary special tokens (OLMoE's 50279 is not)

_COMMON = dict(vocab_size=V, hidden_size=D, num_attention_heads=HEADS, num_experts_per_tok=K,
               max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=BOS,
               eos_token_id=EOS, pad_token_id=0)
# DeepSeek-V3's own RoPE scaling (its config.json: YaRN, factor 40 over 4096 positions,
# mscale = mscale_all_dim = 1, so the softmax scale grows by mscale(40)^2 ≈ 1.87).
DEEPSEEK_V3_YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0,
                        original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                        mscale=1.0, mscale_all_dim=1.0)
_DEEPSEEK = dict(num_hidden_layers=3, num_key_value_heads=HEADS, kv_lora_rank=12,
                 qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=E,
                 moe_intermediate_size=F, n_shared_experts=1, first_k_dense_replace=1,
                 intermediate_size=DENSE_F)

# name -> (transformers config class, causal-LM class, config kwargs). The name is the
# test's family id (``qwen3_moe_dense`` and ``deepseek_v2_greedy`` are variants of a
# model_type); ``model_type`` of the built config says which family moejax reads.
FAMILY_CONFIGS: dict[str, tuple[str, str, dict]] = {
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=KV_HEADS, num_experts=E, intermediate_size=F,
        norm_topk_prob=False)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=KV_HEADS, num_experts=E,
        moe_intermediate_size=F, shared_expert_intermediate_size=DENSE_F,
        intermediate_size=DENSE_F, qkv_bias=True, norm_topk_prob=False)),
    "qwen3_moe_dense": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=3, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=E,
        moe_intermediate_size=F, intermediate_size=DENSE_F, mlp_only_layers=[0],
        norm_topk_prob=True)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=16, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, rope_parameters=DEEPSEEK_V3_YARN, max_position_embeddings=163840)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy", n_group=4,
        topk_group=2, routed_scaling_factor=1.5)),
    "deepseek_v2_greedy": ("DeepseekV2Config", "DeepseekV2ForCausalLM", dict(
        _DEEPSEEK, q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.5)),
    # GPT-OSS keeps its own RoPE (YaRN, factor 32 over 4096 positions: the context is the
    # real 131072, which also keeps transformers from warning). swiglu_limit 0.5 (real: 7)
    # makes the clamps of the experts' SwiGLU bite at these tiny activations.
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_local_experts=E, intermediate_size=F, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], attention_bias=True,
        swiglu_limit=0.5, max_position_embeddings=131072)),
    # The families moejax served before issue 20 (to check the harness itself).
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=E,
        moe_intermediate_size=F, intermediate_size=DENSE_F, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_hidden_layers=2, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        num_local_experts=E, intermediate_size=F, rope_theta=1e5)),
}
# A fixed seed per family (enabling another family changes no model).
FAMILY_SEEDS = {name: i for i, name in enumerate(FAMILY_CONFIGS)}


def family_config(family: str, **overrides):
    """The transformers config of ``family`` (a key of FAMILY_CONFIGS), with overrides."""
    config_cls, _, kwargs = FAMILY_CONFIGS[family]
    config = getattr(transformers, config_cls)(**{**_COMMON, **kwargs, **overrides})
    # Eager attention everywhere: the reference computation, written out in each modeling
    # file (GPT-OSS has no SDPA path at all: its sinks need the eager softmax).
    config._attn_implementation = "eager"
    return config


# Parameter-name suffixes of the robustness scalings (see the module docstring).
_ROUTER_WEIGHTS = ("mlp.gate.weight", "mlp.router.weight")
_QK_WEIGHTS = ("q_proj.weight", "k_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
               "kv_b_proj.weight")
_EXPERTS = ("experts.gate_up_proj", "experts.down_proj")
_MLPS = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")   # shared experts, dense MLPs
_BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias", "experts.gate_up_proj_bias")
# Biases added straight to the residual stream: at the embeddings' scale (std 0.02), or a
# constant vector dominates every position's logits (greedy decoding then repeats a token).
_RESIDUAL_BIASES = ("o_proj.bias", "experts.down_proj_bias")


def build_family_model(family: str, seed: int = 0, **overrides):
    """The seeded tiny ``family`` model (float32, eval mode), robust and with every bias,
    sink and correction term non-zero."""
    _, model_cls, _ = FAMILY_CONFIGS[family]
    config = family_config(family, **overrides)
    torch.manual_seed(seed)
    hf = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1000)

    def randn_like(t, std):
        return torch.randn(t.shape, generator=gen, dtype=t.dtype) * std

    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):        # layer norms, q/k norms, MLA latent norms
                param.add_(randn_like(param, 0.1))
            elif name.endswith(_ROUTER_WEIGHTS):
                param.mul_(20.0)
            elif name.endswith(_QK_WEIGHTS):
                param.mul_(4.0)
            elif name.endswith(_EXPERTS) or name.endswith(_MLPS):
                param.mul_(2.0)
            elif name.endswith(_BIASES):
                param.copy_(randn_like(param, 0.1))
            elif name.endswith("self_attn.sinks"):
                # Sinks near the attention logits' size, so they take a visible share.
                param.copy_(randn_like(param, 1.0))
            elif name.endswith("mlp.router.bias"):
                # Comparable to the ×20 router logits' spread: it moves choices.
                param.copy_(randn_like(param, 1.0))
            elif name.endswith(_RESIDUAL_BIASES):
                param.copy_(randn_like(param, 0.02))
            elif name.endswith("mlp.shared_expert_gate.weight"):
                param.copy_(randn_like(param, 0.5))
        for name, buf in hf.named_buffers():
            if name.endswith("mlp.gate.e_score_correction_bias"):
                buf.copy_(randn_like(buf, 0.3).to(buf.dtype))
    return hf


def router_module_name(family: str) -> str:
    """Attribute of a decoder layer's ``mlp`` holding its router."""
    return "router" if FAMILY_CONFIGS[family][0] == "GptOssConfig" else "gate"


def moe_layers(hf) -> list[int]:
    """Indices of the decoder layers with a router (dense layers have none)."""
    out = []
    for i, layer in enumerate(hf.model.layers):
        mlp = layer.mlp
        if hasattr(mlp, "gate") and hasattr(mlp, "experts") or hasattr(mlp, "router"):
            out.append(i)
    return out


def router_topk(hf, family: str, input_ids) -> dict[int, torch.Tensor]:
    """The reference router's chosen experts [n, k] of each MoE layer for one forward of
    ``input_ids`` [1, n], read from the router modules themselves (every transformers
    router here returns ``(router_logits, weights, indices)``; DeepSeek's indices come
    from its group-limited / corrected choice, not from the logits)."""
    attr = router_module_name(family)
    got: dict[int, torch.Tensor] = {}
    hooks = []
    for i in moe_layers(hf):
        module = getattr(hf.model.layers[i].mlp, attr)

        def hook(_module, _inputs, output, i=i):
            got[i] = output[2].detach().reshape(-1, output[2].shape[-1]).clone()
        hooks.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf(input_ids)
    finally:
        for h in hooks:
            h.remove()
    return got

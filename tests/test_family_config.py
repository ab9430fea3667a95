"""Config readers of the MoE families (OLMoE, Qwen2-MoE, DeepSeek-V2/V3, Qwen3-MoE dense
layers): what each config.json becomes, what is refused, and the FLOP model held to a
count made independently from the params' matrix shapes (the einsums a token runs)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moejax import param_layout
from moejax.config import ConfigError, from_hf_dict

BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_experts_per_tok=2, hidden_act="silu",
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MLA = dict(q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
           v_head_dim=6)

FAMILIES = {
    "olmoe": dict(BASE, model_type="olmoe", num_experts=8, intermediate_size=16,
                  norm_topk_prob=False),
    "qwen2_moe": dict(BASE, model_type="qwen2_moe", num_experts=8, moe_intermediate_size=16,
                      intermediate_size=20, shared_expert_intermediate_size=24,
                      mlp_only_layers=[1], qkv_bias=True, norm_topk_prob=True),
    "qwen3_moe_dense": dict(BASE, model_type="qwen3_moe", num_experts=8,
                            moe_intermediate_size=16, intermediate_size=24,
                            mlp_only_layers=[0], decoder_sparse_step=1),
    "deepseek_v3": dict(BASE, **MLA, model_type="deepseek_v3", n_routed_experts=8,
                        moe_intermediate_size=16, intermediate_size=40, n_shared_experts=2,
                        first_k_dense_replace=1, n_group=4, topk_group=2,
                        routed_scaling_factor=2.5, norm_topk_prob=True),
    "deepseek_v2": dict(BASE, **MLA, model_type="deepseek_v2", n_routed_experts=8,
                        moe_intermediate_size=16, intermediate_size=24, n_shared_experts=1,
                        first_k_dense_replace=2, topk_method="group_limited_greedy",
                        n_group=4, topk_group=2, routed_scaling_factor=1.5),
}


def _matmul_flops(shapes: dict, names) -> int:
    """2·in·out for each named per-layer matrix [L, in, out] (one token, one layer)."""
    return sum(2 * math.prod(shapes[n][1:]) for n in names)


def _independent_layer_flops(cfg, layer: int) -> int:
    """One token through layer ``layer``, counted from the params' matrix shapes."""
    shapes = param_layout.param_shapes(cfg)["layers"]
    attn = [n for n in ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wkv_b")
            if n in shapes]
    flops = _matmul_flops(shapes, attn)
    d = cfg.hidden_size
    if layer in cfg.dense_layers:
        return flops + 3 * 2 * d * cfg.dense_intermediate_size
    _, e, _, f = shapes["w_gate"]
    flops += 2 * d * e                                              # router
    flops += cfg.num_experts_per_tok * 3 * 2 * d * f                # k routed experts
    flops += 3 * 2 * d * cfg.shared_intermediate_size               # shared experts
    flops += 2 * d if "shared_gate" in shapes else 0
    return flops


@pytest.mark.parametrize("family", list(FAMILIES))
def test_flops_equal_a_count_from_the_matrix_shapes(family):
    cfg = from_hf_dict(FAMILIES[family])
    per_layer = [_independent_layer_flops(cfg, i) for i in range(cfg.num_layers)]
    assert [cfg.layer_linear_flops(i) for i in range(cfg.num_layers)] == per_layer
    assert cfg.linear_flops_per_token == sum(per_layer)
    # attention over c keys: QK^T over the q/k head dim and PV over the value head dim
    if cfg.mla is not None:
        qk, v = cfg.mla.qk_head_dim, cfg.mla.v_head_dim
        heads = cfg.mla.n_heads
    else:
        qk = v = cfg.head_dim
        heads = cfg.num_heads
    for c in (1, 7, 100):
        assert cfg.attention_flops(c) == cfg.num_layers * c * 2 * heads * (qk + v)
    assert cfg.attention_flops_range(3, 9) == sum(cfg.attention_flops(c) for c in range(3, 10))


def test_each_family_reads_its_pieces():
    olmoe = from_hf_dict(FAMILIES["olmoe"])
    assert olmoe.qk_norm and olmoe.qk_norm_over_heads and not olmoe.norm_topk_prob
    qwen2 = from_hf_dict(FAMILIES["qwen2_moe"])
    assert qwen2.qkv_bias and qwen2.shared_expert_gate and qwen2.shared_intermediate_size == 24
    assert qwen2.dense_layers == (1,) and qwen2.dense_intermediate_size == 20
    assert qwen2.resident_mlp_size == 24 and qwen2.moe_layers == (0, 2)
    qwen3 = from_hf_dict(FAMILIES["qwen3_moe_dense"])
    assert qwen3.dense_layers == (0,) and not qwen3.shared_intermediate_size
    v3 = from_hf_dict(FAMILIES["deepseek_v3"])
    assert (v3.router_scoring, v3.score_correction_bias, v3.n_group, v3.topk_group,
            v3.group_score, v3.routed_scaling_factor) == ("sigmoid", True, 4, 2, "top2_sum", 2.5)
    assert v3.dense_layers == (0,) and v3.shared_intermediate_size == 32
    assert v3.resident_mlp_size == 40 and v3.mla.kv_lora_rank == 12
    v2 = from_hf_dict(FAMILIES["deepseek_v2"])
    assert (v2.router_scoring, v2.norm_topk_prob, v2.group_score) == ("softmax", False, "max")
    assert v2.dense_layers == (0, 1)
    greedy = from_hf_dict(dict(FAMILIES["deepseek_v2"], topk_method="greedy"))
    assert greedy.n_group == 1


def test_mla_stores_the_latent_in_the_kv_cache():
    """MLA keeps kv_lora_rank + qk_rope_head_dim numbers per token and layer, against
    2·n_kv·h for grouped-query attention."""
    v3 = from_hf_dict(FAMILIES["deepseek_v3"])
    assert v3.kv_store_dims == (1, 12, 4)
    assert v3.kv_bytes_per_token(2) == 3 * (12 + 4) * 2
    olmoe = from_hf_dict(FAMILIES["olmoe"])
    assert olmoe.kv_store_dims == (2, 8, 8)
    assert olmoe.kv_bytes_per_token(4) == 3 * 2 * 2 * 8 * 4


def test_num_params_counts_the_family_pieces():
    cfg = from_hf_dict(FAMILIES["deepseek_v3"])
    shapes = param_layout.param_shapes(cfg)
    total = sum(math.prod(s) for _, s in param_layout.tree_items(shapes))
    assert param_layout.num_params(cfg) == total
    assert {"wq_a", "wkv_b", "score_bias", "mlp_gate"} <= set(shapes["layers"])
    assert "wk" not in shapes["layers"]


@pytest.mark.parametrize("change, words", [
    (dict(FAMILIES["olmoe"], attention_bias=True), "attention_bias"),
    (dict(FAMILIES["qwen2_moe"], use_sliding_window=True, sliding_window=16),
     "use_sliding_window"),
    (dict(FAMILIES["deepseek_v2"], topk_method="noaux_tc"), "topk_method"),
    (dict(FAMILIES["deepseek_v3"], mlp_bias=True), "mlp_bias"),
    (dict(FAMILIES["deepseek_v3"], moe_layer_freq=2), "moe_layer_freq"),
    (dict(FAMILIES["deepseek_v3"], rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     "rope type"),
    (dict(FAMILIES["deepseek_v3"], n_group=3), "n_group"),
    (dict(FAMILIES["olmoe"], hidden_act="gelu"), "hidden_act"),
    (dict(FAMILIES["olmoe"], model_type="dbrx"), "unsupported model_type"),
])
def test_unsupported_options_are_refused_by_name(change, words):
    with pytest.raises(ConfigError, match=words):
        from_hf_dict(change)


def test_group_limited_routing_picks_from_the_best_groups():
    """DeepSeek-V3's router on hand-made scores: groups scored by their top-2 sum, experts
    chosen inside the best topk_group groups only, the correction bias used for the choice
    but not the weights, weights renormalised then scaled."""
    import jax.numpy as jnp

    from moejax import moe

    # 8 experts, 4 groups of 2; logits chosen so sigmoid scores are easy to order.
    logits = np.array([[3.0, -3.0, 0.5, 0.4, 2.0, 1.9, -1.0, 2.5]], np.float32)
    bias = np.array([0, 0, 0, 0, 0, 0, 0, -0.9], np.float32)
    # x = the logits, router = identity: the router's logits are x itself.
    routing = moe.route_scored(jnp.asarray(logits), jnp.eye(8, dtype=jnp.float32), 2,
                               norm_topk_prob=True, scoring="sigmoid",
                               choice_bias=jnp.asarray(bias), n_group=4, topk_group=2,
                               group_score="top2_sum", scaling=2.5)
    s = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
    choice = s + bias
    groups = choice.reshape(4, 2).sum(1)                    # top-2 sum of 2 = the sum
    best = set(np.argsort(-groups)[:2])
    allowed = [e for e in range(8) if e // 2 in best]
    want = sorted(allowed, key=lambda e: -choice[e])[:2]
    assert want == [4, 5] and sorted(np.argsort(-choice)[:2]) == [0, 4]   # groups matter
    assert sorted(np.asarray(routing.experts[0]).tolist()) == sorted(want)
    w = s[want] / s[want].sum() * 2.5
    np.testing.assert_allclose(np.sort(np.asarray(routing.weights[0])), np.sort(w), rtol=1e-6)

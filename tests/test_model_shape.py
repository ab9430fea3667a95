"""moejax.model_shape: the one ModelShape of the cost models. Its input checks (each
bad field named), its byte and weight counts against hand computations (Qwen3-30B-A3B
and a small fp32 shape), and QWEN3_30B_A3B against the numbers of Qwen3-30B-A3B's
public config.json."""

from __future__ import annotations

import dataclasses

import pytest

from moejax.model_shape import QWEN3_30B_A3B, ModelShape

GOOD = dict(num_layers=2, num_experts=8, top_k=2, hidden_size=16, expert_intermediate=12,
            num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=100)

# Qwen/Qwen3-30B-A3B config.json (Hugging Face hub), the keys the shape holds.
QWEN3_30B_A3B_CONFIG = {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                        "hidden_size": 2048, "moe_intermediate_size": 768,
                        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                        "vocab_size": 151936, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("field", sorted(GOOD) + ["dtype_bytes"])
@pytest.mark.parametrize("bad", [0, -3, 2.0, True, "8"])
def test_every_field_refuses_a_non_positive_or_non_int(field, bad):
    with pytest.raises(ValueError, match=rf"ModelShape\.{field} must be a positive int, "
                                         rf"got {bad!r}"):
        ModelShape(**{**GOOD, field: bad})


def test_top_k_above_experts_and_heads_not_a_multiple_of_kv_heads_are_refused():
    with pytest.raises(ValueError, match=r"ModelShape\.top_k=9 exceeds num_experts=8"):
        ModelShape(**{**GOOD, "top_k": 9})
    with pytest.raises(ValueError, match=r"ModelShape\.num_heads=4 is not a multiple of "
                                         r"num_kv_heads=3"):
        ModelShape(**{**GOOD, "num_kv_heads": 3})
    # the edges are allowed: every expert chosen, one KV head per query head
    shape = ModelShape(**{**GOOD, "top_k": 8, "num_kv_heads": 4})
    assert (shape.top_k, shape.num_kv_heads) == (8, 4)


def test_shape_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        QWEN3_30B_A3B.top_k = 4


def test_qwen3_30b_a3b_matches_its_public_config():
    config = QWEN3_30B_A3B_CONFIG
    assert QWEN3_30B_A3B.num_layers == config["num_hidden_layers"]
    assert QWEN3_30B_A3B.num_experts == config["num_experts"]
    assert QWEN3_30B_A3B.top_k == config["num_experts_per_tok"]
    assert QWEN3_30B_A3B.hidden_size == config["hidden_size"]
    assert QWEN3_30B_A3B.expert_intermediate == config["moe_intermediate_size"]
    assert QWEN3_30B_A3B.num_heads == config["num_attention_heads"]
    assert QWEN3_30B_A3B.num_kv_heads == config["num_key_value_heads"]
    assert QWEN3_30B_A3B.head_dim == config["head_dim"]
    assert QWEN3_30B_A3B.vocab_size == config["vocab_size"]
    assert config["torch_dtype"] == "bfloat16" and QWEN3_30B_A3B.dtype_bytes == 2


def test_qwen3_30b_a3b_bytes_by_hand():
    shape = QWEN3_30B_A3B
    assert shape.expert_bytes == 3 * 2048 * 768 * 2 == 9_437_184           # 9.44 MB
    assert shape.layer_expert_bytes == 128 * 9_437_184 == 1_207_959_552    # 1.21 GB
    assert shape.kv_bytes_per_token_layer == 2 * 4 * 128 * 2 == 2048
    # q and o: 2048 x 4096 each; k and v: 2048 x 512 each
    assert shape.attention_weight_count == 2 * 2048 * 4096 + 2 * 2048 * 512 == 18_874_368
    assert shape.attention_weight_bytes == 37_748_736
    assert shape.router_weight_count == 2048 * 128 == 262_144
    assert shape.non_expert_weight_count == 18_874_368 + 262_144
    assert shape.lm_head_weight_count == 151936 * 2048 == 311_164_928


def test_small_fp32_shape_counts_by_hand():
    shape = ModelShape(**GOOD, dtype_bytes=4)
    assert shape.expert_bytes == 3 * 16 * 12 * 4 == 2304
    assert shape.layer_expert_bytes == 8 * 2304
    assert shape.kv_bytes_per_token_layer == 2 * 2 * 8 * 4 == 128
    assert shape.attention_weight_count == 2 * 16 * 32 + 2 * 16 * 16 == 1536
    assert shape.attention_weight_bytes == 1536 * 4
    assert shape.router_weight_count == 16 * 8
    assert shape.non_expert_weight_count == 1536 + 128
    assert shape.lm_head_weight_count == 100 * 16

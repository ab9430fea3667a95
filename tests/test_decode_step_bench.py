"""benchmarks/decode_step.py: the bytes floor against hand counts (routing, KV, dense
weights), the random weights' layout, and a quick run on the demo model that writes the
named figures. No timing is asserted."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

from benchmarks import decode_step
from moejax import model
from moejax.config import ModelConfig

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                  qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e4, max_context=128,
                  tie_word_embeddings=False)


def test_floor_bytes_hand_count():
    # Layer 0: rows chose {0, 1}, {1, 2}, {0, 2}: 3 distinct experts. Layer 1: every row
    # chose {3, 4}, but row 2's expert 4 has weight 0 (reads nothing): still 2.
    experts = np.array([[[0, 1], [1, 2], [0, 2]],
                        [[3, 4], [3, 4], [4, 3]]], np.int32)
    weights = np.full(experts.shape, 0.5, np.float32)
    weights[1, 2, 0] = 0.0
    per_expert = 3 * 32 * 16 * 4
    kv_token = 2 * 2 * 8 * 2 * 4          # layers × kv heads × head dim × (k, v) × bytes
    floor = decode_step.floor_bytes(experts, weights=weights, expert_bytes=per_expert,
                                    context_tokens=10, kv_token_bytes=kv_token,
                                    dense_bytes=1000)
    assert floor == {"experts": 5 * per_expert, "kv": 10 * kv_token, "dense": 1000,
                     "total": 5 * per_expert + 10 * kv_token + 1000, "active": 5}
    # A zero weight in layer 0 where another row still reads the expert changes nothing;
    # with no weights given every choice counts.
    weights[0, 0, 0] = 0.0
    assert decode_step.floor_bytes(experts, weights=weights, expert_bytes=1, context_tokens=0,
                                   kv_token_bytes=1, dense_bytes=0)["active"] == 5
    only_row_one = experts[:, 1:2]          # {1, 2} and {3, 4}
    assert decode_step.floor_bytes(only_row_one, expert_bytes=7, context_tokens=3,
                                   kv_token_bytes=2, dense_bytes=1)["total"] == 4 * 7 + 6 + 1
    with pytest.raises(ValueError):
        decode_step.floor_bytes(experts[0], expert_bytes=1, context_tokens=0,
                                kv_token_bytes=1, dense_bytes=0)


def test_weight_and_kv_bytes_hand_count():
    params = model.init_params(CFG, seed=0)
    d, f, E, L, V = 32, 16, 8, 2, 64
    nq, nkv, h = 4, 2, 8
    assert decode_step.expert_bytes_per_expert(params, CFG) == 3 * d * f * 4
    assert decode_step.kv_token_bytes(CFG, 4) == L * nkv * h * 2 * 4
    assert decode_step.kv_token_bytes(CFG, 2) == L * nkv * h * 2 * 2
    per_layer = (d                      # attn_norm
                 + d * nq * h + 2 * d * nkv * h + nq * h * d     # wq, wk, wv, wo
                 + 2 * h                # q_norm, k_norm
                 + d                    # mlp_norm
                 + d * E)               # router
    dense = (L * per_layer + d + d * V) * 4      # + final_norm, lm_head; embed left out
    assert decode_step.dense_weight_bytes(params, CFG) == dense
    tied_cfg = dataclasses.replace(CFG, tie_word_embeddings=True)
    tied = model.init_params(tied_cfg, seed=0)
    assert "lm_head" not in tied
    assert decode_step.dense_weight_bytes(tied, tied_cfg) == dense   # the table is the head


def test_random_params_layout():
    from moejax.param_layout import param_shapes

    params = decode_step.random_params(CFG, np.float32)
    model.check_params(params, CFG)
    shapes = param_shapes(CFG)
    assert params["layers"]["w_down"].shape == shapes["layers"]["w_down"]
    w_gate = np.asarray(params["layers"]["w_gate"])
    assert w_gate.dtype == np.float32
    assert abs(float(w_gate.std()) - decode_step.SCALE) < 0.002
    assert not np.array_equal(w_gate[0, 0], w_gate[0, 1])      # experts differ
    assert not np.array_equal(w_gate[0, 0], w_gate[1, 0])      # layers differ
    assert np.all(np.asarray(params["layers"]["attn_norm"]) == 1.0)


def test_quick_run_on_the_demo_writes_the_figures(tmp_path):
    path = tmp_path / "decode_step.json"
    returned = decode_step.main(["--quick", "--shapes", "demo", "--copy-mib", "32",
                                 "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures.keys() == returned.keys()
    key = "demo_8"
    positive = [f"decode_step_ms_{key}_in_place", f"decode_step_ms_{key}_sliced",
                f"decode_step_floor_ms_{key}", f"decode_step_over_floor_{key}_in_place",
                f"decode_step_over_floor_{key}_sliced", "copy_bandwidth_gb_s",
                f"floor_bytes_{key}", f"floor_expert_bytes_{key}", f"floor_kv_bytes_{key}",
                f"floor_dense_bytes_{key}", f"active_experts_mean_{key}",
                "layer_copy_floor_ms_demo", "layer_expert_bytes_demo"]
    for name in positive:
        assert name in figures, name
        assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures[name])
    # The copy's cost is a difference of two noisy times: finite, either sign.
    assert math.isfinite(figures[f"copy_per_layer_ms_{key}"])
    assert figures[f"floor_bytes_{key}"] == (figures[f"floor_expert_bytes_{key}"]
                                             + figures[f"floor_kv_bytes_{key}"]
                                             + figures[f"floor_dense_bytes_{key}"])
    ratio = figures[f"decode_step_ms_{key}_in_place"] / figures[f"decode_step_floor_ms_{key}"]
    assert figures[f"decode_step_over_floor_{key}_in_place"] == pytest.approx(ratio)
    # Quick: one-token prompts, each decode row reads its one token of context.
    assert figures[f"context_tokens_{key}"] == 8
    assert figures[f"timed_steps_{key}"] >= 2
    for name in ("machine", "date", "command", "meta_date_utc", "meta_git_commit",
                 "compiles_in_timed_passes"):
        assert name in figures, name
    assert figures["compiles_in_timed_passes"] == 0

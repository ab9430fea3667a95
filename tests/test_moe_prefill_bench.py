"""``benchmarks/moe_prefill.py``, the MoE-Prefill evaluation harness: its Table 1
formulas on a hand-checkable shape, and a reduced ``--quick`` run whose deterministic
figures (FLOPs over ideal, hit rate, the keys the issue names) are checked."""

from __future__ import annotations

import json

import pytest

from benchmarks import moe_prefill as mp
from moejax.config import ModelConfig

# d=4, f=2, 4 experts top-2, 2 q heads / 1 kv head of width 2, 3 layers.
SMALL = ModelConfig(model_type="qwen3_moe", vocab_size=10, hidden_size=4, num_layers=3,
                    num_heads=2, num_kv_heads=1, head_dim=2, num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=2, norm_topk_prob=True,
                    qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e4, max_context=64,
                    tie_word_embeddings=False)


def test_table1_formulas_on_a_small_shape():
    t = mp.table1(SMALL, degree=2, tokens=10, itemsize=2)
    expert = 3 * 4 * 2 * 2                                   # one expert: 48 bytes
    attention = (4 * (2 + 2) * 2 + 2 * 2 * 4) * 2            # wq, wk, wv + wo: 96 bytes
    assert t["DP+EP"].critical == 2 * 0.5 * 10 * 2 * 4 * 2   # two all-to-alls of k rows
    assert t["DP+TP"].critical == 2 * 1 * 10 * 4 * 2          # gather + reduce-scatter
    assert t["TP+TP"].critical == t["TP+EP"].critical == 2 * 2 * 0.5 * 20 * 4 * 2
    assert t["DP+AsyncEP"].critical == 0 and t["DP+AsyncEP"].background == 0.5 * 4 * expert
    assert t["DP+EP"].weights == attention + 4 * expert / 2
    assert t["TP+TP"].weights == (attention + 4 * expert) / 2
    assert t["PP+PP"].weights == (attention + 4 * expert) / 2   # L/G whole layers
    assert t["PP+PP"].critical == (2 - 1) * 10 * 4 * 2 / 3     # G-1 boundaries over L layers
    figures = mp.table1_figures(SMALL, 2, 10)
    assert figures["critical_path_bytes_per_layer_dp_ep"] == t["DP+EP"].critical
    assert figures["peak_memory_per_device_tp_tp"] == t["TP+TP"].weights * 3


def test_cells_a_system_cannot_run_say_why():
    assert "kv heads" in mp.system_options("TP+EP", 4, 64)
    assert "layers" in mp.system_options("PP+PP", 8, 64)
    assert "kv heads" in mp.system_options("TP+TP/PrefillOnly", 4, 64)
    assert mp.system_options("MoE-Prefill", 2, 64) == dict(backend="async_ep", devices=2,
                                                           prefix_cache_blocks=64)
    assert mp.system_options("DP+EP/PrefillOnly", 4, 64) == dict(
        backend="sync_ep", devices=4, share_prompts=False, routing="prefill_only")
    assert mp.system_options("PrefillOnly-1", 1, 64)["max_num_seqs"] == 1


@pytest.mark.slow
def test_quick_run_reports_the_issue_keys(tmp_path):
    path = tmp_path / "moe_prefill.json"
    mp.main(["--quick", "--systems", "DP+EP,DP+EP/PrefillOnly,AsyncEP-plain,MoE-Prefill",
             "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["flops_over_ideal_mix_2"] <= 1.1           # the router keeps prefixes
    assert figures["prefix_hit_rate_mix_2"] > 0.3
    assert figures["mix_DP+EP_2_hit_rate"] == 0               # no pool, no reuse
    # PrefillOnly's scheduler reorders a poolless group's ops; it computes the same FLOPs.
    assert figures["mix_DP+EP/PrefillOnly_2_flops_over_ideal"] == pytest.approx(
        figures["mix_DP+EP_2_flops_over_ideal"])
    assert figures["moe_prefill_over_best_baseline_mix_2"] > 0
    assert figures["frontend_gain_over_asyncep_plain_2"] > 0
    for key in ("critical_path_bytes_per_layer_dp_ep", "background_bytes_per_layer_dp_asyncep",
                "peak_memory_per_device_dp_asyncep"):
        assert figures[key] > 0
    # Bytes counted from the compiled programs beside the formula: AsyncEP holds layer 0
    # whole and gathers the other L-1 (of the demo's 4) in the background; DP+EP's
    # all-to-alls move the rows on the critical path, padded to a capacity (more than k
    # copies of the rows that leave the device).
    assert figures["mix_AsyncEP-plain_2_critical_bytes_per_layer"] == 0
    assert figures["mix_MoE-Prefill_2_counted_over_formula"] == pytest.approx(3 / 4)
    assert figures["mix_DP+EP_2_background_bytes_per_layer"] == 0
    assert figures["mix_DP+EP_2_counted_over_formula"] >= 1

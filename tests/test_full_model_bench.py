"""benchmarks/full_model.py (weights made where they live, the memory arithmetic, a
quick CPU run) and benchmarks/gpu_summary.py (on synthetic suite outputs)."""

from __future__ import annotations

import argparse
import json
import math

import jax
import numpy as np

from benchmarks import full_model as fm
from benchmarks import gpu_summary as gs
from benchmarks.lib import models
from moejax.param_layout import param_shapes


def _tiny():
    return models.model_shape(argparse.Namespace(quick=True, layers=2, dtype=None))


def test_weight_bytes_by_hand():
    cfg, _ = _tiny()     # d=64, 16/8 heads of 8, E=8, f=32, V=512, qk-norm, untied
    d, q, kv, E, f, V, L = 64, 128, 64, 8, 32, 512, 2
    per_layer = (d + d * q + 2 * d * kv + q * d + d + d * E + 3 * E * d * f + 8 + 8)
    assert fm.weight_bytes(cfg, "float32") == 4 * (L * per_layer + 2 * V * d + d)
    assert fm.weight_bytes(cfg, "bfloat16") == fm.weight_bytes(cfg, "float32") // 2
    assert fm.expert_weight_bytes(cfg, "bfloat16") == 2 * L * 3 * E * d * f


def test_device_and_host_params_agree_with_the_layout():
    cfg, _ = _tiny()
    on_device = models.device_params(cfg, "float32", jax.devices()[0], seed=3)
    on_host = models.host_params(cfg, "float32", seed=3)
    shapes = param_shapes(cfg)
    assert on_device["layers"]["w_gate"].shape == shapes["layers"]["w_gate"]
    assert isinstance(on_host["layers"]["w_up"], np.ndarray)
    for name, shape in shapes["layers"].items():
        np.testing.assert_allclose(np.asarray(on_device["layers"][name]),   # one draw
                                   on_host["layers"][name], rtol=1e-6, atol=1e-9)
    np.testing.assert_array_equal(on_host["layers"]["attn_norm"], 1.0)
    w = on_host["layers"]["w_down"]
    assert not np.array_equal(w[0], w[1])                  # each layer its own draw
    assert 0.015 < float(np.std(w)) < 0.025
    assert models.device_params(cfg, "bfloat16", jax.devices()[0])["embed"].dtype == jnp_bf16()


def jnp_bf16():
    import jax.numpy as jnp

    return jnp.bfloat16


def test_plan_picks_the_largest_batch_that_fits_and_else_offload():
    cfg, dtype = _tiny()
    workload = lambda tokens: models.make_workload(cfg, 1, 32, tokens)[0]  # noqa: E731
    weights = fm.weight_bytes(cfg, dtype)
    roomy = fm.plan_resident(cfg, dtype, [128, 256], 128, 100 * weights + 2 ** 30, workload)
    assert (roomy.backend, roomy.tokens) == ("resident", 256)
    assert roomy.temp > 0 and roomy.compiled is not None
    tight = fm.plan_resident(cfg, dtype, [128, 256], 128, weights, workload)
    assert tight.backend == "offload" and "exceed" in tight.lines[-1]
    assert fm.fits(100, 0, 105) and not fm.fits(100, 1, 105)


def test_quick_run_writes_the_figures(tmp_path):
    path = tmp_path / "full_model.json"
    fm.main(["--quick", "--repeats", "1", "--json", str(path)])
    figures = json.loads(path.read_text())
    assert figures["full_model_backend"] == "resident"
    assert figures["full_model_layers"] == 3
    assert figures["full_model_tokens_per_s"] > 0
    assert 0 < figures["full_model_mfu"] and math.isfinite(figures["full_model_mfu"])
    assert figures["paper_moe_prefill_mfu_low"] == 0.298
    assert "resident at 128 tokens" in figures["decision"]


# ------------------------------------------------------------------ gpu_summary
def _write(directory, name: str, data) -> None:
    (directory / name).write_text(json.dumps(data) if not isinstance(data, str) else data)


def test_summary_of_a_complete_suite_run(tmp_path):
    _write(tmp_path, "backends.json", {"resident_mfu": 0.2, "padded_tokens": 32768,
                                       "offload_exposed_transfer_fraction": 0.12,
                                       "offload_over_resident": 0.5,
                                       "offload_batch_over_theta": 0.8})
    _write(tmp_path, "backends_131k.json", {"resident_mfu": 0.236, "padded_tokens": 131072,
                                            "offload_over_resident": 0.93,
                                            "offload_batch_over_theta": 2.5})
    _write(tmp_path, "backends_theta.json", {"offload_over_resident": 0.9,
                                             "offload_exposed_transfer_fraction": 0.04,
                                             "offload_batch_over_theta": 1.6})
    _write(tmp_path, "gmm.json", {"qwen3_16384_pallas_fraction_of_matmul": 0.4,
                                  "qwen3_16384_best_fraction_of_matmul": 0.55,
                                  "mixtral_16384_pallas_fraction_of_matmul": 0.6,
                                  "qwen3_4096_best_fraction_of_matmul": 0.1})
    _write(tmp_path, "gmm_mixtral.json", {"mixtral_16384_mosaic_over_triton": 1.02})
    _write(tmp_path, "metro.json", {"metro_kernel_device_us": 41.5})
    _write(tmp_path, "full_model.json", {"full_model_tokens_per_s": 12345.0})
    _write(tmp_path, "env.json", {"matmul_bf16_tflops": 702.0})
    summary = gs.main([str(tmp_path)])
    assert summary == {"resident_mfu_qwen3_30b": 0.236, "gmm_qwen3_fraction_of_matmul": 0.55,
                       "gmm_mixtral_fraction_of_matmul": 0.6,
                       # every offload figure from the run at the smallest batch >= 1.5 Θ
                       "offload_exposed_transfer_fraction": 0.04,
                       "offload_over_resident_at_1p5_theta": 0.9,
                       "offload_batch_over_theta": 1.6,
                       "metro_kernel_device_us": 41.5, "full_model_tokens_per_s": 12345.0,
                       "matmul_bf16_tflops": 702.0, "gmm_mixtral_mosaic_over_triton": 1.02,
                       "missing": {k: summary["missing"][k] for k in (
                           "offload_exposed_step_start_fraction",
                           "offload_exposed_between_layers_fraction",
                           "offload_exposed_other_fraction", "gmm_qwen3_mosaic_over_triton",
                           "copy_tbps")}}
    assert "backends_theta.json has no number under offload_exposed_first_layer_fraction" in \
        summary["missing"]["offload_exposed_step_start_fraction"]
    assert "measured_backend" not in summary          # one shape's ratio is not the rule
    assert json.loads((tmp_path / "summary.json").read_text()) == summary


def test_summary_names_what_is_missing_and_why(tmp_path):
    _write(tmp_path, "backends.json", {"resident_mfu": 0.2, "padded_tokens": 32768,
                                       "offload_over_resident": 0.5,
                                       "offload_batch_over_theta": 1.2})
    _write(tmp_path, "gmm.json", {"qwen3_16384_pallas_fraction_of_matmul": 0.4})
    _write(tmp_path, "metro.json", "{not json")
    summary = gs.main([str(tmp_path), "--json", str(tmp_path / "s.json")])
    missing = summary["missing"]
    assert summary["gmm_qwen3_fraction_of_matmul"] == 0.4
    assert set(missing) == set(gs.KEYS) - {"gmm_qwen3_fraction_of_matmul"}
    assert "32768 padded tokens" in missing["resident_mfu_qwen3_30b"]
    assert "mixtral_16384_best_fraction_of_matmul" in missing["gmm_mixtral_fraction_of_matmul"]
    assert "1.2" in missing["offload_exposed_transfer_fraction"]
    assert "1.2" in missing["offload_over_resident_at_1p5_theta"]
    assert "unreadable: metro.json (JSONDecodeError" in missing["metro_kernel_device_us"]
    assert missing["full_model_tokens_per_s"].startswith(
        "no file has a number under full_model_tokens_per_s")
    assert not (tmp_path / "summary.json").exists()


def test_summary_takes_the_exposed_transfer_of_the_qualifying_run_only(tmp_path):
    _write(tmp_path, "backends.json", {"offload_over_resident": 0.5,
                                       "offload_exposed_transfer_fraction": 0.6,
                                       "offload_batch_over_theta": 0.2})
    _write(tmp_path, "backends_131k.json", {"offload_over_resident": 0.96,
                                            "offload_batch_over_theta": 1.9})
    summary = gs.main([str(tmp_path)])
    assert summary["offload_over_resident_at_1p5_theta"] == 0.96
    assert "backends_131k.json has no number under offload_exposed_transfer_fraction" in \
        summary["missing"]["offload_exposed_transfer_fraction"]


def test_summary_rejects_non_numbers():
    files = {"metro.json": {"metro_kernel_device_us": None},
             "full_model.json": {"full_model_tokens_per_s": True}}
    summary, _ = gs.summarize(files)
    assert "metro_kernel_device_us" in summary["missing"]
    assert "full_model_tokens_per_s" in summary["missing"]


def test_summary_falls_back_to_the_breakdown_mfu_and_gives_the_backend_rule(tmp_path):
    _write(tmp_path, "breakdown_32k.json", {"breakdown_mfu": 0.3, "breakdown_padded_tokens": 32768})
    _write(tmp_path, "breakdown_131k.json", {"breakdown_mfu": 0.41,
                                             "breakdown_padded_tokens": 131072})
    _write(tmp_path, "offload.json", {"offload_over_resident": 0.97,
                                      "offload_exposed_transfer_fraction": 0.03,
                                      "offload_exposed_first_layer_fraction": 0.02,
                                      "offload_exposed_between_layers_fraction": 0.006,
                                      "offload_exposed_other_fraction": 0.004,
                                      "offload_batch_over_theta": 1.86})
    _write(tmp_path, "gmm_qwen3.json", {"qwen3_16384_mosaic_over_triton": 1.1})
    _write(tmp_path, "gmm_mixtral.json", {"mixtral_16384_mosaic_over_triton": 0.97})
    summary = gs.main([str(tmp_path)])
    assert summary["resident_mfu_qwen3_30b"] == 0.41          # no backends run had one
    assert summary["offload_exposed_step_start_fraction"] == 0.02
    assert summary["offload_exposed_between_layers_fraction"] == 0.006
    assert summary["offload_exposed_other_fraction"] == 0.004
    assert summary["offload_batch_over_theta"] == 1.86
    assert summary["measured_backend"] == "triton"              # Mosaic lost on Mixtral
    _write(tmp_path, "gmm_mixtral.json", {"mixtral_16384_mosaic_over_triton": 1.0})
    assert gs.main([str(tmp_path)])["measured_backend"] == "mosaic"

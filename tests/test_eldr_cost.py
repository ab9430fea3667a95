"""benchmarks/eldr_cost.py: the least-squares fit recovers known costs, the synthetic
routing touches exactly n experts with k distinct ones per token (and moejax's router
reproduces it), and a quick run writes its figures. No timing is asserted."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import eldr_cost
from moejax import moe


def test_fit_recovers_known_costs():
    a, b, t0 = 37e-6, 1.5e-6, 130e-6
    n = np.array([8, 16, 32, 64, 128, 8, 64, 128, 16, 96])
    batch = np.array([8, 8, 8, 8, 16, 32, 32, 64, 64, 64])
    fit = eldr_cost.fit_cost(n, batch, t0 + a * n + b * batch)
    assert fit["a"] == pytest.approx(a, abs=1e-9)
    assert fit["b"] == pytest.approx(b, abs=1e-9)
    assert fit["t0"] == pytest.approx(t0, abs=1e-9)
    assert fit["r2"] == pytest.approx(1.0, abs=1e-9)


def test_fit_r2_below_one_with_noise_and_single_batch():
    rng = np.random.default_rng(0)
    n = np.tile([4, 8, 16, 32], 3)
    batch = np.repeat([2, 4, 8], 4)
    t = 1e-4 + 2e-5 * n + 1e-6 * batch + rng.normal(0, 2e-5, n.size)
    assert 0.0 < eldr_cost.fit_cost(n, batch, t)["r2"] < 1.0
    one_b = eldr_cost.fit_cost([4, 8, 16], [8, 8, 8], [3.0, 5.0, 9.0])   # t = 1 + n/2
    assert one_b["b"] == 0.0
    assert one_b["a"] == pytest.approx(0.5, abs=1e-9)
    assert one_b["t0"] == pytest.approx(1.0, abs=1e-9)
    with pytest.raises(ValueError):
        eldr_cost.fit_cost([4, 8], [2, 4], [1.0, 2.0])


@pytest.mark.parametrize("n, batch, k, num_experts", [
    (8, 1, 8, 128), (8, 8, 8, 128), (16, 2, 8, 128), (96, 16, 8, 128), (128, 16, 8, 128),
    (5, 3, 4, 32), (24, 8, 4, 32), (32, 16, 4, 32), (7, 7, 1, 7), (13, 4, 4, 32)])
def test_synthetic_experts(n, batch, k, num_experts):
    experts = eldr_cost.synthetic_experts(n, batch, k, num_experts, seed=n + batch)
    assert experts.shape == (batch, k) and experts.dtype == np.int32
    assert len(np.unique(experts)) == n
    assert all(len(set(row.tolist())) == k for row in experts)
    assert experts.min() >= 0 and experts.max() < num_experts


def test_synthetic_experts_given_subset_and_errors():
    subset = np.array([3, 9, 11, 20, 31])
    experts = eldr_cost.synthetic_experts(5, 4, 2, 32, subset=subset)
    assert set(np.unique(experts).tolist()) == set(subset.tolist())
    with pytest.raises(ValueError):
        eldr_cost.synthetic_experts(16, 1, 8, 128)     # B·k < n
    with pytest.raises(ValueError):
        eldr_cost.synthetic_experts(4, 8, 8, 128)      # n < k


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_router_inputs_reproduce_the_routing(dtype):
    experts = eldr_cost.synthetic_experts(24, 8, 4, 32, seed=1)
    x, router = eldr_cost.router_inputs(experts, 128, 32, np.float32, seed=2)
    routing = moe.route(jnp.asarray(x, dtype), jnp.asarray(router, dtype), 4,
                        norm_topk_prob=True)
    np.testing.assert_array_equal(np.sort(np.asarray(routing.experts), axis=1),
                                  np.sort(experts, axis=1))
    np.testing.assert_allclose(np.asarray(routing.weights), 0.25, atol=1e-6)


def test_quick_run_writes_the_figures(tmp_path):
    out, cost = tmp_path / "eldr.json", tmp_path / "cost.json"
    eldr_cost.main(["--quick", "--json", str(out), "--cost-out", str(cost),
                    "--source", "stacked,given", "--repeats", "1"])
    figures = json.loads(out.read_text())
    for key in ("a_us_per_expert", "b_us_per_row", "t0_us", "r2", "n_max_over_n_min_time_ratio",
                "device", "shape", "expert_impl", "t_us_n4_b4", "t_us_n32_b16",
                "fused_tiles_given_a_us_per_expert", "fused_tiles_stacked_r2"):
        assert key in figures, key
    assert figures["shape"] == "demo-e32" and figures["expert_impl"] == "fused_tiles"
    assert "t_us_n32_b4" not in figures              # B·k < n: skipped
    assert all(not isinstance(v, (dict, list)) for v in figures.values())   # flat
    model = json.loads(cost.read_text())
    for key in ("t0_s", "a_s", "b_s", "r2", "shape", "device", "expert_impl", "date",
                "command", "machine", "by_batch", "fits"):
        assert key in model, key
    assert set(model["fits"]) == {"fused_tiles_stacked", "fused_tiles_given"}
    assert model["a_s"] == pytest.approx(figures["a_us_per_expert"] * 1e-6)

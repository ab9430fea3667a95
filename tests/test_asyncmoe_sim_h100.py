"""The AsyncMoE simulator under the H100 cost table (``moejax.asyncmoe.costs.h100_cost_tables``
of ``benchmarks/data/eldr_cost_h100_qwen3-30b-a3b.json``) and ``benchmarks/asyncmoe_sim.py
--h100``. Pure NumPy / Python: no JAX programs run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from moejax.asyncmoe import costs, simulator
from moejax.asyncmoe.schedulers import DefragScheduler
from moejax.model_shape import QWEN3_30B_A3B


@pytest.fixture(scope="module")
def fit():
    return costs.load_h100_fit(costs.H100_FIT_FILE)


@pytest.fixture(scope="module")
def tables(fit):
    return costs.h100_cost_tables(fit)


def test_fit_is_the_measured_h100_one(fit):
    data = json.loads(Path(costs.H100_FIT_FILE).read_text())
    assert "H100" in data["device"] and data["shape"] == "qwen3-30b-a3b"
    assert fit["t0_s"] == data["fits"][costs.H100_FIT]["t0_s"]
    assert fit["a_s"] > 0 and fit["b_s"] > 0


def test_costs_monotone_in_rows(tables):
    rows = np.arange(1, 5000)
    for f in (tables.expert_s, tables.head_s):
        values = np.array([f(int(r)) for r in rows])
        assert np.all(np.diff(values) >= 0) and np.all(values > 0)
    for context in (1, 100, 300, 1000, 5000):
        values = np.array([tables.attention_s(int(b), context) for b in rows[:1200:7]])
        assert np.all(np.diff(values) >= 0)
    for batch in (1, 16, 300):
        values = [tables.attention_s(batch, c) for c in range(1, 5000, 50)]
        assert np.all(np.diff(values) >= 0)
    # the GPU regime: 256 rows cost little more than 1 (weight reads dominate)
    assert tables.expert_s(256) < 2 * tables.expert_s(1)


def test_table_matches_fit_at_its_sample_points(fit, tables):
    """At every (n, B) the fit was measured at, n experts of B·k/n rows each plus
    attention's fixed part give the fit's t0 + a·n + b·B."""
    data = json.loads(Path(costs.H100_FIT_FILE).read_text())
    k = QWEN3_30B_A3B.top_k
    for n, batch in data["points_n_b"]:
        want = fit["t0_s"] + fit["a_s"] * n + fit["b_s"] * batch
        rows = batch * k / n
        expert = np.interp(rows, tables.expert_batch, tables.expert_seconds)
        fixed = tables.attention_s(1, 1) - costs.h100_attention_roofline_s(1, 1)
        assert n * expert + fixed == pytest.approx(want, rel=1e-9)
        if float(rows).is_integer():
            assert n * tables.expert_s(int(rows)) + fixed == pytest.approx(want, rel=1e-9)


def test_table_round_trips_and_states_link(tables):
    again = costs.CostTables.from_dict(tables.to_dict())
    assert again == tables
    assert tables.link_bandwidth_Bps == costs.H100_LINK_BPS
    assert tables.link_s(0) == 0.0


class CountingDefrag(DefragScheduler):
    calls = 0

    def choose(self, queue_lengths):
        CountingDefrag.calls += 1
        return super().choose(queue_lengths)


@pytest.mark.parametrize("top_k", [1, 8])
def test_simulator_under_h100_runs_runtime_scheduler(tables, top_k):
    routing = simulator.SkewedRouting(QWEN3_30B_A3B.num_experts, top_k, 0.15, 0)
    workload = simulator.poisson_workload(16, 1e9, (50, 150), (5, 10), 0)
    common = dict(num_devices=8, num_layers=2, num_experts=QWEN3_30B_A3B.num_experts,
                  top_k=top_k, hidden=QWEN3_30B_A3B.hidden_size, dtype_bytes=2)
    CountingDefrag.calls = 0
    mu = simulator.simulate_mu_queue(tables, routing, workload, scheduler=CountingDefrag(),
                                     **common)
    ep = simulator.simulate_sync_ep(tables, routing, workload, **common)
    assert CountingDefrag.calls >= len(mu.batches) > 0
    tokens = sum(r.decode_tokens for r in workload)
    for result in (mu, ep):
        assert math.isfinite(result.throughput_tokens_per_s)
        assert result.throughput_tokens_per_s > 0
        assert sum(len(t.token_times) for t in result.requests) == tokens
    # every execution costs at least the table's floor: an expert at least a
    assert min(b.end - b.time for b in mu.batches) >= tables.expert_s(1) - 1e-12


def test_benchmark_quick_json(tmp_path):
    from benchmarks import asyncmoe_sim

    path = tmp_path / "h100.json"
    figures = asyncmoe_sim.main(["--h100", "--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(figures))
    for k in (1, 2, 8):
        for suffix in ("", "_16dev"):
            value = data[f"mu_queue_throughput_over_sync_ep_h100_top{k}{suffix}"]
            assert math.isfinite(value) and value > 0
    assert data["paper_mu_queue_over_sync_ep_top1_short"] == 2.7
    assert all(not isinstance(v, (dict, list)) for v in data.values())

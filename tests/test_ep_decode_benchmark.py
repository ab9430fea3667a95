"""The pieces of ``benchmarks/ep_decode.py`` its METRO figures rest on: the modelled MoE
time by hand, every router conserving each expert's tokens on devices that hold it,
METRO never above EPLB-even nor below the optimum, and the noise-floor pools."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import ep_decode
from kernels_pallas import metro


def test_moe_seconds_by_hand():
    fit = {"t0_s": 1e-4, "a_s": 3e-5, "b_s": 1e-6}
    tokens = np.array([[3, 0], [0, 2], [1, 1]])         # [E=3, G=2]
    # device 0: 2 experts, 4 rows; device 1: 2 experts, 3 rows; most rows received: 4.
    want = 1e-4 + max(3e-5 * 2 + 1e-6 * 4, 3e-5 * 2 + 1e-6 * 3) \
        + 2 * 4 * 2048 * 2 / 1e9                      # rows of Qwen3's 2048 bf16 values
    assert ep_decode.moe_seconds(tokens, fit, 1e9) == pytest.approx(want)


def test_routers_conserve_tokens_and_order():
    rng = np.random.default_rng(3)
    load = rng.random(16) + 0.1
    placement = metro.eplb_placement(load, 4, 24)
    for _ in range(20):
        ids = np.argsort(rng.random((32, 16)), axis=1)[:, :2]
        counts = metro.tokens_per_expert(ids, 16)
        routed = ep_decode.route_instance(placement, ids)
        peaks = {}
        for name, tokens in routed.items():
            np.testing.assert_array_equal(tokens.sum(axis=1), counts)
            assert not (tokens[~placement] > 0).any(), name      # only where placed
            peaks[name] = metro.activated_per_device(tokens).max()
        assert peaks["optimal"] <= peaks["metro"] <= peaks["eplb_even"]


def test_uniform_pools_are_distinct_top_k():
    load, pools = ep_decode.uniform_pools(3, 8, 2, 50, seed=1)
    assert load.shape == (3, 8) and len(pools) == 3
    for ids in pools:
        assert ids.shape == (50, 2) and (ids[:, 0] != ids[:, 1]).all()
        assert ids.min() >= 0 and ids.max() < 8


# ----------------------------------------------------------------------------- AsyncMoE half
def test_throughput_at_the_itl_bound():
    from benchmarks import asyncmoe_sim

    runs = [{"throughput": 100.0, "itl_p50_ms": 5.0}, {"throughput": 300.0, "itl_p50_ms": 9.0},
            {"throughput": 400.0, "itl_p50_ms": 12.0}]
    assert asyncmoe_sim.at_bound(runs, 10.0) == 300.0
    assert asyncmoe_sim.at_bound(runs, 4.0) == 0.0
    assert asyncmoe_sim.ratio(3.0, 2.0) == 1.5 and np.isnan(asyncmoe_sim.ratio(1.0, 0.0))


def test_cycled_routing_replays_recorded_requests():
    from benchmarks import asyncmoe_sim
    from moejax.asyncmoe.simulator import TraceRouting

    ids = {r: np.stack([np.array([[r, r + 1]])] * 2) for r in range(3)}     # [L=2, 1, 2]
    weights = {r: np.full((2, 1, 2), 0.5) for r in range(3)}
    cycled = asyncmoe_sim.Cycled(TraceRouting(ids, weights, 8), 3)
    assert (cycled.num_experts, cycled.top_k) == (8, 2)
    np.testing.assert_array_equal(cycled.topk(4, 0, 1)[0], [1, 2])         # request 4 -> 1


def test_cost_measurement_batch_is_one_decode_row_each():
    from benchmarks import asyncmoe_cost

    batch = asyncmoe_cost.decode_batch(3, 40)
    assert batch.block_tables.shape == (3, 3)
    assert len(set(batch.block_tables.ravel().tolist())) == 9           # no shared block
    np.testing.assert_array_equal(batch.positions, 39)
    np.testing.assert_array_equal(batch.write_slots, batch.block_tables[:, -1] * 16 + 39 % 16)
    np.testing.assert_array_equal(batch.context_len, 39)   # positions already in the pool


def test_queue_depth_over_time_reads_the_last_sample_before():
    from benchmarks import asyncmoe_sim

    samples = [(0.0, 0), (1.0, 5), (2.0, 9), (4.0, 2)]
    assert asyncmoe_sim.depth_at(samples, 0.25) == 5.0      # t = 1.0
    assert asyncmoe_sim.depth_at(samples, 0.5) == 9.0       # t = 2.0
    assert asyncmoe_sim.depth_at(samples, 0.7) == 9.0       # t = 2.8: still 9
    assert asyncmoe_sim.depth_at(samples, 1.0) == 2.0 and asyncmoe_sim.depth_at([], 0.5) == 0.0

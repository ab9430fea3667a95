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
        + 2 * 4 * ep_decode.QWEN_HIDDEN * ep_decode.BF16_BYTES / 1e9
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

"""Calibration of the saturation threshold Θ = (1+ε)·L_moe·t_x·R (moejax/calibrate.py)."""

from __future__ import annotations

import math

import pytest

from backend_fixtures import CFG, make_params
from moejax import calibrate as cal
from moejax.backends import make_backend


@pytest.fixture(scope="module")
def params():
    return make_params()


def test_threshold_formula():
    assert cal.threshold(0.1, 48, 2e-3, 5e14) == pytest.approx(1.1 * 48 * 2e-3 * 5e14)
    assert cal.threshold(0.0, 4, 0.0, 1e12) == 0.0


def test_layer_flops_count_matmuls_and_causal_attention():
    tokens, sequence = 256, 64
    per_layer_attention = CFG.attention_flops_range(1, sequence) // CFG.num_layers
    assert cal.layer_flops(CFG, tokens, sequence) == (
        tokens * CFG.linear_flops_per_layer + 4 * per_layer_attention)
    with pytest.raises(ValueError, match="multiple of reference_sequence"):
        cal.reference_batch(CFG, 100, 64)


def test_offload_measures_transfer_and_rate(params):
    backend = make_backend("offload", CFG, params)
    record = cal.calibrate(backend, eps=0.25, reference_tokens=128, reference_sequence=64,
                           repeats=2)
    assert record.source == "measured" and record.channel == "host_to_device"
    assert record.t_x > 0 and record.rate > 0
    assert len(record.layer_seconds) == CFG.num_layers and min(record.layer_seconds) > 0
    assert record.reference_flops == cal.layer_flops(CFG, 128, 64)
    assert record.theta == pytest.approx(1.25 * CFG.num_layers * record.t_x * record.rate)


def test_async_ep_times_the_all_gather(params):
    backend = make_backend("async_ep", CFG, params, devices=2)
    record = cal.calibrate(backend, reference_tokens=128, reference_sequence=64, repeats=1)
    assert record.channel == "all_gather" and record.t_x > 0 and record.theta > 0


def test_resident_is_zero_pinned_and_fallback(params):
    resident = make_backend("resident", CFG, params)
    assert cal.calibrate(resident).theta == 0.0
    pinned = cal.calibrate(resident, theta=3e9)
    assert pinned.source == "pinned" and pinned.theta == 3e9
    tp = make_backend("tp", CFG, params, devices=2)
    fallback = cal.calibrate(tp, max_batch_tokens=512)
    assert fallback.source == "fallback" and fallback.t_x is None
    expected = 512 * CFG.linear_flops_per_token + CFG.attention_flops_range(1, 512)
    assert math.isclose(fallback.theta, expected)
    assert cal.uncalibrated(resident, 512).theta == fallback.theta
    with pytest.raises(ValueError, match="eps must be >= 0"):
        cal.calibrate(resident, eps=-1)
    with pytest.raises(ValueError, match="pinned theta"):
        cal.calibrate(resident, theta=-5)

"""METRO in vectorized rounds (kernels_pallas.metro_rounds, route_metro_jax(impl="rounds"))
and the device-timing path of benchmarks/metro_quality.py."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import metro_quality
from kernels_pallas import metro
from kernels_pallas.metro_rounds import level_bounds, route_rounds

# Few distinct shapes: each compiles once. (1, 1), (6, 1): one device; 37, 100: N not a
# power of two; 12 devices: G not a power of two.
SHAPES = ((1, 1), (6, 1), (7, 3), (37, 8), (100, 12), (64, 16))
TRIALS = 25


def rounds(placement: np.ndarray, tokens: np.ndarray, order: str = "constrained") -> np.ndarray:
    return np.asarray(metro.route_metro_jax(jnp.asarray(placement), jnp.asarray(tokens),
                                            order=order, impl="rounds"))


def assert_valid(device: np.ndarray, placement: np.ndarray, tokens: np.ndarray) -> None:
    active = tokens > 0
    assert device.shape == tokens.shape
    np.testing.assert_array_equal(device[~active], metro.NO_DEVICE)
    assert placement[np.flatnonzero(active), device[active]].all()


def random_instance(rng: np.random.Generator, num_experts: int, num_devices: int):
    """Any placement (each expert on >= 1 device, some on all), some experts inactive."""
    density = rng.choice([0.1, 0.4, 1.0])
    placement = rng.random((num_experts, num_devices)) < density
    placement[np.arange(num_experts), rng.integers(0, num_devices, num_experts)] = True
    tokens = rng.integers(0, 4, num_experts) * (rng.random(num_experts) < rng.random())
    return placement, tokens.astype(np.int32)


def max_activated(device: np.ndarray, tokens: np.ndarray, num_devices: int) -> int:
    return int(metro.activated_per_device(metro.routed_tokens(device, tokens, num_devices)).max())


# --------------------------------------------------------------------------- validity


@pytest.mark.parametrize("shape", SHAPES)
def test_rounds_routing_is_valid_on_random_instances(shape):
    rng = np.random.default_rng(sum(shape))
    for trial in range(TRIALS):
        placement, tokens = random_instance(rng, *shape)
        order = metro.VISIT_ORDERS[trial % 2]
        assert_valid(rounds(placement, tokens, order), placement, tokens)


@pytest.mark.parametrize("shape", [(1, 1), (37, 8), (64, 16)])
def test_rounds_edge_cases(shape):
    num_experts, num_devices = shape
    everywhere = np.ones(shape, bool)
    ones = np.ones(num_experts, np.int32)
    # all experts inactive: nothing is routed
    np.testing.assert_array_equal(rounds(everywhere, np.zeros(num_experts, np.int32)),
                                  np.full(num_experts, -1))
    # every expert replicated everywhere: valid and as even as possible
    device = rounds(everywhere, ones)
    assert_valid(device, everywhere, ones)
    assert max_activated(device, ones, num_devices) == -(-num_experts // num_devices)
    # every expert on one device (the last): all land there
    last = np.zeros(shape, bool)
    last[:, -1] = True
    np.testing.assert_array_equal(rounds(last, ones), np.full(num_experts, num_devices - 1))


def test_level_bounds_cover_every_degree():
    assert level_bounds(1) == ()
    assert level_bounds(2) == (2,)
    assert level_bounds(3) == (2, 4)
    assert level_bounds(12) == (2, 4, 8, 16)
    assert level_bounds(16) == (2, 4, 8, 16)


def test_hand_checked_instance():
    # G = 3; rows in priority order (route_rounds keeps them); rotation key (g - i) mod 3.
    # forced: row 0 -> device 0; load [1, 0, 0]. Level 2, step 1 (rows 1, 2, 3):
    #   row 1 {0,1}: keys 1*3+2=5, 0*3+0=0 -> device 1, second-best load 1
    #   row 2 {0,1}: keys 3+1=4, 0+2=2     -> device 1, second-best load 1
    #   row 3 {1,2}: keys 0+1=1, 0+2=2     -> device 1, second-best load 0
    #   device 1 ranks: row 1 (0): 0+0 <= 1 yes; row 2 (1): 0+1 <= 1 yes; row 3 (2): 0+2 <= 0 no
    #   load [1, 2, 0]. Step 2: row 3 {1,2}: keys 2*3+1=7, 0+2=2 -> device 2 (rank 0): yes
    #   load [1, 2, 1]. Level 4, step 1: row 4 {0,1,2}: keys 3+2=5, 6+0=6, 3+1=4 -> device 2,
    #   second-best load 1: 1+0 <= 1 yes. Row 5 has no candidate -> -1.
    rows = jnp.asarray([[1, 0, 0], [1, 1, 0], [1, 1, 0], [0, 1, 1], [1, 1, 1], [0, 0, 0]],
                       jnp.int32)
    np.testing.assert_array_equal(np.asarray(route_rounds(rows)), [0, 1, 1, 2, 2, -1])


# --------------------------------------------------------------------------- determinism, jit


def test_rounds_is_deterministic_and_equal_under_jit_and_eager():
    rng = np.random.default_rng(5)
    placement, tokens = random_instance(rng, 37, 8)
    first = rounds(placement, tokens)
    np.testing.assert_array_equal(rounds(placement, tokens), first)
    with jax.disable_jit():
        eager = metro.route_metro_jax(jnp.asarray(placement), jnp.asarray(tokens), impl="rounds")
    np.testing.assert_array_equal(np.asarray(eager), first)
    nested = jax.jit(lambda a, t: metro.route_metro_jax(a, t, impl="rounds") + 0)
    np.testing.assert_array_equal(np.asarray(nested(jnp.asarray(placement),
                                                    jnp.asarray(tokens))), first)


def test_unknown_impl_is_rejected():
    with pytest.raises(ValueError, match="impl must be one of"):
        metro.route_metro_jax(jnp.ones((2, 2), bool), jnp.ones(2, jnp.int32), impl="warp")


# --------------------------------------------------------------------------- quality


@pytest.mark.parametrize("devices", [8, 16])
def test_rounds_beats_eplb_even_on_zipf_instances(devices):
    rng = np.random.default_rng(devices)
    experts = 128
    for tokens_per_device in (8, 32, 128):
        probs = metro_quality.popularity(rng, experts)
        history = metro_quality.sample_topk(rng, probs, metro_quality.HISTORY_TOKENS, 8)
        placement = metro.eplb_placement(metro.tokens_per_expert(history, experts), devices,
                                         round(1.5 * experts))
        batch = metro_quality.sample_topk(rng, probs, tokens_per_device * devices, 8)
        tokens = metro.tokens_per_expert(batch, experts)
        device = rounds(placement, tokens.astype(np.int32))
        assert_valid(device, placement, tokens)
        even = int(metro.activated_per_device(metro.route_eplb_even(placement, tokens)).max())
        assert max_activated(device, tokens, devices) <= even


# --------------------------------------------------------------------------- device timing


def _gpu_like_trace() -> dict:
    """Two host calls; the device plane has a stream line (kernels), an op line
    (duplicates) and a module line (a summary, to be ignored); one call runs a
    'metro_greedy' kernel beside another kernel."""
    meta = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "python3"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "Stream #7"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Ops"}},
        {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "XLA Modules"}},
    ]

    def x(pid, tid, name, ts, dur):
        return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}

    events = [
        x(1, 1, "PjitFunction(route_metro_jax)", 0, 30), x(1, 1, "PjitFunction(route_metro_jax)", 1, 28),
        x(2, 7, "sort_kernel", 20, 5), x(2, 7, "metro_greedy", 26, 10),
        x(2, 8, "custom-call.1", 26, 10), x(2, 9, "jit_route_metro_jax", 20, 100),
        x(1, 1, "PjitFunction(route_metro_jax)", 200, 30),
        x(2, 7, "sort_kernel", 220, 4), x(2, 7, "metro_greedy", 230, 12),
    ]
    return {"traceEvents": meta + events}


def test_trace_parsing_groups_device_events_per_call():
    trace = _gpu_like_trace()
    busy, span = metro_quality.per_call_device_us(trace, "route_metro_jax")
    assert busy == [15.0, 16.0]      # union of stream + op lines; module summary ignored
    assert span == [16.0, 22.0]
    kernel, _ = metro_quality.per_call_device_us(trace, "route_metro_jax", "metro_greedy")
    assert kernel == [10.0, 12.0]
    assert metro_quality.per_call_device_us(trace, "other_function") == ([], [])


def test_timing_flag_writes_its_keys(tmp_path, monkeypatch):
    # the smallest run of the real path: one instance per configuration, two traced calls
    monkeypatch.setattr(metro_quality, "INSTANCES_QUICK", 1)
    monkeypatch.setattr(metro_quality, "TRACED_CALLS_QUICK", 2)
    monkeypatch.setattr(metro_quality, "TIMING_REPEATS_QUICK", 2)
    out = tmp_path / "metro.json"
    assert metro_quality.main(["--quick", "--timing", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    for key in ("metro_kernel_device_us", "metro_kernel_host_wall_us", "metro_pallas_device_us",
                "metro_jax_device_us", "metro_rounds_device_us", "metro_rounds_over_optimal",
                "metro_rounds_over_metro"):
        assert figures[key] > 0, key
    assert figures["metro_kernel_device_us"] == figures[f"metro_{metro.DEFAULT_IMPL}_device_us"]
    assert figures["metro_timing_backend"] == jax.default_backend()

"""METRO routing (kernels_pallas.metro): placement, the three routers, batch assignment."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels_pallas import metro

# Few distinct shapes: every (shape, order) compiles the kernel once.
RANDOM_SHAPES = ((5, 3), (16, 4), (37, 8))
RANDOM_TRIALS = 6


def max_activated(device: np.ndarray, tokens: np.ndarray, num_devices: int) -> int:
    return int(metro.activated_per_device(metro.routed_tokens(device, tokens, num_devices)).max())


def ring_placement(num_experts: int) -> np.ndarray:
    """Expert i on devices i and i+1 (mod N): the seed's Fig. 4 shape with N = G."""
    placement = np.zeros((num_experts, num_experts), bool)
    idx = np.arange(num_experts)
    placement[idx, idx] = placement[idx, (idx + 1) % num_experts] = True
    return placement


def random_instance(rng: np.random.Generator, num_experts: int, num_devices: int):
    load = rng.random(num_experts) ** 3
    replicas = int(rng.integers(num_experts, num_experts * num_devices + 1))
    placement = metro.eplb_placement(load, num_devices, replicas)
    tokens = rng.integers(0, 3, num_experts) * (rng.random(num_experts) < 0.7)
    return placement, tokens


def brute_force_lambda(placement: np.ndarray, tokens: np.ndarray) -> int:
    experts = np.flatnonzero(tokens > 0)
    choices = [np.flatnonzero(placement[e]) for e in experts]
    best = len(experts)
    for pick in itertools.product(*choices):
        counts = np.bincount(np.asarray(pick, int), minlength=placement.shape[1])
        best = min(best, int(counts.max(initial=0)))
    return best


# --------------------------------------------------------------------------- known optima


def test_fig4_token_balancing_doubles_activated_experts():
    # 16 tokens (top-1) on 8 devices, 8 experts with 2 replicas each, 2 tokens per expert.
    placement = ring_placement(8)
    topk = np.repeat(np.arange(8), 2)[:, None]
    even = metro.assign_tokens(topk, placement, "eplb_even")
    np.testing.assert_array_equal(even.tokens_per_device, np.full(8, 2))
    np.testing.assert_array_equal(even.activated_per_device, np.full(8, 2))
    for router in ("metro", "optimal"):
        routed = metro.assign_tokens(topk, placement, router)
        np.testing.assert_array_equal(routed.activated_per_device, np.ones(8))
        np.testing.assert_array_equal(routed.tokens_per_device, np.full(8, 2))
        assert routed.max_activated * 2 == even.max_activated


def test_index_order_greedy_is_suboptimal_where_constrained_order_is_not():
    # expert 0 may go to device 0 or 1, expert 1 only to device 0
    placement = np.array([[1, 1], [1, 0]], bool)
    tokens = np.array([3, 1])
    index = metro.route_metro(placement, tokens, order="index")
    np.testing.assert_array_equal(index, [0, 0])
    assert max_activated(index, tokens, 2) == 2
    for route in (metro.route_metro, metro.route_metro_reference):
        np.testing.assert_array_equal(route(placement, tokens, order="constrained"), [1, 0])
    np.testing.assert_array_equal(metro.route_optimal(placement, tokens), [1, 0])


def test_full_replication_reaches_the_lower_bound():
    placement = np.ones((10, 4), bool)
    tokens = np.array([1, 0, 2, 5, 0, 1, 1, 3, 0, 7])  # 7 active experts -> ceil(7/4) = 2
    for route in (metro.route_metro, metro.route_optimal):
        device = route(placement, tokens)
        assert max_activated(device, tokens, 4) == 2
    # ties go to the lowest device id, so the greedy deals experts round-robin
    np.testing.assert_array_equal(metro.route_metro(placement, tokens),
                                  [0, -1, 1, 2, -1, 3, 0, 1, -1, 2])


def test_single_device_holds_everything():
    placement = np.zeros((6, 3), bool)
    placement[:, 2] = True
    tokens = np.array([1, 1, 0, 4, 1, 0])
    for route in (metro.route_metro, metro.route_metro_reference, metro.route_optimal):
        np.testing.assert_array_equal(route(placement, tokens), [2, 2, -1, 2, 2, -1])


def test_no_active_experts():
    placement = np.ones((4, 2), bool)
    tokens = np.zeros(4, np.int64)
    for route in (metro.route_metro, metro.route_metro_reference, metro.route_optimal):
        np.testing.assert_array_equal(route(placement, tokens), np.full(4, -1))
    np.testing.assert_array_equal(metro.route_eplb_even(placement, tokens), np.zeros((4, 2)))


def test_optimal_matches_brute_force_on_tiny_instances():
    rng = np.random.default_rng(3)
    for _ in range(40):
        num_experts, num_devices = int(rng.integers(1, 7)), int(rng.integers(1, 4))
        placement = rng.random((num_experts, num_devices)) < 0.5
        placement[np.arange(num_experts), rng.integers(0, num_devices, num_experts)] = True
        tokens = rng.integers(0, 2, num_experts)
        device = metro.route_optimal(placement, tokens)
        assert max_activated(device, tokens, num_devices) == brute_force_lambda(placement, tokens)


# --------------------------------------------------------------------------- random instances


@pytest.mark.parametrize("shape", RANDOM_SHAPES)
def test_greedy_kernel_matches_reference_and_bounds_optimal(shape):
    rng = np.random.default_rng(sum(shape))
    num_experts, num_devices = shape
    for _ in range(RANDOM_TRIALS):
        placement, tokens = random_instance(rng, num_experts, num_devices)
        optimal = metro.route_optimal(placement, tokens)
        best = max_activated(optimal, tokens, num_devices)
        for order in metro.VISIT_ORDERS:
            reference = metro.route_metro_reference(placement, tokens, order=order)
            kernel = metro.route_metro(placement, tokens, order=order, interpret=True)
            plain = metro.route_metro_jax(jnp.asarray(placement), jnp.asarray(tokens), order=order,
                                          impl="jax")
            np.testing.assert_array_equal(kernel, reference)
            np.testing.assert_array_equal(np.asarray(plain), reference)
            assert max_activated(kernel, tokens, num_devices) >= best
        for device in (kernel, optimal):
            active = tokens > 0
            np.testing.assert_array_equal(device[~active], -1)
            assert placement[np.flatnonzero(active), device[active]].all()


def test_metro_jax_is_jittable_and_defaults_to_interpret_on_cpu():
    assert metro.default_interpret() == (jax.default_backend() != "gpu")
    placement, tokens = random_instance(np.random.default_rng(0), 16, 4)
    fn = jax.jit(lambda a, t: metro.route_metro_jax(a, t) + 0)
    np.testing.assert_array_equal(np.asarray(fn(jnp.asarray(placement), jnp.asarray(tokens))),
                                  metro.route_metro_reference(placement, tokens))


@pytest.mark.parametrize("shape", [(256, 16), (100, 12)])
def test_kernel_lowers_for_cuda_with_triton(shape):
    placement, tokens = random_instance(np.random.default_rng(1), *shape)
    fn = jax.jit(lambda a, t: metro.route_metro_jax(a, t, interpret=False))
    text = fn.trace(jnp.asarray(placement), jnp.asarray(tokens)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


# --------------------------------------------------------------------------- placement


def test_replica_counts_are_proportional_to_load():
    np.testing.assert_array_equal(metro.eplb_replica_counts([8, 4, 2, 2], 4, 8), [4, 2, 1, 1])
    # at most one replica per device, the rest go to the next-highest load per replica
    np.testing.assert_array_equal(metro.eplb_replica_counts([100, 1, 1], 2, 5), [2, 2, 1])


def test_placement_properties_on_random_loads():
    rng = np.random.default_rng(7)
    for _ in range(300):
        num_experts, num_devices = int(rng.integers(1, 20)), int(rng.integers(1, 9))
        load = rng.integers(0, 50, num_experts) * (rng.random(num_experts) < 0.9)
        replicas = int(rng.integers(num_experts, num_experts * num_devices + 1))
        placement = metro.eplb_placement(load, num_devices, replicas)
        counts = placement.sum(axis=1)
        assert placement.dtype == bool and placement.shape == (num_experts, num_devices)
        assert placement.sum() == replicas and (counts >= 1).all() and (counts <= num_devices).all()
        np.testing.assert_array_equal(counts, metro.eplb_replica_counts(load, num_devices, replicas))
        columns = placement.sum(axis=0)
        assert columns.max() - columns.min() <= 1
        # more load never means fewer replicas, unless capped at one per device
        hotter = load[:, None] > load[None, :]
        assert (~hotter | (counts[:, None] >= counts[None, :])).all()


def test_placement_moves_a_replica_when_every_free_slot_holds_the_expert():
    # greedy packing gets stuck on the last replica here and must move one
    placement = metro.eplb_placement([5, 7, 7, 8], 3, 7)
    np.testing.assert_array_equal(placement.sum(axis=1), [1, 2, 2, 2])
    assert sorted(placement.sum(axis=0)) == [2, 2, 3]


def test_placement_balances_load_over_devices():
    load = np.array([90, 60, 30, 20, 10, 5, 3, 2], float)
    placement = metro.eplb_placement(load, 4, 12)
    per_replica = load / placement.sum(axis=1)
    device_load = (placement * per_replica[:, None]).sum(axis=0)
    assert device_load.max() <= 1.25 * device_load.mean()


def _assert_valid_placement(placement, load, num_devices, num_replicas):
    """Every device holds exactly its slots, every expert 1..G replicas, as many as
    eplb_replica_counts gives it, and the replica counts add up to num_replicas."""
    slots = np.full(num_devices, num_replicas // num_devices)
    slots[: num_replicas % num_devices] += 1
    counts = placement.sum(axis=1)
    assert placement.shape == (len(load), num_devices) and placement.dtype == bool
    np.testing.assert_array_equal(placement.sum(axis=0), slots)
    assert (counts >= 1).all() and counts.sum() == num_replicas
    np.testing.assert_array_equal(counts, metro.eplb_replica_counts(load, num_devices,
                                                                    num_replicas))


def _placement_before_fix(load, num_devices, num_replicas):
    """eplb_placement as it was before the overflow fix (verbatim packing loop: ``argmin``
    over the loads with ``inf`` for devices without room), the reference for finite sums."""
    counts = metro.eplb_replica_counts(load, num_devices, num_replicas)
    load = np.asarray(load, np.float64)
    per_replica = load / counts
    slots = np.full(num_devices, num_replicas // num_devices, np.int64)
    slots[: num_replicas % num_devices] += 1
    holds = np.zeros((len(load), num_devices), bool)
    device_load = np.zeros(num_devices, np.float64)
    used = np.zeros(num_devices, np.int64)
    expert_order = np.argsort(-per_replica, kind="stable")
    for expert in np.repeat(expert_order, counts[expert_order]):
        ok = (used < slots) & ~holds[expert]
        if not ok.any():
            metro._make_room(int(expert), holds, device_load, used, slots, per_replica)
            ok = (used < slots) & ~holds[expert]
        device = int(np.argmin(np.where(ok, device_load, np.inf)))
        holds[expert, device] = True
        device_load[device] += per_replica[expert]
        used[device] += 1
    return holds


def test_placement_with_overflowing_loads_is_valid():
    # 64 experts of load 1e308: every device total overflows to inf; the packing used to
    # put 50 replicas on device 0 and lose 32 of the 96.
    load = np.full(64, 1e308)
    placement = metro.eplb_placement(load, 8, 96)
    _assert_valid_placement(placement, load, 8, 96)
    np.testing.assert_array_equal(placement.sum(axis=0), np.full(8, 12))


def test_placement_of_huge_loads_matches_the_same_proportions_at_small_scale():
    # k * 2**1020 sums past float64's max (2**1024); scaled by the max load (8 * 2**1020)
    # every load is k / 8 exactly, so the placement must be that of the small loads k.
    rng = np.random.default_rng(3)
    for num_devices, num_replicas in ((8, 96), (5, 70), (3, 64)):
        small = rng.integers(1, 9, 64).astype(np.float64)
        small[0] = 8
        huge = small * 2.0**1020
        with np.errstate(over="ignore"):
            assert not np.isfinite(np.sum(huge))
        placement = metro.eplb_placement(huge, num_devices, num_replicas)
        _assert_valid_placement(placement, huge, num_devices, num_replicas)
        np.testing.assert_array_equal(
            placement, metro.eplb_placement(small / 8, num_devices, num_replicas))
        np.testing.assert_array_equal(
            placement, metro.eplb_placement(small, num_devices, num_replicas))


def test_placement_of_ordinary_loads_is_unchanged_by_the_overflow_fix():
    rng = np.random.default_rng(11)
    for trial in range(150):
        num_experts, num_devices = int(rng.integers(1, 40)), int(rng.integers(1, 12))
        load = (rng.integers(0, 20, num_experts).astype(np.float64) if trial % 3 == 0
                else rng.random(num_experts) ** 3 if trial % 3 == 1
                else rng.pareto(1.2, num_experts) * 1e300)   # large, but the sum is finite
        replicas = int(rng.integers(num_experts, num_experts * num_devices + 1))
        placement = metro.eplb_placement(load, num_devices, replicas)
        np.testing.assert_array_equal(placement,
                                      _placement_before_fix(load, num_devices, replicas))
        _assert_valid_placement(placement, load, num_devices, replicas)


@pytest.mark.parametrize("bad, shown", [(np.nan, "nan"), (np.inf, "inf"), (-0.5, "-0.5")])
def test_placement_names_the_bad_expert_load(bad, shown, typechecks_off):
    load = [1.0, 2.0, bad, 3.0]
    for fn in (metro.eplb_placement, metro.eplb_replica_counts):
        with pytest.raises(ValueError, match=rf"expert_load .* expert 2 has {shown} "):
            fn(load, 2, 6)


@pytest.mark.parametrize("load, devices, replicas, match", [
    (np.ones((2, 2)), 2, 4, "1-D"),
    ([1.0, -1.0], 2, 2, "non-negative"),
    ([1.0, np.nan], 2, 2, "finite"),
    ([1.0, 2.0], 0, 2, "num_devices"),
    ([1.0, 2.0], True, 2, "num_devices"),
    ([1.0, 2.0], 2, 1, "num_replicas"),
    ([1.0, 2.0], 2, 5, "num_replicas"),
    ([1.0, 2.0], 2, 2.5, "num_replicas"),
])
def test_placement_rejects_bad_input(load, devices, replicas, match, typechecks_off):
    with pytest.raises(ValueError, match=match):
        metro.eplb_placement(load, devices, replicas)


# --------------------------------------------------------------------------- EPLB-even router


def test_eplb_even_rule_and_conservation():
    placement = np.array([[0, 1, 0, 1], [1, 1, 1, 1], [0, 0, 1, 0]], bool)
    tokens = np.array([5, 2, 0])
    np.testing.assert_array_equal(metro.route_eplb_even(placement, tokens),
                                  [[0, 3, 0, 2], [1, 1, 0, 0], [0, 0, 0, 0]])
    rng = np.random.default_rng(5)
    for _ in range(20):
        placement, _ = random_instance(rng, 12, 4)
        tokens = rng.integers(0, 40, 12)
        split = metro.route_eplb_even(placement, tokens)
        np.testing.assert_array_equal(split.sum(axis=1), tokens)
        assert (split[~placement] == 0).all()
        on_replicas = np.where(placement, split, -1)
        spread = on_replicas.max(axis=1) - np.where(placement, split, np.iinfo(np.int64).max).min(axis=1)
        assert (spread <= 1).all()


# --------------------------------------------------------------------------- routing input checks


@pytest.mark.parametrize("route", [metro.route_eplb_even, metro.route_metro,
                                   metro.route_metro_reference, metro.route_optimal])
@pytest.mark.parametrize("placement, tokens, match", [
    (np.ones(3, bool), [1, 1, 1], "2-D"),
    (np.full((2, 2), 2), [1, 1], "0/1"),
    (np.ones((2, 2), bool), [1, 1, 1], "one entry per expert"),
    (np.ones((2, 2), bool), [1, -1], "non-negative"),
    (np.ones((2, 2), bool), [1.0, 1.0], "integers"),
    (np.array([[1, 0], [0, 0]], bool), [1, 3], "expert 1 has 3 tokens but no replica"),
])
def test_routers_reject_bad_input(route, placement, tokens, match, typechecks_off):
    with pytest.raises(ValueError, match=match):
        route(placement, np.asarray(tokens))


def test_bad_order_router_and_topk(typechecks_off):
    placement = np.ones((3, 2), bool)
    with pytest.raises(ValueError, match="order"):
        metro.route_metro_reference(placement, np.array([1, 1, 1]), order="random")
    with pytest.raises(ValueError, match="router"):
        metro.assign_tokens(np.zeros((2, 1), int), placement, "round_robin")
    with pytest.raises(ValueError, match="topk_ids must lie in"):
        metro.assign_tokens(np.array([[0, 3]]), placement)
    with pytest.raises(ValueError, match="2-D"):
        metro.tokens_per_expert(np.array([0, 1]), 3)


# --------------------------------------------------------------------------- batch assignment


def test_tokens_per_expert_counts_every_pick():
    np.testing.assert_array_equal(metro.tokens_per_expert(np.array([[0, 2], [2, 3]]), 5),
                                  [1, 0, 2, 1, 0])


@pytest.mark.parametrize("router", metro.ROUTERS)
def test_assign_tokens_uses_replicas_and_counts_match(router):
    rng = np.random.default_rng(11)
    num_experts, num_devices, top_k = 16, 4, 3
    placement, _ = random_instance(rng, num_experts, num_devices)
    topk = np.stack([rng.choice(num_experts, top_k, replace=False) for _ in range(24)])
    result = metro.assign_tokens(topk, placement, router)
    assert result.device.shape == topk.shape
    assert placement[topk, result.device].all()
    expert_tokens = np.zeros((num_experts, num_devices), np.int64)
    np.add.at(expert_tokens, (topk.ravel(), result.device.ravel()), 1)
    np.testing.assert_array_equal(result.tokens_per_device, expert_tokens.sum(axis=0))
    np.testing.assert_array_equal(result.activated_per_device, (expert_tokens > 0).sum(axis=0))
    assert result.tokens_per_device.sum() == topk.size
    counts = metro.tokens_per_expert(topk, num_experts)
    if router == "eplb_even":
        np.testing.assert_array_equal(expert_tokens, metro.route_eplb_even(placement, counts))
    else:
        route = metro.route_metro if router == "metro" else metro.route_optimal
        expected = route(placement, counts)
        np.testing.assert_array_equal(result.device, expected[topk])

"""Expert replicas and token → replica routing inside the μ-queue (issue 44; seed: METRO):
the three policies against ``kernels_pallas.metro``'s NumPy reference and EPLB-even
dealer; METRO never activates more experts per device than even routing on crafted
batches (the seed's Fig. 4 example, and random batches where every expert has a token
per replica); the engine routes copies to the chosen replicas; the real runtime on 4 CPU
devices gives the resident decoder's tokens with replicas under "metro" and
"round_robin", and the simulator replays its batches exactly; validation errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kernels_pallas import metro as metro_kernels
from moejax.asyncmoe import simulator
from moejax.asyncmoe.engine import Batch, DeviceEngine
from moejax.asyncmoe.placement import ReplicaSets, make_placement
from moejax.asyncmoe.records import ATTENTION_UNIT, HEAD_UNIT, attention_record
from moejax.asyncmoe.replicas import (activated_per_device, check_replica_routing,
                                      metro_assignment, replica_destinations)
from moejax.asyncmoe.runtime import MuQueueRuntime
from moejax.asyncmoe.schedulers import MostTokensScheduler
from moejax.asyncmoe.simulator import (CostTables, SkewedRouting, poisson_workload,
                                       simulate_mu_queue)

from mu_queue_fixtures import demo_case

LENGTHS_NEW = [(9, 6), (14, 7), (5, 5), (21, 4), (8, 6)]
ARRIVALS = [0.0, 0.0, 1.0, 3.0, 3.0]


def _matrix(replicas: ReplicaSets, num_devices: int) -> np.ndarray:
    placement = np.zeros((len(replicas), num_devices), bool)
    for e, devices in enumerate(replicas):
        placement[e, list(devices)] = True
    return placement


def _random_replicas(rng: np.random.Generator, num_experts: int, num_devices: int
                     ) -> ReplicaSets:
    """1 to 3 replicas per expert on random distinct devices, in ascending device order."""
    counts = rng.integers(1, min(3, num_devices) + 1, size=num_experts)
    return tuple(tuple(sorted(int(d) for d in rng.choice(num_devices, count, replace=False)))
                 for count in counts)


def _random_batch(rng: np.random.Generator, tokens: int, num_experts: int, k: int
                  ) -> np.ndarray:
    return np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])


# ----------------------------------------------------------------------------- policies
def test_metro_on_the_seeds_toy_example_activates_half_of_even():
    """METRO Fig. 4: every expert replicated on both devices, 2 tokens each; even routing
    activates every expert on both devices, METRO each expert once: 2 per device."""
    replicas = ((0, 1),) * 4
    ids = np.array([[0], [1], [2], [3], [0], [1], [2], [3]])
    even = replica_destinations("round_robin", ids, replicas)
    metro = replica_destinations("metro", ids, replicas)
    np.testing.assert_array_equal(activated_per_device(ids, even, 2), [4, 4])
    np.testing.assert_array_equal(activated_per_device(ids, metro, 2), [2, 2])
    # Greedy by expert id, ties to the lower device: 0 -> 0, 1 -> 1, 2 -> 0, 3 -> 1.
    np.testing.assert_array_equal(metro.ravel(), [0, 1, 0, 1, 0, 1, 0, 1])
    np.testing.assert_array_equal(replica_destinations("home", ids, replicas), 0)


def test_metro_and_even_equal_the_kernels_references():
    rng = np.random.default_rng(0)
    for trial in range(40):
        num_experts, num_devices, k = int(rng.integers(4, 17)), int(rng.integers(2, 7)), 2
        replicas = _random_replicas(rng, num_experts, num_devices)
        ids = _random_batch(rng, int(rng.integers(1, 24)), num_experts, k)
        placement = _matrix(replicas, num_devices)
        counts = np.bincount(ids.ravel(), minlength=num_experts)
        want = metro_kernels.route_metro_reference(placement, counts, order="constrained")
        got = metro_assignment(ids.ravel().tolist(), replicas)
        assert got == {e: int(want[e]) for e in range(num_experts) if counts[e]}, trial
        np.testing.assert_array_equal(replica_destinations("metro", ids, replicas),
                                      want[ids])
        even = metro_kernels.assign_tokens(ids, placement, "eplb_even")
        np.testing.assert_array_equal(replica_destinations("even", ids, replicas),
                                      even.device)


def test_metro_never_activates_more_than_even_when_every_replica_gets_a_token():
    """With at least R_e tokens for each active expert e, even routing activates every
    replica of it; METRO activates one, so no device can have more."""
    rng = np.random.default_rng(1)
    for _ in range(60):
        num_experts, num_devices = int(rng.integers(4, 13)), int(rng.integers(2, 6))
        replicas = _random_replicas(rng, num_experts, num_devices)
        active = rng.choice(num_experts, int(rng.integers(1, num_experts + 1)), replace=False)
        rows = [[int(e)] for e in active for _ in range(len(replicas[e]) + int(rng.integers(2)))]
        ids = np.array(rows)[rng.permutation(len(rows))]
        even = activated_per_device(ids, replica_destinations("round_robin", ids, replicas),
                                    num_devices)
        metro = activated_per_device(ids, replica_destinations("metro", ids, replicas),
                                     num_devices)
        assert np.all(metro <= even) and metro.sum() == len(active)
        assert metro.max() <= even.max()


def test_every_policy_sends_each_copy_to_a_replica_of_its_expert():
    rng = np.random.default_rng(2)
    replicas = _random_replicas(rng, 10, 4)
    ids = _random_batch(rng, 30, 10, 3)
    for policy in ("home", "round_robin", "metro"):
        destinations = replica_destinations(policy, ids, replicas)
        assert all(int(d) in replicas[int(e)]
                   for d, e in zip(destinations.ravel(), ids.ravel())), policy
    even = replica_destinations("round_robin", ids, replicas)
    for e in range(10):                      # each expert's copies spread within one
        per_replica = [int(np.sum(even[ids == e] == d)) for d in replicas[e]]
        assert max(per_replica) - min(per_replica) <= 1
    # A rotor carries the deal across batches: one copy per batch still alternates.
    rotor: dict[int, int] = {}
    dealt = [int(replica_destinations("round_robin", np.array([[5]]), ((1, 3),) * 6,
                                      rotor)[0, 0]) for _ in range(4)]
    assert dealt == [1, 3, 1, 3] and rotor == {5: 4}


def test_replica_routing_names():
    assert check_replica_routing("even") == "round_robin"
    with pytest.raises(ValueError, match="replica_routing must be one of"):
        check_replica_routing("random")
    with pytest.raises(ValueError, match="replica_routing must be one of"):
        DeviceEngine(0, 1, (ATTENTION_UNIT, HEAD_UNIT, 0), MostTokensScheduler(), 1, (0,),
                     replica_routing="nearest")


def test_engine_routes_copies_to_the_metro_replicas():
    # 4 experts, each on devices 1 and 2; device 0 the attention rank.
    replicas = ((1, 2),) * 4
    engine = DeviceEngine(0, 1, (ATTENTION_UNIT, HEAD_UNIT), MostTokensScheduler(), 2,
                          replicas, replica_routing="metro")
    for rid in range(3):
        engine.enqueue(attention_record(rid, 0, 0, 0, 5))
    batch = engine.next_batch()
    ids = np.array([[0, 1], [1, 2], [0, 3]])
    routed = engine.route(batch, ids, np.full((3, 2), 0.5))
    # Experts 0, 1, 2, 3 in turn to the least-activated replica: 1, 2, 1, 2.
    assert [(d, r.expert) for d, r in routed] == [(1, 0), (2, 1), (2, 1), (1, 2), (1, 0),
                                                   (2, 3)]
    expert_engine = DeviceEngine(2, 1, (0, 1, 2, 3), MostTokensScheduler(), 2, replicas)
    expert_engine.enqueue(routed[1][1])
    other = DeviceEngine(3, 1, (ATTENTION_UNIT, HEAD_UNIT), MostTokensScheduler(), 2,
                         ((1, 2), (1, 2), (1, 2), (1,)))
    with pytest.raises(ValueError, match="does not belong to device 3"):
        other.enqueue(routed[1][1])
    assert isinstance(batch, Batch) and batch.size == 3


def test_simulator_runs_replicas_under_every_policy():
    workload = poisson_workload(24, 2000.0, (16, 48), (5, 8), seed=6)
    routing = SkewedRouting(8, 2, 0.3, seed=3)
    common = dict(num_devices=4, num_layers=2, num_experts=8, top_k=2, scheduler="defrag",
                  hidden=4, dtype_bytes=2, attention_devices=(0, 1))
    tables = CostTables.uniform(0.001)
    runs = {policy: simulate_mu_queue(tables, routing, workload, replicas=2,
                                      replica_routing=policy, **common)
            for policy in ("home", "round_robin", "metro")}
    plain = simulate_mu_queue(tables, routing, workload, **common)
    assert runs["home"] == plain                       # replicas unused: today's run
    tokens = 2 * 2 * sum(w.decode_tokens for w in workload)
    for policy, result in runs.items():
        assert [len(r.token_times) for r in result.requests] == \
            [w.decode_tokens for w in workload], policy
        assert sum(b.size for b in result.batches if b.unit >= 0) == tokens
        hosts = {(b.unit, b.device) for b in result.batches if b.unit >= 0}
        assert all(d in make_placement(8, 4, attention_devices=(0, 1), replicas=2)
                   .expert_replicas[e] for e, d in hosts)
    # Even routing uses both replicas of every expert; home only one.
    assert len({(b.unit, b.device) for b in runs["round_robin"].batches if b.unit >= 0}) == 16
    assert len({(b.unit, b.device) for b in runs["home"].batches if b.unit >= 0}) == 8
    with pytest.raises(ValueError, match="replica_routing must be one of"):
        simulate_mu_queue(tables, routing, workload, replica_routing="nearest", **common)


# ----------------------------------------------------------------------------- real runtime
@pytest.fixture(scope="module")
def demo():
    return demo_case(LENGTHS_NEW, seed=2)


@pytest.mark.parametrize("policy, attention", [("metro", (0, 1)), ("round_robin", None)])
def test_replicated_runtime_gives_the_resident_tokens_and_the_simulators_batches(
        demo, policy, attention):
    cfg, params, specs, want = demo
    runtime = MuQueueRuntime(cfg, params, jax.devices()[:4], scheduler="defrag",
                             attention_devices=attention, replicas=2, replica_routing=policy)
    outputs = runtime.generate(specs, arrivals=ARRIVALS)
    assert [o.token_ids for o in outputs] == want
    run = runtime.last_run
    assert run.leftover_queued == 0 and run.leftover_pooled == 0
    ran_on = {}
    for b in run.batches:
        if b.unit >= 0:
            ran_on.setdefault(b.unit, set()).add(b.device)
            assert b.device in runtime.placement.expert_replicas[b.unit]
    assert any(len(devices) == 2 for devices in ran_on.values())   # replicas were used
    predicted = simulator.replay_outputs(
        outputs, [len(s.prompt) for s in specs], ARRIVALS, CostTables.uniform(), 4,
        cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, "defrag", cfg.hidden_size,
        4, attention_devices=attention, replicas=2, replica_routing=policy)
    assert [b[:5] for b in predicted.batches] == [b[:5] for b in run.batches]
    home = simulator.replay_outputs(
        outputs, [len(s.prompt) for s in specs], ARRIVALS, CostTables.uniform(), 4,
        cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, "defrag", cfg.hidden_size,
        4, attention_devices=attention, replicas=2)
    assert [b[:5] for b in home.batches] != [b[:5] for b in run.batches]

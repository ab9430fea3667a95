"""Attention ranks apart from expert devices in the μ-queue runtime and simulator (issue
44; seed: AsyncMoE §3.3): a scripted disaggregated simulation traced by hand; the
default layout unchanged; the real runtime on 4 CPU devices (2 attention + 2 expert)
gives the resident decoder's greedy tokens with attention, head and expert batches each
on their own devices; the simulator replays that run's batches exactly; the layout's
validation errors."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moejax.asyncmoe import simulator
from moejax.asyncmoe.engine import DeviceEngine
from moejax.asyncmoe.loop import MuQueueLoop
from moejax.asyncmoe.placement import Placement, make_placement, replica_sets
from moejax.asyncmoe.records import ATTENTION_UNIT, HEAD_UNIT, attention_record
from moejax.asyncmoe.runtime import MuQueueRuntime
from moejax.asyncmoe.schedulers import MostTokensScheduler
from moejax.asyncmoe.simulator import (CostTables, SimRequest, SkewedRouting, TraceRouting,
                                       poisson_workload, simulate_mu_queue)

from mu_queue_fixtures import demo_case

LENGTHS_NEW = [(7, 6), (18, 5), (4, 8), (25, 3), (11, 6)]
ARRIVALS = [0.0, 0.0, 2.0, 4.0, 4.0]
ATTENTION = (0, 1)


# ----------------------------------------------------------------------------- layout
def test_make_placement_layouts():
    colocated = make_placement(8, 4)
    assert colocated.attention_devices == (0, 1, 2, 3) and not colocated.disaggregated
    assert colocated.home == (0, 0, 1, 1, 2, 2, 3, 3)
    split = make_placement(8, 4, attention_devices=(0, 1))
    assert split.expert_devices == (2, 3) and split.disaggregated
    assert split.home == (2, 2, 2, 2, 3, 3, 3, 3)
    assert split.units(0) == (ATTENTION_UNIT, HEAD_UNIT) and split.units(3) == (4, 5, 6, 7)
    # 2 replicas over 4 expert devices of 8: expert e's home e // 2, replica 2 devices on.
    replicated = make_placement(8, 8, attention_devices=range(4), replicas=2)
    assert replicated.expert_replicas[0] == (4, 6)
    assert replicated.expert_replicas[7] == (7, 5)
    explicit = make_placement(3, 3, attention_devices=(0,), expert_device=[1, (2, 1), 2])
    assert explicit.expert_replicas == ((1,), (2, 1), (2,))
    assert explicit.units(1) == (0, 1) and explicit.units(2) == (1, 2)


@pytest.mark.parametrize("kwargs, message", [
    ({"attention_devices": ()}, "attention_devices is empty"),
    ({"attention_devices": (0, 0)}, "repeat a device"),
    ({"attention_devices": (0, 4)}, r"devices \[4\] outside \[0, 4\)"),
    ({"attention_devices": (0,), "expert_devices": ()}, "expert_devices is empty"),
    ({"attention_devices": (0, 1), "expert_device": [0, 2, 3, 3]},
     r"expert 0 has a replica on device\(s\) \[0\], an attention-only device"),
    ({"attention_devices": (0, 1), "expert_devices": (2,), "expert_device": [2, 2, 3, 2]},
     "not an expert device"),
    ({"attention_devices": (0,), "expert_devices": (1, 2)},
     r"devices \[3\] are neither attention ranks nor host an expert"),
    ({"attention_devices": (0, 1), "replicas": 3}, r"replicas must be an int in \[1, 2\]"),
    ({"expert_device": [0, 1, 2, 3], "replicas": 2}, "not both"),
    ({"expert_device": [0, 1, 2]}, "places 3 experts; the model has 4"),
    ({"expert_device": [0, (1, 1), 2, 3]}, "repeats a device"),
    ({"expert_device": [0, (), 2, 3]}, "expert 1 has no replica"),
])
def test_make_placement_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_placement(4, 4, **kwargs)


def test_placement_and_loop_validate():
    with pytest.raises(ValueError, match="attention_devices is empty"):
        Placement(2, (), ((1,),))
    with pytest.raises(ValueError, match=r"devices \[1\] are neither"):
        Placement(2, (0,), ((0,),))
    with pytest.raises(ValueError, match="must be a device id"):
        replica_sets([0, -1])
    engine = DeviceEngine(0, 1, (0, 1), MostTokensScheduler(), 1, (0, 0))
    with pytest.raises(ValueError, match="no engine hosts attention"):
        MuQueueLoop([engine], simulator.RoutingExecutor(SkewedRouting(2, 1, 0.0, 0), []),
                    lambda batch: 1.0, lambda nbytes: 0.0, 1)
    with pytest.raises(ValueError, match="not an attention rank"):
        engine.enqueue(attention_record(0, 0, 0, 0, 3))


def test_simulator_rejects_a_bad_layout():
    routing = SkewedRouting(4, 1, 0.0, seed=0)
    workload = poisson_workload(2, 10.0, (4, 4), (2, 2), seed=0)
    for kwargs, message in (({"attention_devices": ()}, "attention_devices is empty"),
                            ({"attention_devices": (0,), "expert_device": [0, 1, 1, 1]},
                             "attention-only device")):
        with pytest.raises(ValueError, match=message):
            simulate_mu_queue(CostTables.uniform(), routing, workload, 2, 1, 4, 1,
                              "defrag", hidden=1, dtype_bytes=1, **kwargs)


# ----------------------------------------------------------------------------- simulator
def test_scripted_disaggregated_run_by_hand():
    """One request, 2 steps, 1 block, top-1 over 2 experts; device 0 attention, device 1
    both experts; every execution 1 s, transfers free. Step s: attention on 0 at 3s,
    the chosen expert on 1 at 3s + 1, the head on 0 at 3s + 2; tokens at 3 and 6."""
    ids = np.array([[[1], [0]]])                        # [layers 1, steps 2, k 1]
    routing = TraceRouting({0: ids}, {0: np.ones((1, 2, 1))}, 2)
    result = simulate_mu_queue(CostTables.uniform(), routing, [SimRequest(0, 0.0, 4, 2)], 2,
                               1, 2, 1, "defrag", hidden=1, dtype_bytes=1,
                               attention_devices=(0,))
    assert [tuple(b[:5]) for b in result.batches] == [
        (0.0, 0, 0, -1, 1), (1.0, 1, 0, 1, 1), (2.0, 0, 0, -2, 1),
        (3.0, 0, 0, -1, 1), (4.0, 1, 0, 0, 1), (5.0, 0, 0, -2, 1)]
    assert [(r.rank, r.token_times) for r in result.requests] == [(0, (3.0, 6.0))]
    # Busy 4 of 6 s on device 0, 2 of 6 on device 1: stall (2 + 4) / 12.
    assert result.stall_fraction == pytest.approx(0.5)


def test_disaggregated_simulation_keeps_kinds_apart_and_conserves_tokens():
    workload = poisson_workload(30, 3000.0, (16, 48), (6, 10), seed=4)
    routing = SkewedRouting(8, 2, 0.5, seed=1)
    common = dict(num_devices=4, num_layers=2, num_experts=8, top_k=2, scheduler="defrag",
                  hidden=4, dtype_bytes=2)
    tables = CostTables.uniform(0.001)
    split = simulate_mu_queue(tables, routing, workload, attention_devices=(0, 1), **common)
    assert {r.rank for r in split.requests} == {0, 1}
    assert all(b.device in (0, 1) for b in split.batches if b.unit < 0)
    assert {b.device for b in split.batches if b.unit >= 0} == {2, 3}
    assert [len(r.token_times) for r in split.requests] == [w.decode_tokens for w in workload]
    assert split.leftover_queued == 0 and split.leftover_pooled == 0
    assert sum(b.size for b in split.batches if b.unit >= 0) == \
        2 * 2 * sum(w.decode_tokens for w in workload)
    # The default layout is today's: every device both, named explicitly or not.
    default = simulate_mu_queue(tables, routing, workload, **common)
    explicit = simulate_mu_queue(tables, routing, workload, attention_devices=range(4),
                                 expert_devices=range(4), **common)
    assert default == explicit and default.batches != split.batches
    assert {r.rank for r in default.requests} == {0, 1, 2, 3}


# ----------------------------------------------------------------------------- real runtime
@pytest.fixture(scope="module")
def demo():
    return demo_case(LENGTHS_NEW, seed=1)


def test_disaggregated_runtime_gives_the_resident_tokens_and_the_simulators_batches(demo):
    cfg, params, specs, want = demo
    runtime = MuQueueRuntime(cfg, params, jax.devices()[:4], scheduler="defrag",
                             attention_devices=ATTENTION)
    assert runtime.placement.expert_devices == (2, 3)
    outputs = runtime.generate(specs, arrivals=ARRIVALS)
    assert [o.token_ids for o in outputs] == want
    run = runtime.last_run
    assert run.leftover_queued == 0 and run.leftover_pooled == 0
    assert {r.rank for r in run.requests} == set(ATTENTION)
    assert {b.device for b in run.batches if b.unit < 0} == set(ATTENTION)
    assert {b.device for b in run.batches if b.unit >= 0} == {2, 3}
    predicted = simulator.replay_outputs(
        outputs, [len(s.prompt) for s in specs], ARRIVALS, CostTables.uniform(), 4,
        cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, "defrag", cfg.hidden_size,
        4, attention_devices=ATTENTION)
    assert [b[:5] for b in predicted.batches] == [b[:5] for b in run.batches]
    assert len(predicted.batches) > 50
    # Colocated, the same requests run other batches (the replay is not trivially equal).
    colocated = simulator.replay_outputs(
        outputs, [len(s.prompt) for s in specs], ARRIVALS, CostTables.uniform(), 4,
        cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, "defrag", cfg.hidden_size, 4)
    assert [b[:5] for b in colocated.batches] != [b[:5] for b in run.batches]


def test_runtime_rejects_a_bad_layout(demo):
    cfg, params, _, _ = demo
    devices = jax.devices()[:4]
    with pytest.raises(ValueError, match="attention_devices is empty"):
        MuQueueRuntime(cfg, params, devices, attention_devices=())
    with pytest.raises(ValueError, match="attention-only device"):
        MuQueueRuntime(cfg, params, devices, attention_devices=(0, 1),
                       expert_device=[0] + [2] * (cfg.num_experts - 1))
    with pytest.raises(ValueError, match="replica_routing must be one of"):
        MuQueueRuntime(cfg, params, devices, replica_routing="random")


# ----------------------------------------------------------------------------- benchmark
def test_h100_benchmark_has_the_disaggregated_and_metro_figures():
    from benchmarks import asyncmoe_sim

    assert asyncmoe_sim.h100_layout("defrag_disaggregated", 16) == \
        {"attention_devices": tuple(range(8))}
    assert asyncmoe_sim.h100_layout("defrag_metro_replicas", 8) == \
        {"replicas": 2, "replica_routing": "metro"}
    with pytest.raises(ValueError, match="unknown H100"):
        asyncmoe_sim.h100_layout("defrag_fast", 8)
    # The --quick keys on a smaller shape (1 block, 1 request a device, 6 tokens each):
    # the test's time, not the figures, is what it shrinks.
    tiny = {"layers": 1, "requests_per_device": 1, "workloads": ("medium",), "decode_cap": 6}
    data = asyncmoe_sim.h100_figures(quick=True, verbose=False, shape=tiny)
    for k in (1, 2, 8):
        for devices, suffix in ((8, ""), (16, "_16dev")):
            tag = f"h100_top{k}_medium_g{devices}"
            put = {s: data[f"{tag}_{s}_throughput"] for s in
                   ("sync_ep", "defrag", "defrag_disaggregated", "defrag_even_replicas",
                    "defrag_metro_replicas")}
            assert all(np.isfinite(v) and v > 0 for v in put.values())
            split = data[f"mu_queue_throughput_over_sync_ep_h100_top{k}_disaggregated{suffix}"]
            assert split == data[
                f"mu_queue_throughput_over_sync_ep_h100_top{k}_medium_disaggregated{suffix}"]
            assert split == pytest.approx(put["defrag_disaggregated"] / put["sync_ep"])
            assert data[f"mu_queue_metro_over_even_replicas_h100_top{k}{suffix}"] == \
                pytest.approx(put["defrag_metro_replicas"] / put["defrag_even_replicas"])
            assert data[f"mu_queue_metro_over_no_replicas_h100_top{k}{suffix}"] == \
                pytest.approx(put["defrag_metro_replicas"] / put["defrag"])
            assert data[f"mu_queue_even_over_no_replicas_h100_top{k}{suffix}"] == \
                pytest.approx(put["defrag_even_replicas"] / put["defrag"])
            assert put["defrag_disaggregated"] != put["defrag"]   # another layout ran
    assert data["h100_replicas"] == 2

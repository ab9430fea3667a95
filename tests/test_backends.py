"""resident, async_ep, offload and hybrid against the single-device forward (f32 ≤ 1e-5),
their memory bounds, and the registry's errors. Multi-device runs use 8 CPU host devices."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from backend_fixtures import CFG, F32_TOL, max_rel_err, run_backend, small_workload
from moejax.backends import BACKENDS, BackendError, make_backend
from moejax.backends.base import padded_step, plan_steps


@pytest.fixture(scope="module")
def work():
    """Two batch shapes: the last layer at the scoring rows only, and on every row + lse."""
    return small_workload()


@pytest.fixture(scope="module")
def work1():
    """One batch shape (each shape compiles for seconds on CPU)."""
    return small_workload(shapes=1)


def check(backend, work) -> None:
    err = max_rel_err(run_backend(backend, work.hosts), work.reference, work.hosts)
    assert err <= F32_TOL, f"{backend.name} on {len(backend.devices)} device(s): {err:.3g}"


def test_resident_equals_forward(work):
    check(make_backend("resident", work.cfg, work.params), work)


@pytest.mark.parametrize("devices", [2, 8])
def test_async_ep_equals_forward(work, work1, devices):
    work = work if devices == 8 else work1
    backend = make_backend("async_ep", work.cfg, work.params, devices=devices)
    assert backend.num_ranks == devices
    # Each device holds E/G experts of every layer.
    shard_shapes = {s.data.shape for s in backend.shards["w_gate"].addressable_shards}
    assert shard_shapes == {(CFG.num_layers, CFG.num_experts // devices, CFG.hidden_size,
                             CFG.moe_intermediate_size)}
    check(backend, work)


def test_async_ep_pads_experts_not_divisible_by_devices():
    work = small_workload(dataclasses.replace(CFG, num_experts=6), seed=3, shapes=1)
    backend = make_backend("async_ep", work.cfg, work.params, devices=4)
    assert backend.shards["w_gate"].shape[1] == 8          # two zero experts appended
    check(backend, work)


@pytest.mark.parametrize("window", [1, 2])
def test_offload_equals_forward_within_its_window(work, work1, window):
    work = work if window == 2 else work1
    backend = make_backend("offload", work.cfg, work.params, window=window, track_memory=True)
    check(backend, work)
    check(backend, work)           # the cyclic window survives consecutive steps
    per_layer = backend.memory_report().expert_bytes_all_layers // CFG.num_layers
    # Measured from JAX's live arrays during the layer loop.
    assert 0 < backend.peak_window_bytes <= window * per_layer
    assert backend.peak_window_bytes == window * per_layer
    assert backend.memory_report().expert_weight_bytes == window * per_layer
    assert backend.host_kind in ("pinned_host", "unpinned_host")


@pytest.mark.parametrize("devices,window", [(2, 2), (4, 3)])
def test_hybrid_equals_forward(work, work1, devices, window):
    work = work if devices == 4 else work1
    backend = make_backend("hybrid", work.cfg, work.params, devices=devices, window=window,
                           track_memory=True)
    check(backend, work)
    report = backend.memory_report()
    assert 0 < backend.peak_window_bytes <= report.expert_weight_bytes
    per_layer = report.expert_bytes_all_layers // CFG.num_layers
    assert report.detail["window"] == window * per_layer // devices


def test_memory_savings_by_the_expected_factor():
    """Per-device expert bytes vs resident: async_ep holds L/G layers of shards plus three
    whole layers (the replicated first layer and two gathered), offload W layers."""
    cfg = dataclasses.replace(CFG, num_layers=8)
    params = __import__("backend_fixtures").make_params(cfg)
    resident = make_backend("resident", cfg, params).memory_report()
    async_ep = make_backend("async_ep", cfg, params, devices=8).memory_report()
    offload = make_backend("offload", cfg, params, window=2).memory_report()
    layers = cfg.num_layers
    assert resident.expert_weight_bytes == resident.expert_bytes_all_layers
    assert async_ep.expert_saving == pytest.approx(layers / (layers / 8 + 3))
    assert offload.expert_saving == pytest.approx(layers / 2)
    assert offload.host_weight_bytes == resident.expert_bytes_all_layers
    assert offload.dense_weight_bytes == resident.dense_weight_bytes


def test_bad_construction_is_refused(work):
    with pytest.raises(BackendError, match="unknown backend 'nccl'"):
        make_backend("nccl", work.cfg, work.params)
    with pytest.raises(BackendError, match="asks for 99 devices but only 8 cpu"):
        make_backend("async_ep", work.cfg, work.params, devices=99)
    with pytest.raises(BackendError, match="'offload' runs on one device"):
        make_backend("offload", work.cfg, work.params, devices=2)
    with pytest.raises(BackendError, match="window must be at least 2"):
        make_backend("hybrid", work.cfg, work.params, devices=2, window=1)
    with pytest.raises(ValueError, match="'resident' runs on one device"):
        make_backend("resident", work.cfg, work.params, devices=4)
    with pytest.raises(ValueError, match="params do not match"):
        make_backend("async_ep", work.cfg, {**work.params, "extra": np.zeros(3)}, devices=2)
    assert set(BACKENDS) == {"resident", "offload", "async_ep", "hybrid", "sync_ep", "tp",
                             "tp_ep", "dp_tp", "pp"}


def test_step_rejects_the_wrong_number_of_batches(work):
    backend = make_backend("async_ep", work.cfg, work.params, devices=2)
    with pytest.raises(ValueError, match="takes 2 batch"):
        backend.step([work.hosts[0].batch], work.hosts[0].options)


def test_plan_steps_groups_by_shape_in_order():
    assert plan_steps(["a", "b", "a", "a", "b", "c"], 2) == [[0, 2], [3], [1, 4], [5]]
    assert plan_steps(["a", "a"], 1) == [[0], [1]]


MIXTRAL = dataclasses.replace(CFG, model_type="mixtral", qk_norm=False, tie_word_embeddings=True,
                              num_layers=2)
ALL_BACKENDS = [("resident", 1), ("offload", 1), ("async_ep", 4), ("hybrid", 2),
                ("sync_ep", 4), ("tp", 2), ("tp_ep", 2),
                ("dp_tp", 4), ("pp", 2)]


@pytest.fixture(scope="module")
def mixtral_work():
    return small_workload(MIXTRAL, seed=5, shapes=1)


@pytest.mark.parametrize("name,devices", ALL_BACKENDS)
def test_every_backend_equals_resident_on_mixtral_with_an_empty_rank(mixtral_work, name,
                                                                      devices):
    """Ranks get batches of different real lengths, and the last rank of the first step
    gets no tokens at all (a padded, empty batch)."""
    work = mixtral_work
    backend = make_backend(name, work.cfg, work.params, devices=devices)
    ranks = backend.num_ranks
    hosts = work.hosts
    first = hosts[:max(1, min(len(hosts), ranks - 1))]
    outputs = backend.step(padded_step([h.batch for h in first], ranks), first[0].options)
    assert len(outputs) == ranks
    got = [jax.device_get(o) for o in outputs[:len(first)]]
    assert max_rel_err(got, work.reference[:len(first)], first) <= F32_TOL
    if ranks > 1:
        empty_logits = np.asarray(outputs[-1].logits)
        assert np.all(np.isfinite(empty_logits)), "an empty rank must not produce NaNs"
    check(backend, work)
    lowered = backend.lowered_steps(padded_step([first[0].batch], ranks), first[0].options)
    assert lowered and all("func.func public @main" in low.as_text() for low in lowered)

"""The ``pp`` backend (the paper's PP+PP baseline: pipeline stages over layers, a step's
batches its micro-batches) equals model.forward on every micro-batch, at every stage
count from one to one layer per stage."""

from __future__ import annotations

import dataclasses

import jax
import pytest

from moejax.backends import BackendError, make_backend
from moejax.backends.base import padded_step
from moejax.backends.pp import stage_bounds
from tests.backend_fixtures import CFG, F32_TOL, max_rel_err
from tests.test_backend_tp import path_workload

FOUR_LAYERS = dataclasses.replace(CFG, num_layers=4)


def test_stage_bounds_split_the_layers_evenly():
    assert stage_bounds(4, 1) == [(0, 4)]
    assert stage_bounds(5, 2) == [(0, 3), (3, 5)]
    assert stage_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(BackendError, match=r"devices must be in \[1, 4\], got 5"):
        stage_bounds(4, 5)


@pytest.mark.parametrize("devices", [1, 3, 4])
def test_every_micro_batch_equals_the_reference(devices):
    """Micro-batch m is batch m of one shape (the last ones empty): each equals the
    single-device forward; each stage holds its layers only."""
    work = path_workload(FOUR_LAYERS)
    backend = make_backend("pp", work.cfg, work.params, devices=devices)
    host = work.hosts[0]
    outputs = backend.step(padded_step([host.batch], devices), host.options)
    assert len(outputs) == devices
    got = [jax.device_get(outputs[0])]
    assert max_rel_err(got, work.reference[:1], [host]) <= F32_TOL
    for (a, b), params in zip(backend.bounds, backend.stage_params):
        assert params["layers"]["w_gate"].shape[0] == b - a
    report = backend.memory_report()
    widest = max(b - a for a, b in backend.bounds)
    assert report.expert_weight_bytes * FOUR_LAYERS.num_layers == (
        report.expert_bytes_all_layers * widest)
    assert len(backend.lowered_steps([host.batch] * devices, host.options)) == devices
    with pytest.raises(BackendError, match="'pp' cannot hold a prefix KV pool: each stage"):
        backend.kv_placement

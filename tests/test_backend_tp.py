"""The ``tp`` backend (heads and expert columns sharded, all-reduces) equals model.forward.

Every compile costs seconds on CPU, so the equality tests run two of the shared
workload's batches (see ``PATHS``) rather than all of its shapes.
"""

from __future__ import annotations

import dataclasses

import pytest

from moejax import model
from moejax.backends import BackendError, make_backend
from moejax.backends.resident import ResidentBackend
from moejax.backends.tp import TPBackend
from moejax.config import ModelConfig
from tests.backend_fixtures import (CFG, F32_TOL, Workload, make_host_batches, make_params,
                                    max_rel_err, reference_outputs, run_backend)

# CFG has 2 kv heads, so 4 devices need more heads to split.
WIDE_CFG = dataclasses.replace(CFG, num_heads=8, num_kv_heads=4)
# f = 35 is not a multiple of 2: the backend pads it to 36.
ODD_F_CFG = dataclasses.replace(CFG, moe_intermediate_size=35)


# (last layer at the scoring rows only?, LM head over the full vocabulary?): two batches
# cover both ways of running the last layer and both ways of scoring.
PATHS = ((True, True), (False, False))


def path_workload(cfg: ModelConfig) -> Workload:
    """The shared workload (same params and batches as ``backend_fixtures.workload``),
    keeping the first batch of each of ``PATHS``."""
    params = make_params(cfg)
    by_path = {}
    for host in make_host_batches(cfg):
        path = (model.last_layer_at_rows_only(host.batch), host.options.full_vocab)
        by_path.setdefault(path, host)
    assert set(PATHS) <= set(by_path), "the shared batches no longer cover every path"
    hosts = [by_path[path] for path in PATHS]
    return Workload(cfg, params, hosts, reference_outputs(cfg, params, hosts))


@pytest.fixture(scope="module")
def work() -> Workload:
    return path_workload(CFG)


@pytest.mark.parametrize("devices", [1, 2])
def test_tp_matches_reference(work, devices):
    backend = TPBackend(work.cfg, work.params, devices=devices)
    assert max_rel_err(run_backend(backend, work.hosts), work.reference, work.hosts) <= F32_TOL


def test_tp_four_devices_matches_reference():
    w = path_workload(WIDE_CFG)
    backend = make_backend("tp", w.cfg, w.params, devices=4)
    assert max_rel_err(run_backend(backend, w.hosts), w.reference, w.hosts) <= F32_TOL


def test_tp_pads_intermediate_not_divisible():
    w = path_workload(ODD_F_CFG)
    backend = TPBackend(w.cfg, w.params, devices=2)
    assert backend.f_padded == 36
    assert max_rel_err(run_backend(backend, w.hosts), w.reference, w.hosts) <= F32_TOL
    report = backend.memory_report()
    assert report.detail["padding"] > 0
    assert report.expert_weight_bytes == report.detail["shards"] + report.detail["padding"]


def test_tp_rejects_heads_not_divisible():
    with pytest.raises(BackendError, match=r"num_kv_heads=2.*devices=3"):
        TPBackend(CFG, make_params(), devices=3)


def test_tp_rejects_too_many_devices():
    with pytest.raises(BackendError, match="99"):
        TPBackend(CFG, make_params(), devices=99)


def test_tp_memory_report_is_one_shard():
    params = make_params()
    resident = ResidentBackend(CFG, params).memory_report()
    report = TPBackend(CFG, params, devices=2).memory_report()
    assert report.expert_weight_bytes * 2 == resident.expert_weight_bytes
    assert report.expert_bytes_all_layers == resident.expert_bytes_all_layers
    assert report.detail == {"shards": report.expert_weight_bytes, "padding": 0}
    assert report.dense_weight_bytes < resident.dense_weight_bytes


def test_tp_shardings_are_real():
    backend = TPBackend(CFG, make_params(), devices=2)
    layers = backend.params["layers"]
    f = CFG.moe_intermediate_size
    for name, axis in (("w_gate", 3), ("w_up", 3), ("w_down", 2)):
        array = layers[name]
        assert array.sharding.spec[axis] == "tp"
        shards = array.addressable_shards
        assert len(shards) == 2
        assert all(s.data.shape[axis] == f // 2 for s in shards)
    wq_cols = CFG.num_heads * CFG.head_dim // 2
    assert all(s.data.shape[2] == wq_cols for s in layers["wq"].addressable_shards)
    assert backend.describe()["mesh"] == {"tp": 2}

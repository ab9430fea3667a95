"""The ``tp_ep`` backend (the paper's TP+EP baseline: heads split, each device owning
whole experts, two all-reduces) equals model.forward, with the experts padded where G
does not divide E, and each device running only its own experts' rows."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from moejax.backends import BackendError, make_backend
from moejax.dispatch import OwnedExpertTokens
from moejax import moe
from tests.backend_fixtures import CFG, F32_TOL, max_rel_err, run_backend
from tests.test_backend_tp import WIDE_CFG, path_workload

# 6 experts over 4 devices: padded to 8, two per device (the last device's are zeros).
SIX_EXPERTS = dataclasses.replace(WIDE_CFG, num_experts=6)


@pytest.mark.parametrize("cfg,devices", [(CFG, 1), (CFG, 2), (WIDE_CFG, 4), (SIX_EXPERTS, 4)])
def test_tp_ep_matches_reference(cfg, devices):
    work = path_workload(cfg)
    backend = make_backend("tp_ep", work.cfg, work.params, devices=devices)
    assert backend.padded_experts == -(-cfg.num_experts // devices) * devices
    assert max_rel_err(run_backend(backend, work.hosts), work.reference, work.hosts) <= F32_TOL
    report = backend.memory_report()
    assert report.expert_weight_bytes * devices == (
        report.expert_bytes_all_layers * backend.padded_experts // cfg.num_experts)


def test_each_device_computes_only_the_rows_of_its_own_experts():
    """4 tokens routed over 8 experts, 4 devices of 2: each device's sorted groups count
    exactly the rows routed to its experts (the rest are outside every group)."""
    routing = moe.Routing(weights=jax.numpy.ones((4, 2)),
                          experts=jax.numpy.array([[0, 7], [2, 3], [7, 6], [1, 2]], np.int32))
    x = jax.numpy.arange(4 * 3, dtype=np.float32).reshape(4, 3)
    transport = OwnedExpertTokens(num_experts=2, psum_axis="tp")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tp",))
    sizes = jax.shard_map(lambda: transport.prepare(x, routing, None).group_sizes[None],
                          mesh=mesh, in_specs=(), out_specs=jax.sharding.PartitionSpec("tp"),
                          check_vma=False)()
    np.testing.assert_array_equal(np.asarray(sizes), [[1, 1], [2, 1], [0, 0], [1, 2]])


def test_tp_ep_refuses_what_it_cannot_split():
    work = path_workload(CFG)
    with pytest.raises(BackendError, match="backend 'tp_ep' shards attention by head"):
        make_backend("tp_ep", work.cfg, work.params, devices=4)
    with pytest.raises(BackendError, match="'tp_ep' cannot hold a prefix KV pool: its"):
        make_backend("tp_ep", work.cfg, work.params, devices=2).kv_placement

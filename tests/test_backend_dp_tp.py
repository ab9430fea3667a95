"""The ``dp_tp`` backend (the paper's DP+TP baseline: data-parallel attention, experts
split on f, every rank's rows gathered for the MoE and reduce-scattered back) equals
model.forward on each rank's own batch, with f padded where G does not divide it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from moejax.backends import BackendError, make_backend
from moejax.backends.base import padded_step
from moejax.core.scoring_engine import Engine
from moejax.packing import BucketPolicy
from tests.backend_fixtures import CFG, F32_TOL, max_rel_err
from tests.test_backend_tp import ODD_F_CFG, path_workload


@pytest.mark.parametrize("cfg,devices", [(CFG, 2), (ODD_F_CFG, 4)])
def test_each_rank_equals_the_reference(cfg, devices):
    """Rank r runs batch r (a different batch per rank, the last rank empty): each
    rank's logits equal model.forward on its own batch."""
    work = path_workload(cfg)
    backend = make_backend("dp_tp", work.cfg, work.params, devices=devices)
    assert backend.num_ranks == devices
    assert backend.f_padded == -(-cfg.moe_intermediate_size // devices) * devices
    hosts = work.hosts[:devices - 1] if devices > 2 else work.hosts[:1]
    same_shape = [h for h in hosts if h.shape_key == hosts[0].shape_key]
    outputs = backend.step(padded_step([h.batch for h in same_shape], devices),
                           same_shape[0].options)
    got = [jax.device_get(o) for o in outputs[:len(same_shape)]]
    assert max_rel_err(got, work.reference[:len(same_shape)], same_shape) <= F32_TOL
    report = backend.memory_report()
    assert report.expert_weight_bytes * devices == (
        report.expert_bytes_all_layers * backend.f_padded // cfg.moe_intermediate_size)


def test_a_scoring_engine_runs_on_it_and_it_refuses_the_pool():
    work = path_workload(CFG)
    backend = make_backend("dp_tp", work.cfg, work.params, devices=2)
    policy = BucketPolicy(max_batch_tokens=128, min_block=32)
    ops = [op for host in work.hosts for op in host.sequences]
    outputs = Engine(CFG, backend, policy=policy).run(ops)
    want = Engine(CFG, make_backend("resident", CFG, work.params), policy=policy).run(ops)
    assert set(outputs) == set(want) == {op.key for op in ops}
    for key, out in want.items():
        for got, expected in zip(outputs[key].logits, out.logits):
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(BackendError, match="'dp_tp' cannot hold a prefix KV pool: its MoE"):
        Engine(CFG, backend, prefix_cache_blocks=8)

"""The pieces of ``benchmarks/eldr.py`` that its figures rest on: the step-cost fit, the
arrival schedule, the noise floor's shown counts, the typical union, and the policy set
(every label a real policy, fresh objects, the shuffled one plain ELDR)."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import eldr
from moejax.eldr.fitfile import EldrFit
from moejax.eldr.policies import EldrPolicy, HandOff, Policy
from moejax.eldr.simulator import SimRequest


def test_step_cost_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    t0, a, b, layers = 3e-4, 5e-5, 2e-6, 6
    steps = []
    for _ in range(200):
        active = rng.integers(4, 33, layers)
        batch = int(rng.integers(1, 17))
        steps.append((active, batch, layers * t0 + a * active.sum() + b * layers * batch))
    fit = eldr.fit_step_costs(steps)
    assert fit["t0_s"] == pytest.approx(t0, rel=1e-6)
    assert fit["a_s"] == pytest.approx(a, rel=1e-6)
    assert fit["b_s"] == pytest.approx(b, rel=1e-6)
    assert fit["r2"] == pytest.approx(1.0) and fit["steps"] == 200


def test_step_cost_fit_keeps_coefficients_non_negative():
    rng = np.random.default_rng(1)
    steps = [(rng.integers(4, 33, 6), int(rng.integers(1, 17)), 1e-3 + 1e-4 * rng.random())
             for _ in range(100)]
    fit = eldr.fit_step_costs(steps)
    assert min(fit["t0_s"], fit["a_s"], fit["b_s"]) >= 0


def test_arrival_steps():
    steps = eldr.arrival_steps(2000, 1.5, seed=3)
    assert steps[0] == 0 and (np.diff(steps) >= 0).all()
    assert 2000 / (steps[-1] + 1) == pytest.approx(1.5, rel=0.1)
    np.testing.assert_array_equal(steps, eldr.arrival_steps(2000, 1.5, seed=3))


def _fit(k=3, L=2, E=4):
    rng = np.random.default_rng(2)
    return EldrFit(model="toy", fingerprint="0" * 64, num_layers=L, num_experts=E, top_k=1,
                   idf=np.ones((L, E)), layers=tuple(range(L)),
                   centroids=rng.uniform(0, 1, (k, L * E)), calibration_requests=6, rho=0.1)


class _Recorder(Policy):
    name = "recorder"
    reads_counts = True

    def __init__(self):
        super().__init__(3)
        self.seen = []

    def _choose(self, request, loads):
        self.seen.append(request.counts)
        return 0


def test_shown_counts_hide_the_request_own():
    pool = np.arange(10 * 2 * 4).reshape(10, 2, 4)
    inner = _Recorder()
    shown = eldr.ShownCounts(inner, pool, seed=5)
    assert shown.reads_counts and shown.num_decoders == 3
    for i in range(10):
        shown.choose(HandOff(counts=pool[i], domain="x"), [0, 0, 0])
    seen = [int(np.flatnonzero((pool == s).all(axis=(1, 2)))[0]) for s in inner.seen]
    assert sorted(seen) == list(range(10))           # each pool entry shown once
    assert seen != list(range(10))                   # but not each request its own


def test_typical_union_counts_distinct_experts():
    ids = np.zeros((2, 3, 1), np.int32)
    ids[1] = 1
    requests = [SimRequest(counts=np.ones((2, 4), int), decode_experts=ids + r)
                for r in range(2)]
    # Batches of 2 from 2 requests: layer 0 sees {0} or {0, 1}, layer 1 {1} or {1, 2}.
    union = eldr.typical_union(requests, 2, np.random.default_rng(0), samples=400)
    assert 1.0 < union[0] < 2.0 and 1.0 < union[1] < 2.0


def test_policy_set():
    fit = _fit()
    configs = eldr.policies(3, fit, fit, ["a", "b"], seed=0)
    assert set(configs) == {"random", "round_robin", "jsq", "p2c", "domain", "eldr_tau0",
                            "eldr_tau0.1", "eldr_tau1", "eldr_plain_kmeans", "eldr_shuffled"}
    assert all(isinstance(p, Policy) and p.num_decoders == 3 for p in configs.values())
    assert isinstance(configs["eldr_shuffled"], EldrPolicy)
    assert configs["eldr_shuffled"] is not configs["eldr_tau0.1"]
    assert [configs[f"eldr_tau{t:g}"].tau for t in eldr.TAUS] == [0.0, 0.1, 1.0]


def test_reduction():
    assert eldr.reduction(8.0, 10.0) == pytest.approx(0.2)
    assert eldr.reduction(11.0, 10.0) == pytest.approx(-0.1)


def test_gpu_cost_model_reads_a_fit_and_clamps_noise(capsys):
    given = eldr.gpu_cost_model(str(eldr.GPU_COST), "fused_tiles_given", 6)
    assert given.a == pytest.approx(3.5014e-5, rel=1e-3)
    assert given.t0 == pytest.approx(6 * 1.2945e-4, rel=1e-3)
    top = eldr.gpu_cost_model(str(eldr.GPU_COST), "top", 6)   # pallas: b < 0 in the file
    assert top.b == 0.0 and "taken as 0" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no fit 'nope'"):
        eldr.gpu_cost_model(str(eldr.GPU_COST), "nope", 6)

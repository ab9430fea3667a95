"""The decode routing policies (``moejax.eldr.policies``) on scripted hand-offs: τ = 1
reproduces JSQ's choices exactly, τ = 0 is the most similar centroid, the band picks the
least loaded of the near centroids, and the load balancers do what their names say."""

from __future__ import annotations

import numpy as np
import pytest

from moejax.eldr import signature as sig
from moejax.eldr.fitfile import EldrFit
from moejax.eldr.policies import (DomainPolicy, EldrPolicy, HandOff, JSQPolicy, P2CPolicy,
                                  RoundRobinPolicy, check_tau, make_policy)

L, E, K = 3, 8, 4


def _fit(seed=0, decoders=K, layers=(0, 2)):
    rng = np.random.default_rng(seed)
    return EldrFit(model="toy", fingerprint="f" * 64, num_layers=L, num_experts=E, top_k=2,
                   idf=rng.uniform(0.2, 2.0, (L, E)), layers=layers,
                   centroids=rng.uniform(0, 1, (decoders, len(layers) * E)),
                   calibration_requests=20, rho=0.4)


def _scripted(steps=300, seed=1):
    """Hand-offs with random prompt counts, and loads that drift (a request joins the
    chosen decoder; now and then one finishes), as (request, loads) pairs produced by
    ``policy``'s own choices."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, (steps, L, E))
    counts[rng.random(steps) < 0.1] = 0           # some requests with no signature at all
    finishes = rng.integers(0, K, steps)
    done = rng.random(steps) < 0.4
    return counts, finishes, done


def _replay(policy, counts, finishes, done):
    loads = np.zeros(K, int)
    choices = []
    for c, f, d in zip(counts, finishes, done):
        choice = policy.choose(HandOff(counts=c), loads.tolist())
        choices.append(choice)
        loads[choice] += 1
        if d and loads[f] > 0:
            loads[f] -= 1
    return choices


def test_tau_one_reproduces_jsq_exactly():
    script = _scripted()
    eldr = _replay(EldrPolicy(_fit(), tau=1.0), *script)
    jsq = _replay(JSQPolicy(K), *script)
    assert eldr == jsq
    assert len(set(jsq)) == K


def test_tau_zero_is_the_most_similar_centroid():
    fit = _fit(3)
    policy = EldrPolicy(fit, tau=0.0)
    counts, _, _ = _scripted(seed=4)
    for c in counts[:50]:
        s = sig.signatures(c, fit.idf, fit.layers)
        if not s.any():
            continue
        want = int(np.argmax(fit.centroids @ s))
        # Whatever the loads: pure locality ignores them.
        assert policy.choose(HandOff(counts=c), [9, 0, 5, 2]) == want


def test_band_picks_the_least_loaded_near_centroid():
    # Two centroids on expert 0 of layer 0, one on expert 1, one on expert 2.
    centroids = np.zeros((K, 2 * E))
    centroids[0, 0] = centroids[1, 0] = 1.0
    centroids[1, 1] = 0.2
    centroids[2, 1] = centroids[3, 2] = 1.0
    fit = EldrFit(model="toy", fingerprint="f" * 64, num_layers=L, num_experts=E, top_k=2,
                  idf=np.ones((L, E)), layers=(0, 1), centroids=centroids,
                  calibration_requests=4, rho=0.0)
    counts = np.zeros((L, E), int)
    counts[0, 0] = 5                              # a request on expert 0
    sims = EldrPolicy(fit, 0.1).similarities(counts)
    assert sims[0] == pytest.approx(1.0) and 0.9 < sims[1] < 1.0 and sims[2] == 0
    assert EldrPolicy(fit, 0.1).choose(HandOff(counts), [3, 1, 0, 0]) == 1   # in the band
    assert EldrPolicy(fit, 0.0).choose(HandOff(counts), [3, 1, 0, 0]) == 0   # locality
    assert EldrPolicy(fit, 1.0).choose(HandOff(counts), [3, 1, 0, 0]) == 2   # = JSQ


def test_load_balancers():
    rr = RoundRobinPolicy(3)
    assert [rr.choose(HandOff(), [0, 0, 0]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert JSQPolicy(4).choose(HandOff(), [2, 1, 1, 3]) == 1          # ties: lowest index
    p2c, draws = P2CPolicy(5, seed=2), np.random.default_rng(2)
    loads = [4, 0, 7, 1, 3]
    chosen = []
    for _ in range(50):
        first, second = (int(i) for i in draws.choice(5, 2, replace=False))
        want = second if loads[second] < loads[first] else first
        chosen.append(p2c.choose(HandOff(), loads))
        assert chosen[-1] == want
    assert 2 not in chosen and len(set(chosen)) > 1
    assert P2CPolicy(1).choose(HandOff(), [5]) == 0


def test_domain_oracle():
    fixed = DomainPolicy(6, ["a", "b", "c"])
    assert {fixed.choose(HandOff(domain="b"), [0] * 6) for _ in range(3)} == {1}
    assert fixed.choose(HandOff(domain="b"), [0, 5, 0, 0, 2, 0]) == 4
    assert fixed.choose(HandOff(domain="zz"), [3, 3, 1, 3, 3, 3]) == 2   # unknown: JSQ
    few = DomainPolicy(2, ["a", "b", "c"])
    assert few.choose(HandOff(domain="c"), [0, 0]) == 0                # 2 mod 2
    learnt = make_policy("domain", 4)
    assert learnt.choose(HandOff(domain="x"), [1, 0, 0, 0]) == 1
    assert learnt.choose(HandOff(domain="y"), [0, 0, 0, 0]) == 1       # y owns 1 and 3
    assert learnt.choose(HandOff(domain="x"), [0, 0, 0, 0]) == 0       # x now owns 0 and 2


def test_bad_policy_arguments():
    for tau in (-0.01, 1.01, float("nan"), True, "0.1"):
        with pytest.raises(ValueError, match="eldr_tau must be a number in"):
            check_tau(tau)
    with pytest.raises(ValueError, match="routing must be one of"):
        make_policy("closest", 2)
    with pytest.raises(ValueError, match="needs a fit"):
        make_policy("eldr", 2)
    with pytest.raises(ValueError, match="refit with --decoders 3"):
        make_policy("eldr", 3, fit=_fit())
    with pytest.raises(ValueError, match="positive integer"):
        JSQPolicy(0)
    with pytest.raises(ValueError, match="3 loads for 4 decoders"):
        JSQPolicy(4).choose(HandOff(), [0, 0, 0])
    with pytest.raises(ValueError, match="prompt expert counts"):
        EldrPolicy(_fit()).choose(HandOff(), [0] * K)

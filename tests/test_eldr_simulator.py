"""The ELDR decode simulator (moejax.eldr.simulator): exact hand-computed schedules, the
per-layer union against a NumPy reference, continuous batching, determinism, the real
policies' calls, the noise-floor hook, trace and cost-file inputs, and bad inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from moejax import traces
from moejax.eldr.policies import HandOff, Policy, make_policy
from moejax.eldr.simulator import (CostModel, SimRequest, poisson_arrivals, rate_for_batch,
                                   requests_from_trace, shuffled_signatures,
                                   simulable_indices, simulate)

UNIT = CostModel(t0=0.0, a=1.0, b=0.0)          # a step costs its active experts, summed


def request(steps, num_experts=4, counts=None, domain=None):
    """A SimRequest from per-step, per-layer expert ids: steps[s][l] = the k ids."""
    ids = np.array(steps, np.int64).transpose(1, 0, 2)              # [D, L, k] -> [L, D, k]
    if counts is None:
        counts = np.zeros((ids.shape[0], num_experts), np.int64)
    return SimRequest(counts=counts, decode_experts=ids, domain=domain)


def random_requests(rng, n, *, num_layers=3, num_experts=8, k=2, max_decode=6):
    """n requests of 1..max_decode decode steps, k distinct experts per token and layer."""
    reqs = []
    for _ in range(n):
        decode = int(rng.integers(1, max_decode + 1))
        ids = np.argsort(rng.random((num_layers, decode, num_experts)), axis=-1)[..., :k]
        reqs.append(SimRequest(counts=rng.integers(0, 4, (num_layers, num_experts)),
                               decode_experts=ids, domain=str(rng.integers(3))))
    return reqs


class Recording(Policy):
    """Join-shortest-queue that records what it was shown."""

    name = "recording"

    def __init__(self, num_decoders):
        super().__init__(num_decoders)
        self.calls = []

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        self.calls.append((request, loads.copy()))
        return int(np.argmin(loads))


# ----------------------------------------------------------------------------- exact schedule
A = request([[[0, 1], [2, 3]], [[0, 1], [0, 1]], [[2, 3], [2, 3]]])      # D = 3
B = request([[[1, 2], [3, 0]], [[2, 3], [1, 2]], [[0, 3], [0, 1]]])      # D = 3


def test_hand_computed_schedule():
    # t=0: A alone, unions {0,1} {2,3} -> 4 s. B arrives at 1.5 and waits for the boundary.
    # t=4: A(step 1) + B(step 0): {0,1,2} {0,1,3} -> 6 s.
    # t=10: A(step 2) + B(step 1): {2,3} {1,2,3} -> 5 s; A finishes at 15.
    # t=15: B(step 2) alone: {0,3} {0,1} -> 4 s; B finishes at 19.
    result = simulate([A, B], [0.0, 1.5], make_policy("jsq", 1), num_decoders=1, cost=UNIT,
                      max_batch_size=8)
    np.testing.assert_array_equal(result.step_start, [0, 4, 10, 15])
    np.testing.assert_array_equal(result.step_end, [4, 10, 15, 19])
    np.testing.assert_array_equal(result.step_batch, [1, 2, 2, 1])
    np.testing.assert_array_equal(result.step_active, [[2, 2], [3, 3], [2, 3], [2, 2]])
    np.testing.assert_array_equal(result.first_token, [4, 10])
    np.testing.assert_array_equal(result.finish, [15, 19])
    np.testing.assert_allclose(result.tpot, [15 / 3, 17.5 / 3])
    assert result.decoder_steps.tolist() == [4]
    assert result.decoder_busy_s.tolist() == [19.0]
    assert result.decoder_tokens.tolist() == [6]
    assert result.mean_active_experts == pytest.approx(19 / 8)
    assert result.throughput_tokens_per_s == pytest.approx(6 / 19)
    assert result.load_imbalance == 1.0
    assert result.tpot_p50 == pytest.approx((15 / 3 + 17.5 / 3) / 2)


def test_cost_model_terms_and_arrival_at_a_step_end():
    # t0 = 1, a = 0.5, b = 0.25 over L = 2 layers. B arrives exactly when A's first step
    # ends: arrivals go first, so the router still counts A, and B joins that boundary.
    cost = CostModel(t0=1.0, a=0.5, b=0.25)
    first = 1.0 + 0.5 * 4 + 0.25 * 2 * 1                              # 3.5
    policy = Recording(1)
    result = simulate([A, B], [0.0, first], policy, num_decoders=1, cost=cost,
                      max_batch_size=8)
    second = 1.0 + 0.5 * 6 + 0.25 * 2 * 2                             # 5.0
    assert result.step_start[:2].tolist() == [0.0, first]
    assert result.step_end[1] == pytest.approx(first + second)
    assert result.step_rows(1).tolist() == [0, 1]
    assert [loads.tolist() for _, loads in policy.calls] == [[0], [1]]


# ----------------------------------------------------------------------------- union
def test_step_cost_is_the_union_per_layer_of_the_rows_current_ids():
    rng = np.random.default_rng(1)
    reqs = random_requests(rng, 30)
    arrivals = np.sort(rng.uniform(0, 20, len(reqs)))
    cost = CostModel(t0=0.3, a=0.2, b=0.05)
    result = simulate(reqs, arrivals, make_policy("round_robin", 3), num_decoders=3,
                      cost=cost, max_batch_size=4)
    done = np.zeros(len(reqs), int)                  # decode tokens each request has run
    for s in range(len(result.step_batch)):
        rows = result.step_rows(s)
        ids = np.stack([reqs[r].decode_experts[:, done[r]] for r in rows])     # [B, L, k]
        want = [len(np.unique(ids[:, layer])) for layer in range(ids.shape[1])]
        assert result.step_active[s].tolist() == want
        assert result.step_end[s] - result.step_start[s] == pytest.approx(
            0.3 + 0.2 * sum(want) + 0.05 * ids.shape[1] * len(rows))
        assert len(rows) <= 4 and (result.decoder[rows] == result.step_decoder[s]).all()
        done[rows] += 1
    assert done.tolist() == [r.decode_tokens for r in reqs]
    assert result.decoder_tokens.sum() == sum(r.decode_tokens for r in reqs)
    # a decoder's steps never overlap, and each starts no earlier than its rows arrived
    for d in range(3):
        mine = result.step_decoder == d
        assert (result.step_start[mine][1:] >= result.step_end[mine][:-1] - 1e-12).all()
    for s in range(len(result.step_batch)):
        assert (result.arrival[result.step_rows(s)] <= result.step_start[s]).all()


# ----------------------------------------------------------------------------- batching
def three_equal(decode=2):
    return [request([[[i, i + 1]]] * decode, num_experts=8) for i in range(3)]


def test_batch_size_one_serializes_fifo():
    result = simulate(three_equal(), [0.0, 0.0, 0.5], make_policy("jsq", 1), num_decoders=1,
                      cost=UNIT, max_batch_size=1)
    # each step: one row, 2 experts at the one layer -> 2 s; 2 steps per request
    assert result.step_batch.tolist() == [1] * 6
    assert result.step_requests.tolist() == [0, 0, 1, 1, 2, 2]
    np.testing.assert_array_equal(result.finish, [4, 8, 12])
    np.testing.assert_array_equal(result.first_token, [2, 6, 10])


def test_larger_batch_admits_at_step_boundaries():
    # 0 and 1 arrive together and start together; 2 arrives mid-step and waits for the
    # boundary; with room for 2, it waits until 0 and 1 leave.
    reqs = three_equal()
    result = simulate(reqs, [0.0, 0.0, 1.0], make_policy("jsq", 1), num_decoders=1,
                      cost=UNIT, max_batch_size=3)
    assert [result.step_rows(s).tolist() for s in range(3)] == [[0, 1], [0, 1, 2], [2]]
    # unions: {0,1,2} = 3; {0,1,2,3} = 4; {2,3} = 2
    np.testing.assert_array_equal(result.step_end, [3, 7, 9])
    np.testing.assert_array_equal(result.finish, [7, 7, 9])
    capped = simulate(reqs, [0.0, 0.0, 1.0], make_policy("jsq", 1), num_decoders=1,
                      cost=UNIT, max_batch_size=2)
    assert [capped.step_rows(s).tolist() for s in range(4)] == [[0, 1], [0, 1], [2], [2]]


def test_idle_decoder_wakes_on_arrival():
    reqs = three_equal(decode=1)
    result = simulate(reqs, [0.0, 10.0, 10.5], make_policy("jsq", 1), num_decoders=1,
                      cost=UNIT, max_batch_size=4)
    np.testing.assert_array_equal(result.step_start, [0, 10, 12])
    np.testing.assert_array_equal(result.finish, [2, 12, 14])
    assert result.decoder_busy_s.tolist() == [6.0]


# ----------------------------------------------------------------------------- routing
def test_deterministic_and_one_policy_call_per_request_with_live_loads():
    rng = np.random.default_rng(2)
    reqs = random_requests(rng, 40)
    arrivals = poisson_arrivals(len(reqs), 1.5, seed=3)
    cost = CostModel(t0=0.1, a=0.3, b=0.02)
    runs = [simulate(reqs, arrivals, make_policy("p2c", 4, seed=5), num_decoders=4,
                     cost=cost, max_batch_size=3) for _ in range(2)]
    for field in ("decoder", "finish", "first_token", "step_start", "step_active",
                  "step_requests"):
        np.testing.assert_array_equal(getattr(runs[0], field), getattr(runs[1], field))

    policy = Recording(4)
    result = simulate(reqs, arrivals, policy, num_decoders=4, cost=cost, max_batch_size=3)
    assert len(policy.calls) == len(reqs)
    for i, (handoff, loads) in enumerate(policy.calls):
        assert handoff.counts is reqs[i].counts and handoff.domain == reqs[i].domain
        # in flight at arrival i: earlier requests on that decoder not yet finished
        # (one finishing at this very instant still counts: arrivals go first)
        earlier = np.arange(len(reqs)) < i
        want = [int((earlier & (result.decoder == d) & (result.finish >= arrivals[i])).sum())
                for d in range(4)]
        assert loads.tolist() == want, i
        assert result.decoder[i] == int(np.argmin(want))


def test_jsq_spreads_equal_requests_evenly():
    reqs = [request([[[0, 1]]] * 3, num_experts=8) for _ in range(8)]
    result = simulate(reqs[:4], [0.0] * 4, make_policy("jsq", 4), num_decoders=4, cost=UNIT,
                      max_batch_size=8)
    assert result.decoder.tolist() == [0, 1, 2, 3]
    assert result.load_imbalance == 1.0
    result = simulate(reqs, [0.0] * 8, make_policy("jsq", 4), num_decoders=4, cost=UNIT,
                      max_batch_size=8)
    assert result.decoder_tokens.tolist() == [6, 6, 6, 6] and result.load_imbalance == 1.0
    uneven = simulate(reqs[:4], [0.0] * 4, make_policy("jsq", 3), num_decoders=3, cost=UNIT,
                      max_batch_size=8)
    assert uneven.load_imbalance == pytest.approx(6 / 4)


def test_signatures_of_shows_the_router_other_counts():
    rng = np.random.default_rng(4)
    reqs = random_requests(rng, 6)
    shown = {1: reqs[4].counts, 4: np.full_like(reqs[1].counts, 7)}
    policy = Recording(2)
    simulate(reqs, np.arange(6.0), policy, num_decoders=2, cost=UNIT, max_batch_size=2,
             signatures_of=shown)
    for i, (handoff, _) in enumerate(policy.calls):
        np.testing.assert_array_equal(handoff.counts, shown.get(i, reqs[i].counts))
        assert handoff.domain == reqs[i].domain
    shuffled = shuffled_signatures(reqs, seed=0)
    assert sorted(shuffled) == list(range(6))
    assert sorted(id(c) for c in shuffled.values()) == sorted(id(r.counts) for r in reqs)


# ----------------------------------------------------------------------------- inputs
def test_requests_from_trace():
    L, k, E = 2, 2, 6
    rng = np.random.default_rng(5)

    def ran(prompt, generated, domain):
        decode = generated - 1
        return traces.RequestTrace(
            id=domain, domain=domain, prompt_token_ids=np.arange(prompt, dtype=np.int32),
            generated_token_ids=np.arange(generated, dtype=np.int32),
            prefill_experts=rng.integers(0, E, (L, prompt, k)).astype(np.int32),
            prefill_weights=np.full((L, prompt, k), 0.5, np.float32),
            decode_experts=rng.integers(0, E, (L, decode, k)).astype(np.int32),
            decode_weights=np.full((L, decode, k), 0.5, np.float32), finish_reason="length")

    rows = [ran(3, 4, "a"), traces.RequestTrace.failed(9, "bad", num_layers=L, top_k=k),
            ran(2, 1, "b"), ran(5, 2, "c")]
    trace = traces.Trace.from_requests(rows, num_layers=L, top_k=k, num_experts=E)
    assert simulable_indices(trace).tolist() == [0, 3]
    reqs = requests_from_trace(trace)
    counts = traces.activation_counts(trace)
    assert [r.domain for r in reqs] == ["a", "c"]
    assert [r.decode_tokens for r in reqs] == [3, 1]
    np.testing.assert_array_equal(reqs[0].counts, counts[0])
    np.testing.assert_array_equal(reqs[1].decode_experts, rows[3].decode_experts)
    assert [r.domain for r in requests_from_trace(trace, [3])] == ["c"]
    for bad, why in ((1, "failed: bad"), (2, "no decode token"), (4, "outside")):
        with pytest.raises(ValueError, match=why):
            requests_from_trace(trace, [bad])


def test_cost_model_constructors(tmp_path):
    assert CostModel.from_per_layer(0.5, 0.25, 0.125, 4) == CostModel(t0=2.0, a=0.25, b=0.125)
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"t0_s": 1e-4, "a_s": 2e-5, "b_s": 3e-7, "device": "cpu",
                                "r2": 0.98, "points": [[1, 2]]}))
    cost = CostModel.from_file(path, num_layers=6)
    assert cost.t0 == pytest.approx(6e-4) and (cost.a, cost.b) == (2e-5, 3e-7)
    assert cost.step_seconds(np.array([3] * 6), 5) == pytest.approx(6e-4 + 18 * 2e-5
                                                                     + 6 * 5 * 3e-7)
    path.write_text(json.dumps({"t0_s": 1e-4, "a_s": 2e-5}))
    with pytest.raises(ValueError, match="b_s"):
        CostModel.from_file(path, num_layers=6)
    path.write_text(json.dumps({"t0_s": 1e-4, "a_s": -2e-5, "b_s": 0}))
    with pytest.raises(ValueError, match="CostModel.a"):
        CostModel.from_file(path, num_layers=6)
    with pytest.raises(ValueError, match="num_layers"):
        CostModel.from_per_layer(1e-4, 0, 0, 0)


def test_arrival_helpers():
    times = poisson_arrivals(20000, 50.0, seed=7)
    assert (np.diff(times) >= 0).all() and times[0] > 0
    assert np.mean(np.diff(times)) == pytest.approx(1 / 50, rel=0.05)
    np.testing.assert_array_equal(times, poisson_arrivals(20000, 50.0, seed=7))
    assert rate_for_batch(8, 24, 31, 0.01) == pytest.approx(24 * 8 / (31 * 0.01))
    for kwargs in ({"rate_per_s": -1.0}, {"rate_per_s": 0.0}, {"rate_per_s": float("nan")}):
        with pytest.raises(ValueError, match="rate_per_s"):
            poisson_arrivals(5, **kwargs)
    with pytest.raises(ValueError, match="n must"):
        poisson_arrivals(-1, 1.0)
    with pytest.raises(ValueError, match="step_seconds"):
        rate_for_batch(8, 4, 31, 0.0)
    with pytest.raises(ValueError, match="num_decoders"):
        rate_for_batch(8, 0, 31, 0.1)


def test_bad_inputs_are_refused_by_name():
    reqs = three_equal()
    jsq = make_policy("jsq", 1)
    run = dict(policy=jsq, num_decoders=1, cost=UNIT, max_batch_size=2)
    with pytest.raises(ValueError, match="arrival_times must be sorted"):
        simulate(reqs, [0.0, 2.0, 1.0], **run)
    with pytest.raises(ValueError, match="arrival_times: shape"):
        simulate(reqs, [0.0, 1.0], **run)
    with pytest.raises(ValueError, match="NaN"):
        simulate(reqs, [0.0, 1.0, float("nan")], **run)
    for size in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_batch_size"):
            simulate(reqs, [0.0] * 3, **{**run, "max_batch_size": size})
    with pytest.raises(ValueError, match="decoders"):
        simulate(reqs, [0.0] * 3, **{**run, "num_decoders": 2})
    with pytest.raises(ValueError, match="at least one request"):
        simulate([], [], **run)
    with pytest.raises(ValueError, match="D = 0"):
        SimRequest(counts=np.zeros((1, 8), np.int64), decode_experts=np.zeros((1, 0, 2), int))
    with pytest.raises(ValueError, match="decode_experts has 2 layers, counts has 1"):
        SimRequest(counts=np.zeros((1, 8), np.int64), decode_experts=np.zeros((2, 3, 2), int))
    with pytest.raises(ValueError, match="expert id 8 outside"):
        SimRequest(counts=np.zeros((1, 8), np.int64), decode_experts=np.full((1, 3, 2), 8))
    two_layer = request([[[0, 1], [2, 3]]], num_experts=8)
    with pytest.raises(ValueError, match=r"requests\[3\]: 2 layers.*requests\[0\] has 1"):
        simulate(reqs + [two_layer], [0.0] * 4, **run)
    with pytest.raises(ValueError, match=r"signatures_of\[0\]: shape"):
        simulate(reqs, [0.0] * 3, **run, signatures_of={0: np.zeros((2, 8))})
    with pytest.raises(ValueError, match="signatures_of: key 3"):
        simulate(reqs, [0.0] * 3, **run, signatures_of={3: reqs[0].counts})
    with pytest.raises(ValueError, match="CostModel.t0"):
        CostModel(t0=float("inf"), a=0, b=0)

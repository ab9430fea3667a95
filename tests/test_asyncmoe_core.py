"""AsyncMoE core: schedulers (Algorithm 1 by hand), token pool, device engine routing,
cost tables, routing sources, and the discrete-event simulator (determinism,
conservation, stability under load, a scripted run traced by hand)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from moejax.asyncmoe.engine import Batch, DeviceEngine
from moejax.asyncmoe.placement import contiguous_placement, device_units
from moejax.asyncmoe.pool import TokenPool
from moejax.asyncmoe.records import (ATTENTION_UNIT, EXPERT, HEAD, HEAD_UNIT, TokenRecord,
                                     attention_record, head_record, queue_key, token_key)
from moejax.asyncmoe.schedulers import (DefragScheduler, FirstLayerScheduler,
                                        MostTokensScheduler, make_scheduler)
from moejax.asyncmoe.simulator import (CostTables, SimRequest, SkewedRouting, TraceRouting,
                                       assign_rank, poisson_workload, simulate_mu_queue,
                                       simulate_sync_ep)


# ----------------------------------------------------------------------------- schedulers
def test_defrag_scores_by_hand():
    # N_B = 3 blocks, N_U = 3 units, delta = 0.5, K = 2. Row sums S = [0, 5, 12].
    q = np.array([[0, 0, 0],
                  [5, 0, 0],
                  [0, 6, 6]])
    # LScore(0) = 0.5*S1/3 + 0.25*S2/3 = 0.5*5/3 + 0.25*4 = 5/6 + 1 = 11/6
    # LScore(1) = 0.5*S2/3 + 0.25*S0/3 = 0.5*4   + 0      = 2
    # LScore(2) = 0.5*S0/3 + 0.25*S1/3 = 0       + 5/12   = 5/12
    scheduler = DefragScheduler(delta=0.5, lookahead=2)
    np.testing.assert_allclose(scheduler.lookahead_scores(q), [11 / 6, 2.0, 5 / 12])
    # Score = Q + LScore where Q > 0, else 0.
    expected = np.array([[0.0, 0.0, 0.0],
                         [7.0, 0.0, 0.0],
                         [0.0, 6 + 5 / 12, 6 + 5 / 12]])
    np.testing.assert_allclose(scheduler.scores(q), expected)
    assert scheduler.choose(q) == (1, 0)
    # MTFS would take the fullest queue instead (6, tied at (2,1) and (2,2): lowest u).
    assert MostTokensScheduler().choose(q) == (2, 1)
    # Without lookahead (K = 0) defrag is MTFS.
    assert DefragScheduler(delta=0.5, lookahead=0).choose(q) == (2, 1)


def test_defrag_tie_rule():
    # Two blocks, K = 2 wraps to the block itself: LScore(0) = LScore(1) = 0.75; both
    # non-empty queues score 2.75 -> the lowest block.
    assert DefragScheduler(0.5, 2).choose(np.array([[0, 2], [2, 0]])) == (0, 1)
    # Within a block: the lowest unit.
    assert DefragScheduler(0.5, 2).choose(np.array([[0, 3, 3], [0, 0, 0]])) == (0, 1)
    # A tie in exact arithmetic that floats break the other way: with delta = 0.3, K = 2,
    # N_U = 4, S = [14, 4, 11, 11]: LScore(2) = 0.3*11/4 + 0.09*14/4 = 1.14 and
    # LScore(3) = 0.3*14/4 + 0.09*4/4 = 1.14, so (2,0), (2,2), (3,1), (3,3) all score
    # 5.14 (plain float argmax picks (3,1)); the tie rule gives (2,0).
    q = np.array([[2, 4, 4, 4], [1, 0, 0, 3], [4, 1, 4, 2], [1, 4, 2, 4]])
    scheduler = DefragScheduler(0.3, 2)
    scores = scheduler.scores(q)
    assert np.unravel_index(np.argmax(scores), q.shape) == (3, 1)
    assert scheduler.choose(q) == (2, 0)


def test_most_tokens_and_first_layer():
    q = np.array([[1, 0, 2],
                  [0, 4, 4],
                  [3, 0, 0]])
    assert MostTokensScheduler().choose(q) == (1, 1)
    assert FirstLayerScheduler().choose(q) == (0, 2)
    assert FirstLayerScheduler().choose(np.array([[0, 0], [2, 2], [9, 9]])) == (1, 0)
    empty = np.zeros((3, 4), dtype=np.int64)
    for scheduler in (DefragScheduler(), MostTokensScheduler(), FirstLayerScheduler()):
        assert scheduler.choose(empty) is None


def test_make_scheduler_and_bad_parameters():
    defrag = make_scheduler("defrag")
    assert isinstance(defrag, DefragScheduler)
    assert (defrag.delta, defrag.lookahead) == (1.0, 2)
    assert make_scheduler("defrag", delta=1, lookahead=0).delta == 1.0
    assert isinstance(make_scheduler("most_tokens"), MostTokensScheduler)
    assert isinstance(make_scheduler("first_layer"), FirstLayerScheduler)
    with pytest.raises(ValueError, match="unknown scheduler 'fifo'"):
        make_scheduler("fifo")
    for delta in (0, -0.5, 1.5, math.nan, True):
        with pytest.raises(ValueError, match="delta"):
            make_scheduler("defrag", delta=delta)
    for lookahead in (-1, 1.5, True):
        with pytest.raises(ValueError, match="lookahead"):
            make_scheduler("defrag", lookahead=lookahead)
    with pytest.raises(ValueError, match="unknown"):
        make_scheduler("defrag", decay=0.5)
    with pytest.raises(ValueError, match="no options"):
        make_scheduler("most_tokens", delta=0.5)
    for bad in (np.array([1, 2]), np.array([[1, -1]]), np.array([[0.5, 1.0]])):
        with pytest.raises(ValueError, match="queue lengths"):
            MostTokensScheduler().choose(bad)


# ----------------------------------------------------------------------------- records
def test_token_record_validation():
    record = attention_record(3, 1, 2, 0, 10)
    assert queue_key(record) == (2, ATTENTION_UNIT) and token_key(record) == (3, 1, 2)
    with pytest.raises(ValueError, match="kind"):
        TokenRecord(0, 0, 0, "router", -1, 0, 1, -1, 0.0)
    with pytest.raises(ValueError, match="expert=-1"):
        TokenRecord(0, 0, 0, "attention", 2, 0, 1, -1, 0.0)
    with pytest.raises(ValueError, match="context"):
        attention_record(0, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="slot"):
        TokenRecord(0, 0, 0, EXPERT, 1, 0, 1, -1, 0.5)


# ----------------------------------------------------------------------------- pool
def _part(request: int, step: int, layer: int, slot: int, expert: int | None = None,
          rank: int = 0, context: int = 9) -> TokenRecord:
    return TokenRecord(request, step, layer, EXPERT, slot if expert is None else expert,
                       rank, context, slot, 0.25 * (slot + 1), payload=f"out{slot}")


def test_pool_merges_k_parts_in_every_arrival_order():
    k = 3
    for order in itertools.permutations(range(k)):
        pool = TokenPool(k)
        results = [pool.add(_part(7, 2, 1, slot)) for slot in order]
        assert results[:-1] == [None] * (k - 1)
        merged = results[-1]
        assert [p.slot for p in merged] == [0, 1, 2]
        assert [p.payload for p in merged] == ["out0", "out1", "out2"]
        assert pool.pending() == 0


def test_pool_interleaved_keys():
    pool = TokenPool(2)
    arrivals = [_part(0, 0, 0, 1), _part(1, 0, 0, 0), _part(0, 0, 1, 0), _part(0, 1, 0, 1),
                _part(1, 0, 0, 1), _part(0, 0, 0, 0), _part(0, 1, 0, 0), _part(0, 0, 1, 1)]
    done = []
    for part in arrivals:
        merged = pool.add(part)
        if merged is not None:
            assert len({token_key(p) for p in merged}) == 1
            done.append(token_key(merged[0]))
    assert done == [(1, 0, 0), (0, 0, 0), (0, 1, 0), (0, 0, 1)]
    assert pool.pending() == 0


def test_pool_rejects_bad_parts_and_keeps_the_good_ones():
    pool = TokenPool(3)
    assert pool.add(_part(4, 0, 2, 1)) is None
    with pytest.raises(ValueError, match=r"\(4, 0, 2\): slot 1 arrived twice"):
        pool.add(_part(4, 0, 2, 1, expert=5))
    with pytest.raises(ValueError, match=r"\(4, 0, 2\): slot 3 outside \[0, 3\)"):
        pool.add(_part(4, 0, 2, 3))
    with pytest.raises(ValueError, match=r"\(4, 0, 2\).*rank 1"):
        pool.add(_part(4, 0, 2, 0, rank=1))
    with pytest.raises(ValueError, match="only expert outputs"):
        pool.add(attention_record(4, 0, 2, 0, 9))
    assert pool.pending() == 1 and pool.pending_keys() == [(4, 0, 2)]
    assert pool.add(_part(4, 0, 2, 0)) is None
    assert [p.slot for p in pool.add(_part(4, 0, 2, 2))] == [0, 1, 2]
    with pytest.raises(ValueError, match="k"):
        TokenPool(0)


# ----------------------------------------------------------------------------- engine
def _engines(num_layers: int = 2, scheduler=None) -> list[DeviceEngine]:
    placement = contiguous_placement(4, 2)  # experts 0,1 on device 0; 2,3 on device 1
    scheduler = scheduler or MostTokensScheduler()
    return [DeviceEngine(d, num_layers, device_units(d, placement), scheduler, 2, placement)
            for d in range(2)]


def test_placement_and_units():
    assert contiguous_placement(8, 3) == (0, 0, 0, 1, 1, 1, 2, 2)
    assert device_units(1, (0, 0, 1, 1)) == (ATTENTION_UNIT, HEAD_UNIT, 2, 3)
    assert device_units(1, (0, 0, 1, 1), hosts_attention=False) == (2, 3)
    with pytest.raises(ValueError, match="expert_device places experts"):
        DeviceEngine(0, 2, (-1, -2, 0), MostTokensScheduler(), 2, (0, 0, 1, 1))
    with pytest.raises(ValueError, match="both"):
        DeviceEngine(0, 2, (-1, 0, 1), MostTokensScheduler(), 2, (0, 0, 1, 1))


def test_engine_routes_a_token_through_a_block():
    dev0, dev1 = _engines()
    dev0.enqueue(attention_record(0, 0, 0, 0, 5))
    dev0.enqueue(attention_record(1, 0, 0, 0, 7))
    assert dev0.queue_lengths().tolist() == [[2, 0, 0, 0], [0, 0, 0, 0]]
    batch = dev0.next_batch()
    assert (batch.layer, batch.unit, batch.kind) == (0, ATTENTION_UNIT, "attention")
    assert [r.request_id for r in batch.records] == [0, 1]
    assert dev0.queued() == 0 and dev0.next_batch() is None
    out_a, out_b = object(), object()
    routed = dev0.route(batch, np.array([[0, 3], [2, 1]]), np.array([[0.7, 0.3], [0.6, 0.4]]),
                        [out_a, out_b])
    assert [(dest, r.request_id, r.expert, r.slot, r.weight, r.kind) for dest, r in routed] == [
        (0, 0, 0, 0, 0.7, EXPERT), (1, 0, 3, 1, 0.3, EXPERT),
        (1, 1, 2, 0, 0.6, EXPERT), (0, 1, 1, 1, 0.4, EXPERT)]
    assert [r.payload for _, r in routed] == [out_a, out_a, out_b, out_b]
    assert all((r.rank, r.layer) == (0, 0) for _, r in routed)
    assert [r.context for _, r in routed] == [5, 5, 7, 7]

    engines = (dev0, dev1)
    for dest, record in routed:
        assert engines[dest].deliver([record], "attention") == []
    assert dev1.queue_lengths()[0].tolist() == [0, 0, 1, 1]
    # Device 1 runs expert 2 (tie with expert 3: lowest column); its output goes home.
    expert_batch = dev1.next_batch()
    assert (expert_batch.layer, expert_batch.unit) == (0, 2)
    back = dev1.route(expert_batch, outputs=["y2"])
    assert [(dest, r.request_id, r.expert, r.slot, r.payload) for dest, r in back] == [
        (0, 1, 2, 0, "y2")]
    assert dev0.receive(back[0][1]) is None
    # Device 0's expert 1 output completes request 1's token at block 0.
    dev0_expert = dev0.next_batch()
    assert dev0_expert.unit == 0  # expert 0 (request 0), then expert 1
    dev0_expert = dev0.next_batch()
    assert (dev0_expert.unit, dev0_expert.records[0].request_id) == (1, 1)
    (dest, out), = dev0.route(dev0_expert, outputs=["y1"])
    merged = dev0.deliver([out], "expert")
    assert len(merged) == 1
    m = merged[0]
    assert (m.request_id, m.step, m.layer, m.rank, m.context) == (1, 0, 0, 0, 7)
    assert [(p.slot, p.expert, p.weight, p.payload) for p in m.parts] == [
        (0, 2, 0.6, "y2"), (1, 1, 0.4, "y1")]
    assert not m.is_last_layer
    nxt = m.next_record("h")
    assert (nxt.kind, nxt.layer, nxt.step, nxt.payload) == ("attention", 1, 0, "h")
    dev0.enqueue(nxt)
    assert dev0.queue_lengths()[1].tolist() == [1, 0, 0, 0]
    assert dev0.stats.batches[(0, ATTENTION_UNIT)] == 1
    assert dev0.stats.tokens[(0, ATTENTION_UNIT)] == 2
    assert dev0.stats.mean_batch_size("attention") == 2.0
    assert dev0.stats.mean_batch_size("expert") == 1.0


def test_engine_last_layer_goes_to_the_head():
    dev0, _ = _engines(num_layers=2)
    parts = [TokenRecord(3, 4, 1, EXPERT, e, 0, 20, slot, 0.5) for slot, e in enumerate((2, 0))]
    assert dev0.receive(parts[1]) is None
    merged = dev0.receive(parts[0])
    assert merged.is_last_layer
    head = merged.next_record()
    assert (head.kind, head.layer, head.step, head.context) == (HEAD, 1, 4, 20)
    dev0.enqueue(head)
    batch = dev0.next_batch()
    assert (batch.layer, batch.unit, batch.kind) == (1, HEAD_UNIT, HEAD)
    with pytest.raises(ValueError, match="head batch"):
        dev0.route(batch)


def test_engine_rejects_records_that_are_not_its_own():
    dev0, dev1 = _engines()
    with pytest.raises(ValueError, match="request 5 .* does not belong to device 0"):
        dev0.enqueue(attention_record(5, 0, 0, 1, 3))
    with pytest.raises(ValueError, match="expert 3 .* does not belong to device 0"):
        dev0.enqueue(TokenRecord(5, 0, 0, EXPERT, 3, 0, 3, 0, 1.0))
    with pytest.raises(ValueError, match="does not belong to device 1"):
        dev1.receive(TokenRecord(5, 0, 0, EXPERT, 3, 0, 3, 0, 1.0))
    with pytest.raises(ValueError, match="receive\\(\\) takes expert outputs"):
        dev0.receive(attention_record(5, 0, 0, 0, 3))
    with pytest.raises(ValueError, match="layer outside"):
        dev0.enqueue(attention_record(5, 0, 2, 0, 3))
    with pytest.raises(ValueError, match="head follows the last block"):
        dev0.enqueue(head_record(5, 0, 0, 0, 3))
    with pytest.raises(ValueError, match="slot outside"):
        dev0.enqueue(TokenRecord(5, 0, 0, EXPERT, 1, 0, 3, 2, 1.0))


def test_engine_route_checks_its_arguments():
    dev0, _ = _engines()
    dev0.enqueue(attention_record(0, 0, 0, 0, 5))
    batch = dev0.next_batch()
    with pytest.raises(ValueError, match="needs topk_experts"):
        dev0.route(batch)
    with pytest.raises(ValueError, match="distinct"):
        dev0.route(batch, np.array([[1, 1]]), np.array([[0.5, 0.5]]))
    with pytest.raises(ValueError, match=r"must both be \(1, 2\)"):
        dev0.route(batch, np.array([[1, 2, 3]]), np.array([[0.5, 0.5, 0.0]]))
    with pytest.raises(ValueError, match="expert ids in"):
        dev0.route(batch, np.array([[1, 4]]), np.array([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="2 outputs for a batch of 1"):
        dev0.route(batch, np.array([[1, 2]]), np.array([[0.5, 0.5]]), ["a", "b"])
    expert_batch = Batch(0, 1, (TokenRecord(0, 0, 0, EXPERT, 1, 0, 5, 0, 1.0),))
    with pytest.raises(ValueError, match="takes no top-k"):
        dev0.route(expert_batch, np.array([[1, 2]]), np.array([[0.5, 0.5]]))


def test_engine_refuses_a_bad_scheduler_choice():
    class Wrong:
        def choose(self, queue_lengths):
            return (1, 0)  # an empty queue

    dev0, _ = _engines(scheduler=Wrong())
    dev0.enqueue(attention_record(0, 0, 0, 0, 5))
    with pytest.raises(RuntimeError, match="not a non-empty queue"):
        dev0.next_batch()


# ----------------------------------------------------------------------------- costs
def _tables(**overrides) -> dict:
    tables = {"attention": {"batch": [1, 3], "context": [10, 20], "seconds": [[1, 2], [3, 5]]},
              "expert": {"batch": [1, 5], "seconds": [1, 3]},
              "head": {"batch": [4], "seconds": [0.25]},
              "batch_overhead_s": 0.5,
              "link": {"latency_s": 1e-3, "bandwidth_Bps": 1e6}}
    tables.update(overrides)
    return tables


def test_cost_tables_interpolate():
    tables = CostTables.from_dict(_tables(meta={"device": "test"}))
    assert tables.attention_s(1, 10) == 1.5
    assert tables.attention_s(2, 15) == pytest.approx(0.25 * (1 + 2 + 3 + 5) + 0.5)
    assert tables.attention_s(5, 10) == pytest.approx(5.5)  # (1 - 2)*1 + 2*3, extrapolated
    assert tables.attention_s(1, 30) == pytest.approx(3.5)  # (1 - 2)*1 + 2*2
    assert tables.expert_s(3) == pytest.approx(2.5)
    assert tables.expert_s(9) == pytest.approx(5.5)
    assert tables.head_s(1) == tables.head_s(100) == 0.75
    assert tables.link_s(0) == 0.0
    assert tables.link_s(1000) == pytest.approx(2e-3)
    falling = CostTables.from_dict(_tables(expert={"batch": [1, 2], "seconds": [2, 0]}))
    assert falling.expert_s(4) == 0.5  # extrapolated below 0: floored, plus the overhead
    assert CostTables.from_dict(tables.to_dict()) == tables
    with pytest.raises(ValueError):
        tables.expert_s(0)


@pytest.mark.parametrize("change, message", [
    ({"link": {"latency_s": 0.0}}, "missing \\['bandwidth_Bps'\\]"),
    ({"extra": 1}, "unknown \\['extra'\\]"),
    ({"expert": {"batch": [2, 1], "seconds": [1, 1]}}, "strictly increasing"),
    ({"expert": {"batch": [1, 2], "seconds": [1, -1]}}, "expert.seconds\\[1\\] must be >= 0"),
    ({"attention": {"batch": [1, 3], "context": [10, 20], "seconds": [[1, 2], [3]]}},
     "attention.seconds\\[1\\]"),
    ({"link": {"latency_s": 0.0, "bandwidth_Bps": 0}}, "bandwidth_Bps must be > 0"),
    ({"batch_overhead_s": float("nan")}, "batch_overhead_s"),
])
def test_cost_tables_validate(change, message):
    with pytest.raises(ValueError, match=message):
        CostTables.from_dict(_tables(**change))


# ----------------------------------------------------------------------------- routing
def test_skewed_routing():
    uniform = SkewedRouting(8, 2, 0.0, seed=1)
    skewed = SkewedRouting(8, 2, 2.0, seed=1)
    keys = [(r, s, l) for r in range(50) for s in range(20) for l in range(2)]
    counts = {}
    for name, routing in (("uniform", uniform), ("skewed", skewed)):
        counts[name] = np.zeros(8)
        for key in keys:
            ids, weights = routing.topk(*key)
            assert len(set(ids.tolist())) == 2
            assert weights.sum() == pytest.approx(1.0)
            counts[name][ids] += 1
    freq = counts["uniform"] / len(keys)
    np.testing.assert_allclose(freq, 0.25, atol=0.04)
    hot = int(np.argmax(skewed.popularity))
    assert counts["skewed"][hot] / len(keys) > 0.95
    # A pure function of (seed, request, step, layer): another object, reversed order.
    again = SkewedRouting(8, 2, 2.0, seed=1)
    for key in reversed(keys[:50]):
        np.testing.assert_array_equal(again.topk(*key)[0], skewed.topk(*key)[0])
    with pytest.raises(ValueError, match="exceeds"):
        SkewedRouting(2, 3, 0.0, 0)
    with pytest.raises(ValueError, match="skew"):
        SkewedRouting(4, 2, -1.0, 0)


def test_trace_routing_validates():
    ids = {0: np.zeros((2, 3, 2), dtype=np.int64) + [0, 1]}
    weights = {0: np.full((2, 3, 2), 0.5)}
    routing = TraceRouting(ids, weights, num_experts=4)
    assert routing.top_k == 2 and routing.topk(0, 2, 1)[0].tolist() == [0, 1]
    with pytest.raises(ValueError, match="outside its 3 steps"):
        routing.topk(0, 3, 0)
    with pytest.raises(ValueError, match="no request 1"):
        routing.topk(1, 0, 0)
    with pytest.raises(ValueError, match="repeats an expert"):
        TraceRouting({0: np.zeros((2, 3, 2), dtype=np.int64)}, weights, 4)
    with pytest.raises(ValueError, match="expert ids in"):
        TraceRouting({0: ids[0] + 3}, weights, 4)


# ----------------------------------------------------------------------------- simulator
SIM_TABLES = CostTables.from_dict({
    "attention": {"batch": [1, 64], "context": [64, 512],
                  "seconds": [[1.0e-4, 1.5e-4], [2.0e-4, 6.0e-4]]},
    "expert": {"batch": [1, 64], "seconds": [1.0e-4, 3.0e-4]},
    "head": {"batch": [1, 64], "seconds": [5.0e-5, 1.0e-4]},
    "batch_overhead_s": 1e-5,
    "link": {"latency_s": 1e-5, "bandwidth_Bps": 1e11}})
PROMPTS = (16, 48)
DECODES = (8, 12)
SIM_SHAPE = dict(num_devices=2, num_layers=2, num_experts=4, top_k=2)
HIDDEN, DTYPE_BYTES = 256, 2


def _mu(workload, routing, scheduler="defrag"):
    return simulate_mu_queue(SIM_TABLES, routing, workload, scheduler=scheduler,
                             hidden=HIDDEN, dtype_bytes=DTYPE_BYTES, **SIM_SHAPE)


def _sync(workload, routing):
    return simulate_sync_ep(SIM_TABLES, routing, workload, hidden=HIDDEN,
                            dtype_bytes=DTYPE_BYTES, **SIM_SHAPE)


def _check_conserved(result, workload):
    by_id = {r.request_id: r for r in result.requests}
    assert sorted(by_id) == sorted(r.request_id for r in workload)
    for spec in workload:
        times = by_id[spec.request_id].token_times
        assert len(times) == spec.decode_tokens
        assert times[0] > spec.arrival_s and all(np.diff(times) > 0)
    assert result.tokens_generated == sum(r.decode_tokens for r in workload)
    assert result.leftover_queued == 0 and result.leftover_pooled == 0


def test_poisson_workload_and_rank_assignment():
    workload = poisson_workload(50, 100.0, PROMPTS, DECODES, seed=3)
    assert workload == poisson_workload(50, 100.0, PROMPTS, DECODES, seed=3)
    assert [r.request_id for r in workload] == list(range(50))
    assert all(16 <= r.prompt_length <= 48 and 8 <= r.decode_tokens <= 12 for r in workload)
    assert np.all(np.diff([r.arrival_s for r in workload]) > 0)
    assert assign_rank([2, 1, 1]) == 1
    with pytest.raises(ValueError, match="empty"):
        poisson_workload(5, 1.0, (5, 4), DECODES, seed=0)


def test_simulation_is_deterministic_and_conserves_tokens():
    workload = poisson_workload(40, 4000.0, PROMPTS, DECODES, seed=5)
    first = _mu(workload, SkewedRouting(4, 2, 1.0, seed=2))
    again = _mu(workload, SkewedRouting(4, 2, 1.0, seed=2))
    assert first == again
    other = _mu(workload, SkewedRouting(4, 2, 1.0, seed=3))
    assert other.batches != first.batches
    _check_conserved(first, workload)
    sync = _sync(workload, SkewedRouting(4, 2, 1.0, seed=2))
    _check_conserved(sync, workload)
    assert [len(r.token_times) for r in sync.requests] == [
        len(r.token_times) for r in first.requests]
    for scheduler in ("most_tokens", "first_layer"):
        _check_conserved(_mu(workload, SkewedRouting(4, 2, 1.0, seed=2), scheduler),
                         workload)
    for result in (first, sync):
        assert 0.0 <= result.stall_fraction < 1.0
        assert result.itl_p50_s <= result.itl_p99_s
        assert result.throughput_tokens_per_s > 0
        assert result.mean_expert_batch >= 1.0 and result.mean_attention_batch >= 1.0


def test_uniform_and_skewed_routing_both_run():
    workload = poisson_workload(30, 4000.0, PROMPTS, DECODES, seed=6)
    spread = {}
    for skew in (0.0, 2.0):
        routing = SkewedRouting(4, 2, skew, seed=0)
        for result in (_mu(workload, routing), _sync(workload, routing)):
            _check_conserved(result, workload)
            tokens = np.zeros(4)
            for b in result.batches:
                if b.unit >= 0:
                    tokens[b.unit] += b.size
            assert tokens.sum() == 2 * SIM_SHAPE["num_layers"] * result.tokens_generated
            spread[skew] = tokens.max() / max(tokens.min(), 1)
    assert spread[0.0] < 1.5 < 5 < spread[2.0]


def _window_rates(result, workload):
    """Completions and arrivals per second over the last 3/4 of the arrival period."""
    a0, a1 = workload[0].arrival_s, workload[-1].arrival_s
    lo = a0 + 0.25 * (a1 - a0)
    done = ((result.completion_times >= lo) & (result.completion_times < a1)).sum()
    came = ((result.arrival_times >= lo) & (result.arrival_times < a1)).sum()
    return done / (a1 - lo), came / (a1 - lo)


def test_queue_depth_stays_bounded_below_capacity():
    routing = SkewedRouting(4, 2, 0.0, seed=0)
    burst = poisson_workload(100, 1e6, PROMPTS, DECODES, seed=3)
    capacity_tokens = _mu(burst, routing).throughput_tokens_per_s
    mean_decode = sum(DECODES) / 2
    # Half the saturated throughput: the system keeps up.
    steady = poisson_workload(300, 0.5 * capacity_tokens / mean_decode, PROMPTS, DECODES,
                              seed=4)
    result = _mu(steady, routing)
    _check_conserved(result, steady)
    a0, a1 = steady[0].arrival_s, steady[-1].arrival_s
    mid = (a0 + a1) / 2
    depth = np.array(result.queue_depth)
    first = depth[(depth[:, 0] >= a0) & (depth[:, 0] < mid), 1].max()
    second = depth[(depth[:, 0] >= mid) & (depth[:, 0] <= a1), 1].max()
    assert second <= 2 * first
    done, came = _window_rates(result, steady)
    assert done == pytest.approx(came, rel=0.15)
    # Twice the saturated throughput: completions fall behind arrivals.
    flood = poisson_workload(300, 2.0 * capacity_tokens / mean_decode, PROMPTS, DECODES,
                             seed=4)
    done, came = _window_rates(_mu(flood, routing), flood)
    assert done < 0.8 * came


def _scripted():
    """2 devices, 2 blocks, 4 experts (0, 1 on device 0; 2, 3 on device 1), top-2.
    Costs: attention 2 s, expert 1 s, head 0.5 s, a transfer between devices 0.5 s."""
    tables = CostTables.from_dict({
        "attention": {"batch": [1], "context": [1], "seconds": [[2.0]]},
        "expert": {"batch": [1], "seconds": [1.0]},
        "head": {"batch": [1], "seconds": [0.5]},
        "batch_overhead_s": 0.0,
        "link": {"latency_s": 0.5, "bandwidth_Bps": 2.0 ** 60}})
    # ids[request][layer, step] = top-2 experts
    ids = {0: np.array([[[0, 2], [3, 2]], [[1, 0], [0, 1]]]),
           1: np.array([[[2, 3]], [[0, 2]]])}
    routing = TraceRouting(ids, {r: np.full(a.shape, 0.5) for r, a in ids.items()}, 4)
    workload = [SimRequest(0, 0.0, 4, 2), SimRequest(1, 0.5, 4, 1)]
    return tables, routing, workload


def test_scripted_mu_queue_run_by_hand():
    tables, routing, workload = _scripted()
    result = simulate_mu_queue(tables, routing, workload, 2, 2, 4, 2, "defrag", hidden=1,
                               dtype_bytes=1)
    # Request 0 -> rank 0 (t=0), request 1 -> rank 1 (t=0.5: rank 0 has one active).
    # t=2    r0's attention L0 ends: expert 0 on device 0 now, expert 2 on device 1 at 2.5.
    # t=2.5  r1's attention L0 ends (experts 2, 3, both local); device 1 finds expert 2
    #        holding r0 and r1 (2 tokens + lookahead) and runs it before expert 3.
    # t=4    r0's second part arrives home -> attention L1; t=4.5 same for r1.
    # t=6    r0 L1 -> experts 1, 0 on device 0: tied queues, lowest column (expert 0).
    # t=7    r1's expert-0 input has arrived (6.5 + 0.5): expert 0 of L1 again, then 1.
    # t=8.5  r1 merged after L1 -> head; t=9 r0 merged -> head; r0 step 1 from 9.5.
    expected = [
        (0.0, 0, 0, -1, 1), (0.5, 1, 0, -1, 1), (2.0, 0, 0, 0, 1), (2.5, 1, 0, 2, 2),
        (3.5, 1, 0, 3, 1), (4.0, 0, 1, -1, 1), (4.5, 1, 1, -1, 1), (6.0, 0, 1, 0, 1),
        (6.5, 1, 1, 2, 1), (7.0, 0, 1, 0, 1), (8.0, 0, 1, 1, 1), (8.5, 1, 1, -2, 1),
        (9.0, 0, 1, -2, 1), (9.5, 0, 0, -1, 1), (12.0, 1, 0, 2, 1), (13.0, 1, 0, 3, 1),
        (14.5, 0, 1, -1, 1), (16.5, 0, 1, 0, 1), (17.5, 0, 1, 1, 1), (18.5, 0, 1, -2, 1)]
    assert [tuple(b[:5]) for b in result.batches] == expected
    assert [(r.rank, r.token_times) for r in result.requests] == [(0, (9.5, 19.0)),
                                                                   (1, (9.0,))]
    assert result.itl_s == (9.5,)
    # Busy: device 0 15 s, device 1 9.5 s, of 2 x 19 s with a request active.
    assert result.stall_fraction == pytest.approx(13.5 / 38)
    assert result.batch_sequence(1) == [(0, -1, 1), (0, 2, 2), (0, 3, 1), (1, -1, 1),
                                        (1, 2, 1), (1, -2, 1), (0, 2, 1), (0, 3, 1)]


def test_scripted_sync_ep_run_by_hand():
    tables, routing, workload = _scripted()
    result = simulate_sync_ep(tables, routing, workload, 2, 2, 4, 2, hidden=1, dtype_bytes=1)
    # Step 1 (r0 alone; r1 arrives at 0.5 and waits for the boundary):
    #   L0: attention 2 | dispatch (expert 2 remote) 0.5 | experts max(1, 1) | back 0.5
    #   L1: attention 2 | all local: 0 | experts 0 and 1 on device 0: 2 | 0 ; head 0.5
    #   -> 2 + 0.5 + 1 + 0.5 + 2 + 2 + 0.5 = 8.5
    # Step 2 (r0 step 1 on rank 0, r1 step 0 on rank 1), from 8.5:
    #   L0: 2 | 0.5 | device 1 runs experts 2, 3 (2 rows each): 2 | 0.5
    #   L1: 2 | 0.5 | device 0 runs experts 0 (2 rows), 1: 2 | 0.5 ; head 0.5 -> 19
    assert [(r.rank, r.token_times) for r in result.requests] == [(0, (8.5, 19.0)),
                                                                   (1, (19.0,))]
    assert result.batch_sequence(1) == [(0, 2, 1), (0, -1, 1), (0, 2, 2), (0, 3, 2),
                                        (1, -1, 1), (1, 2, 1), (1, -2, 1)]
    # Stall: step 1: 2 x 8.5 - (7.5 + 1); step 2: 2 x 10.5 - (6.5 + 7.5).
    assert result.stall_fraction == pytest.approx(15.5 / 38)
    assert result.queue_depth[0] == (0.0, 1)

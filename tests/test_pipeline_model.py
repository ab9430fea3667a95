"""The composed prefill→decode pipeline model (``moejax.pipeline_sim``) against hand
computations on tiny inputs (one request, one layer), the invariants of its techniques
(each at its no-op setting gives the baseline exactly), and ``benchmarks/pipeline_sim.py
--quick`` writing its keys."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from moejax import traces
from moejax.asyncmoe import costs
from moejax.eldr.simulator import SimRequest
from moejax.model_shape import QWEN3_30B_A3B, ModelShape
from moejax.pipeline_sim import decode_cost, hardware, prefill, shape as sh
from moejax.pipeline_sim import pipeline as pl

FIT = hardware.ExpertFit(t0_s=1e-4, a_s=3e-5, b_s=8e-7, top_k=8)
ONE_LAYER = ModelShape(num_layers=1, num_experts=4, top_k=1, hidden_size=2048,
                       expert_intermediate=768, num_heads=32, num_kv_heads=4, head_dim=128,
                       vocab_size=151936)
SMALL = ModelShape(num_layers=4, num_experts=16, top_k=4, hidden_size=256,
                   expert_intermediate=128, num_heads=4, num_kv_heads=2, head_dim=64,
                   vocab_size=512)


def attention_by_hand(shape: ModelShape, lengths: list[int]) -> float:
    weights = (2 * shape.hidden_size * shape.num_heads * shape.head_dim
               + 2 * shape.hidden_size * shape.num_kv_heads * shape.head_dim
               + shape.hidden_size * shape.num_experts)
    tokens = sum(lengths)
    nbytes = 2 * weights + tokens * 2 * shape.num_kv_heads * shape.head_dim * 2
    flops = 2 * weights * tokens + 4 * shape.num_heads * shape.head_dim * sum(
        p * (p + 1) / 2 for p in lengths)
    return max(nbytes / costs.H100_HBM_BPS, flops / costs.H100_BF16_FLOPS)


# ----------------------------------------------------------------------------- the lift
def test_lift_ids_by_hand():
    target = ModelShape(num_layers=3, num_experts=8, top_k=4, hidden_size=8,
                        expert_intermediate=8, num_heads=1, num_kv_heads=1, head_dim=8,
                        vocab_size=16)
    ids = np.array([[[1, 0]], [[0, 1]]])          # 2 traced layers, 1 token, top-2 of 2
    lifted = sh.lift_ids(ids, 2, target)           # f = 4 copies, m = 2 choices per choice
    # rank 0 -> offsets {0, 1}, rank 1 -> {2, 3} (times 2 traced experts)
    assert lifted.tolist() == [[[1, 3, 4, 6]], [[0, 2, 5, 7]], [[1, 3, 4, 6]]]
    counts = sh.lifted_counts(lifted, 8)
    assert counts.tolist() == [[0, 1, 0, 1, 1, 0, 1, 0], [1, 0, 1, 0, 0, 1, 0, 1],
                               [0, 1, 0, 1, 1, 0, 1, 0]]


def test_lift_refuses_shapes_that_do_not_divide():
    with pytest.raises(ValueError, match="both must divide"):
        sh.lift_ids(np.zeros((1, 1, 3), np.int64), 6, SMALL)
    with pytest.raises(ValueError, match="outside"):
        sh.lift_ids(np.full((1, 1, 2), 9), 8, SMALL)


def test_lifted_requests_keep_k_distinct_experts_and_reach_every_expert():
    rng = np.random.default_rng(0)
    ids = np.stack([np.stack([rng.choice(8, 2, replace=False) for _ in range(50)])
                    for _ in range(2)])                                      # [2, 50, 2]
    lifted = sh.lift_ids(ids, 8, SMALL)
    assert lifted.shape == (4, 50, 4)
    assert all(len(set(row.tolist())) == 4 for row in lifted.reshape(-1, 4))
    assert set(lifted.reshape(-1).tolist()) == set(range(16))


# ----------------------------------------------------------------------------- prefill
def test_prefill_one_request_one_layer_by_hand():
    q = np.array([[0.0, 1.0, 0.0, 0.0]])           # every token to expert 1 (top-1)
    want = attention_by_hand(ONE_LAYER, [10]) + FIT.t0_s + FIT.a_s + FIT.b_s / 8 * 10
    for strategy in prefill.STRATEGIES:            # one device: the same
        got = prefill.forward_s(prefill.PrefillConfig(1, strategy, 100), ONE_LAYER, FIT,
                                [10], [q])
        assert got == pytest.approx(want, rel=1e-12)


def test_sync_ep_and_async_ep_on_two_devices_by_hand():
    rows = [np.array([[1.0, 0, 0, 0]]), np.array([[0, 0, 1.0, 0]])]
    attn10, attn6 = attention_by_hand(ONE_LAYER, [10]), attention_by_hand(ONE_LAYER, [6])
    row_s = FIT.b_s / 8
    a2a = costs.H100_LINK_LATENCY_S + 10 * 1 * 2048 * 2 * 0.5 / costs.H100_LINK_BPS
    sync = prefill.forward_s(prefill.PrefillConfig(2, "sync_ep", 100), ONE_LAYER, FIT,
                             [10, 6], rows)
    # longest first: 10 tokens on device 0, 6 on device 1; experts 0-1 live on device 0
    assert sync == pytest.approx(attn10 + 2 * a2a + FIT.t0_s + FIT.a_s + row_s * 10)
    asynchronous = prefill.forward_s(prefill.PrefillConfig(2, "async_ep", 100), ONE_LAYER,
                                     FIT, [10, 6], rows)
    # one layer: nothing to gather ahead; each device its own tokens over its experts
    assert asynchronous == pytest.approx(max(attn10 + FIT.t0_s + FIT.a_s + row_s * 10,
                                             attn6 + FIT.t0_s + FIT.a_s + row_s * 6))


def test_async_ep_exposes_the_gather_when_compute_is_shorter():
    two = dataclass_replace(ONE_LAYER, num_layers=2, num_experts=128)
    rows = np.zeros((2, 128))
    rows[:, 0] = 1.0
    compute = attention_by_hand(two, [4]) + FIT.t0_s + FIT.a_s + FIT.b_s / 8 * 4
    gather = costs.H100_LINK_LATENCY_S + 128 * two.expert_bytes * 0.5 / costs.H100_LINK_BPS
    assert gather > compute                        # a 4-token batch cannot hide it
    got = prefill.forward_s(prefill.PrefillConfig(2, "async_ep", 100), two, FIT, [4], [rows])
    assert got == pytest.approx(gather + compute)  # layer 0 waits for layer 1's gather


def dataclass_replace(shape: ModelShape, **changes) -> ModelShape:
    import dataclasses

    return dataclasses.replace(shape, **changes)


def test_prefill_batches_first_come_first_served():
    q = np.array([[1.0, 0, 0, 0]])
    config = prefill.PrefillConfig(1, "sync_ep", 15)
    one = prefill.forward_s(config, ONE_LAYER, FIT, [10], [q])
    both = prefill.forward_s(config, ONE_LAYER, FIT, [10, 5], [q, q])
    result = prefill.simulate_prefill(config, ONE_LAYER, FIT, np.array([0.0, 0.0, 0.0, 1.0]),
                                      [10, 5, 10, 10], [q] * 4)
    # [0, 1] fill the 15-token budget; 2 waits; 3 arrives while 2 runs, so runs after it
    assert result.batch.tolist() == [0, 0, 1, 2]
    assert result.handoff.tolist() == pytest.approx([both, both, both + one,
                                                     max(both + one, 1.0) + one])


def test_prefill_refuses_bad_input():
    with pytest.raises(ValueError, match="strategy"):
        prefill.PrefillConfig(2, "tp", 100)
    with pytest.raises(ValueError, match="devices"):
        prefill.PrefillConfig(0, "sync_ep", 100)
    with pytest.raises(ValueError, match="do not split"):
        prefill.forward_s(prefill.PrefillConfig(3, "sync_ep", 100), ONE_LAYER, FIT, [4],
                          [np.ones((1, 4)) / 4])


# ----------------------------------------------------------------------------- decode
def test_route_rows_by_hand():
    placement = np.array([[True, True], [False, True]])   # expert 0 on both, 1 on device 1
    rows = np.array([4, 1])
    # EPLB-even: expert 0's rows 2 + 2, so device 1 activates both experts
    assert decode_cost.route_rows("eplb_even", placement, rows) == (2, pytest.approx(0.6))
    # METRO: expert 1 (one candidate) to device 1, then expert 0 to the idler device 0
    assert decode_cost.route_rows("metro", placement, rows) == (1, pytest.approx(0.8))


def test_decode_step_one_request_one_layer_by_hand():
    table = decode_cost.ActivationTable.single_device(4)
    cost = decode_cost.DecoderCost.build(ONE_LAYER, FIT, table, "resident", 100.0)
    want = (costs.h100_attention_roofline_s(1, 100.0) + FIT.t0_s + FIT.a_s * 1
            + FIT.b_s / 8 * 1 + costs.h100_head_roofline_s(1))
    assert cost.seconds(1, 1, 1) == pytest.approx(want, rel=1e-12)
    copy = ONE_LAYER.expert_bytes / costs.H100_H2D_BPS
    ondemand = decode_cost.DecoderCost.build(ONE_LAYER, FIT, table, "offload_ondemand", 100.0)
    assert ondemand.seconds(1, 1, 1) == pytest.approx(want + copy, rel=1e-12)
    with pytest.raises(ValueError, match="a step of 2 layers"):
        cost.seconds(2, 1, 2)


def test_offload_prefetch_is_the_expert_prefetch_benchmarks_model():
    from benchmarks import expert_prefetch as reference

    shape = QWEN3_30B_A3B
    table = decode_cost.ActivationTable.single_device(shape.num_experts)
    head = costs.h100_head_roofline_s(1)
    recall = {kind: np.ones(shape.num_layers) for kind in (*reference.COMPUTED, "oracle")}
    for mode, key in (("offload_prefetch", "speculative_router"), ("offload_ondemand",
                                                                   "ondemand")):
        cost = decode_cost.DecoderCost.build(shape, FIT, table, mode, 512.0)
        compute = cost.layer_compute_s(shape.top_k, 1)
        want = reference.modelled_tpot(recall, shape.num_layers, compute)[key] / 1000
        got = cost.seconds(shape.top_k * shape.num_layers, 1, shape.num_layers) - head
        assert got == pytest.approx(want, rel=1e-9)


def synthetic_requests(n: int, domains: int, seed: int, trace_layers: int = 2,
                       trace_experts: int = 8, trace_k: int = 2, decode: int = 6,
                       prompt: int = 12, shape: ModelShape = SMALL) -> list[SimRequest]:
    """Lifted requests whose domain d mostly picks traced experts of its own half."""
    rng = np.random.default_rng(seed)
    prefill_ids, decode_ids, labels = [], [], []
    for i in range(n):
        d = (i // 2) % domains          # even (calibration) and odd requests see every domain
        own = np.arange(trace_experts)[(np.arange(trace_experts) * domains
                                        // trace_experts) == d]

        def draw(tokens: int) -> np.ndarray:
            pool = [own if rng.random() < 0.9 else np.arange(trace_experts)
                    for _ in range(trace_layers * tokens)]
            return np.array([rng.choice(p, trace_k, replace=False) for p in pool]
                            ).reshape(trace_layers, tokens, trace_k)

        prefill_ids.append(draw(prompt))
        decode_ids.append(draw(decode))
        labels.append(f"d{d}")
    return sh.lift_requests(prefill_ids, decode_ids, labels, trace_experts, shape)


def test_activation_table_no_op_settings():
    requests = synthetic_requests(12, 2, 0)
    single = decode_cost.activation_table(requests, "metro", 1, 1.0, (1, 4), 5, 0)
    assert single.max_activated.tolist() == list(range(17))
    # One replica per expert: both routers send every expert's rows to its only replica.
    tables = [decode_cost.activation_table(requests, router, 2, 1.0, (1, 2, 4, 8), 10, 0)
              for router in decode_cost.ROUTERS]
    np.testing.assert_array_equal(tables[0].max_activated, tables[1].max_activated)
    np.testing.assert_array_equal(tables[0].max_row_share, tables[1].max_row_share)
    # With replicas METRO activates at most what EPLB-even does, and fewer somewhere.
    even, metro = (decode_cost.activation_table(requests, router, 2, 1.5, (1, 2, 4, 8), 10, 0)
                   for router in decode_cost.ROUTERS)
    assert (metro.max_activated <= even.max_activated + 1e-12).all()
    assert (metro.max_activated < even.max_activated).any()


# ----------------------------------------------------------------------------- pipeline
def test_pipeline_one_request_one_layer_by_hand():
    request = SimRequest(counts=np.array([[0, 7, 0, 0]]),
                         decode_experts=np.array([[[2], [2], [3]]]), domain="x")
    tables = {r: decode_cost.ActivationTable.single_device(4) for r in decode_cost.ROUTERS}
    calibration = pl.Calibration(eldr_fit=None, tables=tables)
    deployment = pl.Deployment(prefill_devices=1, prefill_tokens_per_device=100,
                               num_decoders=1, decoder_devices=1, max_batch_size=4,
                               replication=1.0)
    workload = pl.Workload((request,), np.array([10]), np.array([1.0]))
    run = pl.run_pipeline(pl.Techniques(), deployment, ONE_LAYER, FIT, calibration, workload)
    forward = attention_by_hand(ONE_LAYER, [10]) + FIT.t0_s + FIT.a_s + FIT.b_s / 8 * 10
    context = 10 + 3 / 2
    step = (costs.h100_attention_roofline_s(1, context) + FIT.t0_s + FIT.a_s
            + FIT.b_s / 8 + costs.h100_head_roofline_s(1))
    assert run.ttft.tolist() == pytest.approx([forward])
    assert run.tpot.tolist() == pytest.approx([step])
    assert run.makespan_s == pytest.approx(forward + 3 * step)
    assert run.throughput_tokens_per_s == pytest.approx(4 / (forward + 3 * step))


@pytest.fixture(scope="module")
def small_setup():
    requests = synthetic_requests(64, 2, 1)
    deployment = pl.Deployment(prefill_devices=2, prefill_tokens_per_device=256,
                               num_decoders=2, decoder_devices=2, max_batch_size=8)
    calibration = pl.calibrate(requests[0::2], deployment, model="synthetic",
                               batch_sizes=(1, 2, 4, 8), samples=10, seed=0)
    arrivals = np.sort(np.random.default_rng(2).uniform(0, 0.5, 96))
    workload = pl.draw_workload(requests[1::2], 96, (16, 64), arrivals, 3)
    return deployment, calibration, workload


def same_run(a: pl.PipelineRun, b: pl.PipelineRun) -> bool:
    return (np.array_equal(a.prefill.handoff, b.prefill.handoff)
            and np.array_equal(a.decode.decoder, b.decode.decoder)
            and np.array_equal(a.decode.finish, b.decode.finish))


def test_each_technique_at_its_no_op_setting_is_the_baseline(small_setup):
    import dataclasses

    deployment, calibration, workload = small_setup
    base = pl.run_pipeline(pl.Techniques(), deployment, SMALL, FIT, calibration, workload)
    # AsyncEP on a one-device prefill group: nothing to gather or exchange.
    one = dataclasses.replace(deployment, prefill_devices=1)
    assert same_run(pl.run_pipeline(pl.Techniques(), one, SMALL, FIT, calibration, workload),
                    pl.run_pipeline(pl.Techniques(async_ep=True), one, SMALL, FIT, calibration,
                                    workload))
    # ELDR at τ = 1: the band admits every decoder, so it is JSQ.
    wide = dataclasses.replace(deployment, eldr_tau=1.0)
    assert same_run(base, pl.run_pipeline(pl.Techniques(eldr=True), wide, SMALL, FIT,
                                          calibration, workload))
    # METRO with one replica per expert: the same routing as EPLB-even.
    single = dataclasses.replace(deployment, replication=1.0)
    flat = pl.calibrate([r for r in workload.requests[:32]], single, model="synthetic",
                        batch_sizes=(1, 2, 4, 8), samples=10, seed=0)
    assert same_run(pl.run_pipeline(pl.Techniques(), single, SMALL, FIT, flat, workload),
                    pl.run_pipeline(pl.Techniques(metro=True), single, SMALL, FIT, flat,
                                    workload))
    # And switched on they change the run (these settings are not no-ops).
    for name in pl.TECHNIQUES:
        other = pl.run_pipeline(pl.Techniques.of([name]), deployment, SMALL, FIT, calibration,
                                workload)
        assert not same_run(base, other), name


def test_eldr_gathers_a_domain_on_a_decoder(small_setup):
    deployment, calibration, loaded = small_setup
    # Every request at once: the decoders run full batches, so a step's experts compare
    # at the same batch size.
    workload = pl.Workload(loaded.requests, loaded.prompt_tokens, np.zeros(96))
    jsq = pl.run_pipeline(pl.Techniques(), deployment, SMALL, FIT, calibration, workload)
    eldr = pl.run_pipeline(pl.Techniques(eldr=True), deployment, SMALL, FIT, calibration,
                           workload)
    assert eldr.decode.mean_active_experts < jsq.decode.mean_active_experts
    domains = np.array([r.domain for r in workload.requests])[eldr.order]
    purity = [max(np.mean(domains[eldr.decode.decoder == d] == label) for label in ("d0", "d1"))
              for d in range(2)]
    assert min(purity) > 0.8


def test_eldr_on_one_domain_leaves_the_experts_per_step_alone():
    # One domain, every request the same routing: whatever decoder a request lands on, a
    # step's union is that routing's, so ELDR cannot lower the experts a step activates.
    deployment = pl.Deployment(prefill_devices=1, prefill_tokens_per_device=4096,
                               num_decoders=2, decoder_devices=1, max_batch_size=64,
                               replication=1.0)
    varied = synthetic_requests(16, 2, 4, decode=1)
    calibration = pl.calibrate(varied, deployment, model="synthetic", batch_sizes=(1, 2),
                               samples=4, seed=0)
    one = synthetic_requests(1, 1, 5, decode=1)[0]
    workload = pl.Workload((one,) * 40, np.full(40, 32), np.linspace(0, 0.2, 40))
    runs = [pl.run_pipeline(t, deployment, SMALL, FIT, calibration, workload)
            for t in (pl.Techniques(), pl.Techniques(eldr=True))]
    for run in runs:                 # a lifted token has top-k = 4 distinct experts a layer
        assert (run.decode.step_active == 4).all()
        assert run.decode.step_batch.sum() == 40


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="unknown techniques"):
        pl.Techniques.of(["prefetch"])
    with pytest.raises(ValueError, match="num_decoders"):
        pl.Deployment(prefill_devices=1, prefill_tokens_per_device=1, num_decoders=0,
                      decoder_devices=1, max_batch_size=1)
    with pytest.raises(ValueError, match="replication"):
        pl.Deployment(prefill_devices=1, prefill_tokens_per_device=1, num_decoders=1,
                      decoder_devices=1, max_batch_size=1, replication=1.5)
    request = synthetic_requests(1, 1, 0)[0]
    with pytest.raises(ValueError, match="sorted"):
        pl.Workload((request, request), np.array([8, 8]), np.array([1.0, 0.0]))
    with pytest.raises(ValueError, match="experts"):
        decode_cost.DecoderCost.build(SMALL, FIT, decode_cost.ActivationTable.single_device(16),
                                      "swap", 10.0)
    with pytest.raises(ValueError, match="ExpertFit.a_s"):
        hardware.ExpertFit(t0_s=0.0, a_s=-1.0, b_s=0.0, top_k=8)


def test_every_combination_names():
    names = [t.name for t in pl.every_combination()]
    assert len(names) == 16 == len(set(names))
    assert names[0] == "baseline" and names[-1] == "+".join(pl.TECHNIQUES)


# ----------------------------------------------------------------------------- benchmark
def synthetic_trace(model: str, seed: int) -> traces.Trace:
    """A demo-e32-shaped trace (6 layers, 32 experts, top-4) of 4 domains × 8 requests."""
    rng = np.random.default_rng(seed)
    requests = []
    for i in range(32):
        d = i % 4
        own = np.arange(8 * d, 8 * d + 8)

        def draw(tokens: int) -> np.ndarray:
            pool = [own if rng.random() < 0.8 else np.arange(32) for _ in range(6 * tokens)]
            return np.array([rng.choice(p, 4, replace=False) for p in pool],
                            np.int32).reshape(6, tokens, 4)

        prompt, decode = draw(16), draw(8)
        requests.append(traces.RequestTrace(
            id=str(i), domain=f"domain{d}", prompt_token_ids=np.arange(16, dtype=np.int32),
            generated_token_ids=np.arange(9, dtype=np.int32), prefill_experts=prompt,
            prefill_weights=np.full(prompt.shape, 0.25, np.float32), decode_experts=decode,
            decode_weights=np.full(decode.shape, 0.25, np.float32), finish_reason="length"))
    return traces.Trace.from_requests(requests, num_layers=6, top_k=4, num_experts=32,
                                      model=model)


def test_quick_run_writes_its_keys(tmp_path):
    from benchmarks import pipeline_sim

    for name, seed in (("demo-e32", 0), ("demo-e32-init", 1)):
        traces.save(tmp_path / f"{name}.npz", synthetic_trace(name, seed))
    path = tmp_path / "pipeline.json"
    figures = pipeline_sim.main(["--quick", "--traces", str(tmp_path), "--json", str(path),
                                 "--requests", "120"])
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(figures))
    assert all(not isinstance(v, (dict, list)) for v in data.values())
    for suffix in ("", "_twin"):
        throughput = {c.name: data[f"{pipeline_sim.key_name(c)}_throughput_tokens_per_s{suffix}"]
                      for c in pipeline_sim.QUICK_CONFIGS}
        assert all(math.isfinite(v) and v > 0 for v in throughput.values())
        base = throughput["baseline"]
        singles = {t: throughput[t] for t in pl.TECHNIQUES}
        for t in pl.TECHNIQUES:
            assert data[f"{t}_over_baseline_modelled_h100{suffix}"] == pytest.approx(
                singles[t] / base)
        best = max(singles.values())
        assert data[f"composed_over_best_single_modelled_h100{suffix}"] == pytest.approx(
            throughput["+".join(pl.TECHNIQUES)] / best)
        assert data[f"composed_resident_over_best_single_modelled_h100{suffix}"] == \
            pytest.approx(throughput["async_ep+eldr+metro"] / best)
        assert data[f"composed_over_offload_prefetch_modelled_h100{suffix}"] == \
            pytest.approx(throughput["+".join(pl.TECHNIQUES)] / singles["offload_prefetch"])
        assert data[f"best_single_technique{suffix}"] == max(singles, key=singles.get)
        for config in pipeline_sim.QUICK_CONFIGS:
            key = pipeline_sim.key_name(config)
            assert data[f"{key}_ttft_p50_ms{suffix}"] > 0
            assert data[f"{key}_tpot_p50_ms{suffix}"] > 0
        # The router tables: METRO never activates more replicas than EPLB-even.
        for union in (8, 32, 64, 128):
            assert data[f"metro_max_activated_at_union{union}{suffix}"] <= \
                data[f"eplb_even_max_activated_at_union{union}{suffix}"] + 1e-9

"""moejax.prefetch.step_model against a float64 hand computation at two contexts, the
facts the overlap rule must keep, its input checks, the demo contexts of
benchmarks/prefetch_lengths.py, the replay's attention blocks and packing (a 135-token
traced request, once refused by the attention tiling, replays to its trace's routing,
packed with a short one that replays as it does alone), that benchmark's quick run
(every named key, values in range, the modelled figures reproduced from its measured
recall) and its --measure figures on two short contexts (every key, ratios of the
TPOTs, no compile inside a timed pass). No timing is asserted."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest

from benchmarks import expert_prefetch, prefetch_lengths
from moejax import attention
from moejax.asyncmoe import costs
from moejax.model_shape import QWEN3_30B_A3B
from moejax.prefetch import replay
from moejax.prefetch import step_model as sm

COST = expert_prefetch.GPU_COST


def hand_step(context: int, mode: str, recall: float) -> dict[str, float]:
    """Qwen3-30B-A3B on the H100 at batch 1, from the raw numbers (float64)."""
    a_s = float(json.loads(COST.read_text())["by_batch"]["8"]["a_s"])
    expert_bytes = 3.0 * 2048 * 768 * 2                 # gate, up, down; bf16
    h2d = 128 * expert_bytes / 22.7e-3                   # docs/PERF.md: 22.7 ms per layer
    kv_bytes = context * 2.0 * 4 * 128 * 2               # K and V, 4 heads of 128, bf16
    weights = (2048 * 4096 * 2 + 2048 * 512 * 2) * 2.0   # q, o [2048, 4096]; k, v [2048, 512]
    attention = (kv_bytes + weights) / 3.35e12 + 6 * 5e-6
    expert = 8 * a_s
    copy = 8 * expert_bytes / h2d
    hidden = min(copy, expert + attention)
    if mode == "ondemand":
        exposed, hidden_total = 48 * copy, 0.0
    else:
        misses = (1 - recall) * copy if mode == "exact" else 0.0
        exposed = copy + 47 * (copy - hidden + misses)
        hidden_total = 47 * hidden
    return {"copy_exposed_ms": 1e3 * exposed, "copy_hidden_ms": 1e3 * hidden_total,
            "attention_ms": 1e3 * 48 * attention, "expert_ms": 1e3 * 48 * expert,
            "total_ms": 1e3 * (exposed + 48 * (attention + expert))}


@pytest.mark.parametrize("context", [1024, 65536])
@pytest.mark.parametrize("mode", sm.MODES)
def test_step_model_by_hand(context, mode):
    cost = sm.expert_cost_from_file(COST, 1, "expert")
    got = sm.step_breakdowns(QWEN3_30B_A3B, sm.H100, cost, context, 0.7)[mode].as_ms()
    want = hand_step(context, mode, 0.7)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key


def test_step_model_numbers_at_64k():
    """The figures the hand computation rests on, as numbers a reader can check."""
    assert QWEN3_30B_A3B.expert_bytes == 9_437_184
    assert QWEN3_30B_A3B.layer_expert_bytes == 1_207_959_552
    layer = sm.layer_cost(QWEN3_30B_A3B, sm.H100, sm.expert_cost_from_file(COST), 65536)
    assert layer.copy_s == pytest.approx(8 / 128 * 22.7e-3)          # 1.419 ms
    # 134 MB of KV + 38 MB of projections at 3.35 TB/s + 30 us of launches
    assert layer.attention_s == pytest.approx((65536 * 2048 + 37_748_736) / 3.35e12 + 30e-6)


def test_batch_counts_distinct_experts_and_picks_the_fit():
    fits = json.loads(COST.read_text())["by_batch"]
    assert sm.active_experts(QWEN3_30B_A3B, 1) == pytest.approx(8.0)
    assert sm.active_experts(QWEN3_30B_A3B, 4) == pytest.approx(128 * (1 - (120 / 128) ** 4))
    for batch, key in ((1, "8"), (8, "8"), (9, "16"), (33, "64")):
        cost = sm.expert_cost_from_file(COST, batch, "layer")
        assert cost.per_active_s == fits[key]["a_s"]
        assert cost.per_layer_s == fits[key]["t0_s"]
    layer = sm.layer_cost(QWEN3_30B_A3B, sm.H100, sm.expert_cost_from_file(COST, 4), 4096, 4)
    n = 128 * (1 - (120 / 128) ** 4)
    assert layer.copy_s == pytest.approx(n * QWEN3_30B_A3B.expert_bytes / costs.H100_H2D_BPS)
    assert layer.expert_s == pytest.approx(n * fits["8"]["a_s"])
    assert layer.attention_s == pytest.approx((4 * 4096 * 2048 + 37_748_736) / 3.35e12 + 30e-6)
    # the benchmark of issue 18 reads the same fit through the shared definition
    assert expert_prefetch.h100_compute_per_layer(COST, "layer") == pytest.approx(
        8 * fits["8"]["a_s"] + fits["8"]["t0_s"])


GRID = list(itertools.product([1, 512, 8192, 65536, 1 << 20], [1, 8, 64],
                              [0.0, 0.3, 0.9, 1.0], [1e-6, 5.7e-5, 1e-3]))


@pytest.mark.parametrize("context,batch,recall,per_active", GRID[::3])
def test_overlap_facts(context, batch, recall, per_active):
    shape = QWEN3_30B_A3B
    layer = sm.layer_cost(shape, sm.H100, sm.ExpertCost(per_active), context, batch)
    steps = {mode: sm.step_breakdown(mode, layer, shape.num_layers, recall) for mode in sm.MODES}
    L, copy, window = shape.num_layers, layer.copy_s, layer.window_s
    for step in steps.values():
        assert step.copy_exposed_s >= 0 and step.copy_hidden_s >= 0
        assert step.total_s == pytest.approx(step.attention_s + step.expert_s + step.copy_exposed_s)
    # every byte copied is either hidden or exposed (exact also copies its misses)
    for mode, copied in (("ondemand", L * copy), ("speculative", L * copy),
                         ("exact", L * copy + (L - 1) * (1 - recall) * copy)):
        assert steps[mode].copy_exposed_s + steps[mode].copy_hidden_s == pytest.approx(copied)
    assert steps["ondemand"].copy_hidden_s == 0.0
    assert steps["speculative"].total_s <= steps["exact"].total_s
    # the prefetch hides min(copy, window) of every predicted layer
    assert steps["exact"].copy_hidden_s == pytest.approx((L - 1) * min(copy, window))
    at_one = sm.step_breakdown("exact", layer, L, 1.0)
    assert at_one.copy_exposed_s == pytest.approx(L * copy - (L - 1) * min(copy, window))
    assert at_one.total_s == pytest.approx(steps["speculative"].total_s)
    # at recall 0 exact copies everything on-demand does, plus the useless prefetch's
    # unhidden part: equal to on-demand exactly when the window covers the copy
    at_zero = sm.step_breakdown("exact", layer, L, 0.0)
    spill = max(0.0, copy - window)
    assert at_zero.total_s == pytest.approx(steps["ondemand"].total_s + (L - 1) * spill)
    if window >= copy:
        assert at_zero.total_s == pytest.approx(steps["ondemand"].total_s)
    else:
        assert at_zero.total_s > steps["ondemand"].total_s
    # more recall never costs exact mode time
    worse = sm.step_breakdown("exact", layer, L, max(0.0, recall - 0.25))
    assert worse.total_s >= steps["exact"].total_s


def test_longer_context_hides_more():
    cost = sm.expert_cost_from_file(COST)
    ratios, hidden, attention = [], [], []
    for context in prefetch_lengths.LENGTHS.values():
        steps = sm.step_breakdowns(QWEN3_30B_A3B, sm.H100, cost, context, 0.8)
        ratios.append(steps["exact"].total_s / steps["ondemand"].total_s)
        hidden.append(steps["exact"].copy_hidden_s)
        attention.append(steps["ondemand"].attention_s)
        assert steps["ondemand"].copy_exposed_s == pytest.approx(48 * 8 / 128 * 22.7e-3)
    assert np.all(np.diff(attention) > 0) and np.all(np.diff(hidden) > 0)
    assert np.all(np.diff(ratios) < 0)       # copy-bound: more attention, more hidden copy


def test_bad_inputs_are_refused():
    layer = sm.layer_cost(QWEN3_30B_A3B, sm.H100, sm.ExpertCost(1e-5), 1024)
    with pytest.raises(ValueError, match="recall"):
        sm.step_breakdown("exact", layer, 48, 1.5)
    with pytest.raises(ValueError, match="mode"):
        sm.step_breakdown("lazy", layer, 48, 0.5)
    with pytest.raises(ValueError, match="num_layers"):
        sm.step_breakdown("exact", layer, 0, 0.5)
    with pytest.raises(ValueError, match="context"):
        sm.layer_cost(QWEN3_30B_A3B, sm.H100, sm.ExpertCost(1e-5), 0)
    with pytest.raises(ValueError, match="batch"):
        sm.active_experts(QWEN3_30B_A3B, 0)
    with pytest.raises(ValueError, match="no expert-cost fit for batch 65"):
        sm.expert_cost_from_file(COST, 65)
    with pytest.raises(ValueError, match="compute_model"):
        sm.expert_cost_from_file(COST, 1, "token")
    with pytest.raises(ValueError, match="h2d_bytes_per_s"):
        sm.Device(3e12, 0.0, 0.0)
    with pytest.raises(ValueError, match="per_active_s"):
        sm.ExpertCost(float("nan"))


def test_demo_contexts():
    assert prefetch_lengths.demo_contexts(2048, 8) == {"1k": 32, "4k": 128, "16k": 512,
                                                       "64k": 2048}
    with pytest.raises(ValueError, match="too short"):
        prefetch_lengths.demo_contexts(512, 8)           # the 1k point: 8 tokens
    # any context replays (replay_block pads it to a block the attention accepts)
    assert prefetch_lengths.demo_contexts(64 * 40, 8) == {"1k": 40, "4k": 160, "16k": 640,
                                                          "64k": 2560}


def test_replay_block_is_the_smallest_the_attention_tiles():
    assert [replay.replay_block(n) for n in (1, 16, 17, 128, 129, 135, 257, 2048, 2049)] == [
        16, 16, 32, 128, 256, 256, 384, 2048, 2560]
    for tokens in range(1, 5000, 7):
        block = replay.replay_block(tokens)
        assert block >= tokens and block % replay.BLOCK_MULTIPLE == 0
        assert block % attention.tiling_for(block).sub == 0, tokens
        for smaller in range(-(-tokens // 16) * 16, block, 16):      # none smaller tiles
            assert smaller % attention.tiling_for(smaller).sub != 0, (tokens, smaller)
    with pytest.raises(ValueError, match="at least one token"):
        replay.replay_block(0)


def test_pack_blocks_keeps_order_and_room():
    lengths = [100, 20, 200, 256, 1, 30, 226]
    blocks = replay.pack_blocks(lengths, 256)
    assert blocks == [[0, 1], [2], [3], [4, 5], [6]]
    assert [i for b in blocks for i in b] == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 256 for b in blocks)
    with pytest.raises(ValueError, match="300 tokens does not fit a block of 256"):
        replay.pack_blocks([10, 300], 256)


@pytest.mark.slow
def test_135_token_request_replays_to_its_trace():
    """Regression: the replay once gave a 135-token request a 144-token block, which the
    attention's 128-row sub-blocks cannot cut ("incompatible shapes"). The traces come
    from the benchmark's own Generator; the short request shares the long one's block."""
    from moejax.prefetch import train

    cfg, params = train.load_model(expert_prefetch.MODEL)
    tracer = prefetch_lengths.Tracer(expert_prefetch.MODEL)
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(3, cfg.vocab_size, n)] for n in (127, 12)]
    (trace,) = tracer.trace_sets([prompts], 9)
    requests = trace.requests
    assert [len(replay.sequence_tokens(r)) for r in requests] == [135, 20]
    states = replay.replay(cfg, params, requests)
    assert replay.check_against_trace(states, requests) >= 0.98
    assert states.num_tokens == 155
    np.testing.assert_array_equal(states.request, [0] * 135 + [1] * 20)
    np.testing.assert_array_equal(states.decode[:135], np.arange(135) >= 127)
    # packed beside the long request, the short one computes what it does alone
    alone = replay.replay(cfg, params, requests[1:])
    short = states.take(states.request == 1)
    np.testing.assert_allclose(short.residual, alone.residual, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.sort(short.experts, -1), np.sort(alone.experts, -1))


@pytest.mark.slow
def test_measured_figures():
    """--measure's figures (``measured_figures``, the router predictor, which reads no
    file) on contexts of 32 and 64 tokens: every key, the ratios, and one untimed pass
    per runner compiling all that the timed passes of both lengths run."""
    from benchmarks.lib import compiles
    from moejax.prefetch import train

    cfg, params = train.load_model(expert_prefetch.MODEL)
    rng = np.random.default_rng(4)
    contexts = {"1k": 32, "64k": 64}
    prompts = {tag: [[int(t) for t in rng.integers(3, cfg.vocab_size, c - 4)]]
               for tag, c in contexts.items()}
    compiles.start_run()
    out = prefetch_lengths.measured_figures(cfg, params, [], "router", prompts, contexts, 4)
    assert compiles.run_figures() == {"compiles_in_timed_passes": 0, "timed_passes": 6}
    ratios = {f"measured_prefetch_tpot_over_ondemand_{tag}_{mode}"
              for tag in contexts for mode in ("exact", "speculative")}
    assert set(out) == ({"measured_platform", "measured_predictor"} | ratios
                        | {f"measured_tpot_ms_{tag}_{mode}" for tag in contexts
                           for mode in sm.MODES}
                        | {f"measured_demo_context_{tag}" for tag in contexts})
    assert out["measured_platform"] == "cpu" and out["measured_predictor"] == "router"
    for tag, context in contexts.items():
        assert out[f"measured_demo_context_{tag}"] == context
        for mode in sm.MODES:
            assert math.isfinite(out[f"measured_tpot_ms_{tag}_{mode}"])
            assert out[f"measured_tpot_ms_{tag}_{mode}"] > 0
            if mode != "ondemand":
                assert out[f"measured_prefetch_tpot_over_ondemand_{tag}_{mode}"] == (
                    out[f"measured_tpot_ms_{tag}_{mode}"] / out[f"measured_tpot_ms_{tag}_ondemand"])


@pytest.mark.slow
def test_quick_run_writes_every_key(tmp_path):
    path = tmp_path / "lengths.json"
    figures = prefetch_lengths.main(["--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data == json.loads(json.dumps(figures))
    assert all(not isinstance(v, (dict, list)) for v in data.values())
    best = data["best_predictor"]
    assert best in expert_prefetch.COMPUTED
    mean = {k: np.mean([data[f"recall_{k}_{t}"] for t in prefetch_lengths.LENGTHS])
            for k in expert_prefetch.COMPUTED}
    assert mean[best] == max(mean.values())
    cost = sm.expert_cost_from_file(COST)
    for tag, context in prefetch_lengths.LENGTHS.items():
        assert data[f"demo_context_{tag}"] == 2048 * context // 65536
        assert data[f"decode_tokens_{tag}"] == 2 * 7         # 2 requests, 8 new tokens
        for kind in (*expert_prefetch.COMPUTED, "random", "popularity", "previous"):
            assert 0.0 <= data[f"recall_{kind}_{tag}"] <= 1.0
        assert data[f"recall_oracle_{tag}"] == 1.0
        assert data[f"recall_best_{tag}"] == data[f"recall_{best}_{tag}"]
        steps = sm.step_breakdowns(QWEN3_30B_A3B, sm.H100, cost, context,
                                   data[f"recall_best_{tag}"])
        for mode, step in steps.items():
            for name, value in step.as_ms().items():
                assert data[f"{name}_{tag}_{mode}"] == pytest.approx(value)
                assert value >= 0
            assert data[f"tpot_ms_{tag}_{mode}_modelled"] == pytest.approx(data[f"total_ms_{tag}_{mode}"])
        exact = data[f"prefetch_tpot_over_ondemand_{tag}_modelled"]
        speculative = data[f"prefetch_tpot_over_ondemand_{tag}_modelled_speculative"]
        assert exact == pytest.approx(steps["exact"].total_s / steps["ondemand"].total_s)
        assert 0.5 < speculative <= exact < 1.1
    assert not any(key.startswith("measured_") for key in data)       # no --measure

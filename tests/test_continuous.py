"""The decode runtime on the shipped demo model: continuous batching equals one-by-one
generation (mixed lengths, staggered arrivals, forced preemption, a cached prompt
prefix), fused == layerwise, offload == resident, the layer hook, cancellation, the
block manager, and the Generator's options.

The reference for "alone" is the same runtime with one sequence and a fresh pool; the
static batcher (another attention algorithm over a dense cache) must agree too.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moejax import checkpoint
from moejax.decode.programs import StepOptions, compiled_program_counts
from moejax.decode.factory import make_runner
from moejax.static.decode import DecodeEngine
from moejax.sequences import SequenceSpec
from serving import Generator
from serving.api import resolve_model_dir
from moejax.core.continuous import Scheduler, SchedulerOptions, SequenceTooLong

from compile_events import backend_compiles

LENGTHS_NEW = [(5, 7), (40, 12), (17, 3), (70, 9), (33, 1), (3, 10)]


@pytest.fixture(scope="module")
def demo():
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    rng = np.random.default_rng(0)
    specs = [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 1024, n)),
                          max_new_tokens=m) for n, m in LENGTHS_NEW]
    resident = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    alone = [_run(resident, [spec], blocks=64, batch=1)[0] for spec in specs]
    return cfg, params, specs, resident, alone


def _scheduler(runner, blocks=64, batch=4, prefill=32, step="fused", trace=False, row=64):
    return Scheduler(runner, blocks, SchedulerOptions(max_batch_size=batch,
                                                      max_prefill_tokens=prefill, step=step,
                                                      trace=trace, prefill_row_tokens=row))


def _run(runner, specs, **kwargs):
    scheduler = _scheduler(runner, **kwargs)
    seqs = [scheduler.submit(s) for s in specs]
    scheduler.run_until_idle()
    assert scheduler.occupancy() == 0
    return [s.output for s in seqs]


def _tokens(outputs):
    return [o.token_ids for o in outputs]


def test_alone_equals_static_batching(demo):
    cfg, params, specs, _, alone = demo
    static = DecodeEngine(params, cfg, max_batch_size=8).generate(specs)
    assert _tokens(alone) == _tokens(static)
    assert [len(o.token_ids) for o in alone] == [m for _, m in LENGTHS_NEW]


def test_staggered_arrivals_in_any_order_equal_one_by_one(demo):
    """Requests join a running batch at different steps, in a shuffled order; long
    prompts are prefilled over several steps (max_prefill_tokens=32)."""
    _, _, specs, runner, alone = demo
    order = [3, 0, 5, 1, 4, 2]
    scheduler = _scheduler(runner, batch=3)
    seqs = {}
    for i in order:
        seqs[i] = scheduler.submit(specs[i])
        scheduler.step()
    scheduler.run_until_idle()
    assert [seqs[i].output.token_ids for i in range(len(specs))] == _tokens(alone)
    assert scheduler.stats["steps"] > max(m for _, m in LENGTHS_NEW)


def test_forced_preemption_loses_nothing(demo):
    """A pool of 10 blocks for 4 running sequences of up to 79 tokens: the newest are
    preempted (blocks freed, recomputed later) and every sequence still ends with the
    tokens it gets alone."""
    _, _, specs, runner, alone = demo
    scheduler = _scheduler(runner, blocks=10, batch=4)
    seqs = [scheduler.submit(s) for s in specs]
    scheduler.run_until_idle()
    assert scheduler.stats["preemptions"] > 0
    assert [s.output.token_ids for s in seqs] == _tokens(alone)
    assert max(s.preemptions for s in seqs) > 0 and scheduler.occupancy() == 0


def test_a_cached_prompt_prefix_is_reused(demo):
    """A second request starting with the same 40 tokens reuses the first's two full
    blocks (32 tokens) and gives the tokens it gets alone."""
    _, _, specs, runner, _ = demo
    system = specs[1].prompt            # 40 tokens
    first = SequenceSpec(prompt=system + (7, 8, 9), max_new_tokens=4)
    second = SequenceSpec(prompt=system + (11, 12), max_new_tokens=5)
    scheduler = _scheduler(runner)
    scheduler.submit(first)
    scheduler.run_until_idle()
    assert scheduler.stats["prefix_hit_tokens"] == 0
    seq = scheduler.submit(second)
    scheduler.run_until_idle()
    assert scheduler.stats["prefix_hit_tokens"] == 32
    assert seq.output.token_ids == _run(runner, [second])[0].token_ids


def test_fused_equals_layerwise_and_offload_equals_resident(demo):
    cfg, params, specs, resident, alone = demo
    offload = make_runner("offload", cfg, params, dtype="float32", opts=StepOptions())
    fused = _run(resident, specs, trace=True)
    layerwise = _run(resident, specs, step="layerwise", trace=True)
    streamed = _run(offload, specs, step="layerwise", trace=True)
    assert _tokens(fused) == _tokens(layerwise) == _tokens(streamed) == _tokens(alone)
    for a, b, c in zip(fused, layerwise, streamed):
        for name in ("prefill_experts", "decode_experts"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
            np.testing.assert_array_equal(getattr(a, name), getattr(c, name))
        np.testing.assert_allclose(a.decode_weights, c.decode_weights, rtol=1e-5, atol=1e-6)
    # Offload copies at most the experts a step's rows chose, never all of them each layer.
    assert 0 < offload.experts_copied
    with pytest.raises(Exception, match="layerwise"):
        _scheduler(offload, step="fused")


def test_packed_prefill_rows_equal_one_by_one(demo):
    """Prefill rows of 8 tokens, 4 per step: a prompt chunk spans several rows, several
    sequences share one prefill program (attention stays inside each), and the traced
    routing of every prompt token is the one it gets alone."""
    cfg, _, specs, runner, _ = demo
    packed = _run(runner, specs, row=8, trace=True)
    alone = [_run(runner, [spec], batch=1, trace=True)[0] for spec in specs]
    assert _tokens(packed) == _tokens(alone)
    for a, b in zip(packed, alone):
        np.testing.assert_array_equal(a.prefill_experts, b.prefill_experts)
        np.testing.assert_array_equal(a.decode_experts, b.decode_experts)


def test_precompile_covers_every_program(demo):
    """After precompile (which leaves the pool untouched), a run of mixed prompts and
    batch sizes compiles nothing. A context loop of 2 blocks per iteration (a fresh
    compile key) also reads the 70-token prompt's context over several iterations."""
    cfg, params, specs, _, alone = demo
    runner = make_runner("resident", cfg, params, dtype="float32",
                         opts=StepOptions(pool_chunk_blocks=2))
    scheduler = _scheduler(runner, row=8)
    assert scheduler.program_shapes() == [(1, 1), (2, 1), (4, 1), (1, 8), (2, 8), (4, 8)]
    before = compiled_program_counts().get("fused_step", 0)
    # 6 step programs, and the token feed of pipelined steps: each of the 3 decode
    # programs fed from the last plan's prefill program (3 shapes), decode program (3) or
    # both (3 x 3).
    assert scheduler.precompile() == 6 + 3 * (3 + 3 + 3 * 3)
    assert compiled_program_counts()["fused_step"] == before + 6
    assert not np.asarray(scheduler.kv.keys).any() and scheduler.occupancy() == 0
    seqs = [scheduler.submit(s) for s in specs]
    scheduler.run_until_idle()
    assert [s.output.token_ids for s in seqs] == _tokens(alone)
    assert compiled_program_counts()["fused_step"] == before + 6


def test_precompiled_offload_compiles_nothing_later(demo):
    """Offload (layerwise, expert copies): after precompile no backend compile happens
    while generating (the slot copy included; a fresh compile key: pool_chunk_blocks=4)."""
    cfg, params, specs, _, alone = demo
    runner = make_runner("offload", cfg, params, dtype="float32",
                         opts=StepOptions(pool_chunk_blocks=4))
    scheduler = _scheduler(runner, step="layerwise")
    scheduler.precompile()
    assert runner.experts_copied == 0 and all(
        held is None for slots in runner.slots.pair for held in slots.held)
    with backend_compiles() as compiles:
        seqs = [scheduler.submit(s) for s in specs[:3]]
        scheduler.run_until_idle()
    assert [s.output.token_ids for s in seqs] == _tokens(alone[:3])
    assert compiles == [] and runner.experts_copied > 0


def test_traces_have_every_token_once(demo):
    """Prefill routing of every prompt token, decode routing of every fed-back token, also
    across preemption (recomputed tokens are not recorded twice)."""
    cfg, _, specs, runner, _ = demo
    for outputs in (_run(runner, specs, trace=True),
                    _run(runner, specs, blocks=10, trace=True)):
        for spec, out in zip(specs, outputs):
            k = cfg.num_experts_per_tok
            assert out.prefill_experts.shape == (cfg.num_layers, len(spec.prompt), k)
            assert out.decode_experts.shape == (cfg.num_layers, len(out.token_ids) - 1, k)
            np.testing.assert_allclose(out.prefill_weights.sum(-1), 1.0, rtol=1e-5)


def test_traced_requests_sharing_a_prompt_prefix_trace_every_prompt_token(demo):
    """A prompt whose blocks are already cached is still prefilled in full when traced (a
    prefix hit would skip the routing of the tokens it covers): both copies of a shared
    40-token prefix get the same routing, and every prompt token is recorded."""
    cfg, _, specs, runner, _ = demo
    shared = specs[3].prompt[:40]
    twins = [SequenceSpec(prompt=shared + tail, max_new_tokens=3) for tail in ((5,), (6, 7))]
    scheduler = _scheduler(runner, trace=True)
    first = scheduler.submit(twins[0])
    scheduler.run_until_idle()
    second = scheduler.submit(twins[1])     # its first two blocks are cached by now
    scheduler.run_until_idle()
    assert scheduler.stats["prefix_hit_tokens"] == 0
    for spec, seq in zip(twins, (first, second)):
        out = seq.output
        assert out.prefill_experts.shape == (cfg.num_layers, len(spec.prompt),
                                             cfg.num_experts_per_tok)
        assert out.decode_experts.shape[1] == len(out.token_ids) - 1
    np.testing.assert_array_equal(first.output.prefill_experts[:, :40],
                                  second.output.prefill_experts[:, :40])
    untraced = _scheduler(runner)
    for spec in twins:
        untraced.submit(spec)
        untraced.run_until_idle()
    assert untraced.stats["prefix_hit_tokens"] == 32      # untraced, the blocks are reused


def test_layer_hook_sees_and_overrides_routing(demo):
    cfg, params, specs, _, alone = demo
    runner = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    seen = []

    def observe(layer, routing):
        seen.append((layer, np.asarray(routing.experts).shape))
        return None

    runner.layer_hook = observe
    assert _tokens(_run(runner, specs[:2], step="layerwise")) == _tokens(alone[:2])
    assert [layer for layer, _ in seen[:cfg.num_layers]] == list(range(cfg.num_layers))

    def force_expert_zero(layer, routing):
        return type(routing)(weights=routing.weights, experts=routing.experts * 0,
                             probs=routing.probs)

    runner.layer_hook = force_expert_zero
    forced = _run(runner, specs[:2], step="layerwise", trace=True)
    assert _tokens(forced) != _tokens(alone[:2])
    # The trace keeps the router's own choice, not the override.
    assert forced[0].prefill_experts.max() > 0


def test_cancel_frees_blocks_at_the_next_step(demo):
    _, _, specs, runner, _ = demo
    scheduler = _scheduler(runner)
    keep = scheduler.submit(specs[0])
    drop = scheduler.submit(SequenceSpec(prompt=specs[3].prompt, max_new_tokens=50))
    for _ in range(4):
        scheduler.step()
    assert scheduler.occupancy() > 0 and not drop.finished
    scheduler.cancel(drop)
    events = scheduler.step()
    assert drop.finished and drop.output.finish_reason == "cancelled"
    assert any(e.sequence is drop and e.output is not None for e in events)
    scheduler.run_until_idle()
    assert keep.output.finish_reason == "length" and scheduler.occupancy() == 0


def test_a_sequence_longer_than_the_pool_is_refused(demo):
    _, _, specs, runner, _ = demo
    scheduler = _scheduler(runner, blocks=4)
    with pytest.raises(SequenceTooLong, match="needs 5 KV blocks"):
        scheduler.submit(SequenceSpec(prompt=specs[3].prompt, max_new_tokens=9))


# ----------------------------------------------------------------------------- Generator
def test_generator_options_and_kv_budget():
    gen = Generator("demo", dtype="float32", kv_cache_mib=1, compilation_cache="off")
    block = gen.scheduler.runner.block_bytes()
    assert block == 2 * 4 * 16 * 2 * 32 * 4           # K+V, 4 layers, 16 tokens, 2×32, f32
    assert gen.scheduler.num_blocks == 2**20 // block
    with pytest.raises(ValueError, match="not both"):
        Generator("demo", kv_cache_mib=1, kv_cache_blocks=4)
    with pytest.raises(ValueError, match="static"):
        Generator("demo", batching="static", backend="offload")
    with pytest.raises(ValueError, match="step must be"):
        Generator("demo", step="sideways")
    with pytest.raises(ValueError, match="precompile applies to batching='continuous'"):
        Generator("demo", batching="static", precompile=True)
    with pytest.raises(ValueError, match="prefill_row_tokens"):
        Generator("demo", prefill_row_tokens=0)
    small = Generator("demo", dtype="float32", kv_cache_blocks=2, compilation_cache="off")
    [bad, good] = small.generate([{"prompt_token_ids": [5] * 30, "max_new_tokens": 8},
                                  {"prompt_token_ids": [5, 6], "max_new_tokens": 2}])
    assert "max_new_tokens" in bad.error and "KV blocks" in bad.error
    assert good.error is None and len(good.token_ids) == 2


def test_generation_loop_serves_threads(demo):
    """Requests submitted from several threads share the loop; each gets its tokens as
    events and a final result equal to generating it alone."""
    _, _, specs, _, alone = demo
    gen = Generator("demo", dtype="float32", compilation_cache="off")
    loop = gen.start_loop()
    done = {}
    events: dict[int, list[int]] = {}
    finished = threading.Event()

    def on_event(event):
        events.setdefault(event.index, []).extend(event.token_ids)
        if event.result is not None:
            done[event.index] = event.result
            if len(done) == 3:
                finished.set()

    threads = [threading.Thread(target=loop.submit, args=(
        {"prompt_token_ids": list(specs[i].prompt), "max_new_tokens": specs[i].max_new_tokens,
         "stop_token_ids": []}, on_event, i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert finished.wait(120)
    loop.close()
    for i in range(3):
        assert done[i].token_ids == events[i] == alone[i].token_ids

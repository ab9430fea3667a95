"""``sync_ep`` decode (``moejax.decode.sync_ep``): data-parallel attention over G ranks,
expert-parallel MoE with all-to-all, against the resident runner on the demo model.

Greedy float32 tokens and the traced top-k ids must equal resident's, with and without
replicas (both replica routers, and METRO in decode with EPLB-even in prefill), and
through preemptions; the dispatch capacity is the batch's worst case, so no step ever
overflows, and every step's overflow is counted though ``run`` never waits for it.
Every Generator compiles a few shapes on the 8 CPU devices (seconds each), so the runs
share one request set, and prompts are prefilled in chunks of at most 32 tokens (fewer
shapes; the longer prompts attend to their earlier chunks in the pool).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from moejax.backends import BackendError
from moejax.backends import sync_ep as sync_ep_backend
from moejax.backends.sync_ep import AXIS
from moejax.decode import sync_ep
from moejax.prefix_hash import BLOCK_SIZE
from moejax.sequences import SequenceSpec
from serving import Generator

LENGTHS = (5, 60, 17, 33, 9, 48)
NEW_TOKENS = (12, 1, 7, 12, 3, 10)
PREFILL = 32      # prompt chunks of 16 or 32 tokens: fewer shapes, and chunked prefill


def _requests() -> list[dict]:
    rng = np.random.default_rng(7)
    return [{"id": i, "prompt_token_ids": [int(t) for t in rng.integers(3, 1000, n)],
             "max_new_tokens": m, "stop_token_ids": []}
            for i, (n, m) in enumerate(zip(LENGTHS, NEW_TOKENS))]


def _generate(gen: Generator) -> list:
    results = gen.generate(_requests())
    for r in results:
        assert r.error is None, r.error
    return results


def _sync_ep(devices: int, kv_cache_blocks: int | None = None,
             trace_router_inputs: bool = False, **options) -> Generator:
    return Generator("demo", dtype="float32", backend="sync_ep", devices=devices,
                     backend_options=options, max_batch_size=4, max_prefill_tokens=PREFILL,
                     trace_experts=True, trace_router_inputs=trace_router_inputs,
                     kv_cache_blocks=kv_cache_blocks, compilation_cache="off")


def _assert_same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids, g.id
        assert len(g.token_ids) == NEW_TOKENS[g.id]
        for part in ("prefill", "decode"):
            np.testing.assert_array_equal(g.experts[part], w.experts[part])
            np.testing.assert_allclose(g.experts[f"{part}_weights"],
                                       w.experts[f"{part}_weights"], atol=1e-5)
            if f"{part}_router_inputs" in g.experts:
                np.testing.assert_allclose(g.experts[f"{part}_router_inputs"],
                                           w.experts[f"{part}_router_inputs"], atol=1e-4)


@pytest.fixture(scope="module")
def resident() -> list:
    return _generate(Generator("demo", dtype="float32", trace_experts=True,
                               trace_router_inputs=True, max_prefill_tokens=PREFILL,
                               compilation_cache="off"))


def test_two_ranks_with_preemptions_equal_resident(resident):
    """Two ranks, each with a pool of 6 blocks: sequences are preempted and recomputed
    (on their rank) and still give resident's tokens and routing."""
    gen = _sync_ep(2, kv_cache_blocks=6)
    _assert_same(_generate(gen), resident)
    runner, kv = gen.scheduler.runner, gen.scheduler.kv
    assert runner.num_ranks == 2 and runner.overflow_steps == 0
    assert gen.scheduler.stats["preemptions"] > 0
    # Each device holds its own rank's pool, and both ranks ran sequences.
    slots = 6 * BLOCK_SIZE
    assert kv.keys.sharding.spec == P(None, AXIS)
    assert {s.data.shape[1] for s in kv.keys.addressable_shards} == {slots}
    keys = np.asarray(kv.keys)
    assert all(np.abs(keys[:, r * slots:(r + 1) * slots]).sum() > 0 for r in range(2))


@pytest.mark.parametrize("router", ["metro", "eplb_even"])
def test_four_ranks_with_replicas_equal_resident(resident, router):
    """Four ranks, 12 expert replicas for 8 experts (the pools are large enough: no
    preemption), rows sent to replicas by either router; one run traces the router
    inputs too."""
    gen = _sync_ep(4, replicas=1.5, router=router, trace_router_inputs=router == "metro")
    runner = gen.scheduler.runner
    assert runner.layout.replicated and runner.ctx.router == router
    results = _generate(gen)
    _assert_same(results, resident)
    assert ("decode_router_inputs" in results[0].experts) == (router == "metro")
    assert runner.overflow_steps == 0 and gen.scheduler.stats["preemptions"] == 0


def test_metro_decode_eplb_even_prefill_equals_resident(resident, monkeypatch):
    """The METRO paper's pairing: METRO routes the decode steps, EPLB-even the prefill
    steps (four ranks, 12 replicas for 8 experts). Tokens and routing equal resident's,
    and each kind's program really routes with its own router: the routers traced into
    the programs (seen through ``choose_devices``) are EPLB-even at the prefill steps'
    row counts and METRO at the decode steps', and every step ran its kind's program."""
    traced = []
    choose = sync_ep_backend.choose_devices

    def spy(experts, valid, ctx):
        traced.append((ctx.router, int(experts.shape[0])))      # routed rows per rank
        return choose(experts, valid, ctx)

    monkeypatch.setattr(sync_ep_backend, "choose_devices", spy)
    gen = _sync_ep(4, replicas=1.5, router="metro", prefill_router="eplb_even")
    runner = gen.scheduler.runner
    assert runner.layout.replicated
    assert (runner.ctx.router, runner.prefill_ctx.router) == ("metro", "eplb_even")
    _assert_same(_generate(gen), resident)
    k = runner.cfg.num_experts_per_tok
    rows = {router: {m for r, m in traced if r == router} for router in ("metro", "eplb_even")}
    assert set(r for r, _ in traced) == {"metro", "eplb_even"}
    # Decode rows are one token each (at most max_batch_size=4 per rank); prefill rows
    # are chunks of 16 or 32 tokens.
    assert max(rows["metro"]) <= 4 * k < 16 * k <= min(rows["eplb_even"])
    assert runner.router_steps["eplb_even"] > 0 and runner.router_steps["metro"] > 0
    assert runner.router_steps["metro"] == gen.scheduler.stats["decode_steps"]
    assert runner.overflow_steps == 0


def test_default_prefill_router_is_the_router():
    """Without prefill_router both kinds of step share one router and one program."""
    gen = _sync_ep(4, replicas=1.5, router="metro")
    runner = gen.scheduler.runner
    assert runner.ctx == runner.prefill_ctx and runner.ctx.router == "metro"
    assert len(runner._steps) == 1


def test_stats_are_read_back_without_a_host_wait(monkeypatch):
    """``run`` leaves the step's stats on the device: after run_until_idle the last
    step's are still pending; reading ``last_stats`` / ``overflow_steps`` records them,
    so every step is counted, the last one included."""
    gen = Generator("demo", dtype="float32", backend="sync_ep", devices=2, max_batch_size=2,
                    compilation_cache="off")
    scheduler, runner = gen.scheduler, gen.scheduler.runner
    recorded = []
    record = runner._record
    monkeypatch.setattr(runner, "_record",
                        lambda stats, tokens: (recorded.append(tokens), record(stats, tokens)))
    for prompt in (list(range(3, 19)), list(range(40, 49))):
        scheduler.submit(SequenceSpec(prompt=tuple(prompt), max_new_tokens=4))
    scheduler.run_until_idle()
    steps = sum(runner.router_steps.values())
    assert steps >= scheduler.stats["steps"] > 1     # a step may run a prefill and a decode
    assert len(recorded) == steps - 1 and len(runner._pending) == 1   # the last: pending
    stats = runner.last_stats
    assert stats is not None and runner.overflow_steps == 0
    assert len(recorded) == steps and not runner._pending
    assert stats.rows_per_device == recorded[-1] * runner.cfg.num_experts_per_tok
    assert stats.activated_per_device.shape == (2,)


def test_prefill_replica_router_flag():
    import argparse

    from serving.cli.generate import add_decode_runtime_options, decode_runtime_options

    parser = argparse.ArgumentParser()
    add_decode_runtime_options(parser)
    args = parser.parse_args(["--replicas", "1.5", "--replica-router",
                              "metro", "--prefill-replica-router", "eplb_even"])
    assert decode_runtime_options(args)["backend_options"] == {
        "replicas": 1.5, "router": "metro", "prefill_router": "eplb_even"}
    assert "backend_options" not in decode_runtime_options(parser.parse_args([]))


def test_mixtral_tiny_equals_hugging_face(tmp_path):
    """The tiny random Mixtral of the parity tests (no q/k-norm, EOS 2): sync_ep on two
    ranks gives Hugging Face ``generate``'s greedy tokens, the EOS it stops on included."""
    torch = pytest.importorskip("torch", reason="HF parity needs torch (the 'parity' extra)")
    pytest.importorskip("transformers", reason="HF parity needs transformers")
    from hf_tiny_models import V, build_torch_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf = build_torch_model("mixtral", dict(tie_word_embeddings=False), 4)
    hf.save_pretrained(tmp_path)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(3, V, n)] for n in (5, 30)]
    gen = Generator(str(tmp_path), dtype="float32", backend="sync_ep", devices=2,
                    compilation_cache="off")
    results = gen.generate([{"prompt_token_ids": p, "max_new_tokens": 12} for p in prompts])
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              pad_token_id=0)
        assert result.token_ids == [int(t) for t in out[0, len(prompt):]]
    assert gen.scheduler.runner.overflow_steps == 0


def test_overflow_is_counted(monkeypatch, caplog):
    """The counter the tests above read does see an overflow: buffers of one row per
    device pair cannot hold a 16-token prefill's routed rows."""
    monkeypatch.setattr(sync_ep, "step_capacity", lambda tokens, k, slots: 1)
    gen = Generator("demo", dtype="float32", backend="sync_ep", devices=2,
                    max_batch_size=2, compilation_cache="off")
    with caplog.at_level(logging.ERROR, logger=sync_ep.__name__):
        gen.generate([{"prompt_token_ids": list(range(3, 19)), "max_new_tokens": 1}])
    runner = gen.scheduler.runner
    assert runner.overflow_steps == 1
    assert runner.last_stats.capacity == 1 and runner.last_stats.peak_pair_rows.max() > 1
    assert "overflowed" in caplog.text


def test_capacity_is_the_worst_case():
    assert sync_ep.step_capacity(tokens=4, k=2, expert_slots=4) == 8
    assert sync_ep.step_capacity(tokens=4, k=2, expert_slots=1) == 4   # one slot per device
    assert sync_ep.step_capacity(tokens=64, k=8, expert_slots=3) == 192


@pytest.mark.parametrize("options, message", [
    ({"capacity_factor": 2.0}, "unknown option.*'capacity_factor'"),
    ({"router": "nearest"}, "'router'.*unknown router 'nearest'"),
    ({"router": "metro", "prefill_router": "nearest"},
     "'prefill_router'.*unknown router 'nearest'"),
    ({"replicas": 9}, "replicas must be a number in \\[1, devices=2\\]"),
])
def test_bad_options_are_named(options, message):
    with pytest.raises(BackendError, match=message):
        Generator("demo", backend="sync_ep", devices=2, backend_options=options)


def test_layerwise_step_is_refused():
    with pytest.raises(BackendError, match="'sync_ep' runs decode steps 'fused'"):
        Generator("demo", backend="sync_ep", devices=2, step="layerwise")

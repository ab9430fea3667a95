"""The prefill/decode split (``moejax.core.decoders``) and ELDR's signature cache
(``moejax.decode.paged``): the cache's counts against a NumPy reference and against a
traced run, exact under prefix-cache hits; K decoders on K CPU devices give the tokens of
one decoder under every routing policy; bad options get clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import checkpoint
from moejax.backends.base import BackendError
from moejax.kv import count_experts, expert_count_bytes, sum_block_counts
from moejax.prefix_hash import BLOCK_SIZE
from moejax.decode.programs import StepOptions
from moejax.decode.factory import make_runner
from moejax.eldr import fitfile
from moejax.eldr.fitfile import EldrFit, FitError
from moejax.expert_trace import expert_counts
from moejax.sequences import SequenceSpec
from serving import Generator
from serving.api import resolve_model_dir
from moejax.core.continuous import Scheduler, SchedulerOptions

from compile_events import backend_compiles


# ----------------------------------------------------------------------------- the counts
def _reference_counts(counts, slots, experts):
    """count_experts in NumPy loops: a token at offset 0 zeroes its block first."""
    counts = counts.astype(np.int64).copy()
    num_blocks = counts.shape[0]
    for t, slot in enumerate(slots):
        block = slot // BLOCK_SIZE
        if block < num_blocks and slot % BLOCK_SIZE == 0:
            counts[block] = 0
    for t, slot in enumerate(slots):
        block = slot // BLOCK_SIZE
        if block >= num_blocks:
            continue
        for layer in range(experts.shape[0]):
            for e in experts[layer, t]:
                counts[block, layer, e] += 1
    return counts


def test_count_experts_matches_reference():
    rng = np.random.default_rng(0)
    num_blocks, L, E, k = 5, 3, 8, 2
    stale = rng.integers(0, 9, (num_blocks, L, E)).astype(np.int8)
    # Block 1 is reallocated (its first token at offset 0: stale counts must go), block 3
    # continues (offsets 5..9: its earlier counts stay), two rows are padding (slot S).
    slots = np.array([16, 17, 18, 53, 54, 55, 56, 57, num_blocks * 16, num_blocks * 16],
                     np.int32)
    experts = np.stack([np.stack([rng.choice(E, k, replace=False) for _ in slots])
                        for _ in range(L)]).astype(np.int32)
    got = np.asarray(count_experts(jnp.asarray(stale), jnp.asarray(slots),
                                   jnp.asarray(experts)))
    assert got.dtype == np.int8
    np.testing.assert_array_equal(got, _reference_counts(stale, slots, experts))
    assert (got[1] == _reference_counts(np.zeros_like(stale), slots, experts)[1]).all()
    np.testing.assert_array_equal(got[[0, 2, 4]], stale[[0, 2, 4]])


def test_sum_block_counts_ignores_padding():
    counts = np.arange(4 * 2 * 3, dtype=np.int8).reshape(4, 2, 3)
    tables = np.array([[0, 2, 4, 4], [3, 4, 4, 4]], np.int32)      # 4 = past the pool
    got = np.asarray(sum_block_counts(jnp.asarray(counts), jnp.asarray(tables)))
    np.testing.assert_array_equal(got, np.stack([counts[0] + counts[2], counts[3]]))


@pytest.fixture(scope="module")
def demo():
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    runner = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    return cfg, params, runner


def _prefill_counts(runner, prompts, *, trace):
    """Prefill ``prompts`` one after another on one hand-off scheduler -> (raw counts of
    each, prefix-hit tokens of each, the traced routing's counts when ``trace``)."""
    scheduler = Scheduler(runner, 32, SchedulerOptions(
        max_batch_size=2, max_prefill_tokens=32, handoff=True, expert_counts=True,
        trace=trace))
    counts, hits, traced = [], [], []
    for prompt in prompts:
        before = scheduler.stats["prefix_hit_tokens"]
        seq = scheduler.submit(SequenceSpec(prompt=tuple(prompt), max_new_tokens=4))
        handoffs = []
        while not handoffs:
            scheduler.step()
            handoffs = scheduler.take_handoffs()
        assert handoffs == [seq] and seq.computed == len(prompt)
        counts.append(scheduler.prompt_counts(handoffs)[0])
        hits.append(scheduler.stats["prefix_hit_tokens"] - before)
        if trace:
            ids = np.concatenate([r[0] for r in seq.routing], axis=1)     # [L, n, k]
            traced.append(expert_counts(ids, runner.cfg.num_experts))
        scheduler.release(seq.blocks)
    assert scheduler.occupancy() == 0
    return counts, hits, traced


def test_signature_cache_is_exact_under_prefix_hits(demo):
    """B starts with A's first two full blocks: B's prefill skips them (prefix hit) and
    still gets the counts of all its prompt tokens, as a traced run computes them."""
    cfg, _, runner = demo
    rng = np.random.default_rng(1)
    a = rng.integers(3, cfg.vocab_size, 45).tolist()
    b = a[:32] + rng.integers(3, cfg.vocab_size, 27).tolist()
    counts, hits, _ = _prefill_counts(runner, [a, b], trace=False)
    assert hits == [0, 32]
    _, traced_hits, traced = _prefill_counts(runner, [a, b], trace=True)
    assert traced_hits == [0, 0]           # a traced run computes every token
    for got, want, prompt in zip(counts, traced, [a, b]):
        np.testing.assert_array_equal(got, want)
        assert got.sum() == len(prompt) * cfg.num_layers * cfg.num_experts_per_tok


def test_signature_cache_memory_share(demo):
    cfg, _, runner = demo
    share = expert_count_bytes(cfg) / runner.block_bytes()
    assert expert_count_bytes(cfg) == cfg.num_layers * cfg.num_experts
    assert 0 < share < 0.01


@pytest.mark.parametrize("backend", ["sync_ep", "async_ep"])
def test_pools_over_ranks_keep_each_ranks_counts(demo, backend):
    """The signature cache over data-parallel ranks: each rank counts its own blocks
    (sharded on the block axis), and every prompt's counts equal a one-device pool's,
    whichever rank prefilled it (a prefill stage on an expert-parallel group)."""
    cfg, params, runner = demo
    options = SchedulerOptions(max_batch_size=4, max_prefill_tokens=32, step="fused",
                               handoff=True, expert_counts=True)
    ranks = make_runner(backend, cfg, params, dtype="float32", opts=StepOptions(),
                        devices=2)
    pool = ranks.make_kv(4, expert_counts=True)
    assert pool.expert_counts.shape == (2 * 4, cfg.num_layers, cfg.num_experts)
    assert pool.expert_counts.sharding.spec[0] == "dp"
    rng = np.random.default_rng(2)
    specs = [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 900, n)),
                          max_new_tokens=2) for n in (5, 40, 17, 33)]
    counts = []
    for step_runner in (runner, ranks):
        scheduler = Scheduler(step_runner, 16, options)
        seqs = [scheduler.submit(spec) for spec in specs]
        while scheduler.busy:
            scheduler.step()
        handed = scheduler.take_handoffs()
        assert sorted(s.seq_id for s in handed) == [s.seq_id for s in seqs]
        counts.append(scheduler.prompt_counts(seqs))
        if step_runner is ranks:
            assert {s.rank for s in seqs} == {0, 1}          # both ranks prefilled
    np.testing.assert_array_equal(counts[1], counts[0])
    assert (counts[0].sum(axis=2) == np.array([5, 40, 17, 33])[:, None]
            * cfg.num_experts_per_tok).all()


# ----------------------------------------------------------------------------- decoders
PROMPTS = [("def add(a, b):\n    return", "python"), ("The river ran past the", "prose"),
           ("#include <stdio.h>\nint main(void)", "c"), ("x = 3 * (4 + ", "math"),
           ("for i in range(10):\n", "python"), ("Once upon a time there", "prose"),
           ("static int count = 0;", "c"), ("2 + 2 = 4 and 3 + 3 =", "math")]


def _requests(new_tokens=(6, 9, 4, 11, 7, 5, 8, 3)):
    return [{"id": i, "prompt": p, "domain": d, "max_new_tokens": n}
            for i, ((p, d), n) in enumerate(zip(PROMPTS, new_tokens))]


@pytest.fixture(scope="module")
def e32():
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo-e32")[0], "float32")
    return cfg, fitfile.model_fingerprint(cfg, params["layers"]["router"])


def _fit_file(tmp_path, cfg, fingerprint, decoders, name="fit.npz", seed=0):
    rng = np.random.default_rng(seed)
    layers = (1, 3, 5)
    fit = EldrFit(model="demo-e32", fingerprint=fingerprint, num_layers=cfg.num_layers,
                  num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                  idf=rng.uniform(0.1, 2.0, (cfg.num_layers, cfg.num_experts)),
                  layers=layers, centroids=rng.uniform(0, 1, (decoders, 3 * cfg.num_experts)),
                  calibration_requests=10, rho=0.5)
    path = tmp_path / name
    fitfile.save(path, fit)
    return path


# One prefill row bucket and few decode buckets: fewer programs to compile per device.
SMALL = {"dtype": "float32", "max_prefill_tokens": 64}


@pytest.fixture(scope="module")
def one_decoder():
    gen = Generator("demo-e32", max_batch_size=4, **SMALL)
    return [r.token_ids for r in gen.generate(_requests())]


@pytest.mark.parametrize("routing", ["round_robin", "jsq", "p2c", "random", "domain", "eldr"])
def test_every_routing_gives_the_tokens_of_one_decoder(routing, one_decoder, e32, tmp_path):
    cfg, fingerprint = e32
    extra = ({"eldr_fit": _fit_file(tmp_path, cfg, fingerprint, 3), "eldr_tau": 0.05}
             if routing == "eldr" else {})
    gen = Generator("demo-e32", max_batch_size=2, decoders=3, routing=routing,
                    routing_seed=3, **SMALL, **extra)
    results = gen.generate(_requests())
    assert [r.error for r in results] == [None] * len(PROMPTS)
    assert [r.token_ids for r in results] == one_decoder
    pool = gen.scheduler
    assert len(pool.routes) == len(PROMPTS)              # each routed once
    assert pool.occupancy() == 0 and not pool.busy
    assert [d.runner.device for d in pool.decoders] == jax.devices()[:3]
    stats = pool.stats()
    assert sum(stats["routed"]) == len(PROMPTS)
    steps = [r for d in pool.decoders for r in d.step_records if r.active_experts is not None]
    assert steps and all(1 <= a.min() and a.max() <= cfg.num_experts
                         for a in (r.active_experts for r in steps))
    if routing == "domain":   # the oracle keeps each label on its own decoder
        by_domain = {}
        for route in pool.routes:
            by_domain.setdefault(PROMPTS[route.seq_id][1], set()).add(route.decoder)
        # Four domains over three decoders: domain i owns decoder i mod 3.
        assert all(len(d) == 1 for d in by_domain.values())
        assert len(set().union(*by_domain.values())) == 3


def test_decoders_trace_and_stream(e32, one_decoder):
    """Traced routing survives the hand-off (prefill part from the prefill engine, decode
    part from the decoder), and streaming delivers every token once."""
    cfg, _ = e32
    gen = Generator("demo-e32", decoders=2, routing="round_robin", trace_experts=True,
                    **SMALL)
    streamed = {}
    finals = {}
    for event in gen.stream(_requests()):
        streamed.setdefault(event.index, []).extend(event.token_ids)
        if event.result is not None:
            finals[event.index] = event.result
    assert [streamed[i] for i in range(len(PROMPTS))] == one_decoder
    for i, result in finals.items():
        assert result.experts["prefill"].shape == (cfg.num_layers, result.prompt_tokens,
                                                   cfg.num_experts_per_tok)
        assert result.experts["decode"].shape[1] == len(result.token_ids) - 1


def test_decoders_loop_and_cancel(e32):
    gen = Generator("demo-e32", decoders=3, routing="jsq", **SMALL)
    loop = gen.start_loop()
    import threading
    done = threading.Event()
    finals = []

    def on_event(event):
        if event.result is not None:
            finals.append(event.result)
            if len(finals) == 2:
                done.set()

    keep = loop.submit({"prompt": "def f(x):", "max_new_tokens": 5}, on_event, 0)
    gone = loop.submit({"prompt": "The sky is", "max_new_tokens": 400}, on_event, 1)
    gone.cancel()
    assert done.wait(120)
    loop.close()
    reasons = sorted(r.finish_reason for r in finals)
    assert reasons == ["cancelled", "length"] and keep is not None
    assert gen.scheduler.occupancy() == 0


def test_precompiled_pool_compiles_nothing_later():
    """After ``precompile`` a run of the pool compiles nothing: besides the step programs,
    the hand-off's block copies (prompts of 1, 3 and 2 blocks: copy buckets 1, 4 and 2)
    and, for a policy that reads prompt counts, their sums. (Without the hand-off part
    of precompile this run compiled 8 programs.) The smallest pool that has every kind
    of program, to compile few: ``demo``, two decoders of one row, one prefill row, a
    pool of 8 blocks (copy buckets 1..8)."""
    from moejax.eldr.policies import Policy, least_loaded

    class CountsLeastLoaded(Policy):
        """Least loaded, after checking that it was shown the prompt's counts."""

        reads_counts = True

        def _choose(self, request, loads):
            assert request.counts is not None and request.counts.sum() > 0
            return least_loaded(loads)

    gen = Generator("demo", dtype="float32", decoders=2, routing=CountsLeastLoaded(2),
                    max_batch_size=1, max_prefill_tokens=64, kv_cache_blocks=8,
                    precompile=True)
    with backend_compiles() as compiles:
        results = gen.generate([{"prompt_token_ids": list(range(3, 3 + length)),
                                 "max_new_tokens": 3} for length in (5, 40, 20, 9)])
    assert [r.error for r in results] == [None] * 4
    assert len(gen.scheduler.routes) == 4
    assert compiles == []


# ----------------------------------------------------------------------------- bad options
def test_more_decoders_than_devices():
    with pytest.raises(BackendError, match="decoders=9 needs one device per decoder"):
        Generator("demo-e32", decoders=9)


def test_bad_routing_options(e32, tmp_path):
    cfg, fingerprint = e32
    with pytest.raises(ValueError, match="eldr_tau must be a number in"):
        Generator("demo-e32", decoders=2, routing="eldr", eldr_tau=1.5,
                  eldr_fit=_fit_file(tmp_path, cfg, fingerprint, 2))
    with pytest.raises(ValueError, match="eldr_tau must be a number in"):
        Generator("demo-e32", decoders=2, routing="eldr", eldr_tau=-0.1, eldr_fit="x")
    with pytest.raises(ValueError, match="needs eldr_fit"):
        Generator("demo-e32", decoders=2, routing="eldr")
    with pytest.raises(ValueError, match="routing must be one of"):
        Generator("demo-e32", decoders=2, routing="nearest")
    with pytest.raises(ValueError, match="give decoders >= 2"):
        Generator("demo-e32", routing="jsq")
    with pytest.raises(ValueError, match="decoders >= 2 runs each decoder on one device"):
        Generator("demo-e32", decoders=2, backend="sync_ep", devices=2)
    with pytest.raises(ValueError, match="decoders must be a positive integer"):
        Generator("demo-e32", decoders=0)


def test_missing_stale_and_mismatched_fits(e32, tmp_path):
    cfg, fingerprint = e32
    with pytest.raises(FileNotFoundError, match="moejax eldr-fit"):
        Generator("demo-e32", decoders=2, routing="eldr", eldr_fit=tmp_path / "none.npz")
    stale = _fit_file(tmp_path, cfg, "0" * 64, 2, "stale.npz")
    with pytest.raises(FitError, match="stale"):
        Generator("demo-e32", decoders=2, routing="eldr", eldr_fit=stale)
    three = _fit_file(tmp_path, cfg, fingerprint, 3, "three.npz")
    with pytest.raises(FitError, match="refit with --decoders 2"):
        Generator("demo-e32", decoders=2, routing="eldr", eldr_fit=three)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(FitError, match="not an ELDR fit file"):
        Generator("demo-e32", decoders=2, routing="eldr", eldr_fit=junk)
    # The small demo (4 layers, 8 experts) is another model altogether.
    with pytest.raises(FitError, match="fitted for a model with 6 layers"):
        Generator("demo", decoders=2, routing="eldr",
                  eldr_fit=_fit_file(tmp_path, cfg, fingerprint, 2, "e32.npz"))


def test_bad_domain_field(demo_generator):
    [result] = demo_generator.generate([{"prompt": "hi", "domain": 3}])
    assert "domain: must be a string" in result.error


def test_generate_command_with_decoders(tmp_path, one_decoder):
    import json

    from serving import cli

    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps(r) + "\n" for r in _requests()))
    out = tmp_path / "out.jsonl"
    assert cli.main(["generate", str(requests), "-o", str(out), "--model", "demo-e32",
                     "--dtype", "float32", "--max-batch-size", "2", "--decoders", "2",
                     "--max-prefill-tokens", "64",
                     "--decode-routing", "round_robin"]) == 0
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in results] == one_decoder
    bad = tmp_path / "bad.jsonl"
    assert cli.main(["generate", str(requests), "-o", str(bad), "--model", "demo-e32",
                     "--decoders", "2", "--decode-routing", "eldr"]) == 2

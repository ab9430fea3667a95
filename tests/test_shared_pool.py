"""A Scorer and a Generator on one device share one copy of the weights and one KV pool
(``Generator(share_with=scorer)``, ``serving.scorer_sharing``, ``moejax.kv.KVStore``):
generation reads the prompt blocks scoring wrote by the same block ids (no copy), scoring
reads generation's, tokens and scores do not change, and a reset or failed step of one
side leaves the other correct."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from moejax.prefix_hash import block_hashes
from moejax.sequences import SequenceSpec
from serving import Generator, Scorer

OPTS = dict(dtype="float32", compilation_cache="off")


@pytest.fixture(scope="module")
def pair(demo_generator, demo_scorer):
    rng = np.random.default_rng(3)
    system = [int(t) for t in rng.integers(3, 1024, 40)]
    scorer = Scorer("demo", prefix_cache_blocks=32, **OPTS)
    shared = Generator("demo", share_with=scorer, max_batch_size=2, **OPTS)
    return scorer, shared, demo_generator, system


@pytest.fixture(scope="module")
def reference(demo_scorer):
    return demo_scorer


def _request(prompt, new=6):
    return {"prompt_token_ids": prompt, "max_new_tokens": new, "stop_token_ids": []}


def _slots(blocks):
    return (np.asarray(blocks)[:, None] * 16 + np.arange(16)).reshape(-1)


def test_one_copy_of_the_weights_and_one_pool(pair):
    scorer, shared, _, _ = pair
    assert shared.shared_with_scorer == {"weights": "shared", "kv_pool": "shared"}
    backend, runner = scorer.engine.backend, shared.scheduler.runner
    assert runner.placement is backend.placement
    ours, theirs = jax.tree.leaves(runner.params), jax.tree.leaves(backend.params)
    assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs))
    store = scorer.engine.kv_store
    assert shared.scheduler.store is store
    assert shared.scheduler.allocators == store.allocators
    assert shared.scheduler.kv is store.pool


def test_generation_reads_the_blocks_scoring_wrote_in_place(pair):
    scorer, shared, plain, system = pair
    # One candidate: the whole 41-token sequence is the request's prefix; its two whole
    # blocks (32 tokens) are named in the pool.
    scorer.score([{"prompt_token_ids": system, "candidate_token_ids": [[5]]}])
    hashes = block_hashes(np.asarray(system[:32]))
    allocator = scorer.engine.prefix_cache
    blocks = allocator.lookup(hashes)
    assert len(blocks) == 2
    written = [np.asarray(a)[:, _slots(blocks)] for a in (scorer.engine.kv_store.pool.keys,
                                                          scorer.engine.kv_store.pool.values)]
    hits = shared.scheduler.stats["prefix_hit_tokens"]
    prompt = system + [7, 8, 9]
    [got] = shared.generate([_request(prompt)])
    [want] = plain.generate([_request(prompt)])
    assert got.error is None and got.token_ids == want.token_ids
    assert shared.scheduler.stats["prefix_hit_tokens"] == hits + 32
    # The same blocks, untouched: generation read them where scoring left them.
    assert allocator.lookup(hashes) == blocks
    pool = shared.scheduler.kv
    for before, after in zip(written, (pool.keys, pool.values)):
        np.testing.assert_array_equal(np.asarray(after)[:, _slots(blocks)], before)
    # ... and they hold what generation would have computed itself.
    plain_blocks = plain.scheduler.allocators[0].lookup(hashes)
    for name in ("keys", "values"):
        np.testing.assert_allclose(
            np.asarray(getattr(pool, name))[:, _slots(blocks)],
            np.asarray(getattr(plain.scheduler.kv, name))[:, _slots(plain_blocks)],
            rtol=1e-5, atol=1e-5)
    assert allocator.num_in_use == 0          # nothing left pinned


def test_scoring_reads_the_blocks_generation_wrote(pair, reference):
    scorer, shared, _, _ = pair
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(3, 1024, 50)]
    shared.generate([_request(prompt, new=2)])
    request = {"prompt_token_ids": prompt, "candidate_token_ids": [[5], [9]]}
    cached = scorer.engine.stats.prefix_tokens_cached
    [got] = scorer.score([request])
    assert scorer.engine.stats.prefix_tokens_cached >= cached + 48
    [want] = reference.score([request])
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)


def test_scoring_and_generation_on_two_threads(pair, reference):
    scorer, shared, plain, system = pair
    prompts = [system[:20 + i] for i in range(3)]
    want = [r.token_ids for r in plain.generate([_request(p, new=4) for p in prompts])]
    requests = [{"prompt_token_ids": system[:30 + i], "candidate_token_ids": [[5], [6]]}
                for i in range(4)]
    want_scores = [r.logprobs for r in reference.score(requests)]
    got: dict[str, list] = {}

    def score():
        got["scores"] = [r.logprobs for r in scorer.score(requests)]

    thread = threading.Thread(target=score)
    thread.start()
    got["tokens"] = [r.token_ids for r in shared.generate([_request(p, new=4)
                                                           for p in prompts])]
    thread.join()
    assert got["tokens"] == want
    np.testing.assert_allclose(got["scores"], want_scores, rtol=1e-4, atol=1e-4)


def test_a_reset_store_makes_generation_recompute(pair, reference):
    """A sharer's failed step resets the store (fresh pool, every block forgotten): the
    scheduler re-queues what it was running and recomputes it; the tokens do not change."""
    scorer, shared, plain, system = pair
    scheduler = shared.scheduler
    spec = SequenceSpec(prompt=tuple(system[:24]), max_new_tokens=5)
    [want] = plain.generate([_request(list(spec.prompt), new=5)])
    seq = scheduler.submit(spec)
    scheduler.step()                          # the prompt ran
    assert seq.computed > 0 and seq.blocks
    recomputed = scheduler.stats["recomputed_after_reset"]
    scheduler.store.reset()
    assert scheduler.store.allocators[0].num_in_use == 0
    scheduler.run_until_idle()
    assert seq.output.token_ids == want.token_ids
    assert scheduler.stats["recomputed_after_reset"] == recomputed + 1
    assert scheduler.store.allocators[0].num_in_use == 0
    # The scorer plans afresh on the new pool.
    request = {"prompt_token_ids": system, "candidate_token_ids": [[5]]}
    [got] = scorer.score([request])
    [ref] = reference.score([request])
    np.testing.assert_allclose(got.logprobs, ref.logprobs, rtol=1e-4, atol=1e-4)


def test_reset_prefix_cache_leaves_running_generation_alone(pair):
    scorer, shared, plain, system = pair
    scheduler = shared.scheduler
    spec = SequenceSpec(prompt=tuple(system[:36]), max_new_tokens=4)
    [want] = plain.generate([_request(list(spec.prompt), new=4)])
    seq = scheduler.submit(spec)
    scheduler.step()
    scorer.reset_prefix_cache()
    allocator = scheduler.allocators[0]
    assert allocator.num_named <= len(seq.blocks)   # only what the sequence re-names
    scheduler.run_until_idle()
    assert seq.output.token_ids == want.token_ids
    assert allocator.num_in_use == 0


def test_what_cannot_be_shared_is_kept_apart_and_said(pair, caplog):
    scorer, _, _, _ = pair
    caplog.set_level("INFO", logger="serving.scorer_sharing")
    other = Generator("demo", share_with=scorer, dtype="bfloat16", compilation_cache="off")
    assert "bfloat16" in other.shared_with_scorer["weights"]
    assert "bfloat16" in other.shared_with_scorer["kv_pool"]
    assert other.scheduler.store is not scorer.engine.kv_store
    assert "bfloat16" in caplog.text
    sized = Generator("demo", share_with=scorer, kv_cache_blocks=8, **OPTS)
    assert sized.shared_with_scorer["weights"] == "shared"
    assert "kv_cache_blocks" in sized.shared_with_scorer["kv_pool"]
    assert sized.scheduler.store.num_blocks == 8
    static = Generator("demo", share_with=scorer, batching="static", **OPTS)
    assert "continuous" in static.shared_with_scorer["weights"]
    offload = Generator("demo", share_with=scorer, backend="offload", **OPTS)
    assert offload.shared_with_scorer["kv_pool"] == "shared"
    assert "resident" in offload.shared_with_scorer["weights"]
    no_pool = Generator("demo", share_with=Scorer("demo", share_prompts=False, **OPTS), **OPTS)
    assert "keeps no KV pool" in no_pool.shared_with_scorer["kv_pool"]
    with pytest.raises(ValueError, match="another model"):
        Generator("demo-e32", share_with=scorer, **OPTS)


def test_a_failed_generation_step_resets_the_shared_store(pair, reference, monkeypatch):
    """The pool went into the failed step: the store starts afresh and scoring, which
    plans each run on the current pool, still answers correctly."""
    scorer, shared, plain, system = pair
    scheduler = shared.scheduler
    epoch = scheduler.store.epoch

    def fail(*args, **kwargs):
        raise RuntimeError("injected step failure")

    monkeypatch.setattr(scheduler.runner, "run", fail)
    with pytest.raises(RuntimeError, match="injected"):
        shared.generate([_request(system[:20], new=2)])
    monkeypatch.undo()
    assert not scheduler.busy                  # the call's sequences were dropped cleanly
    assert scheduler.store.epoch == epoch + 1
    assert scheduler.store.allocators[0].num_named == 0
    request = _request(system[:20], new=2)
    assert shared.generate([request])[0].token_ids == plain.generate([request])[0].token_ids
    request = {"prompt_token_ids": system, "candidate_token_ids": [[5]]}
    [got] = scorer.score([request])
    [want] = reference.score([request])
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)



def test_a_sync_ep_server_holds_one_placement(pair):
    """sync_ep scoring and sync_ep decode over the same devices run on one
    SyncEPPlacement (dense weights replicated, expert slots per device); the tokens are
    resident decode's. A Generator asking for its own expert layout keeps its own."""
    _, _, plain, system = pair
    scorer = Scorer("demo", backend="sync_ep", devices=2, **OPTS)
    gen = Generator("demo", share_with=scorer, backend="sync_ep", devices=2, **OPTS)
    assert gen.shared_with_scorer["weights"] == "shared"
    assert "keeps no KV pool" in gen.shared_with_scorer["kv_pool"]
    runner, backend = gen.scheduler.runner, scorer.engine.backend
    assert runner.placement is backend.placement
    assert runner.expert_slots is backend.expert_slots and runner.layout is backend.layout
    request = _request(system[:18], new=4)
    assert gen.generate([request])[0].token_ids == plain.generate([request])[0].token_ids
    own = Generator("demo", share_with=scorer, backend="sync_ep", devices=2,
                    backend_options={"replicas": 1.5}, **OPTS)
    assert "own expert layout" in own.shared_with_scorer["weights"]
    assert own.scheduler.runner.placement is not backend.placement


def test_an_offload_server_holds_one_placement(pair, reference):
    """offload scoring and offload decode (with or without prefetch) on one device run on
    one OffloadPlacement: the dense weights on the device and the experts in host memory
    once, copied in by the scoring window and by decode's slots alike. Generation reads
    the prompt blocks scoring wrote, and tokens and scores are resident's."""
    _, _, plain, system = pair
    scorer = Scorer("demo", backend="offload", prefix_cache_blocks=32, **OPTS)
    gen = Generator("demo", share_with=scorer, backend="offload", max_batch_size=2, **OPTS)
    assert gen.shared_with_scorer == {"weights": "shared", "kv_pool": "shared"}
    runner, backend = gen.scheduler.runner, scorer.engine.backend
    assert runner.placement is backend.placement
    assert runner.slots.host is backend.host_experts is backend.placement.host
    request = {"prompt_token_ids": system, "candidate_token_ids": [[5]]}
    [got] = scorer.score([request])
    [want] = reference.score([request])
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-4, atol=1e-4)
    hits = gen.scheduler.stats["prefix_hit_tokens"]
    prompt = _request(system + [7, 8, 9])
    assert gen.generate([prompt])[0].token_ids == plain.generate([prompt])[0].token_ids
    assert gen.scheduler.stats["prefix_hit_tokens"] == hits + 32
    assert runner.experts_copied > 0
    ahead = Generator("demo", share_with=scorer, backend="offload", prefetch="oracle",
                      max_batch_size=2, **OPTS)
    assert ahead.scheduler.runner.placement is backend.placement
    assert ahead.generate([prompt])[0].token_ids == plain.generate([prompt])[0].token_ids

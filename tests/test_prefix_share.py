"""Generation reuses the prompt blocks that scoring cached (``moejax.core.prefix_share``):
copied blocks hold the keys/values generation computes itself, the tokens do not change,
an engine busy scoring is skipped (never waited on), and mismatched pairs are refused.
Also the other thing a server shares between the two: the weights (``weights_of``)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from moejax.prefix_hash import block_hashes
from serving import Generator, Scorer

OPTS = dict(dtype="float32", compilation_cache="off")


@pytest.fixture(scope="module")
def pair():
    rng = np.random.default_rng(3)
    system = [int(t) for t in rng.integers(3, 1024, 40)]
    scorer = Scorer("demo", prefix_cache_blocks=32, **OPTS)
    # One candidate: the whole 41-token sequence is the request's prefix; its two whole
    # blocks (32 tokens) are named in the scorer's cache.
    scorer.score([{"prompt_token_ids": system, "candidate_token_ids": [[5]]}])
    shared = Generator("demo", max_batch_size=2, **OPTS)
    shared.share_prefix_cache(scorer)
    plain = Generator("demo", max_batch_size=2, **OPTS)
    return scorer, shared, plain, system


def _request(prompt, new=6):
    return {"prompt_token_ids": prompt, "max_new_tokens": new, "stop_token_ids": []}


def _pool_blocks(generator, tokens):
    """Keys and values [L, 32, n_kv, h] of the cached blocks holding ``tokens``' first
    two blocks in ``generator``'s pool."""
    scheduler = generator.scheduler
    blocks = scheduler.managers[0].lookup(block_hashes(np.asarray(tokens[:32])))
    assert len(blocks) == 2
    slots = (np.asarray(blocks)[:, None] * 16 + np.arange(16)).reshape(-1)
    return np.asarray(scheduler.kv.keys)[:, slots], np.asarray(scheduler.kv.values)[:, slots]


def test_a_scored_prompt_is_copied_not_prefilled(pair):
    scorer, shared, plain, system = pair
    prompt = system + [7, 8, 9]
    [got] = shared.generate([_request(prompt)])
    [want] = plain.generate([_request(prompt)])
    assert got.error is None and got.token_ids == want.token_ids
    assert shared.scheduler.stats["shared_prefix_tokens"] == 32
    assert plain.scheduler.stats["shared_prefix_tokens"] == 0
    for copied, computed in zip(_pool_blocks(shared, prompt), _pool_blocks(plain, prompt)):
        np.testing.assert_allclose(copied, computed, rtol=1e-5, atol=1e-5)
        assert np.abs(copied).max() > 0
    # The copies are the generator's own cached blocks now: no second copy.
    shared.generate([_request(system + [11])])
    assert shared.scheduler.stats["shared_prefix_tokens"] == 32
    cache = scorer.engine.prefix_cache
    assert cache.num_cached == 2 and cache.num_in_use == 0    # nothing left pinned there


def test_an_engine_busy_scoring_is_skipped(pair):
    scorer, shared, plain, _ = pair
    rng = np.random.default_rng(4)
    other = [int(t) for t in rng.integers(3, 1024, 36)]
    scorer.score([{"prompt_token_ids": other, "candidate_token_ids": [[5]]}])
    held, done = threading.Event(), threading.Event()

    def hold():          # a scoring run holds the engine's lock
        with scorer.engine.prefix_lock:
            held.set()
            done.wait()

    thread = threading.Thread(target=hold)
    thread.start()
    held.wait()
    try:
        before = shared.scheduler.stats["shared_prefix_tokens"]
        skips = shared.scheduler.prefix_source.busy_skips
        [got] = shared.generate([_request(other + [1, 2])])
        assert shared.scheduler.stats["shared_prefix_tokens"] == before
        assert shared.scheduler.prefix_source.busy_skips == skips + 1
    finally:
        done.set()
        thread.join()
    assert got.token_ids == plain.generate([_request(other + [1, 2])])[0].token_ids


def test_mismatched_pairs_are_refused(pair):
    scorer, _, _, _ = pair
    with pytest.raises(ValueError, match="no prefix cache"):
        Generator("demo", **OPTS).share_prefix_cache(Scorer("demo", **OPTS))
    with pytest.raises(ValueError, match="bfloat16"):
        Generator("demo", dtype="bfloat16", compilation_cache="off").share_prefix_cache(scorer)
    with pytest.raises(ValueError, match="continuous"):
        Generator("demo", batching="static", **OPTS).share_prefix_cache(scorer)
    with pytest.raises(ValueError, match="one-rank"):
        Generator("demo", backend="sync_ep", devices=2, **OPTS).share_prefix_cache(scorer)


def test_serve_shares_where_it_can(pair, caplog):
    from serving.grpc.cli import _share_prefix_cache

    scorer, _, _, _ = pair
    gen = Generator("demo", **OPTS)
    _share_prefix_cache(gen, scorer)
    assert gen.scheduler.prefix_source is not None
    unshared = Generator("demo", **OPTS)
    _share_prefix_cache(unshared, Scorer("demo", **OPTS))      # kv-cache-free: nothing kept
    assert unshared.scheduler.prefix_source is None
    other = Generator("demo", dtype="bfloat16", compilation_cache="off")
    _share_prefix_cache(other, scorer)                          # warns, serves anyway
    assert other.scheduler.prefix_source is None and "bfloat16" in caplog.text


def test_a_generator_decodes_with_the_scorers_weights(pair, caplog):
    """``weights_of=scorer``: the runner holds the Scorer's very arrays (one copy in a
    server), and the tokens are a Generator's own; where it cannot (another dtype) it
    keeps its own copy and says why."""
    import jax

    scorer, _, plain, system = pair
    gen = Generator("demo", weights_of=scorer, **OPTS)
    theirs = jax.tree.leaves(scorer.engine.backend.params)
    ours = jax.tree.leaves(gen.scheduler.runner.params)
    assert len(ours) == len(theirs) and all(a is b for a, b in zip(ours, theirs))
    request = _request(system[:20], new=5)
    assert gen.generate([request])[0].token_ids == plain.generate([request])[0].token_ids
    caplog.set_level("INFO", logger="serving.generate")
    own = Generator("demo", weights_of=scorer, dtype="bfloat16", compilation_cache="off")
    assert not any(a is b for a, b in zip(jax.tree.leaves(own.scheduler.runner.params),
                                          theirs))
    assert "own copy" in caplog.text and "bfloat16" in caplog.text

"""The prefix KV cache: block bookkeeping, and scores equal with the cache on, off and
KV-cache-free, over shared / partially shared / unique prefixes, prefixes ending
mid-block, repeated runs (cross-batch reuse) and evictions."""

from __future__ import annotations

import numpy as np
import pytest

from backend_fixtures import CFG, make_params
from moejax.backends import make_backend
from moejax.packing import BucketPolicy, ScoringSequence
from serving.engine import Engine
from serving.prefix_cache import PrefixCache, blocks_for_budget, plan_run
from serving.prefix_hash import block_hashes

TOL = 1e-5


# ------------------------------------------------------------------ bookkeeping
def test_match_allocate_commit_release_and_lru_eviction():
    cache = PrefixCache(num_blocks=3)
    hashes = block_hashes(np.arange(48), 16)
    assert cache.match(hashes) == []
    blocks = cache.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and cache.allocate(1) is None   # all pinned
    for block, h in zip(blocks, hashes):
        assert cache.commit(block, h)
    assert not cache.commit(blocks[0], hashes[0])                      # name already taken
    cache.release(blocks)
    assert cache.match(hashes) == blocks and cache.hits == 3
    cache.release(blocks)
    # Touch order: the run above released blocks in order, so block 0 is the oldest.
    other = block_hashes(np.arange(100, 116), 16)
    (new,) = cache.allocate(1)
    assert new == blocks[0] and cache.evicted == [hashes[0]]
    cache.commit(new, other[0])
    assert cache.match(hashes) == []           # the chain starts with the evicted block
    stored, evicted = cache.drain_events()
    assert stored == hashes + [other[0]] and evicted == [hashes[0]]
    with pytest.raises(RuntimeError, match="released more often"):
        cache.release([blocks[1]])
    with pytest.raises(ValueError, match="at least one block"):
        PrefixCache(0)


def test_blocks_for_budget():
    per_block = 2 * CFG.num_layers * 16 * CFG.num_kv_heads * CFG.head_dim * 4
    assert blocks_for_budget(CFG, 10 * per_block + 5, 4) == 10


# ------------------------------------------------------------------ equality
def sequences(seed: int):
    """Siblings over three prompts (one ending mid-block, one of exactly two blocks), a
    prompt sharing its first blocks with another, unique ones, and scores inside prompts."""
    rng = np.random.default_rng(seed)
    system = rng.integers(2, CFG.vocab_size, 37)                 # ends mid-block
    out, prefix_lens = [], {}

    def add(tokens, positions, p, vocab=False):
        key = len(out)
        ids = [tuple(rng.integers(0, CFG.vocab_size, int(rng.integers(1, 3))).tolist())
               for _ in positions]
        out.append(ScoringSequence(key=key, token_ids=np.asarray(tokens, np.int32),
                                   score_positions=tuple(positions), score_token_ids=tuple(ids),
                                   full_vocab=vocab))
        prefix_lens[key] = p

    prompts = [np.concatenate([system, rng.integers(2, CFG.vocab_size, 9)]),       # 46
               rng.integers(2, CFG.vocab_size, 32),                                 # 2 blocks
               np.concatenate([system, rng.integers(2, CFG.vocab_size, 30)])]       # shares blocks
    for i, prompt in enumerate(prompts):
        for _ in range(3 if i < 2 else 1):                     # siblings: prompt + candidate
            cand = rng.integers(2, CFG.vocab_size, int(rng.integers(1, 4)))
            tokens = np.concatenate([prompt, cand])
            positions = list(range(len(prompt) - 1, len(tokens) - 1))
            add(tokens, positions, len(prompt), vocab=bool(i == 1))
    for n in (5, 16, 50):                                       # unique, no siblings
        add(rng.integers(2, CFG.vocab_size, n), [n - 1], n)
    return out, prefix_lens


@pytest.fixture(scope="module")
def setup():
    params = make_params()
    resident = make_backend("resident", CFG, params)
    policy = BucketPolicy(max_batch_tokens=128, min_block=32)
    return params, resident, policy


def run(engine, seqs, prefix_lens):
    return engine.run(seqs, prefix_lens=prefix_lens)


def assert_equal(got, want):
    assert got.keys() == want.keys()
    for key in want:
        (g_logits, g_lse), (w_logits, w_lse) = got[key], want[key]
        assert len(g_logits) == len(w_logits)
        for a, b in zip(g_logits, w_logits):
            np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
        if w_lse is not None:
            np.testing.assert_allclose(g_lse, w_lse, rtol=TOL, atol=TOL)


def test_scores_equal_with_cache_on_off_and_kv_cache_free(setup):
    params, resident, policy = setup
    plain = Engine(CFG, resident, policy=policy)
    cached = Engine(CFG, resident, policy=policy, prefix_cache_blocks=64)
    free = Engine(CFG, resident, policy=policy, prefix_cache_blocks=64, kv_cache_free=True)
    for seed in (1, 2, 1):                       # the third run repeats the first: cache hits
        seqs, prefix_lens = sequences(seed)
        want = run(plain, seqs, prefix_lens)
        assert_equal(run(cached, seqs, prefix_lens), want)
        assert_equal(run(free, seqs, prefix_lens), want)
    assert cached.stats.prefix_tokens_cached > 0 and cached.prefix_cache.hits > 0
    # KV-cache-free: nothing kept, nothing looked up; in-run sharing still happened.
    assert free.prefix_cache.resident == 0 and free.prefix_cache.lookups == 0
    assert free.stats.prefix_tokens_computed > 0


def test_small_cache_evicts_and_stays_exact(setup):
    params, resident, policy = setup
    plain = Engine(CFG, resident, policy=policy)
    tiny = Engine(CFG, resident, policy=policy, prefix_cache_blocks=4)
    for seed in (3, 4, 3, 5):
        seqs, prefix_lens = sequences(seed)
        assert_equal(run(tiny, seqs, prefix_lens), run(plain, seqs, prefix_lens))
    assert tiny.prefix_cache.evictions > 0
    assert tiny.prefix_cache.resident <= 4


def test_leading_blocks_shared_by_different_prompts_run_once():
    """Four prompts over one 40-token system prompt (2 whole blocks) with different
    questions and no siblings: the 2 blocks run once (phase 0), each prompt continues."""
    rng = np.random.default_rng(11)
    system = rng.integers(2, CFG.vocab_size, 40)
    seqs = []
    for i in range(4):
        tokens = np.concatenate([system, rng.integers(2, CFG.vocab_size, 10 + i)]).astype(np.int32)
        seqs.append(ScoringSequence(key=i, token_ids=tokens, score_positions=(len(tokens) - 1,),
                                    score_token_ids=((1, 2),)))
    cache = PrefixCache(32)
    plan = plan_run(seqs, {}, cache)
    assert [len(s.token_ids) for s in plan.phase0] == [32]
    assert all(s.position_offset == 32 and len(s.context_slots) == 32 for s in plan.phase1)
    cache.release(plan.pinned)


def test_plan_computes_each_shared_prefix_once():
    seqs, prefix_lens = sequences(7)
    cache = PrefixCache(64)
    plan = plan_run(seqs, prefix_lens, cache)
    # Prompt 0 (46 tokens, 3 siblings) and prompt 2 (67 tokens) share the system prompt's
    # 2 whole blocks: they run once in phase 0; prompt 0's siblings then continue from
    # token 32 in phase 1 (nothing more of their prompt to share). Prompt 1 (32 tokens,
    # 3 siblings) runs its 2 blocks once in phase 1; its siblings with a score position
    # from token 32 on run their tails in phase 2 (a score at position 31 is read from
    # the shared prefix's own row).
    assert [len(s.token_ids) for s in plan.phase0] == [32]
    assert plan.prefix_tokens == 32 + 32
    continued = [s for s in plan.phase1 if s.position_offset == 32]
    assert len(continued) >= 4                       # prompt 0's siblings and prompt 2
    siblings = [s for s in seqs[3:6] if max(s.score_positions) >= 32]
    assert len(plan.phase2) == len(siblings)
    assert all(s.position_offset == 32 for s in plan.phase2)
    # every score entry has exactly one owner
    owned = sorted(o for owners in plan.owners.values() for o in owners)
    assert owned == sorted((s.key, i) for s in seqs for i in range(len(s.score_positions)))
    cache.release(plan.pinned)


def test_prefix_cache_needs_the_resident_backend(setup):
    params, _, policy = setup
    tp = make_backend("tp", CFG, params, devices=2)
    with pytest.raises(ValueError, match="prefix cache runs on the 'resident' backend"):
        Engine(CFG, tp, policy=policy, prefix_cache_blocks=8)


def test_executed_flops_follow_the_cost_formula_and_credit_the_cache(setup):
    from serving.engine import sequence_flops

    seq = ScoringSequence(key=0, token_ids=np.arange(2, 42, dtype=np.int32),
                          score_positions=(39,), score_token_ids=((3, 4, 5),))
    assert sequence_flops(CFG, seq) == CFG.request_flops(prefix=40, scoring_positions=1,
                                                         num_candidates=3)
    params, resident, policy = setup
    engine = Engine(CFG, resident, policy=policy, prefix_cache_blocks=16)
    engine.run([seq], prefix_lens={0: 40})
    first = engine.stats.executed_flops
    engine.run([seq], prefix_lens={0: 40})         # 2 whole blocks now come from the cache
    second = engine.stats.executed_flops - first
    assert first == sequence_flops(CFG, seq)
    assert second == CFG.request_flops(prefix=40, cached=32, scoring_positions=1,
                                       num_candidates=3)
    engine.reset_prefix_cache()
    engine.run([seq], prefix_lens={0: 40})
    assert engine.stats.executed_flops - first - second == first

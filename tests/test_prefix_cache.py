"""The prefix KV cache: block bookkeeping, and scores equal with the cache on, off and
KV-cache-free, over shared / partially shared / unique prefixes, prefixes ending
mid-block, repeated runs (cross-batch reuse) and evictions."""

from __future__ import annotations

import numpy as np
import pytest

from backend_fixtures import CFG, make_params
from moejax.backends import BackendError, make_backend
from moejax.ops import PrefillOp
from moejax.packing import BucketPolicy
from moejax.core.scoring_engine import Engine
from moejax.kv import BlockAllocator
from moejax.core.prefix_plan import blocks_for_budget, plan_run
from serving.prefix_hash import block_hashes

TOL = 1e-5


# ------------------------------------------------------------------ bookkeeping
def test_blocks_for_budget():
    per_block = 2 * CFG.num_layers * 16 * CFG.num_kv_heads * CFG.head_dim * 4
    assert blocks_for_budget(CFG, 10 * per_block + 5, 4) == 10


# ------------------------------------------------------------------ equality
def sequences(seed: int):
    """Siblings over three prompts (one ending mid-block, one of exactly two blocks), a
    prompt sharing its first blocks with another, unique ones, and scores inside prompts."""
    rng = np.random.default_rng(seed)
    system = rng.integers(2, CFG.vocab_size, 37)                 # ends mid-block
    out = []

    def add(tokens, positions, p, vocab=False):
        ids = [tuple(rng.integers(0, CFG.vocab_size, int(rng.integers(1, 3))).tolist())
               for _ in positions]
        out.append(PrefillOp(key=len(out), token_ids=np.asarray(tokens, np.int32),
                             score_positions=tuple(positions), score_token_ids=tuple(ids),
                             full_vocab=vocab, prefix_len=p))

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
    return out


@pytest.fixture(scope="module")
def setup():
    params = make_params()
    resident = make_backend("resident", CFG, params)
    policy = BucketPolicy(max_batch_tokens=128, min_block=32)
    return params, resident, policy


def assert_equal(got, want):
    assert got.keys() == want.keys()
    for key in want:
        g, w = got[key], want[key]
        g_lse, w_lse = g.logsumexp, w.logsumexp
        assert len(g.logits) == len(w.logits)
        for a, b in zip(g.logits, w.logits):
            np.testing.assert_allclose(a, b, rtol=TOL, atol=TOL)
        # A log-sum-exp comes back for every sequence of a full-vocabulary batch; only
        # those that asked for one are guaranteed it whatever the batch composition.
        if g_lse is not None and w_lse is not None:
            np.testing.assert_allclose(g_lse, w_lse, rtol=TOL, atol=TOL)


def test_scores_equal_with_cache_on_off_and_kv_cache_free(setup):
    params, resident, policy = setup
    plain = Engine(CFG, resident, policy=policy)
    cached = Engine(CFG, resident, policy=policy, prefix_cache_blocks=64)
    free = Engine(CFG, resident, policy=policy, prefix_cache_blocks=64, kv_cache_free=True)
    for seed in (1, 2, 1):                       # the third run repeats the first: cache hits
        seqs = sequences(seed)
        want = plain.run(seqs)
        for engine in (cached, free):
            got = engine.run(seqs)
            assert_equal(got, want)
            assert all(got[s.key].logsumexp is not None and want[s.key].logsumexp is not None
                       for s in seqs if s.full_vocab)
    assert cached.stats.prefix_tokens_cached > 0 and cached.prefix_cache.hits > 0
    # KV-cache-free: nothing kept, nothing looked up; in-run sharing still happened.
    assert free.prefix_cache.num_named == 0 and free.prefix_cache.lookups == 0
    assert free.stats.prefix_tokens_shared > 0


def test_small_cache_evicts_and_stays_exact(setup):
    params, resident, policy = setup
    plain = Engine(CFG, resident, policy=policy)
    tiny = Engine(CFG, resident, policy=policy, prefix_cache_blocks=4)
    for seed in (3, 4, 3, 5):
        seqs = sequences(seed)
        assert_equal(tiny.run(seqs), plain.run(seqs))
    assert tiny.prefix_cache.evictions > 0
    assert tiny.prefix_cache.num_named <= 4


def planned_tokens(plan) -> int:
    return sum(len(s.token_ids) for level in plan.levels for s in level)


def test_shared_tokens_run_once_across_prompts_and_mid_block():
    """Four prompts over one 40-token system prompt (2 whole blocks and 8 tokens) with
    different questions: the 40 shared tokens run once — the partial block too — and the
    other prompts continue from token 40, one level later."""
    rng = np.random.default_rng(11)
    system = rng.integers(2, CFG.vocab_size, 40)
    seqs = []
    for i in range(4):
        tokens = np.concatenate([system, rng.integers(2, CFG.vocab_size, 10 + i)]).astype(np.int32)
        seqs.append(PrefillOp(key=i, token_ids=tokens, score_positions=(len(tokens) - 1,),
                              score_token_ids=((1, 2),)))
    cache = BlockAllocator(32)
    plan = plan_run(seqs, cache)
    assert [len(level) for level in plan.levels] == [1, 3]
    (first,) = plan.levels[0]
    assert first.position_offset == 0 and np.all(first.store_slots[:40] >= 0)
    assert all(s.position_offset == 40 and len(s.context_slots) == 40 for s in plan.levels[1])
    assert planned_tokens(plan) == 40 + sum(10 + i for i in range(4))
    assert plan.shared_tokens == 3 * 40 and plan.cached_tokens == 0
    # The first prompt names its 3 whole blocks; the others have none of their own (their
    # third block starts inside the shared part), so they store nothing.
    assert len(plan.to_commit) == 3 and all(s.store_slots is None for s in plan.levels[1])
    cache.release(plan.pinned)


def brute_force_computed(seqs) -> int:
    """Tokens the run must compute if every sequence reads its longest common prefix with
    any earlier sequence of the sorted order (never its first score position), when that
    is at least a block (16 tokens)."""
    order = sorted(seqs, key=lambda s: tuple(s.token_ids.tolist()))
    total = 0
    for i, seq in enumerate(order):
        shared = 0
        for other in order[:i]:
            a, b = seq.token_ids, other.token_ids
            m = min(len(a), len(b))
            shared = max(shared, next((t for t in range(m) if a[t] != b[t]), m))
        readable = min(shared, min(seq.score_positions))
        total += len(seq.token_ids) - (readable if readable >= 16 else 0)   # a block's worth
    return total


def test_plan_reads_each_shared_token_from_where_it_was_stored():
    seqs = sequences(7)
    cache = BlockAllocator(64)
    plan = plan_run(seqs, cache)
    assert planned_tokens(plan) == brute_force_computed(seqs)
    by_key = {s.key: s for s in seqs}
    # Each stored slot holds one token prefix; every context slot a sequence reads holds
    # exactly its own prefix up to that token, stored at an earlier level.
    stored: dict[int, tuple[tuple, int]] = {}
    for level, derived in enumerate(plan.levels):
        for s in derived:
            tokens = by_key[s.key].token_ids
            assert np.array_equal(s.token_ids, tokens[s.position_offset:])
            if s.context_slots is not None:
                for t, slot in enumerate(s.context_slots):
                    assert stored[int(slot)] [0] == tuple(tokens[:t + 1].tolist())
                    assert stored[int(slot)][1] < level
            if s.store_slots is not None:
                for j, slot in enumerate(s.store_slots):
                    if slot >= 0:
                        t = s.position_offset + j
                        assert int(slot) not in stored
                        stored[int(slot)] = (tuple(tokens[:t + 1].tolist()), level)
            # score entries keep their owner and order, shifted by the offset
            assert [q + s.position_offset for q in s.score_positions] == list(
                by_key[s.key].score_positions)
    cache.release(plan.pinned)


def test_context_entries_share_a_slot_across_consecutive_segments_only():
    from moejax.packing import context_entries

    slots = np.array([5, 6, 5, 6, 5, 7], np.int32)
    segments = np.array([0, 0, 1, 1, 3, 3], np.int32)
    got = sorted(zip(*(a.tolist() for a in context_entries(slots, segments))))
    # slot 5: segments 0-1 share an entry; segment 3 is not next to them: its own entry.
    assert got == [(5, 0, 1), (5, 3, 3), (6, 0, 1), (7, 3, 3)]


def test_offload_scores_equal_resident_with_and_without_the_cache(setup):
    """The pool on the offload device, threaded (donated) through its per-layer programs."""
    params, resident, policy = setup
    plain = Engine(CFG, resident, policy=policy)
    offload = make_backend("offload", CFG, params)
    uncached = Engine(CFG, offload, policy=policy)
    cached = Engine(CFG, offload, policy=policy, prefix_cache_blocks=64)
    for seed in (1, 1):                          # the second run reads the cached blocks
        seqs = sequences(seed)
        want = plain.run(seqs)
        assert_equal(uncached.run(seqs), want)
        assert_equal(cached.run(seqs), want)
    assert cached.stats.prefix_tokens_cached > 0 and cached.prefix_cache.hits > 0
    assert cached.stats.prefix_tokens_shared > 0


@pytest.mark.parametrize("name", ["sync_ep", "tp"])
def test_backends_without_a_pool_refuse_the_cache_by_name(setup, name):
    params, _, policy = setup
    backend = make_backend(name, CFG, params, devices=2)
    with pytest.raises(BackendError, match=f"backend '{name}' cannot hold a prefix KV pool: "
                                           f"its .* \\(the prefix cache runs on resident, "
                                           f"offload, async_ep, hybrid\\)"):
        Engine(CFG, backend, policy=policy, prefix_cache_blocks=8)


@pytest.mark.parametrize("name", ["async_ep", "hybrid"])
def test_data_parallel_ranks_each_hold_a_pool_and_equal_one_engine(setup, name):
    """async_ep / hybrid on 2 ranks: each rank plans on its own allocator and reads and
    writes its own blocks; cached, KV-cache-free and plain runs equal a plain engine."""
    params, resident, policy = setup
    backend = make_backend(name, CFG, params, devices=2)
    plain = Engine(CFG, resident, policy=policy)
    cached = Engine(CFG, backend, policy=policy, prefix_cache_blocks=16)
    free = Engine(CFG, backend, policy=policy, prefix_cache_blocks=16, kv_cache_free=True)
    assert cached.backend.make_kv_pool(16).keys.shape[1] == 2 * 16 * 16   # 16 blocks per rank
    for seed in (1, 1):                          # the second run reads the cached blocks
        seqs = sequences(seed)
        want = plain.run(seqs)
        assert_equal(cached.run(seqs), want)
        assert_equal(free.run(seqs), want)
    assert cached.stats.prefix_tokens_cached > 0 and cached.stats.prefix_tokens_shared > 0
    assert {a.engine for a in cached.last_rank_report.assignments} == {0, 1}
    assert all(a.hits > 0 for a in cached.kv_store.allocators)


def test_executed_flops_follow_the_cost_formula_and_credit_the_cache(setup):
    seq = PrefillOp(key=0, token_ids=np.arange(2, 42, dtype=np.int32),
                    score_positions=(39,), score_token_ids=((3, 4, 5),), prefix_len=40)
    assert seq.flops(CFG) == CFG.request_flops(prefix=40, scoring_positions=1,
                                               num_candidates=3)
    params, resident, policy = setup
    engine = Engine(CFG, resident, policy=policy, prefix_cache_blocks=16)
    engine.run([seq])
    first = engine.stats.executed_flops
    engine.run([seq])                              # 2 whole blocks now come from the cache
    second = engine.stats.executed_flops - first
    assert first == seq.flops(CFG)
    assert second == CFG.request_flops(prefix=40, cached=32, scoring_positions=1,
                                       num_candidates=3) == seq.flops(CFG, cached=32)
    engine.reset_prefix_cache()
    engine.run([seq])
    assert engine.stats.executed_flops - first - second == first


def test_a_few_shared_tokens_are_not_worth_a_level():
    """Prompts opening with the same few tokens run in one pass, each whole."""
    rng = np.random.default_rng(12)
    opening = rng.integers(2, CFG.vocab_size, 5)
    seqs = [PrefillOp(key=i, token_ids=np.concatenate(
                [opening, rng.integers(2, CFG.vocab_size, 30)]).astype(np.int32),
                score_positions=(34,), score_token_ids=((1,),)) for i in range(3)]
    cache = BlockAllocator(32)
    plan = plan_run(seqs, cache)
    assert len(plan.levels) == 1 and planned_tokens(plan) == 3 * 35 and plan.shared_tokens == 0
    cache.release(plan.pinned)


def test_heterogeneous_engines_each_calibrated_under_one_router(setup):
    """A resident engine on device 0 and an offload engine on device 1 behind one
    router, each with the Θ its own calibration gives: results equal one plain engine's,
    and each engine saturates at its own Θ."""
    import jax

    from moejax.calibrate import calibrate, fallback_theta
    from moejax.core.engine_pool import EnginePool
    from moejax.core.router import PrefixAwareRouter

    params, resident, policy = setup
    devices = jax.devices()
    engines = [Engine(CFG, make_backend("resident", CFG, params, device=devices[0]),
                      policy=policy, prefix_cache_blocks=32),
               Engine(CFG, make_backend("offload", CFG, params, device_pool=devices[1:2]),
                      policy=policy, prefix_cache_blocks=32)]
    assert engines[1].backend.devices == (devices[1],)
    calibrations = [calibrate(e.backend, max_batch_tokens=128, reference_tokens=64,
                              reference_sequence=32, repeats=1) for e in engines]
    # resident moves no weights (Θ = 0: the Scorer's rule makes that one full batch);
    # offload measured its copy time and FLOP rate, and its Θ hides one behind the other.
    assert calibrations[0].theta == 0 and calibrations[1].theta > 0
    assert calibrations[1].rate > 0
    thetas = [c.theta or fallback_theta(CFG, 128) for c in calibrations]
    router = PrefixAwareRouter(CFG, 2, thetas)
    assert router.theta == tuple(thetas) and router.thetas[0] != router.thetas[1]
    pool = EnginePool(engines, router)
    plain = Engine(CFG, resident, policy=policy)
    for seed in (1, 2):
        seqs = sequences(seed)
        outputs, timings = pool.run(seqs)
        assert_equal(outputs, plain.run(seqs))
    assert {t.engine for t in timings.values()} <= {0, 1}
    assert sum(e.stats.batches for e in engines) > 0


def test_prefill_only_pool_runs_one_sequence_at_a_time_in_its_schedule(setup):
    """PrefillOnly's setting (the paper's baseline): shortest prefill first over two
    engines, max_num_seqs=1 (each engine runs its ops one by one, in the schedule's
    order): the results equal one plain engine's."""
    import jax

    from moejax.core.engine_pool import EnginePool
    from moejax.core.router import make_router

    params, resident, policy = setup
    engines = [Engine(CFG, make_backend("resident", CFG, params, device=d), policy=policy,
                      prefix_cache_blocks=32) for d in jax.devices()[:2]]
    pool = EnginePool(engines, make_router("prefill_only", CFG, 2), max_num_seqs=1)
    seqs = sequences(3)
    outputs, _ = pool.run(seqs)
    assert_equal(outputs, Engine(CFG, resident, policy=policy).run(seqs))
    assert sum(e.stats.batches for e in engines) >= len(seqs)     # one sequence a run
    order = pool.last_report.schedule()
    costs = [seqs[i].flops(CFG) for i in order]
    assert costs[0] == min(costs)
    with pytest.raises(ValueError, match="max_num_seqs must be None or a positive"):
        EnginePool(engines, make_router("prefill_only", CFG, 2), max_num_seqs=0)

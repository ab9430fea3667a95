"""Router (seed Algorithm 1) and block hashing on hand-built scenarios."""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from moejax.config import ModelConfig
from moejax.ops import OpKey, PrefillOp
from serving.prefix_hash import (BLOCK_SIZE, DIGEST_SIZE, HASH_PERSON, ROOT_HASH, block_hash,
                                 block_hashes, num_full_blocks)
from moejax.core.router import (BlocksEvicted, BlocksStored, FlopsExecuted, LeastTokensRouter,
                            PrefixAwareRouter, RandomRouter, RoundRobinRouter,
                            ShortestPrefillFirstRouter, make_router)

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=128, hidden_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=32, norm_topk_prob=True, qk_norm=True, rms_norm_eps=1e-6,
                  rope_theta=10000.0, max_context=4096, tie_word_embeddings=False)

PREFIX = list(range(1, 65))            # 64 tokens = 4 full blocks


def route_op(key, tokens, prefix_len: int | None = None,
             num_candidates: int | None = None) -> PrefillOp:
    """An op read at its last token over ``num_candidates`` columns (None: the vocabulary)."""
    return PrefillOp(key=key, token_ids=tokens, score_positions=(len(tokens) - 1,),
                     score_token_ids=(tuple(range(num_candidates or 1)),),
                     full_vocab=num_candidates is None, prefix_len=prefix_len)


def sibling(i: int, prefix=PREFIX, suffix_len: int = 8, **kw) -> PrefillOp:
    """Shared ``prefix`` + a distinct ``suffix_len``-token suffix."""
    suffix = [100 + (i * 7 + j) % 28 for j in range(suffix_len)]
    return route_op(f"sib{i}", prefix + suffix, prefix_len=len(prefix), **kw)


def random_workload(seed: int, count: int) -> list[PrefillOp]:
    """Groups of siblings over a few prompts of varied length, some shared across groups."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 128, int(rng.integers(8, 200))).tolist() for _ in range(12)]
    requests = []
    for i in range(count):
        prompt = prompts[int(rng.integers(0, len(prompts)))]
        suffix = rng.integers(0, 128, int(rng.integers(1, 24))).tolist()
        requests.append(route_op(i, prompt + suffix, prefix_len=len(prompt),
                                 num_candidates=int(rng.integers(1, 5))))
    return requests


# ---------------------------------------------------------------------------- block hashes
def test_block_hash_known_digest():
    tokens = list(range(16))
    expected = hashlib.blake2b(ROOT_HASH + np.arange(16, dtype="<i4").tobytes(),
                               digest_size=DIGEST_SIZE, person=HASH_PERSON).digest()
    assert BLOCK_SIZE == 16
    assert block_hashes(tokens) == [expected]
    # Pinned so that any change of the scheme (person, digest size, byte order) is caught.
    assert expected.hex() == "48b1418fca09e06765282868a751046d"
    assert block_hashes(list(range(32)))[1].hex() == "af913a176593f6d2474b4cf6d7e9e8c8"


def test_block_hashes_are_chained():
    tokens = np.arange(64) * 3
    base = block_hashes(tokens)
    assert len(base) == 4 and len(set(base)) == 4
    for block in range(4):
        changed = tokens.copy()
        changed[block * 16 + 5] += 1
        hashes = block_hashes(changed)
        assert hashes[:block] == base[:block]
        assert all(a != b for a, b in zip(hashes[block:], base[block:]))
    # Same block content after a different history hashes differently.
    assert block_hashes(list(range(16)) * 2)[1] != block_hashes(list(range(16)))[0]


def test_partial_block_not_hashed_and_inputs_agree():
    tokens = list(range(40))
    assert len(block_hashes(tokens)) == 2 == num_full_blocks(40)
    assert block_hashes(tokens) == block_hashes(tokens[:32])
    assert block_hashes(tokens[:15]) == [] and block_hashes([]) == []
    as_array = [np.array(tokens, dtype=dtype) for dtype in (np.int32, np.int64, np.uint16)]
    assert all(block_hashes(a) == block_hashes(tokens) for a in as_array)
    assert block_hashes(tokens, block_size=8) != block_hashes(tokens)[:1]
    assert len(block_hashes(tokens, block_size=8)) == 5


def test_block_hashes_continue_from_parent():
    tokens = list(range(100, 164))
    whole = block_hashes(tokens)
    head = block_hashes(tokens[:32])
    assert head + block_hashes(tokens[32:], parent=head[-1]) == whole
    assert block_hash(whole[0], tokens[16:32]) == whole[1]


@pytest.mark.parametrize("bad, error", [([-1] * 16, ValueError), ([2**31] * 16, ValueError),
                                        (np.zeros((2, 16), int), ValueError),
                                        (np.zeros(16, float) + 0.5, TypeError)])
def test_block_hashes_refuse_bad_ids(bad, error):
    with pytest.raises(error):
        block_hashes(bad)
    with pytest.raises(ValueError):
        block_hashes(list(range(16)), block_size=0)


# ---------------------------------------------------------------------------- Algorithm 1
def test_siblings_land_on_one_engine_and_cost_one_prefix_plus_suffixes():
    router = PrefixAwareRouter(CFG, num_engines=4, theta=1e12)
    report = router.assign([sibling(i) for i in range(10)])
    assert report.engines == [0] * 10
    prefix_cost = CFG.request_flops(prefix=64, suffix=0, cached=0, scoring_positions=0)
    suffix_cost = CFG.request_flops(prefix=64, suffix=8, cached=64, scoring_positions=1)
    assert report.total_flops == prefix_cost + 10 * suffix_cost      # exact, integers
    assert report.engine_flops == (prefix_cost + 10 * suffix_cost, 0, 0, 0)
    assert [a.cached_tokens for a in report.assignments] == [0] + [64] * 9
    assert router.load(0) == report.total_flops
    assert len(router.pending_blocks(0)) == 4 and not router.committed_blocks(0)
    # The cost of a full request is what the token-blind metric would charge every sibling.
    assert sibling(0).flops(CFG) == prefix_cost + suffix_cost


@pytest.mark.parametrize("name", ["prefix", "prefill_only", "least_tokens"])
def test_engines_that_share_no_prefix_are_priced_at_full_flops(name):
    """Engines without a pool or prompt sharing compute every op whole: no match is
    credited and nothing promised, so the router's load is the FLOPs they really run."""
    router = make_router(name, CFG, 2, theta=1e12, shares_prefixes=False)
    ops = [sibling(i) for i in range(6)]
    report = router.assign(ops)
    assert [a.cached_tokens for a in report.assignments] == [0] * 6
    assert report.total_flops == sum(op.flops(CFG) for op in ops)
    assert not router.pending_blocks(0) and not router.pending_blocks(1)
    assert make_router(name, CFG, 2, theta=1e12).assign(ops).total_flops < report.total_flops


def test_popular_prefix_spills_to_next_best_match():
    one_suffix = CFG.request_flops(64, 8, 64)
    theta = 8 * one_suffix                 # engine 0 saturates after exactly 8 siblings
    router = PrefixAwareRouter(CFG, num_engines=4, theta=theta)
    prefix_hashes = block_hashes(PREFIX)
    # Engine 0 holds the whole prefix, engine 3 its first half; engines 1 and 2 hold nothing
    # (index order alone would prefer them).
    router.on_event(BlocksStored(0, prefix_hashes))
    router.on_event(BlocksStored(3, prefix_hashes[:2]))
    report = router.assign([sibling(i) for i in range(15)])
    assert report.engines == [0] * 8 + [3] * 5 + [1] * 2
    assert [a.cached_tokens for a in report.assignments[7:10]] == [64, 32, 64]
    assert router.saturated(0) and router.saturated(3) and not router.saturated(2)
    # Engine 3 computes only the missing half of the prefix, once; engine 1 the whole of it.
    assert report.engine_flops == (8 * one_suffix, CFG.request_flops(64, 8, 0) + one_suffix,
                                   0, CFG.request_flops(64, 8, 32) + 4 * one_suffix)
    assert report.num_rounds == 1


def test_no_engine_exceeds_theta_plus_largest_request_in_a_round():
    requests = random_workload(seed=1, count=300)
    biggest = max(r.flops(CFG) for r in requests)
    theta = 2 * biggest
    router = PrefixAwareRouter(CFG, num_engines=4, theta=theta)
    report = router.assign(requests)
    assert report.num_rounds > 2                      # the workload overflows one round
    for r in range(report.num_rounds):
        per_engine = report.round_flops(r)
        assert max(per_engine) < theta + biggest
        if r < report.num_rounds - 1:                 # a round closes only when all saturate
            assert min(per_engine) >= theta
    first = [a for a in report.assignments if a.round == 0]
    assert len(first) < len(requests)
    # A fresh router given only the first round ends with W_g in [0, Θ + largest).
    fresh = PrefixAwareRouter(CFG, num_engines=4, theta=theta)
    fresh.route(requests[:len(first)])
    assert all(fresh.load(g) < theta + biggest for g in range(4))


def test_saturated_engines_at_call_start_open_a_new_round():
    router = PrefixAwareRouter(CFG, num_engines=2, theta=1.0)
    assert router.route([sibling(0), sibling(1, prefix=list(range(200, 264)))]) == [0, 1]
    report = router.assign([sibling(2)])
    # Both engines still hold ≥ Θ of outstanding work: the call starts in round 1, and the
    # sibling follows its prefix.
    assert report.engines == [0] and report.assignments[0].round == 1
    router.on_event(FlopsExecuted(1, router.load(1)))
    report = router.assign([sibling(3, prefix=list(range(300, 364)))])
    assert report.engines == [1] and report.assignments[0].round == 0


def test_theta_zero_still_routes_one_request_per_engine_per_round():
    router = PrefixAwareRouter(CFG, num_engines=3, theta=0)
    report = router.assign([sibling(i) for i in range(6)])
    assert report.engines == [0, 1, 2, 0, 1, 2]
    assert [a.round for a in report.assignments] == [0, 0, 0, 1, 1, 1]


def test_routing_is_deterministic():
    requests = random_workload(seed=7, count=200)
    theta = 3 * max(r.flops(CFG) for r in requests)
    first = PrefixAwareRouter(CFG, 5, theta).assign(requests)
    second = PrefixAwareRouter(CFG, 5, theta).assign(list(requests))
    assert first == second
    # Another process with another str-hash seed decides the same.
    code = ("import sys; sys.path.insert(0, '.'); from tests.test_router import *; "
            "r = random_workload(seed=7, count=200); "
            "t = 3 * max(x.flops(CFG) for x in r); "
            "print(PrefixAwareRouter(CFG, 5, t).route(r))")
    env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, cwd=os.path.dirname(os.path.dirname(__file__)), check=True)
    assert out.stdout.strip() == str(first.engines)


def test_match_never_credits_the_block_of_the_last_token():
    router = PrefixAwareRouter(CFG, 2, theta=math.inf)
    whole = route_op("a", PREFIX)                          # 64 tokens, all prefix, no suffix
    router.on_event(BlocksStored(1, block_hashes(PREFIX)))
    report = router.assign([whole])
    assert report.engines == [1] and report.assignments[0].cached_tokens == 48
    assert report.assignments[0].cost == CFG.request_flops(64, 0, 48)


# ---------------------------------------------------------------------------- events
def test_events_promote_evict_and_decay_in_channel_order():
    router = PrefixAwareRouter(CFG, 2, theta=math.inf)
    hashes = block_hashes(PREFIX)
    router.route([sibling(0)])
    assert router.pending_blocks(0) == frozenset(hashes) and not router.committed_blocks(0)
    router.channel.put(BlocksStored(0, hashes[:3]))
    router.channel.put(BlocksEvicted(0, hashes[:1]))
    router.channel.put(FlopsExecuted(0, 10))
    assert router.drain() == 3
    assert router.committed_blocks(0) == frozenset(hashes[1:3])
    assert router.pending_blocks(0) == frozenset(hashes[3:])
    assert router.num_blocks(0) == 3
    assert router.load(0) == sibling(0).flops(CFG) - 10
    router.on_event(FlopsExecuted(0, 1e30))
    assert router.load(0) == 0                          # never below zero
    # Block 0 was evicted, so the chain no longer matches anywhere: least W_g wins.
    router.on_event(FlopsExecuted(1, 0))
    assert router.route([route_op("x", list(range(500, 530)))]) == [0]
    assert router.route([sibling(1)]) == [1]            # engine 0 now carries "x"
    assert router.last_report.assignments[0].cached_tokens == 0
    # The channel is drained at the start of route, in order: evict-then-store keeps it.
    router.channel.put(BlocksEvicted(1, hashes))
    router.channel.put(BlocksStored(1, hashes))
    router.route([])
    assert router.committed_blocks(1) == frozenset(hashes)
    router.on_event(BlocksEvicted(1, (h for h in hashes)))     # any iterable of hashes
    assert router.num_blocks(1) == 0


def test_set_theta_reopens_engines():
    router = PrefixAwareRouter(CFG, 2, theta=1.0)
    router.route([sibling(0), sibling(1, prefix=list(range(200, 264)))])
    assert router.saturated(0) and router.saturated(1)
    router.set_theta(1e15)
    assert not router.saturated(0) and not router.saturated(1)


def test_match_is_contiguous_from_the_start_after_holes():
    router = PrefixAwareRouter(CFG, 2, theta=math.inf)
    hashes = block_hashes(PREFIX)
    router.route([sibling(0)])                          # engine 0: whole prefix pending
    router.on_event(BlocksEvicted(0, hashes[1:2]))      # a hole at block 1
    report = router.assign([sibling(1)])
    assert report.engines == [0] and report.assignments[0].cached_tokens == 16
    # Blocks held out of chain order give no credit either.
    other = list(range(300, 364))
    router.on_event(BlocksStored(1, block_hashes(other)[1:]))
    report = router.assign([sibling(2, prefix=other)])
    assert report.assignments[0].cached_tokens == 0


def test_decay_reopens_a_saturated_engine():
    router = PrefixAwareRouter(CFG, 2, theta=CFG.request_flops(64, 8, 0))
    assert router.route([sibling(0)]) == [0] and router.saturated(0)
    assert router.route([sibling(1)]) == [1]            # spills: engine 0 is saturated
    router.channel.put(FlopsExecuted(0, router.load(0)))
    router.channel.put(FlopsExecuted(1, router.load(1)))
    assert router.route([sibling(2)]) == [0]


def test_bad_events_are_refused():
    router = PrefixAwareRouter(CFG, 2, theta=1.0)
    with pytest.raises(ValueError):
        router.on_event(BlocksStored(2, []))
    with pytest.raises(ValueError):
        FlopsExecuted(0, -1.0)
    with pytest.raises(TypeError):
        router.on_event(types.SimpleNamespace(engine=0))


# ---------------------------------------------------------------------------- baselines
def test_round_robin_cycles_across_calls():
    router = RoundRobinRouter(CFG, 3)
    assert router.route([sibling(i) for i in range(4)]) == [0, 1, 2, 0]
    assert router.route([sibling(4), sibling(5)]) == [1, 2]
    # It keeps the shadow tables for accounting: the 4th sibling found its prefix on 0.
    assert router.last_report.assignments[0].cached_tokens == 64


def test_least_tokens_picks_least_and_decays():
    router = LeastTokensRouter(CFG, 3)
    long = route_op("long", list(range(100)))
    short = route_op("short", list(range(10)))
    assert router.route([long, short, short, short]) == [0, 1, 2, 1]
    assert [router.outstanding_tokens(g) for g in range(3)] == [100, 20, 10]
    router.on_event(FlopsExecuted(0, 0, tokens=95))
    assert router.route([short]) == [0]
    router.on_event(FlopsExecuted(1, router.load(1)))   # no tokens reported: share of W_g
    assert router.outstanding_tokens(1) == 0
    # Token-blind: ten siblings are spread although they share a prefix.
    assert len(set(LeastTokensRouter(CFG, 4).route([sibling(i) for i in range(10)]))) == 4


def test_random_router_is_seeded():
    requests = [sibling(i) for i in range(50)]
    a = RandomRouter(CFG, 4, seed=3).route(requests)
    assert a == RandomRouter(CFG, 4, seed=3).route(requests)
    assert a != RandomRouter(CFG, 4, seed=4).route(requests)
    assert set(a) == {0, 1, 2, 3}


def test_make_router_and_bad_input():
    assert isinstance(make_router("prefix", CFG, 2, theta=5.0), PrefixAwareRouter)
    assert isinstance(make_router("round_robin", CFG, 2), RoundRobinRouter)
    assert isinstance(make_router("least_tokens", CFG, 2), LeastTokensRouter)
    assert isinstance(make_router("random", CFG, 2, seed=1), RandomRouter)
    with pytest.raises(ValueError, match="unknown router"):
        make_router("fastest", CFG, 2)
    for engines in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_engines"):
            make_router("prefix", CFG, engines, theta=1.0)
    for theta in (-1.0, float("nan"), "1"):
        with pytest.raises(ValueError, match="theta"):
            make_router("prefix", CFG, 2, theta=theta)
    with pytest.raises(ValueError, match="prefix_len"):
        route_op("r", [1, 2, 3], prefix_len=4)
    with pytest.raises(ValueError, match="is empty"):
        PrefillOp(key="r", token_ids=[], score_positions=(), score_token_ids=())
    router = make_router("prefix", CFG, 2, theta=1.0)
    with pytest.raises(ValueError, match="continuation"):       # it has no hashes of its own
        router.route([sibling(0).continuation(16, context_slots=None, store_slots=None)])
    with pytest.raises(TypeError):
        router.route([object()])
    assert router.loads() == [0, 0]                      # refused calls change nothing


def test_router_reads_the_op_record_and_calibration():
    op = PrefillOp(key=OpKey(3, 1), token_ids=PREFIX + [9], prefix_len=64,
                   score_positions=(64,), score_token_ids=((5, 6),))
    report = PrefixAwareRouter(CFG, 2, theta=math.inf).assign([op])
    assert report.assignments[0].key == (3, 1)
    # Head over the widest candidate set; the whole prompt is the prefix, 1 token of suffix.
    assert report.assignments[0].cost == CFG.request_flops(64, 1, 0, 1, 2) == op.flops(CFG)
    assert op.block_hashes() == tuple(block_hashes(PREFIX))
    full_vocab = dataclasses.replace(op, full_vocab=True)
    assert full_vocab.flops(CFG) == CFG.request_flops(64, 1, 0, 1, None)
    router = PrefixAwareRouter.from_calibration(CFG, 2, types.SimpleNamespace(theta=7.0))
    assert router.theta == 7.0


# ---------------------------------------------------------------------------- availability
@pytest.mark.parametrize("name", ["prefix", "round_robin", "least_tokens", "random"])
def test_unavailable_engines_are_never_chosen(name):
    """Engines marked unavailable get no request; with none marked, the decisions are the
    plain rule's (a fresh router routes the same workload the same way)."""
    requests = random_workload(3, 60)
    plain = make_router(name, CFG, 4, theta=2e6).route(requests)
    router = make_router(name, CFG, 4, theta=2e6)
    router.set_unavailable([])
    assert router.route(requests) == plain
    router = make_router(name, CFG, 4, theta=2e6)
    router.set_unavailable([1, 3])
    assert router.available() == [0, 2] and router.unavailable == {1, 3}
    engines = router.route(requests)
    assert set(engines) <= {0, 2} and len(set(engines)) == 2
    router.set_unavailable([])      # back: used again
    assert set(router.route(random_workload(4, 60))) >= {1, 3}


def test_at_least_one_engine_stays_available():
    router = make_router("prefix", CFG, 2, theta=math.inf)
    with pytest.raises(ValueError, match="at least one engine"):
        router.set_unavailable([0, 1])
    with pytest.raises(ValueError, match="out of range"):
        router.set_unavailable([2])


# ---------------------------------------------------------------------------- heterogeneous
def test_heterogeneous_engines_get_their_own_theta_and_rate():
    """A fast engine (rate 3) beside a slow one (rate 1): unshared requests of equal cost
    go to whichever drains first, so the fast one takes three times the work; each engine
    saturates at its own Θ."""
    distinct = [route_op(i, [1 + i % 100, 2 + i % 50] + list(range(3, 40)), prefix_len=0)
                for i in range(40)]
    router = PrefixAwareRouter(CFG, num_engines=2, theta=math.inf, rates=[3.0, 1.0])
    report = router.assign(distinct)
    assert report.engines.count(0) == 30 and report.engines.count(1) == 10
    assert router.drain_time(0) == pytest.approx(router.drain_time(1), rel=0.05)
    # Θ per engine: the small-Θ engine saturates after one request a round.
    cost = distinct[0].flops(CFG)
    router = PrefixAwareRouter(CFG, num_engines=2, theta=[10 * cost, cost / 2])
    assert router.theta == (10 * cost, cost / 2)
    report = router.assign(distinct[:11])
    assert report.num_rounds == 1 and report.engines.count(1) == 1
    # Siblings still follow their prefix to the engine that holds it, whatever the rate.
    router = PrefixAwareRouter(CFG, num_engines=2, theta=math.inf, rates=[1.0, 5.0])
    router.assign([route_op("x", list(range(60, 99)), prefix_len=0)])      # engine 0 busy
    assert router.assign([sibling(i) for i in range(6)]).engines == [1] * 6
    with pytest.raises(ValueError, match="3 values for 2 engines"):
        PrefixAwareRouter(CFG, num_engines=2, theta=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="rates must be finite numbers > 0"):
        PrefixAwareRouter(CFG, num_engines=2, theta=1.0, rates=[1.0, 0.0])


def test_from_calibrations_reads_each_engines_theta_and_rate():
    fast = types.SimpleNamespace(theta=4e9, rate=2e12)
    slow = types.SimpleNamespace(theta=1e9, rate=5e11)
    router = PrefixAwareRouter.from_calibration(CFG, 2, [fast, slow])
    assert router.thetas == [4e9, 1e9] and router.rates == [2e12, 5e11]
    unmeasured = types.SimpleNamespace(theta=1e9, rate=None)
    assert PrefixAwareRouter.from_calibration(CFG, 2, [fast, unmeasured]).rates == [1.0, 1.0]


# ---------------------------------------------------------------------------- PrefillOnly
def test_prefill_only_schedules_shortest_first_with_continuous_estimates():
    """Shortest prefill first: a long unique request waits behind short ones; once a
    sibling is scheduled, its siblings' estimates drop to their suffixes (the prefix is
    promised), so they go next, to the same engine."""
    long_one = route_op("long", list(range(1, 200)), prefix_len=0)
    short = [route_op(f"s{i}", [90 + i] + list(range(3, 12)), prefix_len=0) for i in range(2)]
    siblings = [sibling(i) for i in range(3)]
    router = make_router("prefill_only", CFG, 2)
    assert isinstance(router, ShortestPrefillFirstRouter)
    report = router.assign([long_one, *siblings, *short])
    order = report.schedule()
    assert order[:2] == [4, 5]                    # the two short ones first
    assert order[-1] == 0                         # the long one last
    assert order[2:5] == [1, 2, 3]                # one sibling, then its cheap siblings
    assert {report.assignments[i].engine for i in (1, 2, 3)} == {report.assignments[1].engine}
    assert [a.cached_tokens for a in report.assignments[1:4]] == [0, 64, 64]
    assert report.assignments[0].key == "long"    # assignments stay in request order
    assert make_router("prefix", CFG, 2).assign(siblings).schedule() == [0, 1, 2]

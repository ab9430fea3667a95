"""The prefill-op record (``moejax.ops.PrefillOp``): made by the request normalizer, read
by the router, the prefix cache, the packer and the engine; its block hashes and its FLOP
cost are computed once and are the ones every reader uses."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from backend_fixtures import CFG, make_params
from moejax import prefix_hash
from moejax.backends import make_backend
from moejax.config import ModelConfig
from moejax.ops import OpKey, PrefillOp
from moejax.packing import BucketPolicy
from serving import requests as requests_lib
from moejax.core.engine_pool import EnginePool
from moejax.core.scoring_engine import Engine
from moejax.kv import BlockAllocator
from moejax.core.prefix_plan import plan_run
from moejax.core.router import PrefixAwareRouter

PROMPT = list(range(2, 42))                        # 40 tokens: 2 whole blocks + 8


def siblings(prompt=PROMPT, count: int = 3, request_index: int = 0) -> list[PrefillOp]:
    """Binary siblings of one prompt, as the normalizer builds them for kind "multi"."""
    ops = []
    for k in range(count):
        tokens = prompt + [50 + k, 60 + k, 70 + k]
        ops.append(PrefillOp(key=OpKey(request_index, k), token_ids=tokens,
                             prefix_len=len(prompt), score_positions=(len(tokens) - 1,),
                             score_token_ids=((5, 6),)))
    return ops


class _Calls(list):
    """Recorded calls, and the unpatched function."""

    original = None


@pytest.fixture
def hash_calls(monkeypatch):
    """Counts calls of the block hash function (the one the record uses)."""
    calls = _Calls()
    original = prefix_hash.block_hashes

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(prefix_hash, "block_hashes", counting)
    calls.original = original
    return calls


# ----------------------------------------------------------------------------- the normalizer
class _Chars:
    """A tokenizer: one token per character, except the multi-selection answers."""

    def encode(self, text: str) -> list[int]:
        answers = {" yes": [1], " no": [2]}
        return answers.get(text) or [ord(c) % 97 + 3 for c in text]


def test_the_normalizer_makes_the_one_record():
    assert requests_lib.PrefillOp is PrefillOp          # serving re-exports it, no copy
    ops, errors, _ = requests_lib.normalize_requests(
        [{"prompt": "is it so?", "candidates": [" yes", " no"]},
         {"kind": "multi", "prompt": "pick:", "candidates": ["a", "b"]}],
        _Chars(), vocab_size=100, max_context=64)
    assert errors == {}
    assert [op.key for op in ops] == [OpKey(0, -1), OpKey(1, 0), OpKey(1, 1)]
    assert [(op.request_index, op.candidate_index) for op in ops] == [(0, -1), (1, 0), (1, 1)]
    assert ops[0].prefix_len == len("is it so?")
    assert ops[0].score_token_ids == ((1, 2),) and not ops[0].full_vocab
    assert all(op.prefix_len == len("pick:") for op in ops[1:])
    assert all(op.token_ids.dtype == np.int32 and not op.token_ids.flags.writeable for op in ops)
    with pytest.raises(TypeError, match="OpKey"):
        PrefillOp(key="free-form", token_ids=[1, 2], score_positions=(1,),
                  score_token_ids=((3,),)).request_index


def test_record_is_frozen_and_compares_by_value():
    op = siblings()[0]
    assert op == PrefillOp(key=(0, 0), token_ids=tuple(op.token_ids.tolist()),
                           prefix_len=40, score_positions=(42,), score_token_ids=((5, 6),))
    assert op != siblings()[1]
    with pytest.raises(AttributeError):
        op.prefix_len = 3
    with pytest.raises(ValueError):
        op.token_ids[0] = 9
    assert PrefillOp(key=1, token_ids=[4, 5], score_positions=(1,),
                     score_token_ids=((1,),)).prefix_len == 2          # default: the whole op
    with pytest.raises(ValueError, match="prefix_len"):
        PrefillOp(key=1, token_ids=[4, 5], score_positions=(1,), score_token_ids=((1,),),
                  prefix_len=3)


# ----------------------------------------------------------------------------- block hashes
def test_block_hashes_are_the_stable_chain_and_are_computed_once(hash_calls):
    op = siblings()[0]
    hashes = op.block_hashes()
    # The whole blocks up to the first score position (42): 2, the prefix's two.
    assert hashes == tuple(hash_calls.original(PROMPT[:32]))
    assert len(hashes) == 2 and len(hash_calls) == 1
    assert op.block_hashes() is hashes and len(hash_calls) == 1
    # Another block size is another chain, memoized on its own.
    assert len(op.block_hashes(8)) == 5 and len(hash_calls) == 2
    op.block_hashes(8)
    assert len(hash_calls) == 2


def test_block_hashes_match_the_hash_function():
    op = siblings()[0]
    assert op.block_hashes() == tuple(prefix_hash.block_hashes(PROMPT[:32]))
    # Multi-selection sibling: its prefix (the prompt) ends before its first score position,
    # so the blocks an engine may read reach past the prefix.
    long = PrefillOp(key=0, token_ids=list(range(2, 60)), prefix_len=16, score_positions=(57,),
                     score_token_ids=((1,),))
    assert long.block_hashes() == tuple(prefix_hash.block_hashes(list(range(2, 50))))
    with pytest.raises(ValueError, match="no block hashes"):
        op.continuation(16, context_slots=None, store_slots=None).block_hashes()


def test_router_and_prefix_cache_read_the_records_hashes(hash_calls):
    ops = siblings() + siblings(prompt=list(range(100, 148)), count=2, request_index=1)
    router = PrefixAwareRouter(CFG, num_engines=2, theta=math.inf)
    report = router.assign(ops)
    assert len(hash_calls) == len(ops)                  # the router hashed each op once
    # Siblings follow their prefix; the router promised exactly the records' prefix blocks.
    engine = report.engines[0]
    assert report.engines[:3] == [engine] * 3
    promised = {h for op, g in zip(ops, report.engines) if g == engine
                for h in op.block_hashes()[:op.prefix_len // 16]}
    assert router.pending_blocks(engine) == promised
    # That engine's cache plans with the same digests (the very same objects), no rehash.
    cache = BlockAllocator(64, record_events=True)        # as an engine's
    plan = plan_run([op for op, g in zip(ops, report.engines) if g == engine], cache)
    assert len(hash_calls) == len(ops)
    named = [digest for _, digest in plan.to_commit]
    first = ops[0].block_hashes()
    assert named[:2] == list(first) and all(a is b for a, b in zip(named, first))
    for block, digest in plan.to_commit:
        cache.name(block, digest)
    cache.release(plan.pinned)
    stored, _ = cache.drain_events()              # what the engine reports to the router
    assert stored == list(first) and set(stored) <= promised


# ----------------------------------------------------------------------------- FLOP cost
def _by_hand(cfg: ModelConfig, n: int, cached: int, heads: list[int | None]) -> int:
    """DESIGN.md: tokens cached+1..n each cost F_lin + F_att(i); F_head per score position."""
    body = sum(cfg.linear_flops_per_token + cfg.attention_flops(i)
               for i in range(cached + 1, n + 1))
    return body + sum(cfg.head_flops(columns) for columns in heads)


def test_cost_is_the_config_formula():
    joint = siblings()[0]                               # 43 tokens, 40 of prefix, 2 columns
    assert joint.flops(CFG) == _by_hand(CFG, 43, 0, [2]) == CFG.request_flops(
        prefix=40, suffix=3, cached=0, scoring_positions=1, num_candidates=2)
    # The router's ΔW with c cached tokens is seed Eq. (2) with that credit.
    assert joint.flops(CFG, cached=32) == _by_hand(CFG, 43, 32, [2]) == CFG.request_flops(
        prefix=40, suffix=3, cached=32, scoring_positions=1, num_candidates=2)
    # A teacher-forced candidate: the full-vocabulary head at each of its positions.
    sequence = PrefillOp(key=OpKey(2, 1), token_ids=PROMPT + [7, 8], prefix_len=40,
                         score_positions=(39, 40, 41), score_token_ids=((7,), (8,), (9,)),
                         full_vocab=True)
    assert sequence.flops(CFG) == _by_hand(CFG, 42, 0, [None] * 3) == CFG.request_flops(
        prefix=40, suffix=2, scoring_positions=3, num_candidates=None)
    assert sequence.head_flops(CFG) == 3 * CFG.head_flops(None)


def test_a_continuation_costs_what_the_router_credited():
    op = siblings()[0]
    tail = op.continuation(32, context_slots=np.arange(32, dtype=np.int32), store_slots=None)
    assert tail.position_offset == 32 and tail.key == op.key
    assert tail.score_positions == (10,) and tail.token_ids.tolist() == op.token_ids[32:].tolist()
    assert tail.flops(CFG) == op.flops(CFG, cached=32)
    assert tail.flops(CFG, cached=0) < op.flops(CFG)


def test_cost_is_computed_once_per_config_and_credit(monkeypatch):
    calls = []
    original = ModelConfig.request_flops

    def counting(self, *args, **kwargs):
        calls.append((args, kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(ModelConfig, "request_flops", counting)
    op = siblings()[0]
    first = op.flops(CFG)
    assert op.flops(CFG) == first and len(calls) == 1
    op.flops(CFG, cached=16)
    op.flops(CFG, cached=16)
    assert len(calls) == 2
    # The router charges the memoized cost: no further formula call for a known credit.
    PrefixAwareRouter(CFG, 2, theta=math.inf).assign([op])
    assert len(calls) == 2


# ----------------------------------------------------------------------------- end to end
def test_engines_behind_a_router_hash_each_op_once_and_score_as_one_engine(hash_calls):
    params = make_params()
    policy = BucketPolicy(max_batch_tokens=128, min_block=32)
    devices = jax.devices()[:2]
    engines = [Engine(CFG, make_backend("resident", CFG, params, device=d), policy=policy,
                      prefix_cache_blocks=32) for d in devices]
    pool = EnginePool(engines, PrefixAwareRouter(CFG, 2, theta=math.inf))
    ops = siblings() + siblings(prompt=list(range(100, 148)), count=2, request_index=1)
    outputs, timings = pool.run(ops)
    assert len(hash_calls) == len(ops)                  # router and caches: one hash per op
    assert set(outputs) == {op.key for op in ops} and set(timings) == set(range(len(ops)))
    plain = Engine(CFG, make_backend("resident", CFG, params, device=devices[0]), policy=policy)
    want = plain.run(ops)
    for op in ops:
        np.testing.assert_allclose(outputs[op.key].logits[0], want[op.key].logits[0], rtol=1e-5,
                                   atol=1e-5)

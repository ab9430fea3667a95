"""A backend step that raises part-way fails its own requests only, and the backend stays
usable: the next call scores exactly as before the failure.

Failures are injected in the middle of a step: the offload window's second copy of the
step (``jax.device_put``), a hybrid layer program, the async_ep program (2 of the 8 CPU
host devices), and a step on the offload prefix pool (which fails its run: the pool went
into it). Then the results of the Scorer's API: error results naming the request.
"""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

from backend_fixtures import CFG, make_params
from moejax.backends import make_backend
from moejax.backends.base import plan_steps
from moejax.ops import OpKey, PrefillOp
from moejax.packing import BucketPolicy, pack
from moejax.core.scoring_engine import Engine
from serving.requests import OpOutput, ScoreResult
from serving.results import combine_results

POLICY = BucketPolicy(max_batch_tokens=64, min_block=32)


class Injected(RuntimeError):
    """The failure a test injects."""


def failing_on_call(fn, n: int):
    """``fn``, except that its n-th call (1-based) raises :class:`Injected`."""
    calls = itertools.count(1)

    def wrapped(*args, **kwargs):
        if next(calls) == n:
            raise Injected(f"injected failure on call {n}")
        return fn(*args, **kwargs)

    return wrapped


def make_ops(count: int = 6, seed: int = 3, prompt: np.ndarray | None = None) -> list[PrefillOp]:
    """Ops of 40–60 tokens scoring their last position: one batch shape (one compile),
    one op per batch, so every step holds known ops."""
    rng = np.random.default_rng(seed)
    ops = []
    for key in range(count):
        n = int(rng.integers(40, 61))
        tokens = rng.integers(2, CFG.vocab_size, n).astype(np.int32)
        if prompt is not None:
            tokens[:len(prompt)] = prompt
        ops.append(PrefillOp(key=key, token_ids=tokens, score_positions=(n - 1,),
                             score_token_ids=((1, 2),),
                             prefix_len=None if prompt is None else len(prompt)))
    return ops


def step_keys(engine: Engine, ops: list[PrefillOp]) -> list[set]:
    """The op keys of each step the engine runs, in order."""
    hosts = pack(ops, engine.policy, engine.options)
    steps = plan_steps([h.shape_key for h in hosts], engine.backend.num_ranks)
    return [{op.key for i in step for op in hosts[i].sequences} for step in steps]


def assert_same(got: dict, want: dict, keys) -> None:
    """Bit for bit on CPU; on a GPU (test_streamed_pipeline runs these checks there) one
    program may sum in another order from run to run (atomic adds): f32 tolerance."""
    for key in keys:
        g, w = got[key], want[key]
        for a, b in zip(g.logits, w.logits):
            if jax.default_backend() == "cpu":
                np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        assert (g.logsumexp is None) == (w.logsumexp is None)


def check_recovery(engine: Engine, ops: list[PrefillOp], inject, monkeypatch) -> None:
    """A clean run (what a fresh engine returns), a run with ``inject(monkeypatch)`` armed:
    exactly one step's ops fail and the others are unchanged, then a clean run again."""
    want = engine.run(ops)
    assert not any(isinstance(v, Exception) for v in want.values())
    with monkeypatch.context() as patch:
        inject(patch)
        got = engine.run(ops)
    failed = {key for key, value in got.items() if isinstance(value, Exception)}
    assert failed in step_keys(engine, ops)[1:-1], f"failed ops {failed} are not a middle step"
    assert all(isinstance(got[key], Injected) for key in failed)
    assert_same(got, want, [op.key for op in ops if op.key not in failed])
    again = engine.run(ops)
    assert_same(again, want, [op.key for op in ops])


@pytest.fixture(scope="module")
def params():
    return make_params()


def test_offload_recovers_from_a_failed_copy_in_its_window(params, monkeypatch):
    backend = make_backend("offload", CFG, params, window=2)
    engine = Engine(CFG, backend, policy=POLICY)
    # A step puts its batch, then copies one layer in after each of its L layers: call
    # L + 3 is the second step's copy after its layer 1, with layer 2 still to run.
    n = CFG.num_layers + 3
    check_recovery(engine, make_ops(), lambda patch: patch.setattr(
        jax, "device_put", failing_on_call(jax.device_put, n)), monkeypatch)
    # Nothing left behind: only the window's W layers of experts are on the device.
    assert backend.live_window_bytes() == backend.memory_report().detail["window"]


def failing_program(backend, kind: str, n: int):
    """The backend's ``_program``, whose ``kind`` program raises on its n-th call."""
    real = backend._program
    calls = itertools.count(1)

    def program(name, opts):
        fn = real(name, opts)
        if name != kind:
            return fn

        def maybe_failing(*args):
            if next(calls) == n:
                raise Injected(f"injected failure in {kind} program call {n}")
            return fn(*args)

        return maybe_failing

    return program


def test_hybrid_recovers_from_a_failed_layer_program(params, monkeypatch):
    backend = make_backend("hybrid", CFG, params, devices=2, window=2)
    engine = Engine(CFG, backend, policy=POLICY)
    # L-1 layer programs a step: the second step's layer 1 (the gathered layer 1 and the
    # shards of layer 2 are held then).
    n = CFG.num_layers - 1 + 2
    check_recovery(engine, make_ops(), lambda patch: patch.setattr(
        backend, "_program", failing_program(backend, "layer", n)), monkeypatch)
    assert backend.live_window_bytes() == backend.memory_report().detail["window"]


def test_async_ep_recovers_from_a_failed_step(params, monkeypatch):
    backend = make_backend("async_ep", CFG, params, devices=2)
    engine = Engine(CFG, backend, policy=POLICY)
    real = backend.forward_fn

    def inject(patch):
        calls = itertools.count(1)

        def forward_fn(opts):
            fn = real(opts)

            def maybe_failing(*args):
                if next(calls) == 2:
                    raise Injected("injected failure in the async_ep program")
                return fn(*args)

            return maybe_failing

        patch.setattr(backend, "forward_fn", forward_fn)

    check_recovery(engine, make_ops(), inject, monkeypatch)


def test_a_failed_prefix_pool_step_fails_its_run_and_the_cache_starts_afresh(params,
                                                                             monkeypatch):
    backend = make_backend("offload", CFG, params)
    engine = Engine(CFG, backend, policy=POLICY, prefix_cache_blocks=16)
    prompt = np.random.default_rng(5).integers(2, CFG.vocab_size, 34).astype(np.int32)
    ops = make_ops(prompt=prompt)
    want = engine.run(ops)                             # stores the prompt's blocks
    assert engine.prefix_cache.num_named > 0
    with monkeypatch.context() as patch:
        patch.setattr(backend, "_program", failing_program(backend, "layer", 2))
        with pytest.raises(Injected):
            engine.run(ops)
    # The pool went into the failed step: a fresh one, and no cached block points into it.
    assert engine.prefix_cache.num_named == 0
    assert_same(engine.run(ops), want, [op.key for op in ops])
    assert engine.prefix_cache.num_named > 0


def test_combine_results_turns_failed_ops_into_errors_naming_the_request():
    requests = [{"id": "ok", "prompt": "a", "candidate_token_ids": [[1], [2]]},
                {"id": "broken", "prompt": "b", "candidate_token_ids": [[1], [2]]},
                {"prompt": "c", "candidate_token_ids": [[1], [2]]}]

    def op(index):
        return PrefillOp(key=OpKey(index, -1), token_ids=np.array([3, 4], np.int32),
                         score_positions=(1,), score_token_ids=((1, 2),))

    ops = [op(0), op(1), op(2)]
    good = OpOutput(logits=[np.array([0.0, -1.0])], logsumexp=None)
    failure = Injected("device lost\nlong trace")
    results = combine_results(requests, ops, [good, failure, failure], {}, {0: 2, 1: 2, 2: 2})
    assert [r.id for r in results] == ["ok", "broken", None]
    assert results[0].error is None and results[0].label == 0
    assert results[1] == ScoreResult(id="broken", error="request 'broken': scoring failed "
                                                        "(Injected: device lost)")
    assert results[2].error == "request #2: scoring failed (Injected: device lost)"


def test_scorer_gives_the_failed_step_s_requests_error_results_then_recovers(monkeypatch):
    from serving import Scorer

    requests = [{"id": f"r{i}", "prompt": "Is this review positive? " * (i + 1) + "Answer:",
                 "candidates": [" yes", " no"]} for i in range(4)]
    # Plain steps (no prompt sharing): a failed step on the shared prefix pool fails its
    # whole run instead (tested below).
    scorer = Scorer("demo", dtype="float32", max_batch_tokens=64, backend="offload",
                    calibrate=False, share_prompts=False)
    backend = scorer.engine.backend
    want = scorer.score(requests)
    assert all(r.error is None for r in want)
    with monkeypatch.context() as patch:     # the second step's layer-1 program raises
        patch.setattr(backend, "_program",
                      failing_program(backend, "layer", backend.cfg.num_layers - 1 + 2))
        got = scorer.score(requests)
    failed = [r for r in got if r.error is not None]
    assert 0 < len(failed) < len(requests)
    for result in failed:
        assert result.error == (f"request {result.id!r}: scoring failed (Injected: injected "
                                f"failure in layer program call {backend.cfg.num_layers + 1})")
    for result, reference in zip(got, want):
        if result.error is None:
            assert result.logprobs == reference.logprobs
    assert [r.logprobs for r in scorer.score(requests)] == [r.logprobs for r in want]

"""The ELDR simulator replays a real prefill→decode pipeline run (``moejax.eldr.replay``):
a pool of 3 resident decoders (demo model, float32) serves 8 requests of different
prompt and decode lengths arriving together, and the simulator, fed what the run's
hand-off produced (each request's hand-off step, decode length and routing inputs) and
a fresh policy object of the run's kind, predicts every decoder's batch sequence, every
route and the loads each routing saw, exactly — under round robin, join-shortest-queue
and ELDR's locality band, with pipelined decoders (the default) and unpipelined ones.
Each replay is also shown to fail where it should (a wrong batch limit, the hand-off
moments dropped, the other step semantics), so the exact match is not vacuous.

The simulator's release modes are first checked on small cases worked by hand.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from moejax import checkpoint
from moejax.core.decoders import DecoderPool
from moejax.eldr.fitfile import EldrFit
from moejax.eldr.policies import EldrPolicy, JSQPolicy, Policy, RoundRobinPolicy
from moejax.eldr.replay import (UNIT_STEP, HandOffRecorder, PipelineRun, mismatches,
                                observe, replay)
from moejax.eldr.simulator import RELEASE_MODES, SimRequest, simulate
from moejax.sequences import SequenceSpec
from serving import Generator
from serving.api import resolve_model_dir
from serving.pipeline_config import PipelineConfig

K = 3
LENGTHS = (5, 30, 7, 3, 12, 6, 4, 9)
NEW_TOKENS = (6, 9, 7, 3, 10, 2, 8, 5)
# Rows of 8 prompt tokens, 4 a step: several short prompts are handed off at one step, so
# decoders fill their 2 rows and routed requests wait for one.
SMALL = {"dtype": "float32", "max_prefill_tokens": 32, "prefill_row_tokens": 8,
         "max_batch_size": 2}


def _specs(seed: int = 11) -> list[SequenceSpec]:
    rng = np.random.default_rng(seed)
    return [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 1000, n)),
                         max_new_tokens=m, domain="ab"[i % 2])
            for i, (n, m) in enumerate(zip(LENGTHS, NEW_TOKENS))]


# ------------------------------------------------------------------------ the model by hand
def _requests(decode_steps: list[int], layers: int = 1, experts: int = 2) -> list[SimRequest]:
    return [SimRequest(counts=np.zeros((layers, experts), np.int64),
                       decode_experts=np.zeros((layers, d, 1), np.int64))
            for d in decode_steps]


def _batches(result) -> list[tuple[int, int, list[int]]]:
    return [(int(result.step_decoder[s]), int(result.step_start[s]),
             sorted(result.step_rows(s).tolist())) for s in range(len(result.step_decoder))]


def test_release_modes_by_hand():
    """One decoder of one row; A (2 decode steps) and B (1) at t=0, C (1) at t=3.
    at_boundary and before_arrivals: A runs at 0, 1; B at 2; C at 3. step_late: A runs
    at 0, 1 and holds its row at 2 (a step of batch 0), so B runs at 3 and holds at 4, C
    runs at 5 and holds at 6."""
    requests = _requests([2, 1, 1])
    arrivals = [0.0, 0.0, 3.0]
    for release in ("at_boundary", "before_arrivals"):
        result = simulate(requests, arrivals, JSQPolicy(1), num_decoders=1, cost=UNIT_STEP,
                          max_batch_size=1, release=release)
        assert _batches(result) == [(0, 0, [0]), (0, 1, [0]), (0, 2, [1]), (0, 3, [2])]
        np.testing.assert_array_equal(result.finish, [2.0, 3.0, 4.0])
    late = simulate(requests, arrivals, JSQPolicy(1), num_decoders=1, cost=UNIT_STEP,
                    max_batch_size=1, release="step_late")
    assert _batches(late) == [(0, 0, [0]), (0, 1, [0]), (0, 2, []), (0, 3, [1]), (0, 4, []),
                              (0, 5, [2]), (0, 6, [])]
    # finish: the end of the last decode step, not of the held one.
    np.testing.assert_array_equal(late.finish, [2.0, 4.0, 6.0])
    np.testing.assert_array_equal(late.first_token, [1.0, 4.0, 6.0])
    assert late.step_batch.tolist() == [1, 1, 0, 1, 0, 1, 0]


def test_release_modes_change_the_loads_routing_sees():
    """Two decoders. A (1 decode step) goes to decoder 0 at t=0 (JSQ, ties lowest). At t=1
    A's step has ended: B arrives. at_boundary counts A (B -> decoder 1);
    before_arrivals has let it go (B -> decoder 0); step_late holds it one more step,
    (B -> decoder 1), and C at t=2 finds it gone (C -> decoder 0)."""
    requests = _requests([1, 1, 1])
    arrivals = [0.0, 1.0, 2.0]
    want = {"at_boundary": [0, 1, 0], "before_arrivals": [0, 0, 0], "step_late": [0, 1, 0]}
    seen = {}
    for release in RELEASE_MODES:
        recorder = HandOffRecorder(JSQPolicy(2))
        result = simulate(requests, arrivals, recorder, num_decoders=2, cost=UNIT_STEP,
                          max_batch_size=2, release=release)
        assert result.decoder.tolist() == want[release], release
        seen[release] = [loads for _, loads, _ in recorder.seen]
    assert seen["at_boundary"] == [(0, 0), (1, 0), (0, 1)]
    assert seen["before_arrivals"] == [(0, 0), (0, 0), (0, 0)]
    assert seen["step_late"] == [(0, 0), (1, 0), (0, 1)]


def test_release_mode_is_checked():
    with pytest.raises(ValueError, match="release must be one of"):
        simulate(_requests([1]), [0.0], JSQPolicy(1), num_decoders=1, cost=UNIT_STEP,
                 max_batch_size=1, release="late")


# ----------------------------------------------------------------------------- real runs
@pytest.fixture(scope="module")
def eldr_fit() -> EldrFit:
    cfg, _, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    rng = np.random.default_rng(5)
    layers = tuple(range(min(2, cfg.num_layers)))
    return EldrFit(model="demo", fingerprint="test", num_layers=cfg.num_layers,
                   num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                   idf=rng.uniform(0.1, 2.0, (cfg.num_layers, cfg.num_experts)),
                   layers=layers,
                   centroids=rng.uniform(0, 1, (K, len(layers) * cfg.num_experts)),
                   calibration_requests=10, rho=0.5)


def _policies(fit: EldrFit) -> dict[str, Callable[[], Policy]]:
    return {"round_robin": lambda: RoundRobinPolicy(K), "jsq": lambda: JSQPolicy(K),
            "eldr": lambda: EldrPolicy(fit, tau=0.05)}


def _generator(fit: EldrFit, **options) -> Generator:
    """3 resident decoders behind a counts-reading policy (so the prefill keeps the
    signature cache, and a pool over the same schedulers can run any policy)."""
    config = PipelineConfig.from_dict({"decoders": [{"placement": "resident", "count": K}]})
    config = dataclasses.replace(config, routing=HandOffRecorder(EldrPolicy(fit)))
    return Generator("demo", pipeline=config, **SMALL, **options)


@pytest.fixture(scope="module")
def pipelined(eldr_fit) -> Generator:
    return _generator(eldr_fit)


def _run(gen: Generator, policy: Policy, seed: int) -> PipelineRun:
    """A real run of ``policy`` on the generator's schedulers (its own pool)."""
    base = gen.scheduler
    pool = DecoderPool(base.prefill, base.decoders, HandOffRecorder(policy))
    run = observe(pool, _specs(seed))
    assert pool.occupancy() == 0 and not pool.busy
    assert [r.seq_id for r in pool.routes][-len(run.handoffs):] == [
        h.seq_id for h in run.handoffs]
    return run


def _waits(run: PipelineRun) -> list[int]:
    """Per hand-off, the pool steps from its routing to its first decode step."""
    first = {}
    for batches in run.batches:
        for step, ids in batches:
            for i in ids:
                first.setdefault(i, step)
    return [first[h.seq_id] - h.step for h in run.handoffs]


def _check_exact(run: PipelineRun, make: Callable[[], Policy]) -> None:
    predicted = replay(run, make())
    assert mismatches(run, predicted) == []
    assert predicted.batches == run.batches
    assert predicted.routes == {h.seq_id: h.decoder for h in run.handoffs}
    # Decode rows: every request ran its decode steps, each in one batch.
    rows = [i for batches in run.batches for _, ids in batches for i in ids]
    want = sorted(i for h in run.handoffs for i in [h.seq_id] * h.decode_steps)
    assert sorted(rows) == want


@pytest.mark.parametrize("kind", ["round_robin", "jsq", "eldr"])
def test_replay_predicts_a_pipelined_run_exactly(pipelined, eldr_fit, kind):
    make = _policies(eldr_fit)[kind]
    run = _run(pipelined, make(), seed=11 + len(kind))
    assert run.pipelined and run.max_batch_size == 2 and run.num_decoders == K
    assert len(run.handoffs) == len(LENGTHS)       # every request decodes (max_new >= 2)
    assert [h.decode_steps for h in sorted(run.handoffs, key=lambda h: h.seq_id)] == [
        m - 1 for m in NEW_TOKENS]
    assert len({h.step for h in run.handoffs}) > 1       # hand-offs spread over steps
    if kind == "eldr":
        assert all(h.counts is not None and h.counts.sum() > 0 for h in run.handoffs)
        # Locality routes: not what join-shortest-queue would have done.
        assert any(h.decoder != replay(run, JSQPolicy(K)).routes[h.seq_id]
                   for h in run.handoffs)
    # The run exercises the batch limit: full batches, and requests waiting for a row.
    assert max(len(ids) for batches in run.batches for _, ids in batches) == 2
    assert max(_waits(run)) > 0, _waits(run)
    _check_exact(run, make)
    # Not vacuous: the same hand-offs on decoders of one row, all at step 0 (the prefill
    # ignored), or as if the decoders read their tokens in the step (unpipelined),
    # mismatch.
    assert mismatches(run, replay(run, make(), max_batch_size=1))
    together = tuple(dataclasses.replace(h, step=0) for h in run.handoffs)
    assert mismatches(run, replay(dataclasses.replace(run, handoffs=together), make()))
    assert mismatches(run, replay(dataclasses.replace(run, pipelined=False), make()))


def test_replay_predicts_an_unpipelined_run_exactly(eldr_fit):
    gen = _generator(eldr_fit, pipelined=False)
    assert not any(d.pipelined for d in gen.scheduler.decoders)
    make = _policies(eldr_fit)["jsq"]
    run = _run(gen, make(), seed=3)
    assert not run.pipelined
    assert max(_waits(run)) > 0, _waits(run)
    _check_exact(run, make)
    assert mismatches(run, replay(dataclasses.replace(run, pipelined=True), make()))
    assert mismatches(run, replay(run, make(), max_batch_size=3))


def test_observe_refuses_what_the_replay_does_not_model(pipelined):
    """A sequence that a stop token ends after its hand-off is refused by name."""
    base = pipelined.scheduler
    pool = DecoderPool(base.prefill, base.decoders, JSQPolicy(K))
    spec = _specs()[0]
    seq = pool.submit(spec)
    while pool.busy:
        pool.step()
    tokens = seq.output.token_ids
    assert len(tokens) == spec.max_new_tokens
    # Its third token stops it (its first, sampled at prefill, does not).
    stopping = dataclasses.replace(spec, stop_token_ids=frozenset([tokens[2]]) - {tokens[0]})
    assert stopping.stop_token_ids
    with pytest.raises(ValueError, match="not at its length"):
        observe(pool, [stopping])
    assert not pool.busy
    with pytest.raises(ValueError, match="at least one sequence"):
        observe(pool, [])

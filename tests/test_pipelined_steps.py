"""Pipelined decode steps (issue 43, part 3): the scheduler plans and dispatches step n+1
before it reads step n's tokens, and the tokens reach step n+1 on the device.

Held to the unpipelined loop (``pipelined=False``: plan, run, read, in turn) on the demo
model: the same greedy tokens and finish reasons with stop tokens, max-length stops,
forced preemption and cancellation mid-stream; events one call later; a sequence
that stopped runs at most one more row.
"""

from __future__ import annotations

import numpy as np
import pytest

from moejax import checkpoint
from moejax.core.continuous import Scheduler, SchedulerOptions
from moejax.decode.factory import make_runner
from moejax.decode.programs import StepOptions
from moejax.sequences import SequenceSpec
from serving.api import resolve_model_dir

LENGTHS_NEW = [(5, 9), (40, 12), (17, 4), (70, 9), (33, 1), (3, 14)]


@pytest.fixture(scope="module")
def demo():
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    runner = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    rng = np.random.default_rng(7)
    specs = [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 1024, n)),
                          max_new_tokens=m) for n, m in LENGTHS_NEW]
    return runner, specs


def _run(runner, specs, pipelined, blocks=64, batch=4, cancel_after=None):
    """Run ``specs`` to the end -> (outputs, steps, rows run per sequence). With
    ``cancel_after`` {index: k}: cancel sequence ``index`` once k of its tokens arrived."""
    scheduler = Scheduler(runner, blocks, SchedulerOptions(
        max_batch_size=batch, max_prefill_tokens=32, prefill_row_tokens=16,
        pipelined=pipelined))
    seqs = [scheduler.submit(spec) for spec in specs]
    received = {i: [] for i in range(len(seqs))}
    index = {seq.seq_id: i for i, seq in enumerate(seqs)}
    steps = 0
    while scheduler.busy:
        for event in scheduler.step():
            i = index[event.sequence.seq_id]
            received[i] += event.token_ids
            if cancel_after and len(received[i]) >= cancel_after.get(i, 1 << 30):
                scheduler.cancel(seqs[i])
        steps += 1
        assert steps < 500
    assert scheduler.occupancy() == 0
    for i, seq in enumerate(seqs):       # the events carried every token, in order
        assert received[i] == seq.output.token_ids
    return [seq.output for seq in seqs], steps, scheduler


def _tokens(outputs):
    return [(o.token_ids, o.finish_reason) for o in outputs]


def test_pipelined_tokens_equal_unpipelined_with_stops_and_lengths(demo):
    runner, specs = demo
    plain, plain_steps, _ = _run(runner, specs, pipelined=False)
    # Stop tokens each sequence meets mid-stream (its third greedy token).
    stopping = [SequenceSpec(prompt=s.prompt, max_new_tokens=s.max_new_tokens,
                             stop_token_ids=frozenset({out.token_ids[min(2, len(out.token_ids) - 1)]}))
                for s, out in zip(specs, plain)]
    for batch in (specs, stopping):
        sync, _, _ = _run(runner, batch, pipelined=False)
        piped, piped_steps, scheduler = _run(runner, batch, pipelined=True)
        assert _tokens(piped) == _tokens(sync)
        assert {o.finish_reason for o in sync} >= ({"stop"} if batch is stopping
                                                   else {"length"})
        assert scheduler.stats["steps"] <= piped_steps
    assert any(o.finish_reason == "stop" and len(o.token_ids) < s.max_new_tokens
               for o, s in zip(_run(runner, stopping, pipelined=True)[0], stopping))


def test_pipelined_tokens_equal_unpipelined_under_preemption(demo):
    runner, specs = demo
    # 8 blocks of 16 tokens for up to 4 running sequences of up to 79 tokens: the pool
    # runs out and the newest sequences are preempted and recomputed.
    sync, _, sync_scheduler = _run(runner, specs, pipelined=False, blocks=8)
    piped, _, piped_scheduler = _run(runner, specs, pipelined=True, blocks=8)
    assert sync_scheduler.stats["preemptions"] > 0
    assert piped_scheduler.stats["preemptions"] > 0
    assert _tokens(piped) == _tokens(sync)
    alone, _, _ = _run(runner, specs, pipelined=False, blocks=64)
    assert _tokens(piped) == _tokens(alone)


def test_cancellation_mid_stream_keeps_what_arrived(demo):
    runner, specs = demo
    cancel = {0: 3, 5: 6}
    sync, _, _ = _run(runner, specs, pipelined=False, cancel_after=cancel)
    piped, _, _ = _run(runner, specs, pipelined=True, cancel_after=cancel)
    assert _tokens(piped) == _tokens(sync)
    for i, k in cancel.items():
        assert piped[i].finish_reason == "cancelled" and len(piped[i].token_ids) == k
    full, _, _ = _run(runner, specs, pipelined=False)
    for i, out in enumerate(piped):
        assert out.token_ids == full[i].token_ids[:len(out.token_ids)]


def test_events_come_one_call_later_and_a_stopped_sequence_runs_one_more_row(demo):
    runner, specs = demo
    spec = SequenceSpec(prompt=specs[0].prompt, max_new_tokens=6)
    counts = {}
    for pipelined in (False, True):
        scheduler = Scheduler(runner, 64, SchedulerOptions(max_batch_size=2,
                                                           pipelined=pipelined))
        seq = scheduler.submit(spec)
        first = scheduler.step()
        assert (first == []) is pipelined       # pipelined: the first token is in flight
        assert seq.in_flight == int(pipelined)
        scheduler.run_until_idle()
        counts[pipelined] = scheduler.stats["steps"]
        assert seq.output.finish_reason == "length" and len(seq.output.token_ids) == 6
    # A max-length stop is known when planning: no extra row, the same steps (+ the one
    # call that reads the last step).
    assert counts[True] == counts[False]
    # A stop token is read one step late: the sequence ran one row more, dropped.
    stop = SequenceSpec(prompt=spec.prompt, max_new_tokens=6,
                        stop_token_ids=frozenset({seq.output.token_ids[1]}))
    scheduler = Scheduler(runner, 64, SchedulerOptions(max_batch_size=2))
    stopped = scheduler.submit(stop)
    scheduler.run_until_idle()
    assert stopped.output.token_ids == seq.output.token_ids[:2]
    assert stopped.output.finish_reason == "stop"
    assert scheduler.stats["decode_steps"] == 2     # rows for tokens 2 and 3; 3 dropped

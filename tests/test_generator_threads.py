"""A Generator is safe to call from several threads (issue 37, defect 6).

Before the fix, 6 threads x 5 calls on one ``Generator("demo")`` failed 25-27 of 30 calls
with internal errors (a donated KV pool read by another call, the scheduler's tables
changed under it). Each call must now return exactly what the same call returns alone.
"""

from __future__ import annotations

import threading

import pytest

from serving import Generator

THREADS = 4
CALLS_PER_THREAD = 2
# Sums the demo model was trained on (moejax.demo.corpus): greedy tokens are deterministic.
PROMPTS = ["12 + 9 =", "3 + 4 =", "7 + 8 =", "2 + 3 =", "Is 3 + 4 = 7? Answer:"]
MAX_NEW_TOKENS = 4


def _requests(thread: int, call: int) -> list[dict]:
    """One request per call (one batch shape: a single compile), a different prompt per
    thread and call, so that concurrent calls would share the scheduler and KV pool."""
    prompt = PROMPTS[(thread + call) % len(PROMPTS)]
    return [{"id": f"t{thread}c{call}", "prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS}]


@pytest.fixture(scope="module")
def generator(demo_generator) -> Generator:
    return demo_generator         # the session's (conftest.py)


def _alone(generator: Generator) -> dict[str, tuple[list[int], str]]:
    """Each prompt's greedy tokens and text, generated one request per call."""
    expected = {}
    for prompt in PROMPTS:
        [result] = generator.generate([{"prompt": prompt, "max_new_tokens": MAX_NEW_TOKENS}])
        assert result.error is None, result.error
        expected[prompt] = (result.token_ids, result.text)
    return expected


def test_generate_from_several_threads_matches_single_threaded(generator):
    expected = _alone(generator)
    outcomes: dict[tuple[int, int], object] = {}

    def work(thread: int) -> None:
        for call in range(CALLS_PER_THREAD):
            requests = _requests(thread, call)
            try:
                outcomes[thread, call] = (requests, generator.generate(requests))
            except Exception as exc:   # noqa: BLE001  (recorded: the test names it below)
                outcomes[thread, call] = exc

    threads = [threading.Thread(target=work, args=(t,), daemon=True) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a generate call hung"
    failures = {key: repr(v) for key, v in outcomes.items() if isinstance(v, Exception)}
    assert not failures, failures
    assert len(outcomes) == THREADS * CALLS_PER_THREAD
    for (requests, results) in outcomes.values():
        assert [r.id for r in results] == [q["id"] for q in requests]
        for request, result in zip(requests, results):
            assert result.error is None, result.error
            assert (result.token_ids, result.text) == expected[request["prompt"]], request


def test_a_call_that_would_deadlock_is_refused(generator):
    """This thread's own open stream, or an open loop, owns the Generator: a call then
    raises a RuntimeError saying what to do instead of waiting forever."""
    request = [{"prompt": PROMPTS[0], "max_new_tokens": 2}]
    events = generator.stream(request)
    next(events)
    with pytest.raises(RuntimeError, match="earlier stream"):
        generator.generate(request)
    events.close()
    loop = generator.start_loop()
    try:
        with pytest.raises(RuntimeError, match="generation loop"):
            generator.generate(request)
        with pytest.raises(RuntimeError, match="generation loop"):
            generator.start_loop()
    finally:
        loop.close()
    [result] = generator.generate(request)       # handed back once the loop is closed
    assert result.error is None and len(result.token_ids) == 2

"""Compile counts: XLA compiles one program per shape bucket, never one per call or layer.

Counted from JAX's own compile log (``jax.log_compiles``), not from moejax's bookkeeping:
a path that rebuilt its jitted function per call, or passed a traced value where a
static one belongs, would compile again on every call and fail here.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from moejax.static import decode as static_decode
from serving import Generator, Scorer

REQUESTS = [
    {"id": "a", "prompt": "Review: lovely food.\nSentiment:", "candidates": [" positive", " negative"]},
    {"id": "b", "kind": "choice", "prompt": "Which is a colour?", "candidates": ["red", "seven"]},
    {"id": "c", "kind": "multi", "prompt": "Article: the team won.", "candidates": ["sports", "music"]},
    {"id": "d", "prompt": "A longer prompt " * 30 + "Answer:", "candidates": [" yes", " no"],
     "normalize": "vocab"},
]


class CompileLog(logging.Handler):
    """Collects the names of the programs XLA compiles while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.programs: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Compiling (\S+) with global shapes", record.getMessage())
        if found:
            self.programs.append(found.group(1))


@pytest.fixture
def compile_log():
    import jax

    handler = CompileLog()
    logger = logging.getLogger("jax")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with jax.log_compiles():
            yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _model_programs(log: CompileLog) -> list[str]:
    """The compiled programs that run the model (eager one-op programs left out)."""
    return [p for p in log.programs if not re.fullmatch(
        r"jit\((convert_element_type|broadcast_in_dim|concatenate|reshape|squeeze|"
        r"dynamic_slice|gather|_where|clip|iota|_multi_slice|_unstack)\)", p)]


@pytest.mark.parametrize("options", [
    {},
    {"prefix_cache_blocks": 32},
    {"backend": "offload", "backend_options": {"window": 2}},
], ids=["resident", "prefix_cache", "offload"])
def test_scoring_compiles_once_per_shape(options, compile_log):
    scorer = Scorer("demo", dtype="float32", max_batch_tokens=512, theta=1e12, **options)
    first = scorer.score(REQUESTS)
    assert all(r.error is None for r in first)
    compiled_first = len(_model_programs(compile_log))
    assert compiled_first >= 1
    # At most one program per shape the engine ran (layer programs count once, not per layer).
    assert compiled_first <= 3 * max(len(scorer.engine.stats.shapes), 1) + 2
    # With a prefix cache the second call reads the blocks the first stored: a new
    # context width, so possibly new shapes; from then on the calls are alike.
    scorer.score(REQUESTS)
    compiled_second = len(_model_programs(compile_log))
    third = scorer.score(REQUESTS)
    assert _model_programs(compile_log)[compiled_second:] == []
    for a, b in zip(first, third):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


def test_warm_up_compiles_the_bucket_shapes_before_the_first_request(compile_log):
    """Scorer.warm_up (moejax serve --warmup): afterwards a request of any token bucket
    up to the batch size, with single-token candidates, compiles nothing, and its result
    equals a cold Scorer's."""
    scorer = Scorer("demo", dtype="float32", max_batch_tokens=128, calibrate=False)
    compiled, seconds = scorer.warm_up()
    # (The engine counts the shapes it met first; JAX compiles fewer when an earlier test
    # of this process compiled one already.)
    assert compiled >= 3 and len(_model_programs(compile_log)) <= compiled and seconds > 0
    after_warm_up = len(_model_programs(compile_log))
    requests = [{"prompt_token_ids": list(range(5, 5 + n)), "candidate_token_ids": [[9], [11]],
                 "normalize": normalize} for n in (20, 50, 100) for normalize in
                ("candidates", "vocab")]
    warm = [scorer.score([r])[0] for r in requests]      # each alone: its own batch
    assert _model_programs(compile_log)[after_warm_up:] == []
    assert scorer.engine.stats.prefix_tokens_cached == 0
    cold = Scorer("demo", dtype="float32", max_batch_tokens=128, calibrate=False)
    for a, b in zip(warm, (cold.score([r])[0] for r in requests)):
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-6, atol=1e-6)


def test_generation_compiles_one_prefill_and_one_decode_step_per_bucket(compile_log):
    gen = Generator("demo", dtype="float32", max_batch_size=2)
    before = static_decode.compiled_program_counts()
    requests = [{"id": "x", "prompt": "2+3=", "max_new_tokens": 5},
                {"id": "y", "prompt": "def f(x):", "max_new_tokens": 7}]
    gen.generate(requests)
    after_first = static_decode.compiled_program_counts()
    logged = [p for p in compile_log.programs if "prefill_program" in p or "decode_step" in p]
    gen.generate(requests)
    assert static_decode.compiled_program_counts() == after_first      # nothing new the second time
    assert [p for p in compile_log.programs
            if "prefill_program" in p or "decode_step" in p] == logged
    new = {k: after_first[k] - before[k] for k in after_first}
    # One batch of two rows: at most one prefill and one decode-step program (zero if an
    # earlier test compiled this bucket already), and the log agrees with the counter.
    assert all(0 <= n <= 1 for n in new.values())
    assert len(logged) == sum(new.values())

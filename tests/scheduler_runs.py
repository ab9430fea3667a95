"""One continuous-batching run of a decode runner, the tokens it gives: what the tests
hold other runtimes and placements to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moejax.core.continuous import Scheduler, SchedulerOptions
from moejax.sequences import SequenceSpec


def scheduler_tokens(runner: Any, specs: Sequence[SequenceSpec], batch: int = 4,
                     step: str = "fused") -> list[list[int]]:
    """Each of ``specs``' generated tokens on ``runner`` (``batch`` rows, prompts
    prefilled 32 tokens at a time, a pool of 64 blocks)."""
    options = SchedulerOptions(max_batch_size=batch, max_prefill_tokens=32, step=step)
    scheduler = Scheduler(runner, 64, options)
    seqs = [scheduler.submit(s) for s in specs]
    scheduler.run_until_idle()
    return [list(s.output.token_ids) for s in seqs]

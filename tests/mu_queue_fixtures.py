"""The demo requests and resident tokens the μ-queue runtime tests hold the runtime to:
random prompts of the demo vocabulary, greedy float32 tokens from the resident decoder
(continuous batching, 4 rows, prompts prefilled 32 tokens at a time)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from moejax import checkpoint
from moejax.decode.factory import make_runner
from moejax.decode.programs import StepOptions
from moejax.sequences import SequenceSpec
from serving.api import resolve_model_dir

from scheduler_runs import scheduler_tokens


def demo_model() -> tuple[Any, Any]:
    """The demo model's config and float32 params."""
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    return cfg, params


def random_specs(lengths_new: Sequence[tuple[int, int]], seed: int) -> list[SequenceSpec]:
    """One request per (prompt length, new tokens), prompt ids drawn from ``seed``."""
    rng = np.random.default_rng(seed)
    return [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 1000, n)),
                         max_new_tokens=m) for n, m in lengths_new]


def resident_tokens(cfg: Any, params: Any, specs: Sequence[SequenceSpec]) -> list[list[int]]:
    """The resident decoder's greedy tokens for ``specs``."""
    resident = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    return scheduler_tokens(resident, specs)


def demo_case(lengths_new: Sequence[tuple[int, int]], seed: int
              ) -> tuple[Any, Any, list[SequenceSpec], list[list[int]]]:
    """(cfg, params, the requests, their resident tokens)."""
    cfg, params = demo_model()
    specs = random_specs(lengths_new, seed)
    return cfg, params, specs, resident_tokens(cfg, params, specs)

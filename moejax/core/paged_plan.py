"""The host-side records of paged generation on the engine core
(:mod:`moejax.core.engine_core`): a sequence's state, the plan of one step that the
continuous scheduler (:mod:`moejax.core.continuous`) emits, the row geometry its runner
(:mod:`moejax.core.paged_runner`) builds device arrays with, and a dispatched program.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from moejax.decode.programs import StepResult
from moejax.prefix_hash import BLOCK_SIZE
from moejax.sequences import SequenceOutput, SequenceSpec


@dataclasses.dataclass
class SequenceState:
    """One sequence in the scheduler (host side)."""

    seq_id: int
    spec: SequenceSpec
    on_event: Callable[["TokenEvent"], None] | None
    output: SequenceOutput = dataclasses.field(
        default_factory=lambda: SequenceOutput([], "length"))
    rank: int = 0
    blocks: list[int] = dataclasses.field(default_factory=list)
    hashes: list[bytes] = dataclasses.field(default_factory=list)
    computed: int = 0            # tokens whose keys/values are in the pool, or will be
                                 # once the steps dispatched so far have run
    in_flight: int = 0           # tokens sampled by a dispatched step, not read yet (0/1)
    traced: int = 0              # tokens whose routing has been recorded
    routing: list[tuple[np.ndarray, ...]] = dataclasses.field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    handed_off: bool = False     # prefilled on a hand-off scheduler, waiting for a decoder
    preemptions: int = 0

    @property
    def tokens(self) -> list[int]:
        """What the model reads: the prompt, then the generated tokens."""
        return list(self.spec.prompt) + self.output.token_ids

    @property
    def pending(self) -> int:
        """Tokens still to run through the model (1: decoding), counting a token still in
        flight (sampled on the device, fed to the next step there)."""
        return (len(self.spec.prompt) + len(self.output.token_ids) + self.in_flight
                - self.computed)

    @property
    def generated(self) -> int:
        """Tokens generated so far, read or in flight."""
        return len(self.output.token_ids) + self.in_flight


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """New tokens of one sequence; ``output`` is set on its last event (finished,
    cancelled or failed)."""

    sequence: SequenceState
    token_ids: list[int]
    output: SequenceOutput | None = None


class Work(NamedTuple):
    """One sequence's tokens in one program: positions [start, start + count).
    ``samples``: they are the sequence's last pending tokens, so the program samples its
    next token; ``fed``: the last of them is in flight (sampled by the step before, still
    on the device: the runner feeds it to this program there)."""

    seq: SequenceState
    start: int
    count: int
    samples: bool = True
    fed: bool = False


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """The geometry of a scheduler's step programs: ``ranks`` data-parallel ranks, each
    with ``num_blocks`` pool blocks, at most ``per_rank`` decode rows and
    ``prefill_rows`` prefill rows of ``row_tokens`` tokens; block tables ``max_table``
    blocks wide (the model's whole context)."""

    ranks: int
    per_rank: int
    prefill_rows: int
    row_tokens: int
    num_blocks: int
    max_table: int

    @property
    def slots_per_rank(self) -> int:
        return self.num_blocks * BLOCK_SIZE


@dataclasses.dataclass
class GenerationPlan:
    """One step of the continuous scheduler: the prefill chunks and the decode rows to
    run (blocks allocated), and the events the scheduling itself produced (cancelled
    sequences). Outputs of a plan made before the store was reset are dropped."""

    prefill: list[Work]
    decode: list[Work]
    events: list[TokenEvent]
    started: float
    epoch: int = 0       # the KV store's epoch it was planned in (a reset voids it)


@dataclasses.dataclass
class Launch:
    """A dispatched program: its work items (rank order), row width, each item's first
    and last row, and the (not yet read) result (``result.tokens[last_rows[i]]``: the
    token work item i sampled)."""

    works: list[Work]
    width: int
    first_rows: list[int]
    last_rows: list[int]
    result: StepResult

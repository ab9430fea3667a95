"""Which μ-queue a device drains next (seed §3.4).

Every scheduler reads the device's queue-length matrix ``Q`` [N_B, N_U]: row b is block
b (N_B = the model's blocks), column u is the u-th unit the device hosts, in the order
the engine gives (its attention rank, its head, its experts; :mod:`~.engine`). Q[b][u]
is the number of tokens waiting in that queue. ``choose(Q)`` returns the (row, column)
to drain, or None when every queue is empty. Schedulers are stateless: one object may
serve every device.

Ties: every scheduler breaks them by the lowest block b, then the lowest column u (the
first in row-major order), so a run is deterministic.

* :class:`DefragScheduler`: the seed's Algorithm 1;
* :class:`MostTokensScheduler`: most-token-first-serve (MTFS), the first strawman;
* :class:`FirstLayerScheduler`: first-layer-first-serve (FLFS), the second.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np

DEFAULT_DELTA = 1.0
"""Algorithm 1's weight decay δ. Our choice (the seed gives no value): the best of the
sweep δ ∈ {0.25, 0.5, 0.75, 1} × K ∈ {1, 2, 4} in ``benchmarks/ep_decode.py`` on
demo-e32's traced routing, 4 devices, CPU cost tables (docs/PERF.md, issue 19)."""
DEFAULT_LOOKAHEAD = 2
"""Algorithm 1's lookahead depth K (blocks ahead). Our choice, from the same sweep (K = 4
was no better)."""
SCORE_TIE_RTOL = 1e-9
"""Defrag scores within this relative distance of the best count as tied (the scores are
floats; a tie in exact arithmetic may differ in the last bits after δ^j / N_U)."""

SCHEDULER_NAMES = ("defrag", "most_tokens", "first_layer")


class QueueScheduler(Protocol):
    """What the engine asks: the (block, column) of Q to drain next, None if all empty."""

    def choose(self, queue_lengths: np.ndarray) -> tuple[int, int] | None: ...


def check_queue_lengths(queue_lengths: Any) -> np.ndarray:
    """Q as a 2-D int64 array; ValueError unless it is [N_B >= 1, N_U >= 1] of
    non-negative whole numbers."""
    q = np.asarray(queue_lengths)
    if q.dtype == np.int64 and q.ndim == 2 and q.size and q.min() >= 0:
        return q  # the engine's own matrix: the fast path
    if q.ndim != 2 or q.shape[0] < 1 or q.shape[1] < 1:
        raise ValueError(f"queue lengths must be a [blocks, units] matrix with both >= 1, "
                         f"got shape {q.shape}")
    if q.dtype == bool or not (np.issubdtype(q.dtype, np.integer)
                               or np.issubdtype(q.dtype, np.floating)):
        raise ValueError(f"queue lengths must be token counts, got dtype {q.dtype}")
    if not np.all(np.isfinite(q)) or np.any(q < 0) or np.any(q != np.floor(q)):
        raise ValueError(f"queue lengths must be whole numbers >= 0, got {q.tolist()}")
    return q.astype(np.int64)


def _first_argmax(values: np.ndarray) -> tuple[int, int]:
    """(row, column) of the maximum; the first in row-major order on a tie."""
    flat = int(np.argmax(values))
    row, col = divmod(flat, values.shape[1])
    return row, col


class DefragScheduler:
    """The seed's Algorithm 1. With row sums S(b) = Σ_u Q[b][u]:

        LScore(b)   = Σ_{j=1..K} δ^j · S((b + j) mod N_B) / N_U
        Score[b][u] = Q[b][u] + LScore(b)   where Q[b][u] > 0   (else 0, not eligible)

    and the choice is the argmax of Score over the non-empty queues (ties: lowest b,
    then lowest u). The lookahead favours a queue whose next blocks hold a dense wave of
    tokens, so batches consolidate into one wave; the modulo makes the last block look
    ahead into block 0 (the next decode step)."""

    def __init__(self, delta: float = DEFAULT_DELTA, lookahead: int = DEFAULT_LOOKAHEAD) -> None:
        if isinstance(delta, bool) or not isinstance(delta, (int, float)) \
                or not math.isfinite(delta) or not 0 < delta <= 1:
            raise ValueError(f"defrag scheduler: delta (weight decay) must be in (0, 1], "
                             f"got {delta!r}")
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
            raise ValueError(f"defrag scheduler: lookahead (blocks ahead, K) must be an "
                             f"int >= 0, got {lookahead!r}")
        self.delta = float(delta)
        self.lookahead = lookahead

    def __repr__(self) -> str:
        return f"DefragScheduler(delta={self.delta}, lookahead={self.lookahead})"

    def lookahead_scores(self, queue_lengths: np.ndarray) -> np.ndarray:
        """LScore [N_B] (class docstring)."""
        return self._lookahead(check_queue_lengths(queue_lengths))

    def scores(self, queue_lengths: np.ndarray) -> np.ndarray:
        """Score [N_B, N_U] (class docstring): 0 where the queue is empty, as Algorithm 1
        initializes it."""
        q = check_queue_lengths(queue_lengths)
        return np.where(q > 0, q + self._lookahead(q)[:, None], 0.0)

    def _lookahead(self, q: np.ndarray) -> np.ndarray:
        num_blocks, num_units = q.shape
        row_sums = q.sum(axis=1) / num_units
        blocks = np.arange(num_blocks)
        scores = np.zeros(num_blocks)
        for j in range(1, self.lookahead + 1):
            scores += self.delta ** j * row_sums[(blocks + j) % num_blocks]
        return scores

    def choose(self, queue_lengths: np.ndarray) -> tuple[int, int] | None:
        q = check_queue_lengths(queue_lengths)
        if not q.any():
            return None
        scores = np.where(q > 0, q + self._lookahead(q)[:, None], -np.inf)
        best = scores.max()
        tied = scores >= best - SCORE_TIE_RTOL * max(1.0, abs(best))
        return _first_argmax(tied)


class MostTokensScheduler:
    """Most-token-first-serve: the fullest queue (ties: lowest b, then lowest u)."""

    def __repr__(self) -> str:
        return "MostTokensScheduler()"

    def choose(self, queue_lengths: np.ndarray) -> tuple[int, int] | None:
        q = check_queue_lengths(queue_lengths)
        if not q.any():
            return None
        return _first_argmax(q)


class FirstLayerScheduler:
    """First-layer-first-serve: the lowest block with any token; within it the fullest
    queue (ties: lowest u)."""

    def __repr__(self) -> str:
        return "FirstLayerScheduler()"

    def choose(self, queue_lengths: np.ndarray) -> tuple[int, int] | None:
        q = check_queue_lengths(queue_lengths)
        rows = np.flatnonzero(q.sum(axis=1) > 0)
        if rows.size == 0:
            return None
        row = int(rows[0])
        return row, int(np.argmax(q[row]))


def make_scheduler(name: str, **options: Any) -> QueueScheduler:
    """A scheduler by name: "defrag" (options ``delta``, ``lookahead``), "most_tokens"
    or "first_layer" (no options). ValueError for an unknown name or option, or a bad
    value."""
    if name == "defrag":
        unknown = sorted(set(options) - {"delta", "lookahead"})
        if unknown:
            raise ValueError(f"scheduler 'defrag' takes options delta, lookahead; got "
                             f"unknown {unknown}")
        return DefragScheduler(**options)
    if name in ("most_tokens", "first_layer"):
        if options:
            raise ValueError(f"scheduler {name!r} takes no options, got {sorted(options)}")
        return MostTokensScheduler() if name == "most_tokens" else FirstLayerScheduler()
    raise ValueError(f"unknown scheduler {name!r}; choose one of {SCHEDULER_NAMES}")

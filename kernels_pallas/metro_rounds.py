"""METRO routing in vectorized rounds: no walk over experts one at a time.

The sequential greedy (:mod:`kernels_pallas.metro`) visits the N active experts one
after another: N dependent steps, each a min over G devices. Here every step is
vectorized over all experts, and the number of steps is a small static count that
depends only on G (never on N), so the whole routing is one straight-line,
unrolled XLA program (no while loop: on a GPU each while-loop iteration costs a
device-to-host predicate copy).

Input: the active placement rows ``[N, G]`` in visiting order (the same rows the
greedy gets: most-constrained experts first when the order is ``"constrained"``);
a row's position is its priority. ``degree`` is a row's candidate-device count.

1. **Forced**: rows with one candidate are placed there, all at once.
2. **Levels** ``2, 4, 8, ... >= G``: rows with ``degree <= level`` that are still
   unplaced take part in :data:`SUBSTEPS` proposal steps. In a step every such row
   proposes its least-loaded candidate (ties: the first candidate at or after
   device ``row mod G``, cyclically, so tied rows spread instead of piling on
   device 0). On each device the proposers are ranked by priority (how many
   earlier rows propose the same device), and a row is accepted when
   ``load[device] + rank <= load of its second-best candidate``: the greedy would
   also have put it there after the ``rank`` higher-priority proposers, unless
   another candidate had become at least as good. The first proposer of a device
   is always accepted, so every step places at least one row per proposed device.
3. **Fallback**: whatever is still unplaced goes to its least-loaded candidate,
   with no acceptance test, so the result is always a valid routing: every row
   with a candidate gets one of its candidates, a row without one gets ``-1``.

The result need not equal the sequential greedy's; ``benchmarks/metro_quality.py``
measures both against the optimum on the same instances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int32, Shaped

NO_DEVICE = -1
# Proposal steps per level. Tuned on metro_quality.py's instances with seed 1 (192
# instances; seed 0 is the reported one): max activated over the greedy's 1.033 with
# 1 step, 1.0046 with 2, 1.0027 with 3.
SUBSTEPS = 2
# Above any load * G + rotation key and any load: stands for "not a candidate".
_NOT_CANDIDATE = 2**30


def level_bounds(num_devices: int) -> tuple[int, ...]:
    """Degree bounds of the levels after the forced one: ``2, 4, ...`` up to the first >= G."""
    bounds, level = [], 2
    while num_devices > 1:
        bounds.append(level)
        if level >= num_devices:
            break
        level *= 2
    return tuple(bounds)


def _tie_rotation(num_rows: int, num_devices: int) -> Int32[Array, "N G"]:
    """Tie-break rank of device g for row i: ``(g - i) mod G`` (spreads tied rows)."""
    device = jax.lax.broadcasted_iota(jnp.int32, (num_rows, num_devices), 1)
    row = jax.lax.broadcasted_iota(jnp.int32, (num_rows, num_devices), 0)
    return (device - row) % num_devices


def _best_candidate(candidate: Bool[Array, "N G"], load: Int32[Array, "G"],
                    rotation: Int32[Array, "N G"]) -> tuple[Int32[Array, "N"], Int32[Array, "N"]]:
    """Each row's least-loaded candidate (rotation breaks ties) and its load after the others.

    Returns ``(device [N], second [N])``: ``second`` is the least load over the row's
    other candidates (``_NOT_CANDIDATE`` for a row with one candidate). Rows without a
    candidate get device 0; callers mask them out.
    """
    num_devices = candidate.shape[1]
    key = jnp.where(candidate, load[None, :] * num_devices + rotation, _NOT_CANDIDATE)
    device = jnp.argmin(key, axis=1).astype(jnp.int32)
    others = candidate & (jax.lax.broadcasted_iota(jnp.int32, candidate.shape, 1)
                          != device[:, None])
    second = jnp.min(jnp.where(others, load[None, :], _NOT_CANDIDATE), axis=1)
    return device, second


def _rank_among_proposers(pending: Bool[Array, "N"], device: Int32[Array, "N"]
                          ) -> Int32[Array, "N"]:
    """Earlier (higher-priority) pending rows proposing the same device, per row.

    An [N, N] comparison and one row reduction (N^2 work), not a cumsum down the
    [N, G] proposal columns: XLA lowers a cumsum to a reduce-window with an N-long
    window, N^2 * G work.
    """
    num_rows = device.shape[0]
    earlier = (jax.lax.broadcasted_iota(jnp.int32, (num_rows, num_rows), 1)
               < jax.lax.broadcasted_iota(jnp.int32, (num_rows, num_rows), 0))
    same = pending[None, :] & (device[None, :] == device[:, None])
    return jnp.sum(earlier & same, axis=1, dtype=jnp.int32)


def _placed_load(onehot: Bool[Array, "N G"]) -> Int32[Array, "G"]:
    return onehot.sum(axis=0, dtype=jnp.int32)


def _proposal_step(candidate: Bool[Array, "N G"], eligible: Bool[Array, "N"],
                   out: Int32[Array, "N"], load: Int32[Array, "G"],
                   rotation: Int32[Array, "N G"]) -> tuple[Int32[Array, "N"], Int32[Array, "G"]]:
    """One vectorized step: unplaced eligible rows propose, devices accept by priority."""
    pending = eligible & (out == NO_DEVICE)
    device, second = _best_candidate(candidate, load, rotation)
    proposal = pending[:, None] & (jax.lax.broadcasted_iota(jnp.int32, candidate.shape, 1)
                                   == device[:, None])
    rank = _rank_among_proposers(pending, device)
    accept = pending & (load[device] + rank <= second)
    return (jnp.where(accept, device, out),
            load + _placed_load(proposal & accept[:, None]))


def _place_rest(candidate: Bool[Array, "N G"], out: Int32[Array, "N"], load: Int32[Array, "G"],
                rotation: Int32[Array, "N G"]) -> Int32[Array, "N"]:
    """Fallback: every unplaced row with a candidate takes its least-loaded one."""
    pending = (out == NO_DEVICE) & candidate.any(axis=1)
    device, _ = _best_candidate(candidate, load, rotation)
    return jnp.where(pending, device, out)


def route_rounds(rows: Shaped[Array, "N G"]) -> Int32[Array, "N"]:
    """Device per row ``[N]`` int32 (``-1`` for a row without candidates); jittable.

    ``rows [N, G]``: the active placement in visiting order (non-zero = candidate);
    a lower row index has priority within a step. Static shapes, fixed step count
    (``1 + SUBSTEPS * len(level_bounds(G)) + 1`` steps); see the module docstring.
    """
    num_rows, num_devices = rows.shape
    candidate = rows != 0
    degree = candidate.sum(axis=1, dtype=jnp.int32)
    rotation = _tie_rotation(num_rows, num_devices)
    # forced rows: their only candidate is the first (argmax of a bool row = first True)
    only = jnp.argmax(candidate, axis=1).astype(jnp.int32)
    out = jnp.where(degree == 1, only, NO_DEVICE)
    load = _placed_load(candidate & (degree == 1)[:, None])
    for bound in level_bounds(num_devices):
        eligible = (degree >= 1) & (degree <= bound)
        for _ in range(SUBSTEPS):
            out, load = _proposal_step(candidate, eligible, out, load, rotation)
    return _place_rest(candidate, out, load, rotation)

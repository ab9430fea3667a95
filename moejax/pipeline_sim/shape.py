"""The lift of real expert traces to the model shape the pipeline is simulated at
(:class:`moejax.model_shape.ModelShape`, e.g. ``QWEN3_30B_A3B``).

Why a lift: the expert traces this project can record come from its demo models
(``demo-e32``: 6 layers, 32 experts, top-4), while the pipeline is costed at
Qwen3-30B-A3B's shape (48 layers, 128 experts, top-8). The lift keeps what the routing
techniques feed on -- which requests share experts, step by step -- and gives every
token the target shape's fan-out:

* target layer l replays traced layer ``l mod L_trace`` (the traced layers' locality
  stands for the target's, repeated);
* a traced choice of expert e at rank i (0 = the top expert) becomes the m = k_target /
  k_trace target experts ``e + E_trace · ((m·i + j) mod f)`` for j < m, f = E_target /
  E_trace. A token keeps k_target distinct experts (ids agree with e modulo E_trace,
  and one rank's m offsets differ), a layer can reach all E_target experts (the offset
  depends on the rank), and two tokens that chose the same expert at the same rank
  share all m of its lifted experts.

This is a MODELLED mapping (no Qwen3-30B-A3B trace exists here); the pipeline's figures
are those of the demo's routing structure at the target's fan-out.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jaxtyping import Integer

from moejax import traces as traces_lib
from moejax.eldr.simulator import SimRequest, simulable_indices
from moejax.model_shape import ModelShape


def lift_factors(trace_experts: int, trace_top_k: int, shape: ModelShape) -> tuple[int, int]:
    """(f, m): target experts per traced expert and target choices per traced choice; a
    ValueError when the target shape is not a whole multiple of the trace's."""
    if shape.num_experts % trace_experts or shape.top_k % trace_top_k:
        raise ValueError(f"cannot lift a trace of {trace_experts} experts at top-"
                         f"{trace_top_k} to {shape.num_experts} experts at top-{shape.top_k}: "
                         f"both must divide")
    f, m = shape.num_experts // trace_experts, shape.top_k // trace_top_k
    if m > f:
        raise ValueError(f"lift: {m} target choices per traced choice but only {f} target "
                         f"experts per traced expert")
    return f, m


def lift_ids(ids: Integer[np.ndarray, "Lt n kt"], trace_experts: int, shape: ModelShape
             ) -> Integer[np.ndarray, "L n k"]:
    """Traced expert ids [L_trace, n, k_trace] (rank order) lifted to the target shape
    [L, n, k] (module docstring)."""
    ids = np.asarray(ids)
    if ids.ndim != 3 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"ids must be integer expert ids [L, n, k], got dtype {ids.dtype}, "
                         f"shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= trace_experts):
        raise ValueError(f"ids: expert id outside [0, {trace_experts})")
    trace_layers, n, trace_k = ids.shape
    f, m = lift_factors(trace_experts, trace_k, shape)
    rank = np.arange(trace_k)[:, None]
    offsets = (m * rank + np.arange(m)[None, :]) % f                       # [kt, m]
    lifted = ids.astype(np.int64)[..., None] + trace_experts * offsets      # [Lt, n, kt, m]
    lifted = lifted.reshape(trace_layers, n, trace_k * m)
    return lifted[np.arange(shape.num_layers) % trace_layers]


def lifted_counts(ids: Integer[np.ndarray, "L n k"], num_experts: int
                  ) -> Integer[np.ndarray, "L E"]:
    """How many of the n tokens chose expert e at layer l (each token counts once per
    choice), [L, E] int64."""
    num_layers = ids.shape[0]
    flat = ids.reshape(num_layers, -1) + (np.arange(num_layers) * num_experts)[:, None]
    return np.bincount(flat.reshape(-1), minlength=num_layers * num_experts
                       ).reshape(num_layers, num_experts)


def lift_requests(prefill_ids: Sequence[np.ndarray], decode_ids: Sequence[np.ndarray],
                  domains: Sequence[str | None], trace_experts: int, shape: ModelShape
                  ) -> list[SimRequest]:
    """:class:`SimRequest` s at the target shape from traced requests: ``prefill_ids[i]``
    [L_trace, n_i, k_trace] and ``decode_ids[i]`` [L_trace, D_i, k_trace] (D_i >= 1).
    counts = the lifted prompt's counts, decode_experts = the lifted decode ids."""
    if not (len(prefill_ids) == len(decode_ids) == len(domains)):
        raise ValueError(f"lift_requests: {len(prefill_ids)} prefill, {len(decode_ids)} "
                         f"decode, {len(domains)} domains: one of each per request")
    out = []
    for prompt, decode, domain in zip(prefill_ids, decode_ids, domains):
        lifted_prompt = lift_ids(prompt, trace_experts, shape)
        out.append(SimRequest(counts=lifted_counts(lifted_prompt, shape.num_experts),
                              decode_experts=lift_ids(decode, trace_experts, shape),
                              domain=domain))
    return out


def requests_of_trace(trace: traces_lib.Trace, shape: ModelShape,
                      indices: Sequence[int] | None = None) -> list[SimRequest]:
    """:func:`lift_requests` of a :class:`moejax.traces.Trace`'s requests that ran and
    decoded at least one token (``indices`` picks among the trace's requests)."""
    usable = simulable_indices(trace) if indices is None else np.asarray(indices, np.int64)
    requests = [trace.request(int(i)) for i in usable]
    for i, req in zip(usable.tolist(), requests):
        if not req.ok or req.decode_experts.shape[1] < 1:
            raise ValueError(f"request {i} ({req.id!r}) cannot be lifted: it failed or has "
                             f"no decode token")
    return lift_requests([r.prefill_experts for r in requests],
                         [r.decode_experts for r in requests],
                         [r.domain for r in requests], trace.num_experts, shape)


def rows_per_token(request: SimRequest) -> np.ndarray:
    """[L, E] float: the rows expert e at layer l gets per prompt token of ``request``
    (its prompt counts over its prompt tokens; each layer sums to top-k)."""
    counts = request.counts.astype(np.float64)
    tokens = counts[0].sum()
    if tokens <= 0:
        raise ValueError("rows_per_token: the request's prompt counts are empty")
    return counts / (tokens / request.decode_experts.shape[2])


def layer_period(requests: Sequence[SimRequest]) -> int:
    """The smallest p such that every request's layer l routes as its layer l mod p
    (prompt counts and decode ids): a lifted trace repeats its L_trace layers, so work
    over layers (fitting, placement) needs only the first p."""
    num_layers = requests[0].num_layers
    for period in range(1, num_layers):
        index = np.arange(num_layers) % period
        if all(np.array_equal(r.counts, r.counts[index])
               and np.array_equal(r.decode_experts, r.decode_experts[index]) for r in requests):
            return period
    return num_layers

"""METRO token routing over expert replicas, its baselines, and EPLB placement.

Setting (seed: METRO, §IV): ``N`` experts, ``G`` devices, a placement
``A ∈ {0,1}^{N×G}`` (expert i has a replica on device g) and the tokens per
expert ``T [N]`` of one batch. In the memory-bound (decode) regime a device's
expert time grows with how many expert replicas it activates, not with its
token count, so a router should minimise the largest number of activated
replicas on any device. By the seed's Lemma 1 one replica per active expert is
enough, so a routing is a device per expert (``-1`` for experts without tokens).

What lives here (NumPy or JAX arrays in, NumPy out, unless the name ends in
``_jax``):

* :func:`eplb_placement`: EPLB-style replica counts ∝ load and balanced packing.
* :func:`route_eplb_even`: the baseline (vLLM / SGLang EPLB): every expert's
  tokens spread evenly over all of its replicas; returns tokens ``[N, G]``.
* :func:`route_metro`: seed Algorithm 1 as a single-program Pallas kernel (a
  sequential loop over experts, so the seed's locks are unnecessary);
  :func:`route_metro_reference` is the NumPy twin with identical output, and
  :func:`route_metro_jax` the in-graph (jittable) entry point.
* :func:`route_optimal`: the optimum (binary search on λ, max-flow feasibility
  with SciPy), for measuring quality only.
* :func:`assign_tokens`: maps a batch's top-k expert ids ``[T, k]`` to devices
  under any router, with per-device activated-replica and token counts.

Greedy visiting order (:data:`DEFAULT_VISIT_ORDER`): ``"constrained"`` visits
active experts with the fewest candidate devices first (ties: lower expert
index); ``"index"`` is the seed's order (expert index). Kernel and reference
always share one order. Measured with ``benchmarks/metro_quality.py`` (seed 0,
720 Zipf instances): max activated experts over the optimum 1.016 (constrained)
vs 1.103 (index); over EPLB-even at 32 tokens per device 0.778 vs 0.837. Placing
single-replica experts first leaves the flexible (hot, replicated) experts to
fill the gaps, the classic rule for assignment with restricted machines.
The order is computed outside the kernel (a stable argsort of candidate counts;
rows are permuted before and results un-permuted after), so the kernel itself
always visits rows in sequence. The kernel lowers for CUDA through Triton; its
GPU run time has not been measured yet (this project's CPU machines have none).

Implementations of :func:`route_metro_jax` (:data:`METRO_IMPLS`): ``"pallas"`` (the
kernel), ``"jax"`` (the same sequential loop as plain XLA ops; output identical), and
``"rounds"`` (:mod:`kernels_pallas.metro_rounds`: vectorized proposal rounds by
constraint level, a fixed number of steps independent of N; always a valid routing
but not always the greedy's). Default rule (:data:`DEFAULT_IMPL`): the default is
``"pallas"``, and stays so until a GPU measurement shows ``"rounds"`` faster in
device time (``metro_rounds_device_us < metro_pallas_device_us`` from
``benchmarks/metro_quality.py --timing`` on the serving GPU, 256 experts x 16
devices), with its quality within 1% of the greedy's
(``metro_rounds_over_metro <= 1.01`` in the same benchmark's quality run).
Measured (seed 0, 720 Zipf instances; quality does not depend on the machine):
max activated experts rounds/greedy 1.0022 on average (worst instance 1.125),
rounds/optimum 1.0179 vs greedy/optimum 1.0163, rounds/EPLB-even at 32 tokens per
device 0.776 vs 0.778. The quality half of the rule holds; the GPU timing decides.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jaxtyping import Array, Bool, Int32, Int64, Integer, Real, Shaped

from kernels_pallas.metro_rounds import route_rounds

ROUTERS = ("eplb_even", "metro", "optimal")
METRO_IMPLS = ("pallas", "jax", "rounds")
DEFAULT_IMPL = "pallas"  # see the module docstring for what would change it
VISIT_ORDERS = ("constrained", "index")
DEFAULT_VISIT_ORDER = "constrained"

NO_DEVICE = -1  # routing value of an expert with no tokens in the batch

# One warp is plenty: the loop is sequential and each step touches one row of G devices.
TRITON_NUM_WARPS = 1
TRITON_NUM_STAGES = 1
# The kernel's name in profiles (the Triton kernel event on a GPU stream carries it),
# so benchmarks can pick its events out of a trace.
KERNEL_NAME = "metro_greedy"

# Larger than any greedy key (activated count * padded devices + device), so
# non-candidate devices never win the min.
_NO_CANDIDATE_KEY = 2**30

# Shapes (N experts, G devices, T tokens, k top-k) of what the host functions take: NumPy
# or JAX arrays (dtypes are validated by the functions, with ValueError); lists where noted.
Placement = Shaped[Array | np.ndarray, "N G"]             # bool or 0/1 numbers
ExpertTokens = Integer[Array | np.ndarray, "N"]          # tokens per expert
ExpertLoad = Real[Array | np.ndarray, "N"] | Sequence[float]
TopkIds = Integer[Array | np.ndarray, "T k"]


# --------------------------------------------------------------------------- validation


def _as_count(value, name: str, minimum: int) -> int:
    """A Python int >= minimum from an int-like (bool rejected), else ValueError."""
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _check_placement(placement) -> np.ndarray:
    """Placement as a bool [N, G] array; accepts bool or 0/1 numeric arrays."""
    arr = np.asarray(placement)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"placement must be a non-empty 2-D [experts, devices] array, "
                         f"got shape {arr.shape}")
    if arr.dtype != np.bool_:
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise ValueError(f"placement must be bool or 0/1 numbers, got dtype {arr.dtype}")
        if not np.isin(arr, (0, 1)).all():
            raise ValueError("placement must hold only 0/1 (or False/True) entries")
        arr = arr.astype(bool)
    return arr


def _check_tokens(tokens, num_experts: int, name: str = "tokens_per_expert") -> np.ndarray:
    """Tokens per expert as an int64 [N] array of non-negative integers."""
    arr = np.asarray(tokens)
    if arr.ndim != 1 or arr.shape[0] != num_experts:
        raise ValueError(f"{name} must be 1-D with one entry per expert ({num_experts}), "
                         f"got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer) or arr.dtype == np.bool_:
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if (arr < 0).any():
        bad = int(np.flatnonzero(arr < 0)[0])
        raise ValueError(f"{name} must be non-negative; expert {bad} has {int(arr[bad])}")
    return arr.astype(np.int64)


def _check_routable(placement: np.ndarray, tokens: np.ndarray) -> None:
    """Every expert with tokens needs at least one replica."""
    stranded = np.flatnonzero((tokens > 0) & ~placement.any(axis=1))
    if stranded.size:
        raise ValueError(f"expert {int(stranded[0])} has {int(tokens[stranded[0]])} tokens but no "
                         f"replica in placement ({stranded.size} such experts)")


def _check_inputs(placement, tokens_per_expert) -> tuple[np.ndarray, np.ndarray]:
    placement = _check_placement(placement)
    tokens = _check_tokens(tokens_per_expert, placement.shape[0])
    _check_routable(placement, tokens)
    return placement, tokens


def _check_order(order: str) -> str:
    if order not in VISIT_ORDERS:
        raise ValueError(f"order must be one of {VISIT_ORDERS}, got {order!r}")
    return order


# --------------------------------------------------------------------------- placement


def eplb_replica_counts(expert_load: ExpertLoad, num_devices: int, num_replicas: int
                        ) -> Int64[np.ndarray, "N"]:
    """Replicas per expert ``[N]`` int64, roughly ∝ ``expert_load [N]``.

    Every expert gets one replica; each remaining replica goes, one at a time, to the
    expert with the highest load per replica (ties: lower index) that has fewer than
    ``num_devices`` replicas (at most one replica per device).
    """
    load = np.asarray(expert_load)
    if load.ndim != 1 or load.shape[0] == 0:
        raise ValueError(f"expert_load must be a non-empty 1-D array, got shape {load.shape}")
    if not (np.issubdtype(load.dtype, np.integer) or np.issubdtype(load.dtype, np.floating)):
        raise ValueError(f"expert_load must be numeric, got dtype {load.dtype}")
    load = load.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(load) | (load < 0))
    if bad.size:
        raise ValueError(f"expert_load must be finite and non-negative; expert {int(bad[0])} "
                         f"has {load[bad[0]]} ({bad.size} such experts)")
    num_devices = _as_count(num_devices, "num_devices", 1)
    num_experts = load.shape[0]
    num_replicas = _as_count(num_replicas, "num_replicas", 1)
    if not num_experts <= num_replicas <= num_experts * num_devices:
        raise ValueError(f"num_replicas must lie in [num_experts, num_experts * num_devices] = "
                         f"[{num_experts}, {num_experts * num_devices}], got {num_replicas}")
    counts = np.ones(num_experts, np.int64)
    for _ in range(num_replicas - num_experts):
        per_replica = np.where(counts < num_devices, load / counts, -np.inf)
        counts[int(np.argmax(per_replica))] += 1  # argmax: first maximum -> lower index
    return counts


def eplb_placement(expert_load: ExpertLoad, num_devices: int, num_replicas: int
                   ) -> Bool[np.ndarray, "N G"]:
    """EPLB-style placement ``A [N, G]`` bool from per-expert load ``[N]``.

    Replica counts come from :func:`eplb_replica_counts`. Replicas are then packed in
    order of load per replica (descending; ties: lower expert index): device g has
    ``ceil`` or ``floor(num_replicas / G)`` slots (the first ``num_replicas % G``
    devices get the extra one), and each replica goes to the device with the least
    total load that has a free slot and no replica of that expert yet (ties: lower
    device id). If no such device exists (rare: every device with a free slot already
    holds the expert), a replica of another expert is moved from a full device into
    the free slot, which always succeeds because slot counts differ by at most one.
    Loads whose total overflows float64 are first divided by the largest load (the
    same placement up to rounding), so device totals stay finite and comparable.
    """
    counts = eplb_replica_counts(expert_load, num_devices, num_replicas)
    load = np.asarray(expert_load, np.float64)
    with np.errstate(over="ignore"):
        overflows = not np.isfinite(load.sum())
    if overflows:
        load = load / load.max()   # every load is finite, so the max is finite and > 0
    num_experts = load.shape[0]
    per_replica = load / counts
    slots = np.full(num_devices, num_replicas // num_devices, np.int64)
    slots[: num_replicas % num_devices] += 1

    holds = np.zeros((num_experts, num_devices), bool)
    device_load = np.zeros(num_devices, np.float64)
    used = np.zeros(num_devices, np.int64)
    expert_order = np.argsort(-per_replica, kind="stable")
    for expert in np.repeat(expert_order, counts[expert_order]):
        ok = (used < slots) & ~holds[expert]
        if not ok.any():
            _make_room(int(expert), holds, device_load, used, slots, per_replica)
            ok = (used < slots) & ~holds[expert]
        device = _least_loaded(ok, device_load)
        holds[expert, device] = True
        device_load[device] += per_replica[expert]
        used[device] += 1
    return holds


def _least_loaded(allowed: np.ndarray, device_load: np.ndarray) -> int:
    """The allowed device with the least load (ties: lower id); ``allowed`` has a True.

    Only allowed devices compete: an ``argmin`` over loads with ``inf`` standing for the
    others would pick a forbidden device 0 whenever the allowed loads are ``inf`` too.
    """
    candidates = np.flatnonzero(allowed)
    return int(candidates[np.argmin(device_load[candidates])])


def _make_room(expert: int, holds: np.ndarray, device_load: np.ndarray, used: np.ndarray,
               slots: np.ndarray, per_replica: np.ndarray) -> None:
    """Free a slot for ``expert`` on a device that lacks it (in place).

    Every device with a free slot holds ``expert``. Take the least-loaded such device
    ``src`` and the lowest-id full device ``dst`` without ``expert``; ``dst`` holds at
    least as many replicas as ``src`` minus ``expert``, so one of its experts is not
    on ``src``: move it there.
    """
    src = _least_loaded(used < slots, device_load)
    for dst in np.flatnonzero(~holds[expert] & (slots > 0)):
        movable = np.flatnonzero(holds[:, dst] & ~holds[:, src])
        if movable.size:
            other = int(movable[0])
            holds[other, dst], holds[other, src] = False, True
            device_load[dst] -= per_replica[other]
            device_load[src] += per_replica[other]
            used[dst] -= 1
            used[src] += 1
            return
    raise AssertionError("unreachable: no replica could be moved")  # see the docstring argument


# --------------------------------------------------------------------------- counting helpers


def tokens_per_expert(topk_ids: TopkIds, num_experts: int) -> Int64[np.ndarray, "N"]:
    """Tokens routed to each expert ``[N]`` int64 from a batch's ``topk_ids [T, k]``."""
    num_experts = _as_count(num_experts, "num_experts", 1)
    ids = _check_topk(topk_ids, num_experts)
    return np.bincount(ids.ravel(), minlength=num_experts).astype(np.int64)


def _check_topk(topk_ids, num_experts: int) -> np.ndarray:
    ids = np.asarray(topk_ids)
    if ids.ndim != 2:
        raise ValueError(f"topk_ids must be 2-D [tokens, k], got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer) or ids.dtype == np.bool_:
        raise ValueError(f"topk_ids must hold integers, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")
    return ids.astype(np.int64)


def routed_tokens(expert_device: Integer[Array | np.ndarray, "N"],
                  tokens_per_expert: ExpertTokens, num_devices: int) -> Int64[np.ndarray, "N G"]:
    """Tokens of each expert on each device ``[N, G]`` int64 for a one-replica routing.

    ``expert_device [N]`` is a device per expert (``-1`` for none, allowed only where
    the expert has no tokens); all of expert i's tokens land on that device.
    """
    num_devices = _as_count(num_devices, "num_devices", 1)
    device = np.asarray(expert_device)
    if device.ndim != 1 or not np.issubdtype(device.dtype, np.integer):
        raise ValueError(f"expert_device must be a 1-D integer array, got shape {device.shape} "
                         f"dtype {device.dtype}")
    tokens = _check_tokens(tokens_per_expert, device.shape[0])
    if ((device < NO_DEVICE) | (device >= num_devices)).any():
        raise ValueError(f"expert_device must lie in [-1, {num_devices})")
    lost = np.flatnonzero((device == NO_DEVICE) & (tokens > 0))
    if lost.size:
        raise ValueError(f"expert {int(lost[0])} has tokens but no device")
    out = np.zeros((device.shape[0], num_devices), np.int64)
    routed = device >= 0
    out[np.flatnonzero(routed), device[routed]] = tokens[routed]
    return out


def activated_per_device(expert_tokens: Integer[Array | np.ndarray, "N G"]
                         ) -> Int64[np.ndarray, "G"]:
    """Activated replicas per device ``[G]`` from tokens ``[N, G]``: experts with > 0 tokens there."""
    return (np.asarray(expert_tokens) > 0).sum(axis=0).astype(np.int64)


def tokens_per_device(expert_tokens: Integer[Array | np.ndarray, "N G"]
                      ) -> Int64[np.ndarray, "G"]:
    """Tokens (token, k pairs) per device ``[G]`` from tokens ``[N, G]``."""
    return np.asarray(expert_tokens).sum(axis=0).astype(np.int64)


# --------------------------------------------------------------------------- EPLB-even router


def route_eplb_even(placement: Placement, tokens_per_expert: ExpertTokens
                    ) -> Int64[np.ndarray, "N G"]:
    """Baseline: each expert's tokens spread evenly over its replicas; tokens ``[N, G]`` int64.

    Expert i with ``t`` tokens and ``r`` replicas gives ``t // r`` to each replica and one
    more to each of its first ``t % r`` replicas in device-id order (the same counts as
    dealing the tokens round-robin over the replicas, which :func:`assign_tokens` does).
    Rows sum to ``tokens_per_expert``; devices without a replica get 0.
    """
    placement, tokens = _check_inputs(placement, tokens_per_expert)
    replicas = placement.sum(axis=1)
    safe = np.maximum(replicas, 1)  # experts without a replica have 0 tokens (checked)
    rank = np.cumsum(placement, axis=1) - 1  # replica index in device order
    base = (tokens // safe)[:, None]
    extra = rank < (tokens % safe)[:, None]
    return np.where(placement, base + extra, 0).astype(np.int64)


# --------------------------------------------------------------------------- METRO greedy


def _visit_order_np(active_placement: np.ndarray, order: str) -> np.ndarray:
    """Expert visiting order ``[N]`` (see the module docstring)."""
    num_experts = active_placement.shape[0]
    if order == "index":
        return np.arange(num_experts)
    return np.argsort(active_placement.sum(axis=1), kind="stable")


def _visit_order_jax(active_placement: jax.Array, order: str) -> jax.Array:
    num_experts = active_placement.shape[0]
    if order == "index":
        return jnp.arange(num_experts, dtype=jnp.int32)
    return jnp.argsort(active_placement.sum(axis=1), stable=True).astype(jnp.int32)


def route_metro_reference(placement: Placement, tokens_per_expert: ExpertTokens, *,
                          order: str = DEFAULT_VISIT_ORDER) -> Int64[np.ndarray, "N"]:
    """Seed Algorithm 1 in NumPy: device per expert ``[N]`` int64 (``-1`` without tokens).

    Experts with tokens are visited in ``order``; each goes to its candidate device
    with the fewest activated replicas so far (ties: lowest device id).
    """
    placement, tokens = _check_inputs(placement, tokens_per_expert)
    _check_order(order)
    active = placement & (tokens > 0)[:, None]
    activated = np.zeros(placement.shape[1], np.int64)
    out = np.full(placement.shape[0], NO_DEVICE, np.int64)
    for expert in _visit_order_np(active, order):
        candidates = np.flatnonzero(active[expert])
        if candidates.size == 0:
            continue
        device = int(candidates[np.argmin(activated[candidates])])  # first min -> lowest id
        activated[device] += 1
        out[expert] = device
    return out


def _greedy_loop(get_row, num_rows: int, padded_rows: int, padded_devices: int) -> jax.Array:
    """The greedy over rows 0..num_rows-1 of an active placement; shared by kernel and JAX path.

    ``get_row(i)`` returns row i as ``[1, padded_devices]`` int32 (non-zero = candidate).
    Returns the chosen device per row ``[padded_rows]`` int32 (``-1`` for no candidate).
    The output lives in the loop carry and is updated with a select (no scalar stores).
    Written for a sequential GPU loop: one min-reduction per step (the key
    ``activated * padded_devices + device`` orders by count, then by lowest id), and
    the next row is loaded one step ahead so its memory latency overlaps this step.
    """
    device_iota = jax.lax.broadcasted_iota(jnp.int32, (1, padded_devices), 1)
    row_iota = jax.lax.broadcasted_iota(jnp.int32, (padded_rows,), 0)

    def body(i, carry):
        activated, out, row = carry
        next_row = get_row(jnp.minimum(i + 1, num_rows - 1))
        key = jnp.where(row != 0, activated * padded_devices + device_iota, _NO_CANDIDATE_KEY)
        best = jnp.min(key)
        device = jnp.where(best < _NO_CANDIDATE_KEY, best % padded_devices, NO_DEVICE)
        activated = activated + (device_iota == device).astype(jnp.int32)
        out = jnp.where(row_iota == i, device, out)
        return activated, out, next_row

    init = (jnp.zeros((1, padded_devices), jnp.int32),
            jnp.full((padded_rows,), NO_DEVICE, jnp.int32), get_row(0))
    _, out, _ = jax.lax.fori_loop(0, num_rows, body, init)
    return out


def _metro_kernel(placement_ref, out_ref, *, num_rows: int):
    padded_rows, padded_devices = placement_ref.shape
    out_ref[...] = _greedy_loop(lambda i: placement_ref[pl.ds(i, 1), :], num_rows, padded_rows,
                                padded_devices)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def default_interpret() -> bool:
    """Interpret the Pallas kernel unless JAX runs on a GPU."""
    return jax.default_backend() != "gpu"


def _metro_pallas(rows: jax.Array, interpret: bool) -> jax.Array:
    """Kernel call on visit-ordered active rows ``[N, G]`` int32 -> device per row ``[N]`` int32.

    Pads N and G up to powers of two (Triton block shapes); padded devices are never
    candidates and padded rows are never visited.
    """
    num_rows, num_devices = rows.shape
    padded_rows, padded_devices = _next_pow2(num_rows), _next_pow2(num_devices)
    rows = jnp.pad(rows, ((0, padded_rows - num_rows), (0, padded_devices - num_devices)))
    extra = {}
    if not interpret:
        from jax.experimental.pallas import triton as pl_triton

        extra["compiler_params"] = pl_triton.CompilerParams(num_warps=TRITON_NUM_WARPS,
                                                            num_stages=TRITON_NUM_STAGES)
    out = pl.pallas_call(
        functools.partial(_metro_kernel, num_rows=num_rows),
        out_shape=jax.ShapeDtypeStruct((padded_rows,), jnp.int32),
        grid=(1,),
        in_specs=[pl.BlockSpec((padded_rows, padded_devices), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((padded_rows,), lambda i: (0,)),
        interpret=interpret,
        name=KERNEL_NAME,
        **extra,
    )(rows)
    return out[:num_rows]


def _metro_plain_jax(rows: jax.Array) -> jax.Array:
    num_rows, num_devices = rows.shape
    return _greedy_loop(lambda i: jax.lax.dynamic_slice_in_dim(rows, i, 1, axis=0),
                        num_rows, num_rows, num_devices)


@functools.partial(jax.jit, static_argnames=("order", "impl", "interpret"))
def route_metro_jax(placement: Shaped[Array, "N G"], tokens_per_expert: Integer[Array, "N"], *,
                    order: str = DEFAULT_VISIT_ORDER, impl: str = DEFAULT_IMPL,
                    interpret: bool | None = None) -> Int32[Array, "N"]:
    """In-graph METRO: device per expert ``[N]`` int32 (``-1`` without tokens), jitted.

    ``placement [N, G]`` (bool or 0/1, N, G >= 1), ``tokens_per_expert [N]`` ints
    (only their sign is used). ``impl`` is one of :data:`METRO_IMPLS`: ``"pallas"``
    (the kernel), ``"jax"`` (the same loop as plain XLA ops), or ``"rounds"``
    (vectorized rounds, :func:`kernels_pallas.metro_rounds.route_rounds`: a valid
    routing, not always the greedy's). ``order`` applies to all three (it sets the
    rows' priority in ``"rounds"``); ``interpret`` only to ``"pallas"``. Shapes are
    checked, values are not (use :func:`route_metro` for checked NumPy calls).
    """
    if (placement.ndim != 2 or 0 in placement.shape
            or tokens_per_expert.shape != placement.shape[:1]):
        raise ValueError(f"placement must be [N, G] and tokens_per_expert [N], got shapes "
                         f"{placement.shape} and {tokens_per_expert.shape}")
    _check_order(order)
    if impl not in METRO_IMPLS:
        raise ValueError(f"impl must be one of {METRO_IMPLS}, got {impl!r}")
    active = (placement != 0) & (tokens_per_expert > 0)[:, None]
    active = active.astype(jnp.int32)
    visit = _visit_order_jax(active, order)
    rows = active[visit]
    if impl == "pallas":
        chosen = _metro_pallas(rows, default_interpret() if interpret is None else interpret)
    elif impl == "rounds":
        chosen = route_rounds(rows)
    else:
        chosen = _metro_plain_jax(rows)
    return jnp.zeros_like(chosen).at[visit].set(chosen)


def route_metro(placement: Placement, tokens_per_expert: ExpertTokens, *,
                order: str = DEFAULT_VISIT_ORDER,
                interpret: bool | None = None) -> Int64[np.ndarray, "N"]:
    """METRO greedy via the Pallas kernel: device per expert ``[N]`` int64 (``-1`` without tokens).

    Same output as :func:`route_metro_reference`. ``interpret=None`` interprets the
    kernel unless JAX's default backend is a GPU.
    """
    placement, tokens = _check_inputs(placement, tokens_per_expert)
    _check_order(order)
    active = jnp.asarray(tokens > 0, jnp.int32)  # only the sign matters; avoids int32 overflow
    out = route_metro_jax(jnp.asarray(placement), active, order=order, impl="pallas",
                          interpret=interpret)
    return np.asarray(out).astype(np.int64)


# --------------------------------------------------------------------------- optimum


def route_optimal(placement: Placement, tokens_per_expert: ExpertTokens
                  ) -> Int64[np.ndarray, "N"]:
    """Optimal routing: device per expert ``[N]`` int64 (``-1`` without tokens), CPU only.

    Finds the smallest λ such that every expert with tokens can be given one of its
    devices with at most λ experts per device: binary search on λ over
    ``[ceil(active / G), max_g |active experts placed on g|]``, each step a max-flow
    (source -1-> expert -1-> device (where placed) -λ-> sink) with SciPy.
    """
    placement, tokens = _check_inputs(placement, tokens_per_expert)
    num_experts, num_devices = placement.shape
    out = np.full(num_experts, NO_DEVICE, np.int64)
    experts = np.flatnonzero(tokens > 0)
    if experts.size == 0:
        return out
    active = placement[experts]
    low = max(1, math.ceil(experts.size / num_devices))
    high = int(active.sum(axis=0).max())  # everyone on its first replica stays under this
    best = None
    while low <= high:
        lam = (low + high) // 2
        matched = _match_with_capacity(active, lam)
        if matched is None:
            low = lam + 1
        else:
            best, high = matched, lam - 1
    out[experts] = best
    return out


def _match_with_capacity(active: np.ndarray, capacity: int) -> np.ndarray | None:
    """A device per row of ``active [M, G]`` with <= capacity rows per device, or None."""
    from scipy.sparse import csr_array
    from scipy.sparse.csgraph import maximum_flow

    num_rows, num_devices = active.shape
    source, sink = 0, 1 + num_rows + num_devices
    row_idx, dev_idx = np.nonzero(active)
    src = np.concatenate([np.full(num_rows, source), 1 + row_idx,
                          1 + num_rows + np.arange(num_devices)])
    dst = np.concatenate([1 + np.arange(num_rows), 1 + num_rows + dev_idx,
                          np.full(num_devices, sink)])
    cap = np.concatenate([np.ones(num_rows + row_idx.size), np.full(num_devices, capacity)])
    graph = csr_array((cap.astype(np.int32), (src.astype(np.int32), dst.astype(np.int32))),
                      shape=(sink + 1, sink + 1))
    result = maximum_flow(graph, source, sink)
    if result.flow_value < num_rows:
        return None
    flow = result.flow.toarray()[1:1 + num_rows, 1 + num_rows:sink]
    return np.argmax(flow > 0, axis=1).astype(np.int64)


# --------------------------------------------------------------------------- batch assignment


@dataclasses.dataclass(frozen=True)
class TokenAssignment:
    """Where each (token, k) of a batch is computed.

    device: [T, k] int64, the device computing expert ``topk_ids[t, j]`` for token t;
    activated_per_device: [G] int64, distinct experts with tokens on each device;
    tokens_per_device: [G] int64, (token, k) pairs on each device.
    """

    device: Int64[np.ndarray, "T k"]
    activated_per_device: Int64[np.ndarray, "G"]
    tokens_per_device: Int64[np.ndarray, "G"]

    @property
    def max_activated(self) -> int:
        return int(self.activated_per_device.max())


def assign_tokens(topk_ids: TopkIds, placement: Placement, router: str = "metro", *,
                  order: str = DEFAULT_VISIT_ORDER, interpret: bool | None = None
                  ) -> TokenAssignment:
    """Route a batch's ``topk_ids [T, k]`` over ``placement [N, G]`` with ``router``.

    ``router`` is one of :data:`ROUTERS`. ``"eplb_even"`` deals each expert's
    (token, k) pairs, in row-major order, round-robin over its replicas in device
    order (counts equal :func:`route_eplb_even`); ``"metro"`` (the kernel; ``order``
    and ``interpret`` apply) and ``"optimal"`` send all of an expert's pairs to its
    one chosen device.
    """
    placement = _check_placement(placement)
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    num_experts, num_devices = placement.shape
    ids = _check_topk(topk_ids, num_experts)
    counts = tokens_per_expert(ids, num_experts)
    _check_routable(placement, counts)
    flat = ids.ravel()
    if router == "eplb_even":
        # occurrence number of each pair within its expert, in row-major order
        sort = np.argsort(flat, kind="stable")
        first = np.cumsum(counts) - counts
        occurrence = np.empty_like(flat)
        occurrence[sort] = np.arange(flat.size) - first[flat[sort]]
        replicas = placement.sum(axis=1)
        replica = occurrence % np.maximum(replicas[flat], 1)
        # device of replica r of expert e: the (r+1)-th True in its placement row
        rank = np.cumsum(placement, axis=1) - 1
        device_of_rank = np.full(placement.shape, NO_DEVICE, np.int64)
        rows, cols = np.nonzero(placement)
        device_of_rank[rows, rank[rows, cols]] = cols
        device = device_of_rank[flat, replica]
    else:
        if router == "metro":
            expert_device = route_metro(placement, counts, order=order, interpret=interpret)
        else:
            expert_device = route_optimal(placement, counts)
        device = expert_device[flat]
    expert_tokens = np.zeros((num_experts, num_devices), np.int64)
    np.add.at(expert_tokens, (flat, device), 1)
    return TokenAssignment(device=device.reshape(ids.shape),
                           activated_per_device=activated_per_device(expert_tokens),
                           tokens_per_device=tokens_per_device(expert_tokens))

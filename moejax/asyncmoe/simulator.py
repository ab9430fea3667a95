"""A discrete-event simulator of AsyncMoE decode on G devices, and of the synchronous
expert-parallel (EP) baseline, under measured cost tables.

Why: to see throughput, inter-token latency (ITL), batch sizes and stalls of the
μ-queue design against lock-step EP for workloads, routings and device counts a real run
cannot reach, and to give the real runtime a reference batch order. The μ-queue
simulation drives the real :class:`~moejax.asyncmoe.engine.DeviceEngine` (queues, pool,
scheduler, routing of outputs), never a copy: only time and payloads (None) are
simulated.

Model (both simulations):

* a request arrives (prefill is done elsewhere: its KV holds ``prompt_length`` tokens)
  and is bound for life to the attention rank with the fewest active (arrived, not
  finished) requests, ties to the lowest rank. Every device is an attention rank and
  hosts the experts ``expert_device`` places on it (default
  :func:`~moejax.asyncmoe.engine.contiguous_placement`);
* decode step s of a request (0 <= s < decode_tokens) runs attention and the MoE layer of
  every block, then the LM head + sampler on its rank; the head's end is the step's
  token completion, and step s + 1 enters block 0 at that instant. Attention of a token
  at step s sees context ``prompt_length + s + 1`` (:mod:`~moejax.asyncmoe.records`);
* the head (:meth:`CostTables.head_s`) is charged after the last block, on the rank:
  in the μ-queue simulation as a schedulable head batch, in the EP baseline as a phase
  at the end of every step;
* transfers between devices take ``link_latency_s + bytes / link_bandwidth_Bps`` with
  bytes = tokens × hidden × dtype_bytes; on the same device they are free and instant.

μ-queue simulation (:func:`simulate_mu_queue`): the runtime's own event loop
(:class:`~moejax.asyncmoe.loop.MuQueueLoop`: event order, scheduling, routing of
outputs, merges) with :class:`RoutingExecutor`, which replays the routing and carries no
payloads. A batch takes ``attention_s(n, mean context of its tokens)``, ``expert_s(n)``
or ``head_s(n)``.

EP baseline (:func:`simulate_sync_ep`): lock-step decode steps over the running
requests; arrivals join at step boundaries. Per block: max over ranks of attention, the
all-to-all dispatch (the largest bytes any device sends to other devices), max over
devices of Σ over its active experts of expert_s(rows), the combine back; then the
head (max over ranks). Every phase waits for the slowest device.

Stall fraction (both): of the device-time during which some request is active, the
fraction a device spent not computing. In the μ-queue simulation a device only idles
when its queues are empty, so this is idle time while tokens were elsewhere (in other
queues, in flight, in a token pool); in EP it is the waiting for the slowest device and
for the all-to-all.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from moejax.asyncmoe.engine import (Batch, DeviceEngine, Merged, contiguous_placement,
                                    device_units)
# (the results' types are re-exported: the simulator's callers read them from here)
from moejax.asyncmoe.loop import (MU_QUEUE, SYNC_EP, ExecutedBatch, MuQueueLoop,  # noqa: F401
                                  RequestProgress, RequestTiming, SimResult, assign_rank)
from moejax.asyncmoe.records import ATTENTION, ATTENTION_UNIT, EXPERT, HEAD_UNIT
from moejax.asyncmoe.schedulers import Scheduler, make_scheduler

TABLE_KEYS = ("attention", "expert", "head", "batch_overhead_s", "link")
"""The keys of a cost-table dict (:meth:`CostTables.from_dict`); "meta" may be added."""
META_KEY = "meta"



ROUTING_CHUNK_STEPS = 64
"""Decode steps of one request and block whose synthetic routing is drawn at once."""
ROUTING_CACHE_CHUNKS = 1 << 16
"""Drawn chunks :class:`SkewedRouting` keeps (least recently used dropped; a dropped
chunk is redrawn identically when asked again)."""



# ----------------------------------------------------------------------------- checks
def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _nonnegative(name: str, value: Any) -> float:
    value = _number(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def _positive(name: str, value: Any) -> float:
    value = _number(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def _int_at_least(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _grid(name: str, values: Any) -> tuple[float, ...]:
    """A measured axis: a non-empty, strictly increasing list of positive numbers."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)) \
            or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list of numbers, got {values!r}")
    grid = tuple(_positive(f"{name}[{i}]", v) for i, v in enumerate(values))
    if any(b <= a for a, b in zip(grid, grid[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {list(grid)}")
    return grid


def _seconds_row(name: str, values: Any, length: int) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)) \
            or len(values) != length:
        raise ValueError(f"{name} must be a list of {length} seconds, got {values!r}")
    return tuple(_nonnegative(f"{name}[{i}]", v) for i, v in enumerate(values))


def _segment(x: float, grid: tuple[float, ...]) -> tuple[int, float]:
    """(i, t) with x = grid[i] + t·(grid[i+1] − grid[i]), i clamped to the end segments
    (t < 0 or t > 1 extrapolates linearly); (0, 0.0) on a one-point grid."""
    if len(grid) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def _interp1(x: float, grid: tuple[float, ...], values: tuple[float, ...]) -> float:
    i, t = _segment(x, grid)
    if len(grid) == 1:
        return values[0]
    return values[i] + t * (values[i + 1] - values[i])


# ----------------------------------------------------------------------------- costs
@dataclasses.dataclass(frozen=True)
class CostTables:
    """Measured execution and transfer costs, in seconds.

    * attention: ``attention_seconds[i][j]`` for a batch of ``attention_batch[i]`` tokens
      at context ``attention_context[j]`` (one block: the top-k merge, attention, gate);
    * expert: ``expert_seconds[i]`` for ``expert_batch[i]`` tokens (one expert, one
      block);
    * head: ``head_seconds[i]`` for ``head_batch[i]`` tokens (final norm, LM head,
      sampling);
    * ``batch_overhead_s``: a fixed cost added to every execution (scheduling, gathering
      the batch's inputs, launch) on top of the grid;
    * link: ``link_latency_s + bytes / link_bandwidth_Bps`` per transfer.

    Between grid points costs are (bi)linear; beyond them they extrapolate the end
    segments linearly (a one-point axis is constant), floored at 0."""

    attention_batch: tuple[float, ...]
    attention_context: tuple[float, ...]
    attention_seconds: tuple[tuple[float, ...], ...]
    expert_batch: tuple[float, ...]
    expert_seconds: tuple[float, ...]
    head_batch: tuple[float, ...]
    head_seconds: tuple[float, ...]
    batch_overhead_s: float
    link_latency_s: float
    link_bandwidth_Bps: float

    def __post_init__(self) -> None:
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        fix("attention_batch", _grid("attention.batch", self.attention_batch))
        fix("attention_context", _grid("attention.context", self.attention_context))
        rows = self.attention_seconds
        if isinstance(rows, (str, bytes)) or not isinstance(rows, (Sequence, np.ndarray)) \
                or len(rows) != len(self.attention_batch):
            raise ValueError(f"attention.seconds must have one row per batch size "
                             f"({len(self.attention_batch)}), got {rows!r}")
        fix("attention_seconds", tuple(
            _seconds_row(f"attention.seconds[{i}]", row, len(self.attention_context))
            for i, row in enumerate(rows)))
        for part in ("expert", "head"):
            fix(f"{part}_batch", _grid(f"{part}.batch", getattr(self, f"{part}_batch")))
            fix(f"{part}_seconds", _seconds_row(f"{part}.seconds",
                                                getattr(self, f"{part}_seconds"),
                                                len(getattr(self, f"{part}_batch"))))
        fix("batch_overhead_s", _nonnegative("batch_overhead_s", self.batch_overhead_s))
        fix("link_latency_s", _nonnegative("link.latency_s", self.link_latency_s))
        fix("link_bandwidth_Bps", _positive("link.bandwidth_Bps", self.link_bandwidth_Bps))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostTables:
        """From ``{"attention": {"batch", "context", "seconds"}, "expert": {"batch",
        "seconds"}, "head": {"batch", "seconds"}, "batch_overhead_s", "link":
        {"latency_s", "bandwidth_Bps"}}`` (and an optional "meta", ignored), the shape of
        a JSON cost file. ValueError naming a missing, unknown or bad entry."""
        if not isinstance(data, Mapping):
            raise ValueError(f"cost tables must be a dict, got {type(data).__name__}")
        _check_keys("cost tables", data, TABLE_KEYS, optional=(META_KEY,))
        attention = _section(data, "attention", ("batch", "context", "seconds"))
        expert = _section(data, "expert", ("batch", "seconds"))
        head = _section(data, "head", ("batch", "seconds"))
        link = _section(data, "link", ("latency_s", "bandwidth_Bps"))
        return cls(attention["batch"], attention["context"], attention["seconds"],
                   expert["batch"], expert["seconds"], head["batch"], head["seconds"],
                   data["batch_overhead_s"], link["latency_s"], link["bandwidth_Bps"])

    def to_dict(self) -> dict[str, Any]:
        """The :meth:`from_dict` form (JSON-serializable)."""
        return {"attention": {"batch": list(self.attention_batch),
                              "context": list(self.attention_context),
                              "seconds": [list(row) for row in self.attention_seconds]},
                "expert": {"batch": list(self.expert_batch),
                           "seconds": list(self.expert_seconds)},
                "head": {"batch": list(self.head_batch), "seconds": list(self.head_seconds)},
                "batch_overhead_s": self.batch_overhead_s,
                "link": {"latency_s": self.link_latency_s,
                         "bandwidth_Bps": self.link_bandwidth_Bps}}

    def attention_s(self, batch: int, context: float) -> float:
        """One attention execution of ``batch`` tokens at (mean) ``context``."""
        batch = _int_at_least("attention batch", batch, 1)
        i, t = _segment(float(batch), self.attention_batch)
        j, u = _segment(float(context), self.attention_context)
        grid = self.attention_seconds
        i1 = min(i + 1, len(grid) - 1)
        j1 = min(j + 1, len(grid[0]) - 1)
        value = ((1 - t) * ((1 - u) * grid[i][j] + u * grid[i][j1])
                 + t * ((1 - u) * grid[i1][j] + u * grid[i1][j1]))
        return self.batch_overhead_s + max(value, 0.0)

    def expert_s(self, batch: int) -> float:
        """One expert execution of ``batch`` tokens."""
        batch = _int_at_least("expert batch", batch, 1)
        return self.batch_overhead_s + max(
            _interp1(float(batch), self.expert_batch, self.expert_seconds), 0.0)

    def head_s(self, batch: int) -> float:
        """One head (LM head + sampler) execution of ``batch`` tokens."""
        batch = _int_at_least("head batch", batch, 1)
        return self.batch_overhead_s + max(
            _interp1(float(batch), self.head_batch, self.head_seconds), 0.0)

    def link_s(self, nbytes: float) -> float:
        """One transfer of ``nbytes`` between two devices (0 for nothing to send)."""
        nbytes = _nonnegative("bytes", nbytes)
        return self.link_latency_s + nbytes / self.link_bandwidth_Bps if nbytes else 0.0


def _check_keys(where: str, data: Mapping[str, Any], required: Sequence[str],
                optional: Sequence[str] = ()) -> None:
    missing = [key for key in required if key not in data]
    unknown = sorted(str(key) for key in data if key not in required and key not in optional)
    if missing or unknown:
        raise ValueError(f"{where}: " + "; ".join(
            ([f"missing {missing}"] if missing else [])
            + ([f"unknown {unknown}"] if unknown else []))
            + f" (expects {list(required)})")


def _section(data: Mapping[str, Any], name: str, keys: Sequence[str]) -> Mapping[str, Any]:
    section = data[name]
    if not isinstance(section, Mapping):
        raise ValueError(f"cost tables: {name!r} must be a dict with {list(keys)}, got "
                         f"{section!r}")
    _check_keys(f"cost tables {name!r}", section, keys)
    return section


# ----------------------------------------------------------------------------- routing
class Routing(Protocol):
    """Where each token goes: the top-k expert ids and gate weights of a request's
    token at a decode step and block. Must be a pure function of its arguments (both
    simulations and repeated runs see the same routing)."""

    num_experts: int
    top_k: int

    def topk(self, request_id: int, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]: ...


class TraceRouting:
    """Recorded routing: per request, ``ids[request]`` [L, steps, k] expert ids (distinct
    per token) and ``weights[request]`` [L, steps, k] gate weights."""

    def __init__(self, ids: Mapping[int, Any], weights: Mapping[int, Any],
                 num_experts: int) -> None:
        self.num_experts = _int_at_least("num_experts", num_experts, 1)
        if set(ids) != set(weights):
            raise ValueError(f"TraceRouting: ids and weights cover different requests: "
                             f"{sorted(set(ids) ^ set(weights))}")
        if not ids:
            raise ValueError("TraceRouting: no requests")
        self._ids: dict[int, np.ndarray] = {}
        self._weights: dict[int, np.ndarray] = {}
        top_k = None
        for request in sorted(ids):
            rid = np.array(ids[request])
            w = np.array(weights[request], dtype=np.float64)
            where = f"TraceRouting request {request}"
            if rid.ndim != 3 or w.shape != rid.shape or min(rid.shape) < 1:
                raise ValueError(f"{where}: ids {rid.shape} and weights {w.shape} must both "
                                 f"be [layers, steps, k] with each >= 1")
            if not np.issubdtype(rid.dtype, np.integer) or rid.min() < 0 \
                    or rid.max() >= self.num_experts:
                raise ValueError(f"{where}: ids must be expert ids in [0, "
                                 f"{self.num_experts}), got dtype {rid.dtype}, range "
                                 f"[{rid.min()}, {rid.max()}]")
            if np.any(np.diff(np.sort(rid, axis=-1), axis=-1) == 0):
                raise ValueError(f"{where}: a token repeats an expert in its top-k")
            if not np.all(np.isfinite(w)):
                raise ValueError(f"{where}: weights must be finite")
            if top_k is not None and rid.shape[2] != top_k:
                raise ValueError(f"{where}: k = {rid.shape[2]}, other requests have {top_k}")
            top_k = rid.shape[2]
            rid.setflags(write=False)
            w.setflags(write=False)
            self._ids[int(request)] = rid
            self._weights[int(request)] = w
        self.top_k = int(top_k)

    def topk(self, request_id: int, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self._ids.get(request_id)
        if ids is None:
            raise ValueError(f"TraceRouting has no request {request_id}")
        if not (0 <= layer < ids.shape[0] and 0 <= step < ids.shape[1]):
            raise ValueError(f"TraceRouting request {request_id}: (step {step}, layer "
                             f"{layer}) outside its {ids.shape[1]} steps x {ids.shape[0]} "
                             f"layers")
        return ids[layer, step], self._weights[request_id][layer, step]


class SkewedRouting:
    """Synthetic routing with the seed's exponential load skew (§5): expert e has
    popularity p_e ∝ exp(−skew · rank_e), rank_e its position in one permutation drawn
    from ``seed`` (the same for every block); a token draws its k distinct experts
    without replacement from p (successive sampling, drawn as Gumbel-top-k: the k largest
    log p_e + Gumbel noise). ``skew`` = 0 is uniform routing (the control). Gate weights:
    the drawn experts' p, normalized to sum 1.

    The noise of (request, layer) comes in chunks of :data:`ROUTING_CHUNK_STEPS` steps,
    chunk c from a generator seeded by (seed, request, layer, c), so a token's experts
    depend on (seed, request, step, layer) only, never on call order or on which chunks
    are still cached (:data:`ROUTING_CACHE_CHUNKS`)."""

    def __init__(self, num_experts: int, k: int, skew: float, seed: int) -> None:
        self.num_experts = _int_at_least("num_experts", num_experts, 1)
        self.top_k = _int_at_least("k", k, 1)
        if self.top_k > self.num_experts:
            raise ValueError(f"SkewedRouting: k = {k} exceeds the {num_experts} experts")
        self.skew = _nonnegative("skew", skew)
        self.seed = _int_at_least("seed", seed, 0)
        order = np.random.default_rng(self.seed).permutation(self.num_experts)
        rank = np.empty(self.num_experts, dtype=np.int64)
        rank[order] = np.arange(self.num_experts)
        popularity = np.exp(-self.skew * rank)
        self.popularity = popularity / popularity.sum()
        self.popularity.setflags(write=False)
        self._log_popularity = -self.skew * rank
        self._chunks: collections.OrderedDict[tuple[int, int, int],
                                              tuple[np.ndarray, np.ndarray]] = \
            collections.OrderedDict()

    def topk(self, request_id: int, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        request_id = _int_at_least("request_id", request_id, 0)
        step = _int_at_least("step", step, 0)
        layer = _int_at_least("layer", layer, 0)
        chunk, row = divmod(step, ROUTING_CHUNK_STEPS)
        key = (request_id, layer, chunk)
        if key in self._chunks:
            self._chunks.move_to_end(key)
        else:
            if len(self._chunks) >= ROUTING_CACHE_CHUNKS:
                self._chunks.popitem(last=False)
            rng = np.random.default_rng((self.seed, request_id, layer, chunk))
            keys = self._log_popularity + rng.gumbel(
                size=(ROUTING_CHUNK_STEPS, self.num_experts))
            ids = np.argsort(-keys, axis=1, kind="stable")[:, :self.top_k]
            weights = self.popularity[ids]
            weights = weights / weights.sum(axis=1, keepdims=True)
            ids.setflags(write=False)
            weights.setflags(write=False)
            self._chunks[key] = (ids, weights)
        ids, weights = self._chunks[key]
        return ids[row], weights[row]


# ----------------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class SimRequest:
    """One request: it arrives at ``arrival_s`` with ``prompt_length`` tokens already in
    its KV cache (prefill is outside the simulation) and generates ``decode_tokens``."""

    request_id: int
    arrival_s: float
    prompt_length: int
    decode_tokens: int

    def __post_init__(self) -> None:
        rid = _int_at_least("request_id", self.request_id, 0)
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        fix("request_id", rid)
        fix("arrival_s", _nonnegative(f"request {rid} arrival_s", self.arrival_s))
        fix("prompt_length", _int_at_least(f"request {rid} prompt_length",
                                           self.prompt_length, 0))
        fix("decode_tokens", _int_at_least(f"request {rid} decode_tokens",
                                           self.decode_tokens, 1))


def poisson_workload(num_requests: int, rate_per_s: float, prompt_length: tuple[int, int],
                     decode_tokens: tuple[int, int], seed: int) -> tuple[SimRequest, ...]:
    """``num_requests`` requests (ids 0..n-1) arriving as a Poisson process of
    ``rate_per_s`` from t = 0, with prompt and decode lengths uniform over the inclusive
    ranges (as the seed's workloads, §5)."""
    num_requests = _int_at_least("num_requests", num_requests, 1)
    rate = _positive("rate_per_s", rate_per_s)
    for name, (lo, hi) in (("prompt_length", prompt_length),
                           ("decode_tokens", decode_tokens)):
        if _int_at_least(f"{name} low", lo, 0) > _int_at_least(f"{name} high", hi, 0):
            raise ValueError(f"{name} range ({lo}, {hi}) is empty")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=num_requests))
    prompts = rng.integers(prompt_length[0], prompt_length[1] + 1, size=num_requests)
    decodes = rng.integers(decode_tokens[0], decode_tokens[1] + 1, size=num_requests)
    return tuple(SimRequest(i, float(a), int(p), int(d))
                 for i, (a, p, d) in enumerate(zip(arrivals, prompts, decodes)))


def _check_workload(workload: Sequence[SimRequest]) -> list[SimRequest]:
    requests = list(workload)
    if not requests:
        raise ValueError("workload has no requests")
    for request in requests:
        if not isinstance(request, SimRequest):
            raise ValueError(f"workload entries must be SimRequest, got {request!r}")
    ids = [r.request_id for r in requests]
    if len(set(ids)) != len(ids):
        raise ValueError(f"workload repeats request ids: "
                         f"{sorted(i for i, c in collections.Counter(ids).items() if c > 1)}")
    return sorted(requests, key=lambda r: (r.arrival_s, r.request_id))


# ----------------------------------------------------------------------------- results
# ----------------------------------------------------------------------------- setup
@dataclasses.dataclass(frozen=True)
class _Setup:
    num_devices: int
    num_layers: int
    num_experts: int
    top_k: int
    bytes_per_token: int
    expert_device: tuple[int, ...]


def _setup(routing: Routing, num_devices: int, num_layers: int, num_experts: int,
           top_k: int, hidden: int, dtype_bytes: int,
           expert_device: Sequence[int] | None) -> _Setup:
    num_devices = _int_at_least("num_devices", num_devices, 1)
    num_layers = _int_at_least("num_layers", num_layers, 1)
    num_experts = _int_at_least("num_experts", num_experts, 1)
    top_k = _int_at_least("top_k", top_k, 1)
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} exceeds the {num_experts} experts")
    if (routing.num_experts, routing.top_k) != (num_experts, top_k):
        raise ValueError(f"routing is for {routing.num_experts} experts, top-{routing.top_k}; "
                         f"the model has {num_experts}, top-{top_k}")
    bytes_per_token = (_int_at_least("hidden", hidden, 1)
                       * _int_at_least("dtype_bytes", dtype_bytes, 1))
    if expert_device is None:
        placement = contiguous_placement(num_experts, num_devices)
    else:
        placement = tuple(int(d) for d in expert_device)
        if len(placement) != num_experts or any(not 0 <= d < num_devices for d in placement):
            raise ValueError(f"expert_device must give each of the {num_experts} experts a "
                             f"device in [0, {num_devices}), got {list(expert_device)}")
    return _Setup(num_devices, num_layers, num_experts, top_k, bytes_per_token, placement)


def _batch_seconds(tables: CostTables, batch: Batch) -> float:
    if batch.kind == ATTENTION:
        context = sum(r.context for r in batch.records) / batch.size
        return tables.attention_s(batch.size, context)
    if batch.kind == EXPERT:
        return tables.expert_s(batch.size)
    return tables.head_s(batch.size)


# ----------------------------------------------------------------------------- μ-queue
def simulate_mu_queue(tables: CostTables, routing: Routing, workload: Sequence[SimRequest],
                      num_devices: int, num_layers: int, num_experts: int, top_k: int,
                      scheduler: Scheduler | str, hidden: int, dtype_bytes: int,
                      expert_device: Sequence[int] | None = None) -> SimResult:
    """AsyncMoE decode of ``workload`` on ``num_devices`` devices, each a
    :class:`DeviceEngine` with ``scheduler`` (an object or a name for
    :func:`make_scheduler` with its defaults), in :class:`~moejax.asyncmoe.loop.MuQueueLoop`
    (the runtime's loop) with :class:`RoutingExecutor`. Module docstring for the model.
    RuntimeError if the run ends with a request unfinished."""
    setup = _setup(routing, num_devices, num_layers, num_experts, top_k, hidden,
                   dtype_bytes, expert_device)
    if isinstance(scheduler, str):
        scheduler = make_scheduler(scheduler)
    requests = _check_workload(workload)
    engines = [DeviceEngine(d, setup.num_layers, device_units(d, setup.expert_device),
                            scheduler, setup.top_k, setup.expert_device)
               for d in range(setup.num_devices)]
    loop = MuQueueLoop(engines, RoutingExecutor(routing, requests),
                       lambda batch: _batch_seconds(tables, batch), tables.link_s,
                       setup.bytes_per_token)
    result = loop.run(requests)
    unfinished = [r for r in requests
                  if len(loop.progress[r.request_id].token_times) < r.decode_tokens]
    if unfinished:
        raise RuntimeError(f"μ-queue simulation ended with {len(unfinished)} requests "
                           f"unfinished, e.g. request {unfinished[0].request_id}")
    return result


class RoutingExecutor:
    """The simulator's executor: no arithmetic, no payloads; attention batches take their
    top-k from ``routing``, and a request decodes ``decode_tokens`` steps."""

    def __init__(self, routing: Routing, requests: Sequence[SimRequest]) -> None:
        self.routing = routing
        self.decode_tokens = {r.request_id: r.decode_tokens for r in requests}

    def start(self, request: SimRequest, rank: int) -> tuple[bool, Any]:
        return True, None

    def attention(self, device: int, batch: Batch) -> tuple[Any, Any, None]:
        choices = [self.routing.topk(r.request_id, r.step, r.layer) for r in batch.records]
        return (np.array([ids for ids, _ in choices]), np.array([w for _, w in choices]),
                None)

    def expert(self, device: int, batch: Batch) -> None:
        return None

    def merge(self, device: int, merged: Merged) -> None:
        return None

    def head(self, device: int, batch: Batch) -> list[tuple[bool, None]]:
        return [(r.step + 1 < self.decode_tokens[r.request_id], None) for r in batch.records]


# ----------------------------------------------------------------------------- sync EP
def simulate_sync_ep(tables: CostTables, routing: Routing, workload: Sequence[SimRequest],
                     num_devices: int, num_layers: int, num_experts: int, top_k: int,
                     hidden: int, dtype_bytes: int,
                     expert_device: Sequence[int] | None = None) -> SimResult:
    """The synchronous expert-parallel baseline of the same workload, routing and costs
    (module docstring): lock-step decode steps over all running requests; a request
    that arrives during a step joins at the next step boundary (its rank is chosen with
    the active counts at its arrival)."""
    setup = _setup(routing, num_devices, num_layers, num_experts, top_k, hidden,
                   dtype_bytes, expert_device)
    specs = _check_workload(workload)
    g = setup.num_devices
    progress: dict[int, RequestProgress] = {}
    running: list[RequestProgress] = []
    active = [0] * g
    finished: collections.deque[tuple[float, int]] = collections.deque()
    batches: list[ExecutedBatch] = []
    depth: list[tuple[float, int]] = []
    busy_s = stall_s = 0.0
    now = 0.0
    waiting = 0  # index of the next request to admit

    arrivals = [s.arrival_s for s in specs]
    while waiting < len(specs) or running:
        if not running:
            now = max(now, specs[waiting].arrival_s)
        depth.append((now, bisect.bisect_right(arrivals, now) - waiting))
        while waiting < len(specs) and specs[waiting].arrival_s <= now:
            spec = specs[waiting]
            while finished and finished[0][0] <= spec.arrival_s:
                active[finished.popleft()[1]] -= 1
            rank = assign_rank(active)
            active[rank] += 1
            request = RequestProgress(spec, rank)
            progress[spec.request_id] = request
            running.append(request)
            waiting += 1

        step_start = now
        device_busy = [0.0] * g
        per_rank = [[r for r in running if r.rank == d] for d in range(g)]
        for layer in range(setup.num_layers):
            now = _sync_attention(tables, per_rank, layer, now, batches, device_busy)
            rows = [0] * setup.num_experts
            sent = [0] * g
            returned = [0] * g
            for request in running:
                ids, _ = routing.topk(request.spec.request_id, len(request.token_times), layer)
                for expert in ids:
                    expert = int(expert)
                    rows[expert] += 1
                    if setup.expert_device[expert] != request.rank:
                        sent[request.rank] += 1
                        returned[setup.expert_device[expert]] += 1
            now += tables.link_s(max(sent) * setup.bytes_per_token)
            now = _sync_experts(tables, setup, rows, layer, now, batches, device_busy)
            now += tables.link_s(max(returned) * setup.bytes_per_token)
        head = [tables.head_s(len(reqs)) if reqs else 0.0 for reqs in per_rank]
        for device, seconds in enumerate(head):
            if seconds:
                batches.append(ExecutedBatch(now, device, setup.num_layers - 1, HEAD_UNIT,
                                             len(per_rank[device]), now + seconds))
                device_busy[device] += seconds
        now += max(head)
        busy_s += sum(device_busy)
        stall_s += g * (now - step_start) - sum(device_busy)

        still = []
        for request in running:
            request.token_times.append(now)
            if len(request.token_times) < request.spec.decode_tokens:
                still.append(request)
            else:
                finished.append((now, request.rank))
        running = still

    total = stall_s + busy_s
    return SimResult(SYNC_EP, tuple(progress[s.request_id].timing() for s in specs),
                     tuple(sorted(batches, key=lambda b: (b.time, b.device))),
                     tuple(depth), stall_s / total if total > 0 else 0.0, 0, 0)


def _sync_attention(tables: CostTables, per_rank: list[list[RequestProgress]], layer: int,
                    now: float, batches: list[ExecutedBatch],
                    device_busy: list[float]) -> float:
    """The attention phase of one block: every rank at once; returns its end."""
    longest = 0.0
    for device, requests in enumerate(per_rank):
        if not requests:
            continue
        context = sum(r.spec.prompt_length + len(r.token_times) + 1
                      for r in requests) / len(requests)
        seconds = tables.attention_s(len(requests), context)
        batches.append(ExecutedBatch(now, device, layer, ATTENTION_UNIT, len(requests),
                                     now + seconds))
        device_busy[device] += seconds
        longest = max(longest, seconds)
    return now + longest


def _sync_experts(tables: CostTables, setup: _Setup, rows: list[int], layer: int,
                  now: float, batches: list[ExecutedBatch],
                  device_busy: list[float]) -> float:
    """The expert phase of one block: each device runs its active experts one after
    another (ascending id); returns the end of the slowest device."""
    elapsed = [0.0] * setup.num_devices
    for expert, count in enumerate(rows):
        if not count:
            continue
        device = setup.expert_device[expert]
        seconds = tables.expert_s(count)
        start = now + elapsed[device]
        batches.append(ExecutedBatch(start, device, layer, expert, count, start + seconds))
        elapsed[device] += seconds
        device_busy[device] += seconds
    return now + max(elapsed)

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
  finished) requests, ties to the lowest rank. By default every device is an attention
  rank and hosts the experts ``expert_device`` places on it (default
  :func:`~moejax.asyncmoe.placement.contiguous_placement`). The μ-queue simulation also
  takes the options of :func:`~moejax.asyncmoe.placement.make_placement`:
  ``attention_devices`` apart from the expert devices (seed §3.3: attention
  disaggregated from experts), and expert replicas with a ``replica_routing`` policy
  (``moejax.asyncmoe.replicas``: "home", "round_robin", METRO's "metro"). The EP baseline
  is always colocated and unreplicated (each expert on its home device);
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
from collections.abc import Sequence
from typing import Any

import numpy as np

from moejax.asyncmoe.engine import Batch, DeviceEngine, Merged
# (the results' types are re-exported: the simulator's callers read them from here)
from moejax.asyncmoe.loop import (MU_QUEUE, SYNC_EP, ExecutedBatch, MuQueueLoop,  # noqa: F401
                                  RequestProgress, RequestTiming, SimResult, assign_rank)
from moejax.asyncmoe.records import ATTENTION, ATTENTION_UNIT, EXPERT, HEAD_UNIT
from moejax.asyncmoe.schedulers import QueueScheduler, make_scheduler
# Cost tables and routing sources live in their own modules; re-exported here.
from moejax.asyncmoe.checks import int_at_least, nonnegative, positive
from moejax.asyncmoe.costs import CostTables  # noqa: F401
from moejax.asyncmoe.routing import RoutingSource, SkewedRouting, TraceRouting  # noqa: F401
from moejax.asyncmoe.placement import Placement, make_placement
from moejax.asyncmoe.replicas import HOME, check_replica_routing







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
        rid = int_at_least("request_id", self.request_id, 0)
        fix = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        fix("request_id", rid)
        fix("arrival_s", nonnegative(f"request {rid} arrival_s", self.arrival_s))
        fix("prompt_length", int_at_least(f"request {rid} prompt_length",
                                           self.prompt_length, 0))
        fix("decode_tokens", int_at_least(f"request {rid} decode_tokens",
                                           self.decode_tokens, 1))


def poisson_workload(num_requests: int, rate_per_s: float, prompt_length: tuple[int, int],
                     decode_tokens: tuple[int, int], seed: int) -> tuple[SimRequest, ...]:
    """``num_requests`` requests (ids 0..n-1) arriving as a Poisson process of
    ``rate_per_s`` from t = 0, with prompt and decode lengths uniform over the inclusive
    ranges (as the seed's workloads, §5)."""
    num_requests = int_at_least("num_requests", num_requests, 1)
    rate = positive("rate_per_s", rate_per_s)
    for name, (lo, hi) in (("prompt_length", prompt_length),
                           ("decode_tokens", decode_tokens)):
        if int_at_least(f"{name} low", lo, 0) > int_at_least(f"{name} high", hi, 0):
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
    placement: Placement

    @property
    def expert_device(self) -> tuple[int, ...]:
        """Each expert's home device."""
        return self.placement.home


def _setup(routing: RoutingSource, num_devices: int, num_layers: int, num_experts: int,
           top_k: int, hidden: int, dtype_bytes: int,
           expert_device: Sequence[int | Sequence[int]] | None,
           attention_devices: Sequence[int] | None = None,
           expert_devices: Sequence[int] | None = None, replicas: int = 1) -> _Setup:
    num_devices = int_at_least("num_devices", num_devices, 1)
    num_layers = int_at_least("num_layers", num_layers, 1)
    num_experts = int_at_least("num_experts", num_experts, 1)
    top_k = int_at_least("top_k", top_k, 1)
    if top_k > num_experts:
        raise ValueError(f"top_k = {top_k} exceeds the {num_experts} experts")
    if (routing.num_experts, routing.top_k) != (num_experts, top_k):
        raise ValueError(f"routing is for {routing.num_experts} experts, top-{routing.top_k}; "
                         f"the model has {num_experts}, top-{top_k}")
    bytes_per_token = (int_at_least("hidden", hidden, 1)
                       * int_at_least("dtype_bytes", dtype_bytes, 1))
    placement = make_placement(num_experts, num_devices, attention_devices=attention_devices,
                               expert_devices=expert_devices, expert_device=expert_device,
                               replicas=replicas)
    return _Setup(num_devices, num_layers, num_experts, top_k, bytes_per_token, placement)


def _batch_seconds(tables: CostTables, batch: Batch) -> float:
    if batch.kind == ATTENTION:
        context = sum(r.context for r in batch.records) / batch.size
        return tables.attention_s(batch.size, context)
    if batch.kind == EXPERT:
        return tables.expert_s(batch.size)
    return tables.head_s(batch.size)


# ----------------------------------------------------------------------------- μ-queue
def simulate_mu_queue(tables: CostTables, routing: RoutingSource, workload: Sequence[SimRequest],
                      num_devices: int, num_layers: int, num_experts: int, top_k: int,
                      scheduler: QueueScheduler | str, hidden: int, dtype_bytes: int,
                      expert_device: Sequence[int | Sequence[int]] | None = None, *,
                      attention_devices: Sequence[int] | None = None,
                      expert_devices: Sequence[int] | None = None, replicas: int = 1,
                      replica_routing: str = HOME) -> SimResult:
    """AsyncMoE decode of ``workload`` on ``num_devices`` devices, each a
    :class:`DeviceEngine` with ``scheduler`` (an object or a name for
    :func:`make_scheduler` with its defaults), in :class:`~moejax.asyncmoe.loop.MuQueueLoop`
    (the runtime's loop) with :class:`RoutingExecutor`. ``attention_devices``,
    ``expert_devices``, ``expert_device`` and ``replicas``: the layout
    (:func:`~moejax.asyncmoe.placement.make_placement`; default every device both, one
    replica per expert); ``replica_routing``: ``moejax.asyncmoe.replicas``. Module
    docstring for the model. RuntimeError if the run ends with a request unfinished."""
    setup = _setup(routing, num_devices, num_layers, num_experts, top_k, hidden,
                   dtype_bytes, expert_device, attention_devices, expert_devices, replicas)
    replica_routing = check_replica_routing(replica_routing)
    if isinstance(scheduler, str):
        scheduler = make_scheduler(scheduler)
    requests = _check_workload(workload)
    placement = setup.placement
    engines = [DeviceEngine(d, setup.num_layers, placement.units(d), scheduler, setup.top_k,
                            placement.expert_replicas, replica_routing)
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


def replay_outputs(outputs: Sequence[Any], prompt_lengths: Sequence[int],
                   arrivals: Sequence[float], tables: CostTables, num_devices: int,
                   num_layers: int, num_experts: int, top_k: int, scheduler: QueueScheduler | str,
                   hidden: int, dtype_bytes: int,
                   expert_device: Sequence[int | Sequence[int]] | None = None, *,
                   attention_devices: Sequence[int] | None = None,
                   expert_devices: Sequence[int] | None = None, replicas: int = 1,
                   replica_routing: str = HOME) -> SimResult:
    """The simulation of what a real run decoded: every request of ``outputs`` (the
    runtime's ``SequenceOutput`` s, with their recorded ``decode_experts`` /
    ``decode_weights``) that ran a decode step, arriving at ``arrivals``, replaying its
    own routing. With the runtime's costs (``CostTables.uniform()`` for its default
    clock) and layout (the placement options of :func:`simulate_mu_queue`) it runs the
    same batches in the same order."""
    decoding = [i for i, out in enumerate(outputs) if len(out.token_ids) > 1]
    routing = TraceRouting({i: outputs[i].decode_experts for i in decoding},
                           {i: outputs[i].decode_weights for i in decoding}, num_experts)
    workload = [SimRequest(i, arrivals[i], prompt_lengths[i], len(outputs[i].token_ids) - 1)
                for i in decoding]
    return simulate_mu_queue(tables, routing, workload, num_devices, num_layers, num_experts,
                             top_k, scheduler, hidden, dtype_bytes, expert_device,
                             attention_devices=attention_devices,
                             expert_devices=expert_devices, replicas=replicas,
                             replica_routing=replica_routing)


class RoutingExecutor:
    """The simulator's executor: no arithmetic, no payloads; attention batches take their
    top-k from ``routing``, and a request decodes ``decode_tokens`` steps."""

    def __init__(self, routing: RoutingSource, requests: Sequence[SimRequest]) -> None:
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
def simulate_sync_ep(tables: CostTables, routing: RoutingSource, workload: Sequence[SimRequest],
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

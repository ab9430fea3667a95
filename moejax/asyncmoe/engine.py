"""One device's AsyncMoE execution engine (seed §3.2), payload-agnostic.

A :class:`DeviceEngine` decides what its device runs next and where outputs go; it never
computes. A driver (the discrete-event simulator, or a real runtime) owns the clock and
the arithmetic and talks to it through five calls:

1. ``enqueue(record)`` — an input arrives: an attention input for a request on this
   rank (a new decode step at block 0, or block b+1 after block b merged), an expert
   input for an expert hosted here, or a head input (a request's last block merged);
2. ``receive(record)`` — an expert *output* comes back to the request's rank; it goes to
   the token pool, and when all k parts of a (request, step, block) are in, a
   :class:`Merged` is returned. The driver combines Σ weight · output (+ residual) its
   own way and enqueues ``merged.next_record(payload)``: block b+1's attention input,
   or after the last block the head input. (``deliver`` does 1 or 2 for every record
   that :meth:`DeviceEngine.route` produced on another engine, by the kind of batch
   that produced them.)
3. ``next_batch()`` — when the device is idle: the scheduler picks a μ-queue, which is
   drained whole, FIFO, into a :class:`Batch`;
4. (the driver executes the batch);
5. ``route(batch, topk_experts, topk_weights, outputs)`` — where the outputs go: an
   attention batch's tokens become k expert records each (slot j, gate weight w_j, the
   token's output as payload) for ``expert_device[e]`` (with replicas: the one
   ``replica_routing`` picks for the batch, ``moejax.asyncmoe.replicas``); an expert
   batch's outputs go back to each request's rank. A head batch ends its tokens' decode
   step; it is not routed.

Units (queue columns) of a device, in the order the engine gives Q to the scheduler:
the ones listed in ``units`` — -1 attention and -2 head (both, for a device that is an
attention rank, or neither), and exactly the experts ``expert_device`` places here.
:func:`device_units` lists them in the default order (attention, head, experts
ascending). Every (block, unit) pair is a μ-queue; Q is [num_layers, len(units)].
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from moejax.asyncmoe.checks import int_at_least
from moejax.asyncmoe.placement import replica_sets
from moejax.asyncmoe.pool import TokenPool
from moejax.asyncmoe.replicas import HOME, check_replica_routing, replica_destinations
from moejax.asyncmoe.records import (ATTENTION, ATTENTION_UNIT, EXPERT, HEAD, HEAD_UNIT,
                                     KINDS, QueueKey, TokenRecord, attention_record,
                                     head_record, queue_key, unit_kind)
from moejax.asyncmoe.schedulers import QueueScheduler


@dataclasses.dataclass(frozen=True)
class Batch:
    """One μ-queue drained for one execution: its block ``layer``, its ``unit`` (-1
    attention, -2 head, else the expert id) and its records in arrival (FIFO) order."""

    layer: int
    unit: int
    records: tuple[TokenRecord, ...]

    @property
    def kind(self) -> str:
        """"attention", "head" or "expert"."""
        return unit_kind(self.unit)

    @property
    def size(self) -> int:
        return len(self.records)


@dataclasses.dataclass(frozen=True)
class Merged:
    """All k expert outputs of one token at block ``layer`` have reached its rank:
    ``parts`` ordered by slot (each with its gate ``weight`` and ``payload``)."""

    request_id: int
    step: int
    layer: int
    rank: int
    context: int
    parts: tuple[TokenRecord, ...]
    is_last_layer: bool

    def next_record(self, payload: Any = None) -> TokenRecord:
        """What the merged token (``payload``: the driver's merge) is an input of next:
        attention of block layer + 1, or the head after the last block."""
        if self.is_last_layer:
            return head_record(self.request_id, self.step, self.layer, self.rank,
                               self.context, payload)
        return attention_record(self.request_id, self.step, self.layer + 1, self.rank,
                                self.context, payload)


class DeviceEngineStats:
    """Executions handed out by :meth:`DeviceEngine.next_batch`: how many batches and
    tokens per μ-queue (layer, unit). Start/end times are the driver's to keep."""

    def __init__(self) -> None:
        self.batches: collections.Counter[QueueKey] = collections.Counter()
        self.tokens: collections.Counter[QueueKey] = collections.Counter()

    def record(self, batch: Batch) -> None:
        key = (batch.layer, batch.unit)
        self.batches[key] += 1
        self.tokens[key] += batch.size

    def mean_batch_size(self, kind: str | None = None) -> float:
        """Mean tokens per execution over the queues of ``kind`` ("attention", "expert",
        "head"; None: all); 0.0 if there were none."""
        if kind is not None and kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
        keys = [key for key in self.batches if kind is None or unit_kind(key[1]) == kind]
        count = sum(self.batches[key] for key in keys)
        return sum(self.tokens[key] for key in keys) / count if count else 0.0


class DeviceEngine:
    """The μ-queues, token pool and scheduler of one device (module docstring).

    ``expert_device[e]`` is the device hosting expert e (at every block, seed §3.3), or
    the devices of its replicas (a sequence, home first: ``moejax.asyncmoe.placement``);
    ``units`` lists the queue columns this device hosts (:func:`device_units`);
    ``replica_routing`` picks the replica of each token's expert copy when an attention
    batch is routed (``moejax.asyncmoe.replicas``; "home" without replicas)."""

    def __init__(self, device: int, num_layers: int, units: Sequence[int],
                 scheduler: QueueScheduler, top_k: int,
                 expert_device: Sequence[int | Sequence[int]],
                 replica_routing: str = HOME) -> None:
        self.device = int_at_least("device", device, 0)
        self.num_layers = int_at_least("num_layers", num_layers, 1)
        self.expert_replicas = replica_sets(expert_device)
        self.expert_device = tuple(r[0] for r in self.expert_replicas)   # the homes
        self.replica_routing = check_replica_routing(replica_routing)
        self._home = np.array(self.expert_device, dtype=np.int64)
        self._rotor: dict[int, int] = {}     # round robin's copies dealt per expert
        self.top_k = int_at_least("top_k", top_k, 1)
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k = {top_k} exceeds the {self.num_experts} experts")
        self.units = tuple(int_at_least("unit", u, HEAD_UNIT) for u in units)
        self._check_units()
        if not callable(getattr(scheduler, "choose", None)):
            raise ValueError(f"scheduler must have a choose(queue_lengths) method, got "
                             f"{scheduler!r}")
        self.scheduler = scheduler
        self.pool = TokenPool(self.top_k)
        self.stats = DeviceEngineStats()
        self._column = {unit: col for col, unit in enumerate(self.units)}
        self._queues = [[collections.deque() for _ in self.units]
                        for _ in range(self.num_layers)]
        self._lengths = np.zeros((self.num_layers, len(self.units)), dtype=np.int64)
        self._queued = 0

    def _check_units(self) -> None:
        where = f"device {self.device}"
        if not self.units:
            raise ValueError(f"{where}: units is empty; a device hosts attention + head "
                             f"and/or experts")
        if len(set(self.units)) != len(self.units):
            raise ValueError(f"{where}: units {self.units} repeat a unit")
        if (ATTENTION_UNIT in self.units) != (HEAD_UNIT in self.units):
            raise ValueError(f"{where}: an attention rank hosts both attention "
                             f"({ATTENTION_UNIT}) and the head ({HEAD_UNIT}); units are "
                             f"{self.units}")
        listed = {u for u in self.units if u >= 0}
        placed = {e for e, r in enumerate(self.expert_replicas) if self.device in r}
        if listed != placed:
            raise ValueError(f"{where}: units list experts {sorted(listed)} but "
                             f"expert_device places experts {sorted(placed)} here")

    @property
    def num_experts(self) -> int:
        return len(self.expert_device)

    @property
    def hosts_attention(self) -> bool:
        """Whether this device is an attention rank (holds requests)."""
        return ATTENTION_UNIT in self._column

    # ------------------------------------------------------------------ inputs
    def _check_rank(self, record: TokenRecord) -> None:
        if record.rank != self.device or not self.hosts_attention:
            raise ValueError(f"{record.describe()} does not belong to device {self.device}"
                             + ("" if self.hosts_attention else ", which is not an "
                                "attention rank"))

    def _check_layer(self, record: TokenRecord) -> None:
        if record.layer >= self.num_layers:
            raise ValueError(f"{record.describe()}: layer outside [0, {self.num_layers})")

    def enqueue(self, record: TokenRecord) -> None:
        """Queue an input: attention or head of a request on this rank, or an expert
        input for an expert hosted here. ValueError naming the record otherwise (another
        rank's request, an expert placed elsewhere, a head before the last block, a slot
        outside [0, top_k))."""
        self._check_layer(record)
        if record.kind == EXPERT:
            if record.expert >= self.num_experts \
                    or self.device not in self.expert_replicas[record.expert]:
                raise ValueError(f"{record.describe()} does not belong to device "
                                 f"{self.device}: its experts are "
                                 f"{[u for u in self.units if u >= 0]}")
            if record.slot >= self.top_k:
                raise ValueError(f"{record.describe()}: slot outside [0, {self.top_k})")
        else:
            self._check_rank(record)
            if record.kind == HEAD and record.layer != self.num_layers - 1:
                raise ValueError(f"{record.describe()}: the head follows the last block, "
                                 f"{self.num_layers - 1}")
        layer, unit = queue_key(record)
        col = self._column[unit]
        self._queues[layer][col].append(record)
        self._lengths[layer, col] += 1
        self._queued += 1

    def receive(self, record: TokenRecord) -> Merged | None:
        """An expert output for a request on this rank: into the token pool. Returns the
        :class:`Merged` token once its k parts are in, else None."""
        if record.kind != EXPERT:
            raise ValueError(f"{record.describe()}: receive() takes expert outputs; "
                             f"inputs go to enqueue()")
        self._check_rank(record)
        self._check_layer(record)
        parts = self.pool.add(record)
        if parts is None:
            return None
        return Merged(record.request_id, record.step, record.layer, record.rank,
                      record.context, tuple(parts), record.layer == self.num_layers - 1)

    def deliver(self, records: Iterable[TokenRecord], source_kind: str) -> list[Merged]:
        """Records another engine's :meth:`route` sent here, from a batch of
        ``source_kind``: after "attention" they are expert inputs (enqueued); after
        "expert" they are expert outputs (received). Returns the tokens merged."""
        if source_kind == ATTENTION:
            for record in records:
                self.enqueue(record)
            return []
        if source_kind == EXPERT:
            merged = [self.receive(record) for record in records]
            return [m for m in merged if m is not None]
        raise ValueError(f"deliver: routed records come from an {ATTENTION!r} or "
                         f"{EXPERT!r} batch, got {source_kind!r}")

    # ------------------------------------------------------------------ scheduling
    def queue_lengths(self) -> np.ndarray:
        """Q [num_layers, len(units)]: tokens waiting per μ-queue (a copy)."""
        return self._lengths.copy()

    def queued(self) -> int:
        """Tokens waiting in all μ-queues."""
        return self._queued

    def next_batch(self) -> Batch | None:
        """The scheduler's pick, drained whole in FIFO order; None if all queues are
        empty."""
        choice = self.scheduler.choose(self._lengths.copy())
        if choice is None:
            if self._queued:
                raise RuntimeError(f"device {self.device}: scheduler {self.scheduler!r} "
                                   f"chose nothing with {self.queued()} tokens queued")
            return None
        layer, col = (int(c) for c in choice)
        if not (0 <= layer < self.num_layers and 0 <= col < len(self.units)) \
                or self._lengths[layer, col] == 0:
            raise RuntimeError(f"device {self.device}: scheduler {self.scheduler!r} chose "
                               f"({layer}, {col}), not a non-empty queue of Q "
                               f"{self._lengths.tolist()}")
        queue = self._queues[layer][col]
        batch = Batch(layer, self.units[col], tuple(queue))
        queue.clear()
        self._lengths[layer, col] = 0
        self._queued -= batch.size
        self.stats.record(batch)
        return batch

    # ------------------------------------------------------------------ outputs
    def route(self, batch: Batch, topk_experts: Any = None, topk_weights: Any = None,
              outputs: Sequence[Any] | None = None) -> list[tuple[int, TokenRecord]]:
        """(destination device, record) for every output of ``batch`` (module
        docstring). ``outputs[i]`` is token i's output payload (None: no payloads, as in
        the simulator). An attention batch needs ``topk_experts`` [n, k] (distinct ids
        per token) and ``topk_weights`` [n, k]; its records come token by token, slot by
        slot. An expert batch takes neither."""
        n = batch.size
        if outputs is None:
            outputs = [None] * n
        if len(outputs) != n:
            raise ValueError(f"route: {len(outputs)} outputs for a batch of {n} tokens "
                             f"(layer {batch.layer}, unit {batch.unit})")
        if batch.unit not in self._column:
            raise ValueError(f"route: batch of unit {batch.unit} was not run here; device "
                             f"{self.device} hosts {self.units}")
        if batch.kind == EXPERT:
            if topk_experts is not None or topk_weights is not None:
                raise ValueError("route: an expert batch's outputs go back to their ranks; "
                                 "it takes no top-k")
            return [(r.rank, TokenRecord(r.request_id, r.step, r.layer, EXPERT, r.expert, r.rank,
                                         r.context, r.slot, r.weight, out))
                    for r, out in zip(batch.records, outputs)]
        if batch.kind == HEAD:
            raise ValueError("route: a head batch ends its tokens' decode step; the driver "
                             "starts the next step (enqueue an attention record at block 0)")
        ids, weights = self._check_topk(batch, topk_experts, topk_weights)
        destinations = (self._home[ids] if self.replica_routing == HOME else
                        replica_destinations(self.replica_routing, ids, self.expert_replicas,
                                             self._rotor))
        routed = []
        for i, (record, out) in enumerate(zip(batch.records, outputs)):
            for slot in range(self.top_k):
                expert = int(ids[i, slot])
                routed.append((int(destinations[i, slot]), TokenRecord(
                    record.request_id, record.step, record.layer, EXPERT, expert,
                    record.rank, record.context, slot, float(weights[i, slot]), out)))
        return routed

    def _check_topk(self, batch: Batch, topk_experts: Any,
                    topk_weights: Any) -> tuple[np.ndarray, np.ndarray]:
        shape = (batch.size, self.top_k)
        if topk_experts is None or topk_weights is None:
            raise ValueError(f"route: an attention batch needs topk_experts and "
                             f"topk_weights {list(shape)}")
        ids = np.asarray(topk_experts)
        weights = np.asarray(topk_weights, dtype=np.float64)
        if ids.shape != shape or weights.shape != shape:
            raise ValueError(f"route: topk_experts {ids.shape} and topk_weights "
                             f"{weights.shape} must both be {shape} for layer "
                             f"{batch.layer}")
        if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0
                         or ids.max() >= self.num_experts):
            raise ValueError(f"route: topk_experts must be expert ids in "
                             f"[0, {self.num_experts}), got {ids.tolist()}")
        if not np.all(np.isfinite(weights)):
            raise ValueError(f"route: topk_weights must be finite, got {weights.tolist()}")
        for i, row in enumerate(ids):
            if len(set(row.tolist())) != self.top_k:
                raise ValueError(f"route: token {i} ({batch.records[i].describe()}) chose "
                                 f"experts {row.tolist()}; top-k ids are distinct")
        return ids, weights

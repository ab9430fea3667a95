"""The AsyncMoE μ-queue decode runtime on G devices of one process (seed §3).

By default every device is an attention rank (a request keeps its rank and KV pool for
life) and hosts the experts ``expert_device`` places on it; each (layer, expert) pair is
its own expert layer. ``attention_devices`` disaggregates (seed §3.3): requests bind to
those ranks only, and the experts live on the other devices (``expert_devices``), which
run expert batches only. An expert may have replicas (``replicas`` per expert, or an
explicit ``expert_device[e]`` = its devices): each holds the same weights, and
``replica_routing`` (``moejax.asyncmoe.replicas``: "home", "round_robin", METRO's
"metro") picks the replica of every token's copy, so the tokens do not depend on it.

The μ-queue loop (``moejax.asyncmoe.loop``: the simulator's own) decides what runs where
and when, in virtual time from a cost function (default: every execution one unit,
transfers free), so a run is deterministic; :class:`ModelExecutor` does the
arithmetic with the layerwise decode programs of ``moejax.decode.programs``:

* prefill (``start``): the request's prompt through the fused paged step on its rank
  (its first token, and its keys/values written to the rank's pool); a request
  prefilled elsewhere (``generate(prefilled=...)``, :class:`Prefilled`: a pipeline's
  prefill stage) has its prompt's blocks copied into its rank's pool instead
  (``moejax.kv.copy.copy_blocks``) and starts from the token sampled there;
* attention batch (rank g, block b): ``BEGIN`` + ``ATTENTION(b)`` over the batch's
  tokens, one row each, over the rank's pool; the post-attention residual waits on the
  rank for the merge, the token's keys/values of block b wait for the end of its step,
  and the normed MoE input travels to the k experts;
* expert batch (device h, block b, expert e): ``MOE`` with a one-expert stack, every row
  routed to it with weight 1 (the grouped expert compute of the resident path);
* merge (the rank's token pool has all k outputs): residual + Σ_j w_j·y_j in float32,
  in top-k order (``moe.weighted_sum``'s sum), computed for all the tokens of the batch
  that consumes them (next block's attention, or the head) in one program;
* head batch (rank g): ``HEAD`` (final norm, LM head, sampling), then every token's
  keys/values of all blocks are written to the pool (``WRITE_ROWS``); a request that
  has not stopped enters block 0 of its next step with the new token.

**Transport.** A payload is a row of the array a batch produced (:class:`_Row`: the array,
on its device, and the row), never a per-token slice. A batch gathers its inputs
(:meth:`ModelExecutor._gather`) with one transfer per source device: the rows living on
one device are put, in their order, into a staging array there (one ``_put_rows``
program per source array), the staging array moves to the batch's device in one
``jax.device_put``, and one ``_put_rows`` places its rows at their positions (rows on
the batch's own device go in directly). The rows come out in the batch's record order,
so a run computes what the per-token transport computed (``transport="per_token"``:
one ``device_put`` and one slice per token, kept to measure the difference). Merges are
gathered the same way (residuals local, expert outputs from their devices) and summed in
one program per consuming batch; a head batch gathers every block's keys/values of its
tokens (all on the rank) into [L, rows, ...] the same way before ``WRITE_ROWS``. Row
counts of the programs are powers of two (index lists padded; padding writes nowhere),
so the compiles stay bounded.

Batches are padded to a power of two rows (bounded compiles; padding rows are invalid
and write nothing). Blocks: a request takes ceil((prompt + max_new_tokens) / 16) KV
blocks of its rank at arrival and frees them when it finishes; each ``generate`` call
gets a fresh pool, by default large enough for all its requests at once on one rank
(a run admits every request as it arrives: there is no waiting room), else
``blocks_per_rank`` (a request that finds too few raises RuntimeError). Prefill needs every
expert on the rank (it is the fused step); decode reads each expert only on its device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moejax import moe, sampling
from moejax.asyncmoe.engine import Batch, DeviceEngine, Merged
from moejax.asyncmoe.placement import make_placement, replica_sets
from moejax.asyncmoe.loop import LoopRequest, MuQueueLoop, SimResult
from moejax.asyncmoe.records import TokenRecord
from moejax.asyncmoe.replicas import HOME, check_replica_routing
from moejax.asyncmoe.schedulers import QueueScheduler, make_scheduler
from moejax.backends.base import check_expert_bias, validated
from moejax.config import ModelConfig
from moejax.decode import programs
from moejax.kv import WRITE_ROWS, BlockAllocator, KVPool, empty_pool
from moejax.kv.copy import copy_blocks
from moejax.decode.programs import PagedBatch, StepOptions
from moejax.param_layout import EXPERT_KEYS, Params
from moejax.prefix_hash import BLOCK_SIZE
from moejax.sequences import SequenceOutput, SequenceSpec
from moejax.sizes import bucket

UNIT_SECONDS = 1.0          # the default virtual cost of one execution


@jax.jit
def _merge(residual: jax.Array, outputs: jax.Array, weights: jax.Array) -> jax.Array:
    """residual [d] + Σ_j weights[j]·outputs[j] (outputs [k, d]), the sum in float32."""
    y = jnp.einsum("kd,k->d", outputs.astype(jnp.float32), weights)
    return residual + y.astype(residual.dtype)


@jax.jit
def _merge_rows(residual: jax.Array, outputs: jax.Array, weights: jax.Array) -> jax.Array:
    """Per row t: residual[t] + Σ_j weights[t, j]·outputs[t·k + j] (outputs [T·k, d]), the
    sum in float32 (``moe.weighted_sum``'s)."""
    t, k = weights.shape
    y = jnp.einsum("tkd,tk->td", outputs.reshape(t, k, -1).astype(jnp.float32), weights)
    return residual + y.astype(residual.dtype)


@jax.jit
def _put_rows(out: jax.Array, src: jax.Array, src_rows: jax.Array, dst_rows: jax.Array
              ) -> jax.Array:
    """out with out[dst_rows[i]] = src[src_rows[i]] (a dst row past the end writes
    nothing: the index lists' padding)."""
    return out.at[dst_rows].set(src[src_rows], mode="drop")


def _index_lists(src_rows: Sequence[int], dst_rows: Sequence[int], out_rows: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """``_put_rows``'s index lists padded to a power of two (padding: src 0, dst
    ``out_rows``, which writes nothing)."""
    n = len(src_rows)
    src = np.zeros(bucket(n, 1), np.int32)
    dst = np.full(bucket(n, 1), out_rows, np.int32)
    src[:n], dst[:n] = src_rows, dst_rows
    return src, dst


class Prefilled(NamedTuple):
    """A request whose prompt ran elsewhere (a pipeline's prefill stage): its prompt's
    keys/values are blocks ``blocks`` of the pool ``source`` (blocks of the whole pool,
    on any devices), and ``first_token`` is the token that prefill sampled."""

    source: KVPool
    blocks: Sequence[int]
    first_token: int


class _Row(NamedTuple):
    """A payload: row ``row`` of ``array`` (a batch's output, on its device)."""

    array: jax.Array
    row: int


class _PendingMerge(NamedTuple):
    """A merged token's payload until the batch that consumes it sums it (with the rest
    of that batch's merges): its residual row, its k expert output rows and gate weights
    (slot order)."""

    residual: _Row
    parts: tuple[_Row, ...]
    weights: tuple[float, ...]


def decode_rows(blocks: Sequence[np.ndarray], positions: Sequence[int], tokens: Sequence[int],
                counters: Sequence[int], rows: int, table_width: int, num_slots: int
                ) -> PagedBatch:
    """A decode PagedBatch: row i (of n) is one token at ``positions[i]`` over its block
    table ``blocks[i]`` (its key/value goes to the slot of that position); rows n..rows-1
    are padding (invalid, segment -1, write slot ``num_slots``: nothing written)."""
    n = len(positions)
    pos = np.zeros(rows, np.int32)
    pos[:n] = positions
    tables = np.zeros((rows, table_width), np.int32)
    slots = np.full(rows, num_slots, np.int32)
    for i, table in enumerate(blocks):
        tables[i, :len(table)] = table
        slots[i] = table[pos[i] // BLOCK_SIZE] * BLOCK_SIZE + pos[i] % BLOCK_SIZE
    segments = np.full(rows, -1, np.int32)
    segments[:n] = np.arange(n)
    return PagedBatch(tokens=np.pad(np.asarray(tokens, np.int32), (0, rows - n)), positions=pos,
                      valid=np.arange(rows) < n, write_slots=slots, segments=segments,
                      block_tables=tables, context_len=pos.copy(),   # positions in the pool
                      last=np.arange(rows, dtype=np.int32),
                      counters=np.pad(np.asarray(counters, np.int32), (0, rows - n)))


@dataclasses.dataclass
class _Sequence:
    """One request's state on its rank."""

    spec: SequenceSpec
    rank: int
    blocks: np.ndarray
    tokens: list[int]
    step_keys: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    step_values: dict[int, list[Any]] = dataclasses.field(default_factory=dict)
    experts: list[list[np.ndarray]] = dataclasses.field(default_factory=list)
    weights: list[list[np.ndarray]] = dataclasses.field(default_factory=list)
    finish_reason: str = "length"


class ModelExecutor:
    """The μ-queue loop's :class:`~moejax.asyncmoe.loop.Executor` for a real model
    (module docstring)."""

    def __init__(self, cfg: ModelConfig, params: Params, devices: Sequence[Any],
                 expert_device: Sequence[int | Sequence[int]], *, dtype: Any = "float32",
                 opts: StepOptions = StepOptions()):
        check_expert_bias("asyncmoe", cfg, False)
        self.cfg, self.devices, self.opts = cfg, list(devices), opts
        self.expert_replicas = replica_sets(expert_device)
        host = validated(params, cfg, dtype)
        self.dtype = host["embed"].dtype
        dense = programs.dense_params(host)
        self.dense = [jax.device_put(dense, d) for d in self.devices]
        self.full: dict[int, Params] = {}       # whole params per rank, for prefill
        self._constants: dict[tuple, jax.Array] = {}
        self.host = host
        layers = host["layers"]
        # One stack per (layer, expert, device of a replica): replicas share the weights.
        self.expert_stacks = {
            (layer, e, h): jax.device_put({k: np.ascontiguousarray(layers[k][layer, e][None, None])
                                           for k in EXPERT_KEYS}, self.devices[h])
            for layer in range(cfg.num_layers) for e, hosts in enumerate(self.expert_replicas)
            for h in hosts}
        self.prepare({}, 1)

    def prepare(self, specs: dict[int, SequenceSpec], blocks_per_rank: int,
                prefilled: dict[int, "Prefilled"] | None = None) -> None:
        """A fresh KV pool of ``blocks_per_rank`` blocks per rank for a run of ``specs``
        (``prefilled``: the requests, by id, whose prompts ran elsewhere)."""
        self.prefilled = dict(prefilled or {})
        self.kv = [empty_pool(self.cfg, blocks_per_rank, self.dtype, d)
                   for d in self.devices]
        # The one block allocator of moejax's pools, one per rank (no prefix reuse here).
        self.allocators = [BlockAllocator(blocks_per_rank) for _ in self.devices]
        self.max_table = 1
        self.sequences: dict[int, _Sequence] = {}
        self.specs = dict(specs)
        self.residual: dict[tuple[int, int, int], Any] = {}

    # ---------------------------------------------------------------- prefill

    def start(self, request: LoopRequest, rank: int) -> tuple[bool, Any]:
        spec = self.specs[request.request_id]
        need = -(-(len(spec.prompt) + spec.max_new_tokens) // BLOCK_SIZE)
        allocator = self.allocators[rank]
        if need > allocator.num_available:
            raise RuntimeError(f"request {request.request_id}: needs {need} KV blocks, rank "
                               f"{rank} has {allocator.num_available} free")
        blocks = np.array(allocator.allocate(need), np.int32)
        self.max_table = max(self.max_table, bucket(need, 1))
        seq = _Sequence(spec, rank, blocks, [])
        self.sequences[request.request_id] = seq
        given = self.prefilled.get(request.request_id)
        token = self._prefill(seq) if given is None else self._copy_in(seq, given)
        return self._append(request.request_id, seq, token), token

    def _copy_in(self, seq: _Sequence, given: "Prefilled") -> int:
        """A request prefilled elsewhere: its prompt's blocks copied from ``given.source``
        into the first blocks of its rank here; its first token is the one sampled there."""
        count = -(-len(seq.spec.prompt) // BLOCK_SIZE)
        if len(given.blocks) < count:
            raise ValueError(f"a prefilled request of {len(seq.spec.prompt)} prompt tokens "
                             f"needs {count} source blocks, got {len(given.blocks)}")
        self.kv[seq.rank] = copy_blocks(given.source, list(given.blocks)[:count],
                                        self.kv[seq.rank], [int(b) for b in seq.blocks[:count]],
                                        self.devices[seq.rank])
        return int(given.first_token)

    def _prefill(self, seq: _Sequence) -> int:
        rank, prompt = seq.rank, np.asarray(seq.spec.prompt, np.int32)
        if rank not in self.full:
            self.full[rank] = jax.device_put(self.host, self.devices[rank])
        n = len(prompt)
        width = -(-n // BLOCK_SIZE) * BLOCK_SIZE
        pos = np.arange(width, dtype=np.int32)
        valid = pos < n
        slots = np.where(valid, seq.blocks[np.minimum(pos, n - 1) // BLOCK_SIZE] * BLOCK_SIZE
                         + pos % BLOCK_SIZE, self.kv[rank].num_slots).astype(np.int32)
        batch = PagedBatch(tokens=np.pad(prompt, (0, width - n)), positions=pos, valid=valid,
                           write_slots=slots, segments=np.zeros(1, np.int32),
                           block_tables=self._tables([seq]), context_len=np.zeros(1, np.int32),
                           last=np.array([n - 1], np.int32), counters=np.zeros(1, np.int32))
        batch, samp = jax.device_put((batch, self._sampling([seq], 1)), self.devices[rank])
        result = programs.FUSED_STEP(self.full[rank], self.kv[rank], batch, samp, cfg=self.cfg,
                                     opts=self.opts)
        self.kv[rank] = WRITE_ROWS(self.kv[rank], batch.write_slots, result.new_keys,
                                   result.new_values, None)
        return int(result.tokens[0])

    # ---------------------------------------------------------------- batches
    def _tables(self, seqs: Sequence[_Sequence | None]) -> np.ndarray:
        tables = np.zeros((len(seqs), self.max_table), np.int32)
        for row, seq in enumerate(seqs):
            if seq is not None:
                tables[row, :len(seq.blocks)] = seq.blocks
        return tables

    def _sampling(self, seqs: Sequence[_Sequence | None], rows: int) -> sampling.SamplingParams:
        temperature, top_p, seeds = [0.0] * rows, [1.0] * rows, [0] * rows
        for row, seq in enumerate(seqs):
            if seq is not None:
                temperature[row], top_p[row] = seq.spec.temperature, seq.spec.top_p
                seeds[row] = seq.spec.seed
        return sampling.make_sampling_params(temperature, top_p, seeds)

    def _decode_batch(self, rank: int, records: Sequence[TokenRecord]) -> PagedBatch:
        """One row per record (position = context - 1), padded to a power of two."""
        seqs = [self.sequences[r.request_id] for r in records]
        return decode_rows([seq.blocks for seq in seqs], [r.context - 1 for r in records],
                           [seq.tokens[-1] for seq in seqs], [len(seq.tokens) for seq in seqs],
                           bucket(len(records), 1), self.max_table, self.kv[rank].num_slots)

    # ---------------------------------------------------------------- transport
    def _constant(self, device: Any, value: np.ndarray) -> jax.Array:
        """``value`` on ``device``, put there once (an immutable cached array)."""
        key = (device, value.shape, value.dtype.str, value.tobytes())
        array = self._constants.get(key)
        if array is None:
            array = self._constants[key] = jax.device_put(value, device)
        return array

    def _gather(self, refs: Sequence[_Row], device: int, rows: int,
                dst: Sequence[int] | None = None) -> jax.Array:
        """[rows, ...] on ``devices[device]`` with row dst[i] (default i) = refs[i], zeros
        elsewhere: one transfer per source device (module docstring)."""
        dev = self.devices[device]
        dst = range(len(refs)) if dst is None else dst
        first = refs[0].array
        out = self._constant(dev, np.zeros((rows,) + first.shape[1:], first.dtype))
        arrays: dict[int, tuple[jax.Array, list[int], list[int]]] = {}
        for ref, row in zip(refs, dst):
            entry = arrays.get(id(ref.array))
            if entry is None:
                entry = arrays[id(ref.array)] = (ref.array, [], [])
            entry[1].append(ref.row)
            entry[2].append(row)
        by_device: dict[Any, list[tuple[jax.Array, list[int], list[int]]]] = {}
        for entry in arrays.values():
            by_device.setdefault(next(iter(entry[0].devices())), []).append(entry)
        for source, entries in by_device.items():
            if source == dev:
                for array, src_rows, dst_rows in entries:
                    out = _put_rows(out, array, *_index_lists(src_rows, dst_rows, rows))
                continue
            if len(entries) == 1:               # the source array itself travels
                array, src_rows, dst_rows = entries[0]
            else:                               # its rows, staged on the source device
                count = sum(len(e[1]) for e in entries)
                staged = bucket(count, 1)
                array = self._constant(source, np.zeros((staged,) + first.shape[1:],
                                                        first.dtype))
                at, dst_rows = 0, []
                for part, src_rows, rows_there in entries:
                    span = list(range(at, at + len(src_rows)))
                    array = _put_rows(array, part, *_index_lists(src_rows, span, staged))
                    dst_rows += rows_there
                    at += len(src_rows)
                src_rows = list(range(count))
            out = _put_rows(out, jax.device_put(array, dev),
                            *_index_lists(src_rows, dst_rows, rows))
        return out

    def _merged(self, device: int, payloads: Sequence[_PendingMerge], rows: int) -> jax.Array:
        """[rows, d]: the merges of a batch's tokens in one program (padding rows zero)."""
        k = len(payloads[0].parts)
        residual = self._gather([p.residual for p in payloads], device, rows)
        outputs = self._gather([part for p in payloads for part in p.parts], device, rows * k)
        weights = np.zeros((rows, k), np.float32)
        weights[:len(payloads)] = [p.weights for p in payloads]
        return _merge_rows(residual, outputs, weights)

    # ---------------------------------------------------------------- batches
    def attention(self, device: int, batch: Batch) -> tuple[np.ndarray, np.ndarray, list]:
        records, layer, dev = batch.records, batch.layer, self.devices[device]
        paged = jax.device_put(self._decode_batch(device, records), dev)
        x, attn = programs.BEGIN(self.dense[device], self.kv[device], paged, cfg=self.cfg,
                                 opts=self.opts)
        if layer > 0:
            x = self._layer_input(device, [r.payload for r in records], x.shape[0])
        x, carry, moe_in, routing = programs.ATTENTION(self.dense[device], np.int32(layer), x,
                                                       self.kv[device], attn, cfg=self.cfg)
        keys, values = carry[0][layer], carry[1][layer]
        n = batch.size
        ids, weights = np.asarray(routing.experts)[:n], np.asarray(routing.weights)[:n]
        row = self._row
        for i, r in enumerate(records):
            seq = self.sequences[r.request_id]
            seq.step_keys.setdefault(r.step, [None] * self.cfg.num_layers)[layer] = row(keys, i)
            seq.step_values.setdefault(r.step, [None] * self.cfg.num_layers)[layer] = \
                row(values, i)
            self.residual[(r.request_id, r.step, layer)] = row(x, i)
            if layer == 0:
                seq.experts.append([None] * self.cfg.num_layers)
                seq.weights.append([None] * self.cfg.num_layers)
            seq.experts[r.step][layer], seq.weights[r.step][layer] = ids[i], weights[i]
        return ids, weights, [row(moe_in, i) for i in range(n)]

    def expert(self, device: int, batch: Batch) -> list:
        dev, n = self.devices[device], batch.size
        rows = bucket(n, 1)
        x = self._expert_input(device, [r.payload for r in batch.records], rows)
        routing = moe.Routing(weights=self._constant(dev, np.ones((rows, 1), np.float32)),
                              experts=self._constant(dev, np.zeros((rows, 1), np.int32)))
        y = programs.MOE(self.expert_stacks[(batch.layer, batch.unit, device)], np.int32(0),
                         self._constant(dev, np.zeros(x.shape, x.dtype)), x, routing,
                         self._constant(dev, np.arange(rows) < n), opts=self.opts)
        return [self._row(y, i) for i in range(n)]

    # The transport's hooks (the per-token executor overrides them).
    @staticmethod
    def _row(array: jax.Array, i: int) -> Any:
        """A payload: row i of a batch's output, as a reference (no slice)."""
        return _Row(array, i)

    def _expert_input(self, device: int, payloads: Sequence[Any], rows: int) -> jax.Array:
        """An expert batch's rows [rows, d], gathered (one transfer per source device)."""
        return self._gather(payloads, device, rows)

    def _layer_input(self, device: int, payloads: Sequence[Any], rows: int) -> jax.Array:
        """The hidden states [rows, d] a batch starts from (an attention batch past layer
        0, a head batch): its tokens' pending merges, summed."""
        return self._merged(device, payloads, rows)

    def merge(self, device: int, merged: Merged) -> _PendingMerge:
        residual = self.residual.pop((merged.request_id, merged.step, merged.layer))
        return _PendingMerge(residual, tuple(p.payload for p in merged.parts),
                             tuple(float(p.weight) for p in merged.parts))

    def head(self, device: int, batch: Batch) -> list[tuple[bool, Any]]:
        records, dev, n = batch.records, self.devices[device], batch.size
        paged = self._decode_batch(device, records)
        rows = paged.rows
        seqs = [self.sequences[r.request_id] for r in records]
        samp = self._sampling(seqs, rows)
        paged, samp = jax.device_put((paged, samp), dev)
        x = self._layer_input(device, [r.payload for r in records], rows)
        tokens = np.asarray(programs.HEAD(self.dense[device], x, paged, samp, cfg=self.cfg))
        self._write_step(device, paged.write_slots, seqs, [r.step for r in records], rows)
        out = []
        for r, seq, token in zip(records, seqs, tokens[:n]):
            decodes = self._append(r.request_id, seq, int(token))
            out.append((decodes, int(token)))
        return out

    def _write_step(self, device: int, slots: jax.Array, seqs: Sequence[_Sequence],
                    steps: Sequence[int], rows: int) -> None:
        """Every block's keys/values of the finished tokens into the rank's pool
        (gathered into [L, rows, ...]: row l·rows + i is token i's block l)."""
        layers = self.cfg.num_layers
        keys, values, dst = [], [], []
        for i, (seq, step) in enumerate(zip(seqs, steps)):
            keys += seq.step_keys.pop(step)
            values += seq.step_values.pop(step)
            dst += [layer * rows + i for layer in range(layers)]
        shape = (layers, rows) + keys[0].array.shape[1:]
        self.kv[device] = WRITE_ROWS(
            self.kv[device], slots,
            self._gather(keys, device, layers * rows, dst).reshape(shape),
            self._gather(values, device, layers * rows, dst).reshape(shape), None)

    def _append(self, request_id: int, seq: _Sequence, token: int) -> bool:
        """Record a generated token; whether the request decodes another step (frees its
        blocks when it does not)."""
        seq.tokens.append(token)
        if token in seq.spec.stop_token_ids:
            seq.finish_reason = "stop"
        elif len(seq.tokens) < seq.spec.max_new_tokens:
            return True
        self.allocators[seq.rank].release([int(b) for b in seq.blocks])
        return False

    def output(self, request_id: int) -> SequenceOutput:
        seq = self.sequences[request_id]
        steps = len(seq.experts)
        shape = (self.cfg.num_layers, steps, self.cfg.num_experts_per_tok)
        experts = (np.array([[seq.experts[s][l] for s in range(steps)]
                             for l in range(self.cfg.num_layers)], np.int32)
                   if steps else np.zeros(shape, np.int32))
        weights = (np.array([[seq.weights[s][l] for s in range(steps)]
                             for l in range(self.cfg.num_layers)], np.float32)
                   if steps else np.zeros(shape, np.float32))
        return SequenceOutput(token_ids=list(seq.tokens), finish_reason=seq.finish_reason,
                              decode_experts=experts, decode_weights=weights)


class PerTokenExecutor(ModelExecutor):
    """The former transport (``transport="per_token"``): every payload a per-token slice,
    moved with its own ``jax.device_put``, each merge its own program. Kept to measure
    the batched transport against; same tokens."""

    def _stack(self, payloads: Sequence[Any], device: Any, rows: int) -> jax.Array:
        x = jnp.stack([jax.device_put(p, device) for p in payloads])
        return jnp.pad(x, ((0, rows - len(payloads)), (0, 0)))

    @staticmethod
    def _row(array: jax.Array, i: int) -> Any:
        return array[i]

    def _expert_input(self, device: int, payloads: Sequence[Any], rows: int) -> jax.Array:
        return self._stack(payloads, self.devices[device], rows)

    def merge(self, device: int, merged: Merged) -> jax.Array:
        dev = self.devices[device]
        residual = self.residual.pop((merged.request_id, merged.step, merged.layer))
        outputs = jnp.stack([jax.device_put(p.payload, dev) for p in merged.parts])
        weights = jnp.asarray([p.weight for p in merged.parts], jnp.float32)
        return _merge(residual, outputs, weights)

    def _layer_input(self, device: int, payloads: Sequence[Any], rows: int) -> jax.Array:
        return self._stack(payloads, self.devices[device], rows)

    def _write_step(self, device: int, slots: jax.Array, seqs: Sequence[_Sequence],
                    steps: Sequence[int], rows: int) -> None:
        """Every block's keys/values of the finished tokens into the rank's pool."""
        dev = self.devices[device]
        stored = [(seq.step_keys.pop(step), seq.step_values.pop(step))
                  for seq, step in zip(seqs, steps)]
        pad = [jnp.zeros_like(stored[0][0][0])] * (rows - len(seqs))
        keys = jnp.stack([jnp.stack([k[layer] for k, _ in stored] + pad)
                          for layer in range(self.cfg.num_layers)])
        values = jnp.stack([jnp.stack([v[layer] for _, v in stored] + pad)
                            for layer in range(self.cfg.num_layers)])
        self.kv[device] = WRITE_ROWS(self.kv[device], slots, jax.device_put(keys, dev),
                                     jax.device_put(values, dev), None)


TRANSPORTS: dict[str, type[ModelExecutor]] = {"batched": ModelExecutor,
                                              "per_token": PerTokenExecutor}


class MuQueueRuntime:
    """Greedy or sampled decode of many sequences through the μ-queue loop on
    ``devices`` (module docstring). ``scheduler``: a name ("defrag", "most_tokens",
    "first_layer") or an object; ``duration(batch)`` / ``link(bytes)``: the virtual cost
    model (default one unit per execution, free transfers); ``transport``: "batched"
    (default) or "per_token" (the former one, for comparison; module docstring).
    ``attention_devices`` / ``expert_devices`` / ``expert_device`` / ``replicas``: the
    layout (:func:`~moejax.asyncmoe.placement.make_placement`; default every device an
    attention rank and an expert host, one replica per expert); ``replica_routing``: which
    replica a token's copy goes to (``moejax.asyncmoe.replicas``)."""

    def __init__(self, cfg: ModelConfig, params: Params, devices: Sequence[Any], *,
                 scheduler: QueueScheduler | str = "defrag", dtype: Any = "float32",
                 expert_device: Sequence[int | Sequence[int]] | None = None,
                 blocks_per_rank: int | None = None,
                 duration: Callable[[Batch], float] | None = None,
                 link: Callable[[float], float] | None = None, transport: str = "batched",
                 attention_devices: Sequence[int] | None = None,
                 expert_devices: Sequence[int] | None = None, replicas: int = 1,
                 replica_routing: str = HOME):
        if not devices:
            raise ValueError("MuQueueRuntime needs at least one device")
        self.cfg = cfg
        self.devices = list(devices)
        self.scheduler = make_scheduler(scheduler) if isinstance(scheduler, str) else scheduler
        self.placement = make_placement(cfg.num_experts, len(self.devices),
                                        attention_devices=attention_devices,
                                        expert_devices=expert_devices,
                                        expert_device=expert_device, replicas=replicas)
        self.expert_device = self.placement.home
        self.replica_routing = check_replica_routing(replica_routing)
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {sorted(TRANSPORTS)}, got {transport!r}")
        self.executor = TRANSPORTS[transport](cfg, params, self.devices,
                                              self.placement.expert_replicas, dtype=dtype)
        self.blocks_per_rank = blocks_per_rank
        self.duration = duration or (lambda batch: UNIT_SECONDS)
        self.link = link or (lambda nbytes: 0.0)
        self.last_run: SimResult | None = None

    def generate(self, specs: Sequence[SequenceSpec], arrivals: Sequence[float] | None = None,
                 prefilled: Sequence[Prefilled | None] | None = None
                 ) -> list[SequenceOutput]:
        """Every sequence to its end (arriving at virtual times ``arrivals``, default all at
        0) -> outputs in order; :attr:`last_run` keeps the batches and timings.
        ``prefilled[i]`` (if given and not None): request i's prompt already ran elsewhere
        (:class:`Prefilled`); its blocks are copied in at its arrival instead of a
        prefill, and it decodes from its first token on (its output holds that token
        first, and the sampling counters continue from 1, as the continuous scheduler's
        do: the tokens are those of a run that prefilled it here)."""
        if prefilled is not None and len(prefilled) != len(specs):
            raise ValueError(f"prefilled has {len(prefilled)} entries for {len(specs)} "
                             f"requests")
        placement = self.placement
        engines = [DeviceEngine(d, self.cfg.num_layers, placement.units(d), self.scheduler,
                                self.cfg.num_experts_per_tok, placement.expert_replicas,
                                self.replica_routing)
                   for d in range(len(self.devices))]
        arrivals = [0.0] * len(specs) if arrivals is None else list(arrivals)
        requests = [LoopRequest(i, float(at), len(spec.prompt))
                    for i, (spec, at) in enumerate(zip(specs, arrivals, strict=True))]
        # Default pool: every request's blocks at once on any rank (all may be in flight).
        need = sum(-(-(len(s.prompt) + s.max_new_tokens) // BLOCK_SIZE) for s in specs)
        given = {i: p for i, p in enumerate(prefilled or ()) if p is not None}
        self.executor.prepare(dict(enumerate(specs)), self.blocks_per_rank or max(need, 1),
                              given)
        loop = MuQueueLoop(engines, self.executor, self.duration, self.link,
                           self.cfg.hidden_size * np.dtype(self.executor.dtype).itemsize)
        self.last_run = loop.run(requests)
        return [self.executor.output(i) for i in range(len(specs))]

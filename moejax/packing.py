"""Pack variable-length sequences into flat batches with bucketed shapes.

A scoring job holds sequences (prefill ops, :class:`moejax.ops.PrefillOp`) of any
length up to the model's context. Each packed batch has:

* an attention block size B: the smallest power of two >= the longest sequence
  in the batch (and >= ``min_block``); no sequence crosses a block boundary;
* T = B · n_blocks tokens, with n_blocks a power of two and T <= max_batch_tokens,
  except that a block is never split: when B itself exceeds max_batch_tokens
  (a sequence longer than the largest power of two <= max_batch_tokens), the
  batch is that one block (T = B, shorter sequences may share it); short
  sequences share blocks (best-fit-decreasing bin packing, any block size), and
  the blocks of one size are cut into full batches plus one last batch whose
  block count is rounded up to a power of two;
* P scoring positions rounded up to a power of two (>= ``min_positions``);
* C candidate columns per position rounded up to a power of two (>= ``min_candidates``).

So the compiled programs are keyed by (T, B, P, C, full_vocab), each from a
short list of powers of two: a long job compiles a bounded number of them
(at most log2(max T / min_block)² · |P buckets| · |C buckets| · 2, and in
practice a handful).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Hashable, Sequence

import numpy as np

from moejax.ops import OpOutput, PrefillOp
from moejax.sizes import next_power_of_two, prev_power_of_two
from moejax.attention_kinds import PrefixContext
from moejax.model import ForwardOptions, PackedBatch, VocabReadout


@dataclasses.dataclass(frozen=True)
class BucketPolicy:
    """Shape buckets of packed batches (see the module docstring)."""

    max_batch_tokens: int = 4096
    min_block: int = 32
    min_positions: int = 8
    min_candidates: int = 2

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "min_block", "min_positions", "min_candidates"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_batch_tokens < self.min_block:
            raise ValueError(f"max_batch_tokens ({self.max_batch_tokens}) is smaller than "
                             f"min_block ({self.min_block})")

    def block_for(self, length: int) -> int:
        return max(self.min_block, next_power_of_two(length))

    def token_buckets(self, max_context: int) -> list[int]:
        """Every batch length T this policy can produce for sequences up to ``max_context``."""
        top = max(self.max_batch_tokens, self.block_for(max_context))
        out, t = [], self.min_block
        while t <= top:
            out.append(t)
            t *= 2
        return out


@dataclasses.dataclass(frozen=True)
class HostBatch:
    """A packed batch in host memory and where each sequence's answers land.

    rows[i]: first row in the [P, C] output of ``sequences[i]``; its
    ``len(score_positions)`` rows follow, each with ``len(score_token_ids[j])`` valid columns.
    """

    batch: PackedBatch
    options: ForwardOptions
    sequences: tuple[PrefillOp, ...]
    rows: tuple[int, ...]
    real_tokens: int
    context: "PrefixContext | None" = None

    @property
    def shape_key(self) -> tuple:
        p, c = self.batch.score_token_ids.shape
        key = (self.batch.tokens.shape[0], self.options.attn_block, p, c, self.options.full_vocab,
               self.options.top_k)
        if self.context is not None:
            key += (self.context.ctx_slot.shape[1], self.context.store_row.shape[0])
        return key


@dataclasses.dataclass
class _Block:
    size: int
    used: int = 0
    members: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (seq, offset)


def assign_blocks(lengths: Sequence[int], policy: BucketPolicy) -> list[_Block]:
    """Best-fit-decreasing bin packing of sequences into attention blocks.

    Longest first; each sequence goes into the open block with the least room
    that still fits it (any block size), else into a new block of
    ``policy.block_for(length)`` tokens. Short sequences thus fill the tails of
    long ones' blocks, where they cost no extra attention work (the block is
    computed whole anyway), and padding stays small.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    blocks: list[_Block] = []
    room: list[tuple[int, int]] = []   # sorted (free tokens, block id)
    for i in order:
        n = lengths[i]
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            _, b = room.pop(at)
        else:
            b = len(blocks)
            blocks.append(_Block(size=policy.block_for(n)))
        block = blocks[b]
        block.members.append((i, block.used))
        block.used += n
        if block.used < block.size:
            bisect.insort(room, (block.size - block.used, b))
    return blocks


def batch_block_counts(num_blocks: int, cap: int) -> list[int]:
    """Blocks per batch: full batches of ``cap`` (a power of two), then the remainder in one
    batch rounded up to a power of two. The empty blocks of that last batch cost a little
    attention work (they skip the experts); splitting the remainder into several smaller
    batches instead would cost a compile per extra shape, which dominates small jobs."""
    counts = [cap] * (num_blocks // cap)
    if num_blocks % cap:
        counts.append(next_power_of_two(num_blocks % cap))
    return counts


def pack(sequences: Sequence[PrefillOp], policy: BucketPolicy,
         options: ForwardOptions | None = None, pool_slots: int = 0) -> list[HostBatch]:
    """Pack ``sequences`` into batches (largest attention blocks first). ``options``
    supplies the non-shape forward options (expert implementation, tile rows).
    Batches holding a sequence that uses the prefix pool (of ``pool_slots`` token
    slots) get a :class:`PrefixContext`."""
    blocks = assign_blocks([len(s.token_ids) for s in sequences], policy)
    by_size: dict[int, list[_Block]] = {}
    for block in blocks:
        by_size.setdefault(block.size, []).append(block)
    batches = []
    for size in sorted(by_size, reverse=True):
        group = by_size[size]
        cap = prev_power_of_two(max(1, policy.max_batch_tokens // size))
        start = 0
        for count in batch_block_counts(len(group), cap):
            batches.append(_build(sequences, group[start:start + count], size, policy, options,
                                  pool_slots))
            start += min(count, len(group) - start)
    return batches


def _context_order(sequences: Sequence[PrefillOp], block: _Block) -> list[tuple[int, int]]:
    """A block's members ordered by their context slots, so that siblings reading the same
    cached prefix get consecutive segment ids (each shared slot then needs one context
    entry: ``build_context``)."""
    def key(member: tuple[int, int]) -> bytes:
        slots = sequences[member[0]].context_slots
        return b"" if slots is None else np.asarray(slots, np.int32).tobytes()

    return sorted(block.members, key=key)


def _build(sequences: Sequence[PrefillOp], blocks: list[_Block], block: int,
           policy: BucketPolicy, options: ForwardOptions | None, pool_slots: int = 0
           ) -> HostBatch:
    members = [(i, slot, offset) for slot, b in enumerate(blocks)
               for i, offset in _context_order(sequences, b)]
    total = next_power_of_two(len(blocks)) * block
    tokens = np.zeros(total, np.int32)
    positions = np.zeros(total, np.int32)
    segment_ids = np.full(total, -1, np.int32)
    chosen = [sequences[i] for i, _, _ in members]
    num_positions = sum(len(s.score_positions) for s in chosen)
    num_columns = max(len(ids) for s in chosen for ids in s.score_token_ids) if num_positions else 1
    p_bucket = max(policy.min_positions, next_power_of_two(num_positions))
    c_bucket = max(policy.min_candidates, next_power_of_two(num_columns))
    score_positions = np.zeros(p_bucket, np.int32)
    score_token_ids = np.zeros((p_bucket, c_bucket), np.int32)
    rows, row, real = [], 0, 0
    for segment, ((_, slot, offset), seq) in enumerate(zip(members, chosen)):
        start = slot * block + offset
        n = len(seq.token_ids)
        tokens[start:start + n] = seq.token_ids
        positions[start:start + n] = seq.position_offset + np.arange(n, dtype=np.int32)
        segment_ids[start:start + n] = segment
        rows.append(row)
        for pos, ids in zip(seq.score_positions, seq.score_token_ids):
            score_positions[row] = start + pos
            score_token_ids[row, :len(ids)] = ids
            row += 1
        real += n
    base = options or ForwardOptions(attn_block=block)
    opts = dataclasses.replace(base, attn_block=block,
                               full_vocab=any(s.full_vocab for s in chosen),
                               top_k=top_k_bucket(max(s.top_k for s in chosen)))
    batch = PackedBatch(tokens=tokens, positions=positions, segment_ids=segment_ids,
                        score_positions=score_positions, score_token_ids=score_token_ids)
    context = None
    if any(s.uses_pool for s in chosen):
        starts = [slot * block + offset for _, slot, offset in members]
        context = build_context(chosen, starts, total // block, block, pool_slots)
    return HostBatch(batch=batch, options=opts, sequences=tuple(chosen), rows=tuple(rows),
                     real_tokens=real, context=context)


# Smallest context width per attention block (pool slots; powers of two above it).
MIN_CONTEXT = 16


def context_entries(slots: np.ndarray, segments: np.ndarray) -> tuple[np.ndarray, ...]:
    """One block's context reads — segment ``segments[j]`` reads pool slot ``slots[j]`` —
    as entries (slot, lo, hi): each slot once per run of consecutive segments reading it.
    Siblings of one prefix (consecutive segments, see ``_context_order``) thus share one
    entry per prefix token instead of one each."""
    if len(slots) == 0:
        empty = np.zeros(0, np.int32)
        return empty, empty, empty
    order = np.lexsort((segments, slots))
    slots, segments = slots[order], segments[order]
    new_run = np.ones(len(slots), bool)
    new_run[1:] = (slots[1:] != slots[:-1]) | (segments[1:] != segments[:-1] + 1)
    starts = np.flatnonzero(new_run)
    ends = np.append(starts[1:], len(slots)) - 1
    return slots[starts], segments[starts], segments[ends]


def build_context(chosen: Sequence[PrefillOp], starts: Sequence[int], num_blocks: int,
                  block: int, pool_slots: int) -> PrefixContext:
    """The prefix context of a batch: per attention block the pool slots its segments
    continue from (segment = index in ``chosen``; each slot once per run of segments that
    read it), and the rows to store."""
    reads: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_blocks)]
    # The position of each pool slot read (entry j of a sequence's context sits at
    # position_offset - len(context_slots) + j; a slot holds one token at one position).
    slot_position: list[dict[int, int]] = [{} for _ in range(num_blocks)]
    store_rows, store_slots = [], []
    for segment, (seq, start) in enumerate(zip(chosen, starts)):
        if seq.context_slots is not None and len(seq.context_slots):
            slots = np.asarray(seq.context_slots, np.int32)
            reads[start // block].append((slots, np.full(len(slots), segment, np.int32)))
            first = int(seq.position_offset) - len(slots)
            slot_position[start // block].update(
                (int(s), first + j) for j, s in enumerate(slots.tolist()))
        if seq.store_slots is not None:
            keep = np.flatnonzero(np.asarray(seq.store_slots) >= 0)
            store_rows.extend((start + keep).tolist())
            store_slots.extend(np.asarray(seq.store_slots)[keep].tolist())
    entries = [context_entries(np.concatenate([s for s, _ in r]), np.concatenate([g for _, g in r]))
               if r else context_entries(np.zeros(0, np.int32), np.zeros(0, np.int32))
               for r in reads]
    widest = max(len(slots) for slots, _, _ in entries)
    # No reads at all: width 0, so the forward keeps the tiled attention of model.forward.
    width = max(MIN_CONTEXT, next_power_of_two(widest)) if widest else 0
    ctx_slot = np.zeros((num_blocks, width), np.int32)
    ctx_lo = np.ones((num_blocks, width), np.int32)         # lo > hi: an unused entry
    ctx_hi = np.zeros((num_blocks, width), np.int32)
    ctx_positions = np.zeros((num_blocks, width), np.int32)
    for b, (slots, lo, hi) in enumerate(entries):
        ctx_slot[b, :len(slots)], ctx_lo[b, :len(slots)], ctx_hi[b, :len(slots)] = slots, lo, hi
        ctx_positions[b, :len(slots)] = [slot_position[b][int(s)] for s in slots]
    count = max(MIN_CONTEXT, next_power_of_two(max(len(store_rows), 1)))
    rows = np.zeros(count, np.int32)
    slots = np.full(count, pool_slots, np.int32)        # pool_slots = out of range: dropped
    rows[:len(store_rows)], slots[:len(store_slots)] = store_rows, store_slots
    return PrefixContext(ctx_slot=ctx_slot, ctx_lo=ctx_lo, ctx_hi=ctx_hi, store_row=rows,
                         store_slot=slots, ctx_positions=ctx_positions)


def _pad(array: np.ndarray, shape: Sequence[int], value: int = 0) -> np.ndarray:
    """``array`` grown to ``shape`` (each axis at its end) with ``value``."""
    array = np.asarray(array)
    return np.pad(array, [(0, n - m) for m, n in zip(array.shape, shape)],
                  constant_values=value)


def pad_to_common_shape(hosts: Sequence[HostBatch], rank_slots: int) -> list[HostBatch]:
    """Batches of one attention block, each on its own rank's pool (``rank_slots`` token
    slots per rank), grown to one program shape (the largest of each dimension) so that
    one step runs them together: padding tokens in no segment, padding score rows and
    candidate columns that nobody reads, context entries that read nothing (lo > hi), and
    stored rows dropped (slot ``rank_slots``, past the rank's pool). The full vocabulary
    is scored for all when any asks for it (an extra log-sum-exp is harmless)."""
    blocks = {host.options.attn_block for host in hosts}
    if len(blocks) != 1:
        raise ValueError(f"batches of attention blocks {sorted(blocks)} cannot share a step")
    if len(hosts) < 2:
        return list(hosts)
    tokens = max(h.batch.tokens.shape[0] for h in hosts)
    positions = max(h.batch.score_token_ids.shape[0] for h in hosts)
    columns = max(h.batch.score_token_ids.shape[1] for h in hosts)
    full_vocab = any(h.options.full_vocab for h in hosts)
    top_k = max(h.options.top_k for h in hosts)
    pooled = [h.context for h in hosts if h.context is not None]
    width = max((c.ctx_slot.shape[1] for c in pooled), default=0)
    stored = max((c.store_row.shape[0] for c in pooled), default=0)
    nb = tokens // blocks.pop()
    out = []
    for host in hosts:
        b = host.batch
        batch = PackedBatch(tokens=_pad(b.tokens, (tokens,)),
                            positions=_pad(b.positions, (tokens,)),
                            segment_ids=_pad(b.segment_ids, (tokens,), -1),
                            score_positions=_pad(b.score_positions, (positions,)),
                            score_token_ids=_pad(b.score_token_ids, (positions, columns)))
        context = host.context
        if context is not None:
            context = PrefixContext(
                ctx_slot=_pad(context.ctx_slot, (nb, width)),
                ctx_lo=_pad(context.ctx_lo, (nb, width), 1),
                ctx_hi=_pad(context.ctx_hi, (nb, width)),
                store_row=_pad(context.store_row, (stored,)),
                store_slot=_pad(context.store_slot, (stored,), rank_slots),
                ctx_positions=(None if context.ctx_positions is None
                               else _pad(context.ctx_positions, (nb, width))))
        out.append(dataclasses.replace(
            host, batch=batch, context=context,
            options=dataclasses.replace(host.options, full_vocab=full_vocab, top_k=top_k)))
    return out


def top_k_bucket(k: int) -> int:
    """The top-k a program computes for ops asking for up to ``k``: 0, or the next power
    of two (few programs; an op reads its own first k)."""
    return 0 if k <= 0 else next_power_of_two(k)


def unpack(host: HostBatch, readout: VocabReadout) -> list[tuple[Hashable, OpOutput]]:
    """Split a batch's readout (host arrays: [P, C] logits, [P] log-sum-exp, [P, K] top
    ids and logits) back per sequence: (key, its output)."""
    out = []
    for seq, row in zip(host.sequences, host.rows):
        rows = slice(row, row + len(seq.score_positions))
        per_position = [np.asarray(readout.logits[row + j, :len(ids)])
                        for j, ids in enumerate(seq.score_token_ids)]
        lse = None if readout.lse is None else np.asarray(readout.lse[rows])
        top_ids = top_logits = None
        if seq.top_k:
            top_ids = np.asarray(readout.top_ids[rows, :seq.top_k])
            top_logits = np.asarray(readout.top_logits[rows, :seq.top_k])
        out.append((seq.key, OpOutput(per_position, lse, top_ids, top_logits)))
    return out

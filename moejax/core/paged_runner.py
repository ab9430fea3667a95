"""The device side of paged generation on the engine core (:mod:`moejax.core.engine_core`):
:class:`PagedRunner` owns the KV store (pool and allocators, :class:`moejax.kv.KVStore`) and
the decode runner (the weight placement and the step programs, :mod:`moejax.decode.runners`),
turns a :class:`~moejax.core.paged_plan.GenerationPlan` into device arrays and dispatches
its programs: the prefill rows and then the decode rows, both before either result is read
(the decode rows do not depend on this step's prefill, so the host builds the decode batch
while the prefill runs; the pool carries the order on the device).

A step's arrays: ranks × rows rows of ``width`` tokens, rank-major; each work item
(sequence, first position, token count) fills as many consecutive rows as it needs. Row
counts are powers of two up to the layout's caps, so a scheduler runs a handful of
programs (:meth:`PagedRunner.precompile` runs each once on padding rows).

Sampled tokens stay on the device. The runner keeps where each sequence's token of the
last executed plan lies (which program's ``tokens``, which row); a work item of the next
plan whose last token is that one (``Work.fed``: the scheduler planned it before reading
the token, :meth:`moejax.core.engine_core.EngineCore.step_ahead`) gets it there, by one
small gather (:data:`FEED_TOKENS`) into the program's token array, and the host never
waits for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax import sampling
from moejax.core.paged_plan import GenerationPlan, Launch, RowLayout, Work
from moejax.decode.programs import PagedBatch
from moejax.decode.runners import DecodeRunner
from moejax.kv import SUM_BLOCK_COUNTS, KVPool, KVStore
from moejax.kv.copy import copy_blocks
from moejax.prefix_hash import BLOCK_SIZE
from moejax.sizes import bucket


def feed_tokens(tokens: jax.Array, feed: jax.Array, *sampled: jax.Array) -> jax.Array:
    """``tokens`` [N] with position i replaced by the sampled token ``feed[i]`` (an index
    into the concatenated ``sampled`` arrays) where ``feed[i] >= 0``."""
    every = jnp.concatenate(sampled)
    return jnp.where(feed >= 0, every[jnp.maximum(feed, 0)], tokens)


FEED_TOKENS = jax.jit(feed_tokens)


class PagedRunner:
    """Executes generation plans on ``runner`` and ``store`` (module docstring), with
    ``step`` ("fused" | "layerwise") programs laid out by ``layout``."""

    def __init__(self, runner: DecodeRunner, store: KVStore, layout: RowLayout, step: str):
        self.runner = runner
        self.store = store
        self.layout = layout
        self.step = step
        # The tokens the last executed plan sampled, on the device: each program's token
        # array, and per sequence id the (array, row) of its token.
        self.sampled_arrays: list[jax.Array] = []
        self.sampled_at: dict[int, tuple[int, int]] = {}

    def execute(self, plan: GenerationPlan) -> list[Launch]:
        """Dispatch the plan's prefill program, then its decode program (those with work)."""
        fed_from = (self.sampled_arrays, self.sampled_at)
        self.sampled_arrays, self.sampled_at = [], {}
        return [self.launch(works, width, fed_from)
                for works, width in ((plan.prefill, self.layout.row_tokens), (plan.decode, 1))
                if works]

    def forget_sampled(self) -> None:
        """Drop the device tokens of the last plan (its outputs will never be read)."""
        self.sampled_arrays, self.sampled_at = [], {}

    def launch(self, works: Sequence[Work], width: int,
               fed_from: tuple[list[jax.Array], dict[int, tuple[int, int]]] = ([], {})
               ) -> Launch:
        """Dispatch one program over ``works`` (rows of ``width`` tokens); a fed work
        item's last token comes from ``fed_from`` (the last plan's sampled tokens)."""
        layout = self.layout
        per_rank: list[list[Work]] = [[] for _ in range(layout.ranks)]
        for work in works:
            per_rank[work.seq.rank].append(work)
        needed = max(sum(-(-work.count // width) for work in items) for items in per_rank)
        cap = layout.per_rank if width == 1 else layout.prefill_rows
        batch, samp, first_rows, last_rows = self.build_batch(per_rank, bucket(needed, 1, cap),
                                                              width)
        ordered = [work for items in per_rank for work in items]
        if any(work.fed for work in ordered):
            batch = self._feed(batch, ordered, last_rows, width, fed_from)
        self.store.pool, result = self.runner.run(self.store.pool, batch, samp, self.step)
        sampler = len(self.sampled_arrays)
        self.sampled_arrays.append(result.tokens)
        for work, row in zip(ordered, last_rows):
            if work.samples:
                self.sampled_at[work.seq.seq_id] = (sampler, row)
        return Launch(ordered, width, first_rows, last_rows, result)

    def _feed(self, batch: PagedBatch, works: list[Work], last_rows: list[int], width: int,
              fed_from: tuple[list[jax.Array], dict[int, tuple[int, int]]]) -> PagedBatch:
        """``batch`` with each fed work item's last token taken from the device."""
        arrays, at = fed_from
        offsets = np.cumsum([0] + [a.shape[0] for a in arrays])
        feed = np.full(batch.tokens.shape[0], -1, np.int32)
        for work, row in zip(works, last_rows):
            if work.fed:
                sampler, sampled_row = at[work.seq.seq_id]
                feed[row * width + (work.count - 1) % width] = offsets[sampler] + sampled_row
        tokens = FEED_TOKENS(batch.tokens, feed, *arrays)
        return dataclasses.replace(batch, tokens=tokens)

    def precompile(self, shapes: Sequence[tuple[int, int]], feeds: bool = False) -> int:
        """Run each (rows per rank, row width) program once on rows that are all padding
        (nothing is read or written); with ``feeds`` (pipelined steps) also the token feed
        at every shape it can take (:meth:`precompile_feeds`). Returns how many programs
        ran."""
        self.runner.precompile()
        sampled: dict[tuple[int, int], jax.Array] = {}
        for rows, width in shapes:
            batch, samp, _, _ = self.build_batch([[] for _ in range(self.layout.ranks)], rows,
                                                 width)
            self.store.pool, result = self.runner.run(self.store.pool, batch, samp, self.step)
            sampled[(rows, width)] = result.tokens
        return len(shapes) + (self.precompile_feeds(sampled) if feeds else 0)

    def precompile_feeds(self, sampled: dict[tuple[int, int], jax.Array]) -> int:
        """Run :data:`FEED_TOKENS` once at each shape a pipelined step gives it: a decode
        program's tokens (the fed work is a sequence's next decode row) taken from the last
        plan's sampled tokens, its prefill program's, its decode program's or both, in
        that order (``sampled``: each program shape's sampled tokens, placed as a step
        leaves them). Returns how many ran."""
        prefill = [t for (_, width), t in sampled.items() if width > 1]
        decode = [t for (_, width), t in sampled.items() if width == 1]
        previous = ([(t,) for t in prefill + decode]
                    + [(p, d) for p in prefill for d in decode])
        ran = 0
        for tokens in decode:          # the fed program: [ranks · rows] tokens
            n = tokens.shape[0]
            for arrays in previous:
                FEED_TOKENS(np.zeros(n, np.int32), np.full(n, -1, np.int32), *arrays)
                ran += 1
        return ran

    def copy_in(self, source: KVPool, source_blocks: Sequence[int], blocks: Sequence[int]
                ) -> None:
        """Copy ``source_blocks`` of the pool ``source`` (any device) into ``blocks`` of
        this pool (a sequence prefilled elsewhere, adopted by a decoder)."""
        self.store.pool = copy_blocks(source, source_blocks, self.store.pool, blocks,
                                      self.runner.device)

    def block_counts(self, block_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """The signature-cache counts [len(block_lists), L, E] int32 summed over each list
        of this pool's blocks (rows padded to a power of two; an empty list is a row of
        padding)."""
        counts = self.store.pool.expert_counts
        if counts is None:
            raise ValueError("this scheduler keeps no signature cache (expert_counts=False)")
        rows = bucket(max(len(block_lists), 1), 1)
        # Every rank's blocks, one rank after another: past the last one is padding.
        tables = np.full((rows, self.layout.max_table), counts.shape[0], np.int32)
        for i, blocks in enumerate(block_lists):
            tables[i, :len(blocks)] = blocks
        return np.asarray(SUM_BLOCK_COUNTS(counts, tables))[:len(block_lists)]

    def build_batch(self, per_rank: list[list[Work]], rows: int, width: int
                    ) -> tuple[PagedBatch, sampling.SamplingParams, list[int], list[int]]:
        """The step's arrays: ranks × ``rows`` rows of ``width`` tokens, rank-major; each
        work item (sequence, first position, token count) fills as many consecutive rows
        as it needs. Also the first and the last row of each work item (rank order)."""
        layout = self.layout
        total = layout.ranks * rows
        slots_per_rank = layout.slots_per_rank
        tokens = np.zeros((total, width), np.int32)
        positions = np.zeros((total, width), np.int32)
        valid = np.zeros((total, width), bool)
        write = np.full((total, width), slots_per_rank, np.int32)
        segments = np.full(total, -1, np.int32)
        tables = np.zeros((total, layout.max_table), np.int32)
        context = np.zeros(total, np.int32)
        last = np.arange(total, dtype=np.int32) * width
        counters = np.zeros(total, np.int32)
        temperature, top_p, seeds = [0.0] * total, [1.0] * total, [0] * total
        first_rows: list[int] = []
        last_rows: list[int] = []
        for rank, works in enumerate(per_rank):
            row = rank * rows
            for segment, (seq, start, count, samples, fed) in enumerate(works):
                first_rows.append(row)
                # A fed token is not on the host yet: a placeholder, replaced on the device.
                seq_tokens = np.asarray(seq.tokens[start:start + count] + [0] * fed, np.int32)
                blocks = np.asarray(seq.blocks, np.int32)
                pos = np.arange(start, start + count, dtype=np.int32)
                for offset in range(0, count, width):
                    n = min(width, count - offset)
                    part = pos[offset:offset + n]
                    tokens[row, :n] = seq_tokens[offset:offset + n]
                    positions[row, :n] = part
                    valid[row, :n] = True
                    write[row, :n] = blocks[part // BLOCK_SIZE] * BLOCK_SIZE + part % BLOCK_SIZE
                    segments[row] = segment
                    tables[row, :len(blocks)] = blocks
                    context[row] = start
                    row += 1
                row -= 1
                last[row] = row * width + (count - 1) % width
                # The index of the token it samples (planned, so counted in flight).
                counters[row] = seq.generated - samples
                temperature[row], top_p[row] = seq.spec.temperature, seq.spec.top_p
                seeds[row] = seq.spec.seed
                last_rows.append(row)
                row += 1
        flat = lambda a: a.reshape(-1)   # noqa: E731
        return (PagedBatch(tokens=flat(tokens), positions=flat(positions), valid=flat(valid),
                           write_slots=flat(write), segments=segments, block_tables=tables,
                           context_len=context, last=last, counters=counters),
                sampling.make_sampling_params(temperature, top_p, seeds),
                first_rows, last_rows)

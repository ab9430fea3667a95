"""Continuous batching over the paged KV cache: the scheduler and its background loop.

:class:`Scheduler` keeps a *running* set of at most ``max_batch_size`` sequences (per
data-parallel rank: ``max_batch_size`` is the total) and a *waiting* queue. Each
:meth:`Scheduler.step`:

1. drops cancelled sequences (their blocks go back to the pool at once);
2. admits waiting sequences, oldest first, while the running set has room and the pool
   has blocks for their first chunk; a prompt whose leading full blocks are already
   cached (same chain hash, ``moejax.prefix_hash``) reuses them and skips their prefill;
3. runs the **prefill** of the prompt chunks of the sequences still prefilling, packed
   into one program of rows of ``prefill_row_tokens`` (a chunk spans as many rows as
   it needs; rows of one sequence attend to each other), at most ``max_prefill_tokens``
   tokens of rows in all, oldest first, so a long prompt takes several steps; and then
   one **decode** program over every sequence that is generating (one token each);
4. retires finished sequences: their token and the finish reason are reported.

Steps are pipelined (``pipelined``, the default; vLLM v1's async scheduling,
:meth:`moejax.core.engine_core.EngineCore.step_ahead`): a call of :meth:`Scheduler.step`
plans and dispatches the next step *before* it reads the tokens of the step the last
call dispatched, and those tokens reach the next step's inputs on the device
(:class:`moejax.core.paged_runner.PagedRunner`). A sampled token not read yet is *in
flight* (``SequenceState.in_flight``) and counts as generated when planning; a sequence
whose last allowed token is in flight gets no more rows. Events (tokens, finishes) come
one call later than the step that sampled them. A stop token is seen one step late: the
sequence may have run one more row, whose output is dropped, and nothing else. A
cancelled or preempted sequence with a token in flight is handled when it arrives (a
preempted one keeps the token and waits for it before being re-admitted). The tokens
are those of the unpipelined loop (``pipelined=False``: plan, run, read, in turn).

A scheduler may also serve one side of a prefill/decode split (``moejax.core.decoders``):
with ``handoff`` it only prefills — a sequence whose prompt has run (its first token
sampled) leaves the running set with its blocks still held, to be taken
(:meth:`Scheduler.take_handoffs`) and later released (:meth:`Scheduler.release`) by
whoever hands it to a decoder; a decoder takes such a sequence with
:meth:`Scheduler.adopt`, copying its prompt blocks into its own pool, and decodes it.
The pool and its block allocators are a :class:`moejax.kv.KVStore`, which a scoring
engine on the same device may share (``Generator(share_with=scorer)``): each step holds
the store's lock, and a step that finds the store reset (a sharer's step failed with the
pool) re-queues its running sequences to be recomputed, as after a preemption.
With ``expert_counts`` the pool keeps ELDR's signature cache (one int8 count per block,
layer and expert, written by the step programs: ``moejax.decode.paged``) and
:meth:`Scheduler.prompt_counts` sums a sequence's blocks into its raw signature.

When the pool runs out of blocks, the newest running sequence is *preempted*: its
blocks are freed and it goes back to the front of the queue with the tokens it has
generated, to be recomputed (prompt + generated tokens, as a prompt) when blocks free
up. Nothing is lost, and its tokens do not change (greedy, f32), because every row of
a step is computed independently of the others and a sequence's sampling key depends
only on its seed and step.

A sequence whose prompt + max_new_tokens cannot fit in the whole pool is refused when
it is submitted (:class:`SequenceTooLong`).

Compiled shapes: a step program's shape is its row count (a power of two up to the
running set, or up to ``max_prefill_tokens / prefill_row_tokens`` for prefill) and its
row width (1 or ``prefill_row_tokens``); block tables always have the context's full
width (the attention loops only over the context a step has). So a scheduler runs a
handful of programs, and :meth:`Scheduler.precompile` compiles all of them up front.

:class:`GenerationLoop` runs a scheduler on a background thread for servers and
benchmarks: ``submit(spec, on_event)`` from any thread; ``on_event`` is called from the
loop thread with each new token and, last, the finished output.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from moejax import prefix_hash
from moejax.core.engine_core import EngineCore
from moejax.core.paged_plan import (GenerationPlan, Launch, RowLayout, SequenceState,
                                    TokenEvent, Work)
from moejax.core.paged_runner import PagedRunner
from moejax.decode.programs import StepResult
from moejax.decode.runners import DecodeRunner
from moejax.expert_trace import expert_counts
from moejax.kv import BlockAllocator, KVPool, KVStore
from moejax.sequences import SequenceSpec
from moejax.sizes import bucket_sizes

BLOCK = prefix_hash.BLOCK_SIZE
MAX_RECORDS = 100_000   # step (and route) records kept, newest last: tens of MB at most
log = logging.getLogger(__name__)


EXPERT_SAMPLE_EVERY = 8     # decode steps per one whose routing is counted


class SequenceTooLong(ValueError):
    """A sequence needs more KV blocks than the whole pool holds."""


@dataclasses.dataclass(frozen=True)
class SchedulerOptions:
    """``max_batch_size``: running sequences (all ranks); ``max_prefill_tokens``: prompt
    tokens per step (rows included: a row only partly filled counts whole);
    ``prefill_row_tokens``: the width of a prefill row (capped at max_prefill_tokens);
    ``step``: "fused" | "layerwise"; ``trace``: keep every token's routing (and the
    router inputs, where the runner's step options compute them); ``handoff``: prefill
    only, sequences leave for a decoder after their prompt (module docstring);
    ``expert_counts``: keep the signature cache; ``record_steps``: keep a
    :class:`StepRecord` of every step (``Scheduler.step_records``, the latest
    :data:`MAX_RECORDS`); ``pipelined``: dispatch each step before reading the last
    one's tokens (module docstring; a hand-off scheduler steps in turn: its sequences
    leave after their first token)."""

    max_batch_size: int = 16
    max_prefill_tokens: int = 512
    # Wide enough for efficient matmuls, narrow enough that a short prompt's one partly
    # filled row wastes little.
    prefill_row_tokens: int = 64
    step: str = "fused"
    trace: bool = False
    handoff: bool = False
    expert_counts: bool = False
    record_steps: bool = False
    pipelined: bool = True


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One scheduler step: its prefill and decode rows (sequences), the distinct experts
    its decode rows activated at each layer ([L] ints, None without decode rows), its
    wall time (seconds, planning to results on the host; pipelined, that includes the
    planning and dispatch of the next step), and the ids of the sequences its decode rows
    ran, in plan order (what a replay of the step's batch is checked against:
    ``moejax.eldr.replay``)."""

    prefill_sequences: int
    decode_sequences: int
    active_experts: np.ndarray | None
    seconds: float
    decode_ids: tuple[int, ...] = ()


class Scheduler:
    """Continuous batching of :class:`SequenceSpec` s over a runner (module docstring)."""

    def __init__(self, runner: DecodeRunner, num_blocks: int, options: SchedulerOptions,
                 store: KVStore | None = None):
        if min(options.max_batch_size, options.max_prefill_tokens,
               options.prefill_row_tokens) < 1:
            raise ValueError("max_batch_size, max_prefill_tokens and prefill_row_tokens "
                             "must be >= 1")
        runner.check_step(options.step)
        self.runner = runner
        self.options = options
        self.ranks = runner.num_ranks
        if store is None:
            store = KVStore(functools.partial(runner.make_kv, num_blocks,
                                              expert_counts=options.expert_counts),
                            [BlockAllocator(num_blocks, BLOCK) for _ in range(self.ranks)])
        else:
            self._check_shared(store, num_blocks)
        # The device's KV memory (moejax.kv.store), possibly shared with a scoring engine.
        self.store = store
        self._epoch = store.epoch
        row_tokens = min(options.prefill_row_tokens, options.max_prefill_tokens)
        # The step programs' geometry, which the planning here and the arrays the runner
        # builds both follow.
        self.layout = RowLayout(
            ranks=self.ranks, per_rank=max(1, -(-options.max_batch_size // self.ranks)),
            prefill_rows=max(1, options.max_prefill_tokens // row_tokens),
            row_tokens=row_tokens, num_blocks=num_blocks,
            max_table=-(-runner.cfg.max_context // BLOCK))
        # The device side; each step() runs the engine core over this (host) scheduler and
        # it (built per step: a scheduler holding its core would be a reference cycle,
        # keeping a dropped scheduler's pool alive until the cyclic collector runs).
        self.paged = PagedRunner(runner, store, self.layout, options.step)
        self.pipelined = options.pipelined and not options.handoff
        # Pipelined: the step dispatched by the last step() call, its outputs not read.
        self._in_flight: tuple[GenerationPlan, list[Launch]] | None = None
        self.waiting: collections.deque[SequenceState] = collections.deque()
        self.running: list[SequenceState] = []
        self._ids = itertools.count()
        self.stats = collections.Counter()
        # The decode load (METRO and ELDR act on it): tokens routed to each expert at each
        # layer [L, E], counted over one step with decode rows in EXPERT_SAMPLE_EVERY, the
        # first included (the routing is fetched from the device then only).
        self.decode_expert_tokens: np.ndarray | None = None
        self._handoffs: list[SequenceState] = []
        # The latest steps only: a serving decoder steps for as long as it runs.
        self.step_records: collections.deque[StepRecord] = collections.deque(
            maxlen=MAX_RECORDS)

    # ----------------------------------------------------------------- intake
    def submit(self, spec: SequenceSpec, on_event: Callable[[TokenEvent], None] | None = None
               ) -> SequenceState:
        """Queue one sequence; raises :class:`SequenceTooLong` if it can never fit."""
        needed = -(-(len(spec.prompt) + spec.max_new_tokens) // BLOCK)
        if needed > self.num_blocks:
            raise SequenceTooLong(
                f"prompt ({len(spec.prompt)} tokens) + max_new_tokens ({spec.max_new_tokens}) "
                f"needs {needed} KV blocks of {BLOCK} tokens; the pool holds {self.num_blocks}")
        seq = SequenceState(seq_id=next(self._ids), spec=spec, on_event=on_event)
        self.waiting.append(seq)
        return seq

    def cancel(self, seq: SequenceState) -> None:
        """Stop ``seq``: it is dropped (blocks freed) at the start of the next step.
        Thread-safe (a flag)."""
        seq.cancelled = True

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self._in_flight is not None)

    def _check_shared(self, store: KVStore, num_blocks: int) -> None:
        """ValueError unless this scheduler can step ``store`` (a scoring engine's)."""
        if self.ranks != 1 or len(store.allocators) != 1:
            raise ValueError(f"sharing a KV pool needs a one-rank decode backend (this one "
                             f"has {self.ranks} ranks)")
        if self.options.expert_counts or self.options.handoff:
            raise ValueError("a shared KV pool keeps no signature cache and serves no "
                             "prefill/decode split: scoring's blocks carry no expert counts")
        if store.num_blocks != num_blocks:
            raise ValueError(f"the shared KV pool has {store.num_blocks} blocks, not "
                             f"{num_blocks}")
        pool, cfg = store.pool, self.runner.cfg
        heads, key_dim, value_dim = cfg.kv_store_dims
        if (pool.keys.shape[0] != cfg.num_layers or pool.keys.shape[2:] != (heads, key_dim)
                or pool.values.shape[2:] != (heads, value_dim)
                or pool.keys.dtype != self.runner.dtype):
            raise ValueError("the shared KV pool holds another model's or dtype's keys and "
                             "values")
        if pool.keys.devices() != {self.runner.device}:
            raise ValueError("the shared KV pool lives on another device than the decode "
                             "runner")

    @property
    def num_blocks(self) -> int:
        """KV blocks per rank."""
        return self.layout.num_blocks

    @property
    def kv(self) -> KVPool:
        """The pool (the store's: a step replaces it)."""
        return self.store.pool

    @property
    def allocators(self) -> list[BlockAllocator]:
        """The block allocator of each rank's part of the pool."""
        return self.store.allocators

    def occupancy(self) -> int:
        """KV blocks held by sequences, over every rank."""
        return sum(m.num_in_use for m in self.allocators)

    # ----------------------------------------------------------------- hand-off
    def take_handoffs(self) -> list[SequenceState]:
        """The sequences prefilled since the last call (``handoff``): out of the running
        set, their blocks still held until :meth:`release`."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def release(self, blocks: Sequence[int], rank: int = 0) -> None:
        """Give back a handed-off sequence's blocks (of its rank), once they are copied
        (its full prompt blocks stay cached here for later prompts)."""
        self.allocators[rank].release(blocks)

    def pool_blocks(self, seq: SequenceState) -> list[int]:
        """``seq``'s blocks as blocks of the whole pool (:meth:`rank_blocks`)."""
        return self.rank_blocks(seq.rank, seq.blocks)

    def rank_blocks(self, rank: int, blocks: Sequence[int]) -> list[int]:
        """Rank ``rank``'s ``blocks`` as blocks of the whole pool: rank r's block b is
        ``r · num_blocks + b`` (the pool holds the ranks' blocks one after another)."""
        return [rank * self.num_blocks + b for b in blocks]

    def prompt_counts(self, seqs: Sequence[SequenceState]) -> np.ndarray:
        """The raw signatures [len(seqs), L, E] int32 of sequences whose blocks this pool
        holds: each one's signature-cache counts summed over its blocks (``expert_counts``;
        after prefill, a sequence's blocks hold exactly its prompt), on any rank."""
        return self.block_counts([self.pool_blocks(seq) for seq in seqs])

    def block_counts(self, block_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """The signature-cache counts [len(block_lists), L, E] int32 summed over each list
        of the whole pool's blocks (rows padded to a power of two; an empty list is a row
        of padding, which is how :meth:`moejax.core.decoders.DecoderPool.precompile`
        compiles every row count)."""
        return self.paged.block_counts(block_lists)

    def _adoption_rank(self, seq: SequenceState) -> int | None:
        """The rank that can adopt ``seq`` now (a running row and blocks for its computed
        tokens), or None."""
        return self._open_rank(-(-seq.computed // BLOCK))

    def room_to_adopt(self, seq: SequenceState) -> bool:
        """Whether :meth:`adopt` can take ``seq`` now (on some rank: a running row and
        its blocks)."""
        return self._adoption_rank(seq) is not None

    def adopt(self, seq: SequenceState, source: KVPool, source_blocks: Sequence[int]) -> None:
        """Take a sequence prefilled elsewhere: copy its ``seq.computed`` tokens' blocks
        (``source_blocks``: blocks of the whole pool ``source``, on any devices and ranks)
        into fresh blocks of the rank here with the fewest running sequences, and decode
        it from here on (check :meth:`room_to_adopt` first)."""
        rank = self._adoption_rank(seq)
        if rank is None:
            raise ValueError(f"no rank of this decoder has room for sequence {seq.seq_id} "
                             f"(check room_to_adopt first)")
        count = -(-seq.computed // BLOCK)
        with self.store.lock:
            blocks = self.allocators[rank].allocate(count)
            self.paged.copy_in(source, list(source_blocks)[:count],
                               self.rank_blocks(rank, blocks))
        seq.rank, seq.blocks, seq.handed_off = rank, blocks, False
        self.running.append(seq)
        self.stats["adopted"] += 1

    def drain(self) -> list[SequenceState]:
        """Forget every sequence, running or waiting (after a failed step), and return
        them."""
        seqs = list(self.running) + list(self.waiting) + self._handoffs
        self.running, self.waiting, self._handoffs = [], collections.deque(), []
        self._forget_in_flight(seqs)
        return seqs

    def _forget_in_flight(self, seqs: Sequence[SequenceState]) -> None:
        """The dispatched step's outputs will never be read: its tokens in flight are
        lost (a sequence recomputed later samples the same ones again)."""
        self._in_flight = None
        self.paged.forget_sampled()
        for seq in seqs:
            seq.in_flight = 0

    # ----------------------------------------------------------------- a step
    def step(self) -> list[TokenEvent]:
        """One scheduling step (module docstring); the events it produced. Holds the
        store's lock throughout (a scoring engine sharing the pool waits, and is waited
        for). A step that fails resets the store: its pool went into the step."""
        with self.store.lock:
            try:
                core = EngineCore(self, self.paged)
                if not self.pipelined:
                    return core.step()
                events, self._in_flight = core.step_ahead(self._in_flight)
                if self._in_flight is not None:
                    # What planning produced (cancellations) waits for no device.
                    plan = self._in_flight[0]
                    events, plan.events = events + plan.events, []
                return events
            except BaseException:
                self.store.reset()
                # What this scheduler held went with the pool: nothing is released into
                # the fresh allocators, and a caller that goes on stepping recomputes.
                self._recompute_after_reset()
                raise

    def _recompute_after_reset(self) -> None:
        """The store was reset (a sharer's step failed with the pool): every block this
        scheduler held is gone, so its running sequences go back to the front of the queue
        to be recomputed, as after a preemption (nothing is lost; their tokens do not
        change)."""
        self._epoch = self.store.epoch
        self._forget_in_flight(list(self.running) + list(self.waiting))
        for seq in sorted(self.running, key=lambda s: s.seq_id, reverse=True):
            seq.blocks, seq.computed = [], 0
            self.waiting.appendleft(seq)
        self.stats["recomputed_after_reset"] += len(self.running)
        self.running = []

    # ------------------------------------------------- the engine core's contract
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> GenerationPlan:
        """Host-only: drop cancelled sequences, admit waiting ones, and plan this step's
        prefill chunks and decode rows with their blocks allocated (recomputing what a
        reset of the store took first)."""
        if self.store.epoch != self._epoch:
            self._recompute_after_reset()
        events: list[TokenEvent] = []
        started = time.perf_counter()
        self._drop_cancelled(events)
        self._admit()
        prefill, decode = self._plan()
        return GenerationPlan(prefill, decode, events, started, self._epoch)

    def update(self, plan: GenerationPlan, launches: list[Launch]) -> list[TokenEvent]:
        """The step's tokens (and routing) into its sequences -> the step's events."""
        events = plan.events
        if plan.epoch != self._epoch:
            # Planned before the store was reset (pipelined: it ran while a sharer's step
            # failed): its sequences were re-queued, to be recomputed; nothing of it holds.
            return events
        active = None
        decodes = any(launch.width == 1 for launch in launches)
        sampled = decodes and self.stats["decode_steps"] % EXPERT_SAMPLE_EVERY == 0
        self.stats["decode_steps"] += decodes
        for launch in launches:
            self._collect(launch, events)
            if launch.width == 1 and self.options.record_steps:
                active = _active_experts(launch, self.runner.cfg.num_experts)
            if launch.width == 1 and sampled:
                self._count_decode_experts(launch)
        self.running = [s for s in self.running if not (s.finished or s.handed_off)]
        if any(s.finished for s in self.waiting):   # preempted, its last token was in flight
            self.waiting = collections.deque(s for s in self.waiting if not s.finished)
        self.stats["steps"] += bool(launches)     # steps that ran a program
        if self.options.record_steps and launches:
            self.step_records.append(StepRecord(len(plan.prefill), len(plan.decode), active,
                                                time.perf_counter() - plan.started,
                                                tuple(w.seq.seq_id for w in plan.decode)))
        return events

    def _count_decode_experts(self, launch: Launch) -> None:
        """Add a decode launch's routed tokens per expert (choices with a nonzero weight:
        a dense layer routes with weight 0)."""
        rows = launch.last_rows
        experts = np.asarray(launch.result.experts)[:, rows]                 # [L, n, k]
        taken = np.asarray(launch.result.weights)[:, rows] != 0
        num_experts = self.runner.cfg.num_experts
        counts = np.stack([np.bincount(experts[layer][taken[layer]], minlength=num_experts)
                           for layer in range(experts.shape[0])]).astype(np.int64)
        self.decode_expert_tokens = (counts if self.decode_expert_tokens is None
                                     else self.decode_expert_tokens + counts)

    def program_shapes(self) -> list[tuple[int, int]]:
        """(rows per rank, row width) of every step program this scheduler can run."""
        decode_rows = bucket_sizes(self.layout.per_rank, self.layout.per_rank)
        prefill_rows = bucket_sizes(self.layout.prefill_rows, self.layout.prefill_rows)
        return ([(rows, 1) for rows in decode_rows]
                + [(rows, self.layout.row_tokens) for rows in prefill_rows])

    def precompile(self) -> int:
        """Compile every step program (:meth:`program_shapes`) by running each once on
        rows that are all padding (nothing is read or written), and, with pipelined steps,
        the token feed at every shape (``PagedRunner.precompile_feeds``), so that no later
        step stalls on a compile. Returns how many programs ran."""
        shapes = self.program_shapes()
        with self.store.lock:
            return self.paged.precompile(shapes, feeds=self.pipelined)

    def run_until_idle(self, sink: Callable[[TokenEvent], None] | None = None) -> None:
        """Step until nothing waits or runs; events go to ``sink`` too."""
        while self.busy:
            for event in self.step():
                if sink is not None:
                    sink(event)

    # ----------------------------------------------------------------- bookkeeping
    def _drop_cancelled(self, events: list[TokenEvent]) -> None:
        for seq in [s for s in self.running if s.cancelled]:
            self._free(seq)
            self.running.remove(seq)
            self._finish(seq, "cancelled", events)
        for seq in [s for s in self.waiting if s.cancelled]:
            self.waiting.remove(seq)
            self._finish(seq, "cancelled", events)

    def _finish(self, seq: SequenceState, reason: str, events: list[TokenEvent],
                tokens: Sequence[int] = ()) -> None:
        seq.finished = True
        seq.output.finish_reason = reason
        if self.options.trace:
            _attach_trace(seq, len(seq.spec.prompt))
        events.append(TokenEvent(seq, list(tokens), seq.output))

    def _free(self, seq: SequenceState) -> None:
        self.allocators[seq.rank].release(seq.blocks)
        seq.blocks = []
        seq.computed = 0

    def _admit(self) -> None:
        while self.waiting:
            seq = self.waiting[0]
            if seq.in_flight:     # preempted with a token in flight: it waits for it
                return
            rank = self._rank_for(seq)
            if rank is None:
                return
            self.waiting.popleft()
            seq.rank = rank
            allocator = self.allocators[rank]
            tokens = seq.tokens
            # At least the last token is computed (its logits choose the next token).
            reusable = (len(tokens) - 1) // BLOCK
            seq.hashes = prefix_hash.block_hashes(np.asarray(tokens[:reusable * BLOCK]))
            # A traced request computes every token: a prefix hit would skip the routing
            # of the tokens it covers, and the trace must hold all of them.
            hits = [] if self.options.trace else allocator.lookup(seq.hashes)
            allocator.acquire(hits)
            seq.blocks = list(hits)
            self.stats["prefix_hit_tokens"] += len(hits) * BLOCK
            seq.computed = len(seq.blocks) * BLOCK
            self.running.append(seq)

    def _rank_for(self, seq: SequenceState) -> int | None:
        """The rank with room for admitting ``seq`` (a running row, blocks for its first
        chunk), or None."""
        return self._open_rank(-(-min(len(seq.tokens), self.options.max_prefill_tokens)
                                 // BLOCK))

    def _open_rank(self, blocks: int) -> int | None:
        """The rank with a free running row and ``blocks`` free blocks that runs the
        fewest sequences (ties to the lowest), or None."""
        running = [0] * self.ranks
        for s in self.running:
            running[s.rank] += 1
        open_ranks = [r for r in range(self.ranks) if running[r] < self.layout.per_rank
                      and self.allocators[r].num_available >= blocks]
        return min(open_ranks, key=lambda r: running[r]) if open_ranks else None

    def _plan(self) -> tuple[list[Work], list[Work]]:
        """This step's prefill chunks and decode rows, with their blocks allocated
        (preempting the newest sequences where blocks run out)."""
        rows_left = self.layout.prefill_rows
        prefill: list[Work] = []
        decode: list[Work] = []
        for seq in sorted(self.running, key=lambda s: s.seq_id):
            if seq not in self.running:          # preempted for an older one
                continue
            if seq.in_flight and seq.generated >= seq.spec.max_new_tokens:
                continue                         # its last token is in flight
            if seq.pending > 1:
                count = min(seq.pending, rows_left * self.layout.row_tokens)
                if count == 0 or not self._reserve(seq, seq.computed + count):
                    continue
                rows_left -= -(-count // self.layout.row_tokens)
                prefill.append(Work(seq, seq.computed, count, count == seq.pending))
            elif self._reserve(seq, seq.computed + 1):
                decode.append(Work(seq, seq.computed, 1, True, seq.in_flight > 0))
        prefill = [w for w in prefill if w.seq in self.running]
        decode = [w for w in decode if w.seq in self.running]
        # Planned is as good as done for the next plan: the pool's order on the device
        # runs this step's writes before any later step's reads.
        for work in prefill + decode:
            work.seq.computed = work.start + work.count
            work.seq.in_flight += work.samples
        return prefill, decode

    def _reserve(self, seq: SequenceState, length: int) -> bool:
        """Blocks for ``seq``'s first ``length`` tokens; preempts the newest running
        sequences (possibly ``seq`` itself) until they fit. False if ``seq`` was
        preempted."""
        allocator = self.allocators[seq.rank]
        need = -(-length // BLOCK) - len(seq.blocks)
        while need > allocator.num_available:
            victim = max((s for s in self.running if s.rank == seq.rank),
                         key=lambda s: s.seq_id)
            self._preempt(victim)
            if victim is seq:
                return False
        if need > 0:
            seq.blocks += allocator.allocate(need)
        return True

    def _preempt(self, seq: SequenceState) -> None:
        """Free ``seq``'s blocks and queue it first, to be recomputed (prompt + generated
        tokens) when blocks free up."""
        self._free(seq)
        self.running.remove(seq)
        seq.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(seq)

    # ----------------------------------------------------------------- running
    def _collect(self, launch: Launch, events: list[TokenEvent]) -> None:
        """A dispatched program's tokens (and routing) into its sequences."""
        tokens = np.asarray(launch.result.tokens)
        routing = _host_routing(launch.result, self.options.trace)
        for (seq, start, count, samples, _), first, last in zip(
                launch.works, launch.first_rows, launch.last_rows):
            if seq.finished:           # cancelled, or stopped, while this step ran
                continue
            if routing is not None:
                _record_routing(seq, routing, first * launch.width, start, count)
            self._name_full_blocks(seq)
            if samples:                # its last token ran: the next one was sampled
                seq.in_flight -= 1
                self._accept(seq, int(tokens[last]), events)

    def _accept(self, seq: SequenceState, token: int, events: list[TokenEvent]) -> None:
        out, spec = seq.output, seq.spec
        out.token_ids.append(token)
        if token in spec.stop_token_ids or len(out.token_ids) >= spec.max_new_tokens:
            self._free(seq)
            self._finish(seq, "stop" if token in spec.stop_token_ids else "length", events,
                         [token])
            return
        events.append(TokenEvent(seq, [token]))
        if self.options.handoff:
            seq.handed_off = True
            self._handoffs.append(seq)

    def _name_full_blocks(self, seq: SequenceState) -> None:
        """Name every block that is now fully written (prompt or generated tokens), so
        that a later sequence with the same prefix — or this one after a preemption —
        reuses it."""
        # Only blocks whose tokens are all known here (not a token in flight).
        full = min(min(seq.computed, len(seq.tokens)) // BLOCK, len(seq.blocks))
        if len(seq.hashes) < full:
            tokens = seq.tokens
            parent = seq.hashes[-1] if seq.hashes else prefix_hash.ROOT_HASH
            seq.hashes += prefix_hash.block_hashes(
                np.asarray(tokens[len(seq.hashes) * BLOCK:full * BLOCK]), parent=parent)
        allocator = self.allocators[seq.rank]
        for block, digest in zip(seq.blocks[:full], seq.hashes[:full]):
            allocator.name(block, digest)

def _active_experts(launch: Launch, num_experts: int) -> np.ndarray:
    """The distinct experts the launch's rows (one token each) chose at each layer [L]."""
    experts = np.asarray(launch.result.experts)[:, launch.last_rows]      # [L, n, k]
    return (expert_counts(experts, num_experts) > 0).sum(axis=1)


# ----------------------------------------------------------------------------- tracing
def _host_routing(result: StepResult, trace: bool) -> tuple[np.ndarray, ...] | None:
    if not trace:
        return None
    arrays = (result.experts, result.weights)
    if result.router_inputs is not None:
        arrays += (result.router_inputs,)
    return tuple(np.asarray(a) for a in arrays)


def _record_routing(seq: SequenceState, routing: tuple[np.ndarray, ...], offset: int,
                    start: int, count: int) -> None:
    """Keep the routing [L, n, ...] of the tokens at positions [start, start + count) not
    recorded yet (a recomputed token keeps its first routing)."""
    skip = max(0, seq.traced - start)
    if skip >= count:
        return
    seq.routing.append(tuple(a[:, offset + skip:offset + count] for a in routing))
    seq.traced = start + count


def _attach_trace(seq: SequenceState, prompt_len: int) -> None:
    """Split the recorded routing into the output's prefill and decode parts."""
    if not seq.routing:
        return
    parts = [np.concatenate(arrays, axis=1) for arrays in zip(*seq.routing)]
    out = seq.output
    out.prefill_experts, out.decode_experts = parts[0][:, :prompt_len], parts[0][:, prompt_len:]
    out.prefill_weights, out.decode_weights = parts[1][:, :prompt_len], parts[1][:, prompt_len:]
    if len(parts) > 2:
        out.prefill_router_inputs = parts[2][:, :prompt_len]
        out.decode_router_inputs = parts[2][:, prompt_len:]


# ----------------------------------------------------------------------------- the loop
class GenerationLoop:
    """A scheduler stepping on a background thread (module docstring)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self._lock = threading.Condition()
        self._incoming: list[SequenceState] = []
        self._closed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="moejax-generation",
                                        daemon=True)
        self._thread.start()

    def submit(self, spec: SequenceSpec, on_event: Callable[[TokenEvent], None]
               ) -> SequenceState:
        """Queue ``spec``; ``on_event`` gets its tokens (from the loop thread). Raises
        SequenceTooLong, or RuntimeError once the loop is closed or has failed."""
        with self._lock:
            if self._closed or self.error is not None:
                raise RuntimeError("the generation loop is closed"
                                   + (f" (it failed: {self.error})" if self.error else ""))
            seq = self.scheduler.submit(spec, on_event)
            self._lock.notify()
            return seq

    def cancel(self, seq: SequenceState) -> None:
        """Stop ``seq`` at the next step (its blocks are freed then)."""
        self.scheduler.cancel(seq)
        with self._lock:
            self._lock.notify()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    def _main(self) -> None:
        scheduler = self.scheduler
        while True:
            with self._lock:
                while not scheduler.busy and not self._closed:
                    self._lock.wait()
                if self._closed and not scheduler.busy:
                    return
                try:
                    events = scheduler.step()
                except BaseException as exc:  # noqa: BLE001  (reported to every waiter)
                    log.exception("generation step failed")
                    self.error = exc
                    events = self._fail_all(exc)
            for event in events:
                self._deliver(event)
            if self.error is not None:
                return

    def _fail_all(self, exc: BaseException) -> list[TokenEvent]:
        events = []
        for seq in self.scheduler.drain():
            seq.finished = True
            seq.output.finish_reason = "error"
            seq.output.error = f"generation failed: {type(exc).__name__}: {exc}"
            events.append(TokenEvent(seq, [], seq.output))
        return events

    @staticmethod
    def _deliver(event: TokenEvent) -> None:
        callback = event.sequence.on_event
        if callback is None:
            return
        try:
            callback(event)
        except Exception:  # noqa: BLE001  (one listener's failure is its own)
            log.exception("a generation event callback failed")

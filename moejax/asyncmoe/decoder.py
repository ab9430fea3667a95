"""A μ-queue decoder of a prefill→decode pipeline (:class:`moejax.core.decoders.DecoderPool`):
AsyncMoE's runtime (:class:`~moejax.asyncmoe.runtime.MuQueueRuntime`) on its devices,
behind the decoder interface the pool steps (``room_to_adopt``, ``adopt``, ``step``, ...).

**Whole calls.** The μ-queue runtime runs whole ``generate`` calls in its own virtual
time; it cannot take a sequence in the middle of a call. So a μ-queue decoder's
``step()`` runs every sequence it has adopted since its last step as one ``generate``
call, to the end of each (its stop token or ``max_new_tokens``), and returns their
tokens then: a μ-queue decoder's tokens all arrive when its call ends, one step of the
pool later than their adoption. Sequences adopted while nothing ran wait for the next
step (the pool adopts before it steps, so the next call takes them).

**Adoption copies at once.** The pool releases a sequence's prefill blocks right after
``adopt`` returns, so ``adopt`` copies its prompt blocks (``moejax.kv.copy``) into a
staging pool of this decoder (on its first attention rank's device) then; the call
copies them from there into the request's rank pool (``generate(prefilled=...)``) and
releases the staging blocks when it ends.

**Capacity.** At most ``max_batch_size`` sequences per call, and the blocks of every
adopted sequence's whole length (prompt + ``max_new_tokens``) fit in ``num_blocks``, the
blocks per rank the runtime's pool gets: the loop binds requests to ranks as they
arrive, so this holds on any rank (no request ever finds too few blocks).

Tokens equal a one-decoder continuous run's (greedy and seeded sampling): the runtime
decodes from the token prefill sampled, with the sampling counter continuing from 1.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from moejax.asyncmoe.loop import MU_QUEUE
from moejax.asyncmoe.runtime import MuQueueRuntime, Prefilled
from moejax.core.continuous import MAX_RECORDS, StepRecord
from moejax.core.paged_plan import SequenceState, TokenEvent
from moejax.kv import BlockAllocator, KVPool, empty_pool
from moejax.kv.copy import copy_blocks
from moejax.prefix_hash import BLOCK_SIZE


def blocks_needed(tokens: int) -> int:
    """KV blocks holding ``tokens`` tokens."""
    return -(-tokens // BLOCK_SIZE)


@dataclasses.dataclass(frozen=True)
class MuQueueRunnerInfo:
    """What a pipeline reads of a decoder's runner: its name."""

    name: str = MU_QUEUE


class StagingPool:
    """The decoder's staging pool: adopted prompts' blocks until their call copies them
    to their rank (``copy_in``: the hand-off's copy, which ``DecoderPool`` also
    precompiles through it)."""

    def __init__(self, runtime: MuQueueRuntime, num_blocks: int):
        self.device = runtime.devices[runtime.placement.attention_devices[0]]
        self.kv = empty_pool(runtime.cfg, num_blocks, runtime.executor.dtype, self.device)
        self.allocator = BlockAllocator(num_blocks)

    def copy_in(self, source: KVPool, source_blocks: Sequence[int], blocks: Sequence[int]
                ) -> None:
        """Copy ``source_blocks`` of the pool ``source`` (any device) into ``blocks``
        here."""
        self.kv = copy_blocks(source, source_blocks, self.kv, blocks, self.device)


class MuQueueDecoder:
    """One decoder of a :class:`~moejax.core.decoders.DecoderPool` running the μ-queue
    runtime (module docstring): ``num_blocks`` KV blocks per rank, at most
    ``max_batch_size`` sequences per call."""

    def __init__(self, runtime: MuQueueRuntime, num_blocks: int, max_batch_size: int):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) \
                or max_batch_size < 1:
            raise ValueError(f"max_batch_size must be a positive int, got {max_batch_size!r}")
        if runtime.blocks_per_rank != num_blocks:
            raise ValueError(f"the runtime's pool has blocks_per_rank="
                             f"{runtime.blocks_per_rank}, the decoder num_blocks={num_blocks}: "
                             f"make the runtime with blocks_per_rank={num_blocks}")
        self.runtime = runtime
        self.num_blocks = num_blocks
        self.max_batch_size = max_batch_size
        self.runner = MuQueueRunnerInfo()
        self.paged = StagingPool(runtime, num_blocks)
        self.adopted: list[SequenceState] = []
        self.decode_expert_tokens: np.ndarray | None = None
        self.step_records: collections.deque[StepRecord] = collections.deque(
            maxlen=MAX_RECORDS)
        self.stats: collections.Counter = collections.Counter()

    # ----------------------------------------------------------------- the pool's view
    @property
    def busy(self) -> bool:
        return bool(self.adopted)

    @property
    def running(self) -> list[SequenceState]:
        """The sequences the next call runs (adopted, not yet decoded)."""
        return list(self.adopted)

    @property
    def waiting(self) -> list[SequenceState]:
        """Nothing waits here: an adopted sequence runs in the next call."""
        return []

    def occupancy(self) -> int:
        """KV blocks held: the adopted prompts' staging blocks (a call's rank pools are
        its own, freed when it ends)."""
        return self.paged.allocator.num_in_use

    def _whole_blocks(self, seq: SequenceState) -> int:
        return blocks_needed(len(seq.spec.prompt) + seq.spec.max_new_tokens)

    def room_to_adopt(self, seq: SequenceState) -> bool:
        """Whether :meth:`adopt` can take ``seq`` now: a place in the next call
        (``max_batch_size``), staging blocks for its prompt, and rank blocks for its whole
        length beside the other adopted sequences' (module docstring)."""
        whole = sum(self._whole_blocks(s) for s in self.adopted) + self._whole_blocks(seq)
        return (len(self.adopted) < self.max_batch_size and whole <= self.num_blocks
                and self.paged.allocator.num_available >= blocks_needed(seq.computed))

    def adopt(self, seq: SequenceState, source: KVPool, source_blocks: Sequence[int]) -> None:
        """Take a sequence prefilled elsewhere (its first token sampled): copy its
        ``seq.computed`` tokens' blocks (``source_blocks``: blocks of the whole pool
        ``source``, any devices) into staging blocks now, and run it in the next
        :meth:`step` (check :meth:`room_to_adopt` first)."""
        if not self.room_to_adopt(seq):
            raise ValueError(f"this μ-queue decoder has no room for sequence {seq.seq_id} "
                             f"(check room_to_adopt first)")
        if not seq.output.token_ids:
            raise ValueError(f"sequence {seq.seq_id} has no first token: a decoder adopts "
                             f"prefilled sequences")
        count = blocks_needed(seq.computed)
        blocks = self.paged.allocator.allocate(count)
        self.paged.copy_in(source, list(source_blocks)[:count], blocks)
        seq.rank, seq.blocks, seq.handed_off = 0, blocks, False
        self.adopted.append(seq)
        self.stats["adopted"] += 1

    # ----------------------------------------------------------------- a step
    def step(self) -> list[TokenEvent]:
        """One ``generate`` call over every adopted sequence, each to its end (module
        docstring): per sequence a TokenEvent for each new token, the last one carrying
        its finished output. Cancelled sequences finish "cancelled" without running."""
        events: list[TokenEvent] = []
        for seq in [s for s in self.adopted if s.cancelled]:
            self.adopted.remove(seq)
            self._free(seq)
            self._finish(seq, "cancelled", [], events)
        seqs = list(self.adopted)
        if not seqs:
            return events
        started = time.perf_counter()
        staged = [Prefilled(self.paged.kv, list(s.blocks), s.output.token_ids[-1])
                  for s in seqs]
        # The sequences stay adopted (and their staging blocks held) while the call runs:
        # if it raises, the pool's drain() (after a failed step) finds them here, frees
        # their blocks and gives them their error.
        outputs = self.runtime.generate([s.spec for s in seqs], prefilled=staged)
        self.adopted = []
        for seq in seqs:
            self._free(seq)
        for seq, out in zip(seqs, outputs):
            new = out.token_ids[1:]          # its first token is prefill's, already out
            seq.output.token_ids.extend(new)
            for token in new[:-1]:
                events.append(TokenEvent(seq, [token]))
            self._finish(seq, out.finish_reason, new[-1:], events)
            self._count_experts(out.decode_experts)
        self.stats["decode_calls"] += 1
        self.step_records.append(StepRecord(0, len(seqs), None, time.perf_counter() - started,
                                            tuple(s.seq_id for s in seqs)))
        return events

    def _count_experts(self, experts: np.ndarray) -> None:
        """Add one sequence's decode routing ([L, steps, k] ids) to the decode load [L, E]
        (every decode token counted: a call's routing is on the host anyway)."""
        cfg = self.runtime.cfg
        counts = np.zeros((cfg.num_layers, cfg.num_experts), np.int64)
        for layer in range(cfg.num_layers):
            counts[layer] = np.bincount(np.asarray(experts[layer]).reshape(-1),
                                        minlength=cfg.num_experts)
        self.decode_expert_tokens = (counts if self.decode_expert_tokens is None
                                     else self.decode_expert_tokens + counts)

    @staticmethod
    def _finish(seq: SequenceState, reason: str, tokens: Sequence[int],
                events: list[TokenEvent]) -> None:
        seq.finished = True
        seq.output.finish_reason = reason
        events.append(TokenEvent(seq, list(tokens), seq.output))

    def _free(self, seq: SequenceState) -> None:
        self.paged.allocator.release(seq.blocks)
        seq.blocks = []
        seq.computed = 0

    # ----------------------------------------------------------------- misc
    def precompile(self) -> int:
        """Runs nothing, returns 0: the μ-queue runtime's programs take the row counts of
        the batches its loop forms during a call (powers of two per batch kind, layer and
        expert), which depend on the requests; they compile on first use. (The hand-off
        copy into the staging pool is precompiled by ``DecoderPool`` through
        ``paged.copy_in``.)"""
        return 0

    def drain(self) -> list[SequenceState]:
        """Forget every adopted sequence (after a failed step) and return them."""
        seqs, self.adopted = self.adopted, []
        for seq in seqs:
            self._free(seq)
        return seqs

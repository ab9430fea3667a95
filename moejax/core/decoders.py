"""Prefill/decode split in one process: one prefill scheduler feeding K decoders, each a
continuous-batching scheduler on its own device, with a routing policy choosing each
request's decoder once, at the hand-off (ELDR or a load balancer:
:mod:`moejax.eldr.policies`).

A step of :class:`DecoderPool`:

1. the prefill scheduler (``handoff``: it prefills only, and keeps the ELDR signature
   cache when the policy needs it) runs one step; each sequence whose prompt has run
   (its first token sampled) is *handed off*;
2. each hand-off is routed: the policy sees the sequence's raw prompt expert counts
   (its blocks' signature-cache counts summed on the prefill device) and its domain
   label, and the decoders' loads (running + waiting to be adopted); the choice is
   final;
3. each decoder adopts the sequences routed to it, oldest first, while it has a free
   row and KV blocks: their prompt blocks are copied device to device into its pool and
   the prefill pool's blocks are released (full prompt blocks stay cached there for
   later prompts); then it runs one step.

Routing changes where a sequence decodes, never its tokens: every row of a step is
computed independently of the others, and a sequence's sampling key depends only on its
seed and step, so under every policy the tokens equal a one-decoder run (greedy, f32).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from moejax.core.continuous import MAX_RECORDS, Scheduler
from moejax.core.paged_plan import SequenceState, TokenEvent
from moejax.eldr.policies import HandOff, Policy
from moejax.sequences import SequenceSpec
from moejax.sizes import bucket_sizes


@dataclasses.dataclass(frozen=True)
class RouteRecord:
    """One routing decision: the sequence, the decoder chosen, the loads it saw, and the
    host time the policy took (seconds)."""

    seq_id: int
    decoder: int
    loads: tuple[int, ...]
    seconds: float


class DecoderPool:
    """One prefill scheduler and K decode schedulers behind one scheduler interface
    (``submit``, ``cancel``, ``step``, ``busy``, ``drain``; module docstring)."""

    def __init__(self, prefill: Scheduler, decoders: Sequence[Scheduler], policy: Policy):
        if not prefill.options.handoff:
            raise ValueError("the prefill scheduler must be made with handoff=True")
        if policy.reads_counts and not prefill.options.expert_counts:
            raise ValueError("this policy reads prompt expert counts: make the prefill "
                             "scheduler with expert_counts=True")
        if len(decoders) != policy.num_decoders:
            raise ValueError(f"{len(decoders)} decoders, but the policy routes over "
                             f"{policy.num_decoders}")
        self.prefill = prefill
        self.decoders = list(decoders)
        self.policy = policy
        self.pending: list[collections.deque[SequenceState]] = [
            collections.deque() for _ in self.decoders]
        self.routes: collections.deque[RouteRecord] = collections.deque(maxlen=MAX_RECORDS)

    # ----------------------------------------------------------------- intake
    def submit(self, spec: SequenceSpec, on_event: Callable[[TokenEvent], None] | None = None
               ) -> SequenceState:
        """Queue one sequence for prefill."""
        return self.prefill.submit(spec, on_event)

    def cancel(self, seq: SequenceState) -> None:
        """Stop ``seq`` wherever it is, at the next step (a flag: thread-safe)."""
        seq.cancelled = True

    @property
    def busy(self) -> bool:
        return (self.prefill.busy or any(self.pending)
                or any(decoder.busy for decoder in self.decoders))

    @property
    def running(self) -> list[SequenceState]:
        return [s for d in self.decoders for s in d.running] + list(self.prefill.running)

    @property
    def waiting(self) -> list[SequenceState]:
        return ([s for queue in self.pending for s in queue] + list(self.prefill.waiting)
                + [s for d in self.decoders for s in d.waiting])

    def loads(self) -> list[int]:
        """In-flight sequences per decoder: running, waiting, or routed and not yet
        adopted."""
        return [len(d.running) + len(d.waiting) + len(queue)
                for d, queue in zip(self.decoders, self.pending)]

    def occupancy(self) -> int:
        """KV blocks held, over the prefill pool and every decoder's."""
        return self.prefill.occupancy() + sum(d.occupancy() for d in self.decoders)

    @property
    def decode_expert_tokens(self) -> np.ndarray | None:
        """The decoders' sampled decode load [L, E] summed (``Scheduler``'s)."""
        counted = [d.decode_expert_tokens for d in self.decoders
                   if d.decode_expert_tokens is not None]
        return sum(counted[1:], counted[0]) if counted else None

    # ----------------------------------------------------------------- a step
    def step(self) -> list[TokenEvent]:
        """Prefill, route the hand-offs, adopt, decode (module docstring)."""
        events = self.prefill.step()
        self._route(self.prefill.take_handoffs())
        for index, decoder in enumerate(self.decoders):
            self._adopt(index, decoder, events)
            if decoder.busy:
                events += decoder.step()
        return events

    def _route(self, handoffs: list[SequenceState]) -> None:
        if not handoffs:
            return
        counts = (self.prefill.prompt_counts(handoffs) if self.policy.reads_counts
                  else [None] * len(handoffs))
        for seq, seq_counts in zip(handoffs, counts):
            loads = self.loads()
            started = time.perf_counter()
            decoder = self.policy.choose(
                HandOff(counts=seq_counts, domain=seq.spec.domain), loads)
            seconds = time.perf_counter() - started
            self.routes.append(RouteRecord(seq.seq_id, decoder, tuple(loads), seconds))
            self.pending[decoder].append(seq)

    def _adopt(self, index: int, decoder: Scheduler, events: list[TokenEvent]) -> None:
        queue = self.pending[index]
        for seq in [s for s in queue if s.cancelled]:
            queue.remove(seq)
            self.prefill.release(seq.blocks, seq.rank)
            seq.blocks = []
            seq.finished = True
            seq.output.finish_reason = "cancelled"
            events.append(TokenEvent(seq, [], seq.output))
        while queue and decoder.room_to_adopt(queue[0]):
            seq = queue.popleft()
            prefill_blocks, prefill_rank = list(seq.blocks), seq.rank
            # Copied (blocks of the whole prefill pool, on any rank): seq moves.
            decoder.adopt(seq, self.prefill.kv, self.prefill.pool_blocks(seq))
            self.prefill.release(prefill_blocks, prefill_rank)

    # ----------------------------------------------------------------- misc
    def precompile(self) -> int:
        """Compile every program a step of the pool can run: the step programs of the
        prefill scheduler and of each decoder, and those of the hand-off between them
        (:meth:`_precompile_handoff`). Returns how many programs ran."""
        return (self.prefill.precompile() + sum(d.precompile() for d in self.decoders)
                + self._precompile_handoff())

    def _precompile_handoff(self) -> int:
        """Run once, on padding, each program a hand-off runs besides the step programs,
        at every shape it can take, so that no step of a serving pool stalls on a
        compile: the block copy into each decoder (``copy_blocks`` pads a prompt's block
        count to a power of two: one gather on the prefill device and one write per
        decoder device for each) and, when the policy reads prompt counts, the sum of a
        step's hand-offs' block counts (its rows padded to a power of two). Padding reads
        block 0 and writes nowhere, so no pool changes. Returns how many programs ran."""
        ran = 0
        prefill = self.prefill
        for decoder in self.decoders:
            # A handed-off prompt holds at most a context's blocks, and fits in both pools.
            most_blocks = min(prefill.layout.max_table, prefill.num_blocks,
                              decoder.num_blocks)
            for count in bucket_sizes(most_blocks):
                decoder.paged.copy_in(prefill.kv, [0] * count, [])
                ran += 1
        if self.policy.reads_counts:
            # One prefill step hands off at most its running set.
            for rows in bucket_sizes(prefill.layout.per_rank):
                prefill.block_counts([[]] * rows)
                ran += 1
        return ran

    def drain(self) -> list[SequenceState]:
        """Forget every sequence (after a failed step) and return them."""
        seqs = self.prefill.drain() + [s for queue in self.pending for s in queue]
        for queue in self.pending:
            queue.clear()
        for decoder in self.decoders:
            seqs += decoder.drain()
        return seqs

    def stats(self) -> dict[str, Any]:
        """Routing and decoding figures: route time per request, and per decoder the
        sequences routed, the decode steps and their mean distinct experts per layer."""
        routed = np.bincount([r.decoder for r in self.routes], minlength=len(self.decoders))
        per_decoder = []
        for decoder in self.decoders:
            active = [r.active_experts for r in decoder.step_records
                      if r.active_experts is not None]
            per_decoder.append({
                "decode_steps": len(active),
                "mean_active_experts": float(np.mean(active)) if active else float("nan")})
        return {"routed": routed.tolist(),
                "route_us_mean": (1e6 * float(np.mean([r.seconds for r in self.routes]))
                                  if self.routes else float("nan")),
                "decoders": per_decoder}

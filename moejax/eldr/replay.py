"""A real prefill→decode pipeline run, replayed in the ELDR simulator: each decoder's batch
sequence and each request's decoder predicted exactly.

Why: the simulator (:mod:`moejax.eldr.simulator`) stands for the real pipeline
(:class:`moejax.core.decoders.DecoderPool`) at scales the real one cannot reach. This
module holds it to the real thing on a run both can do: what the real run's hand-off
produced goes in, and the decoders' batches come out, to be compared step by step.

* :func:`observe` runs a pool on some requests, arriving together, stepping it until it
  is idle, and records a :class:`PipelineRun`: per hand-off (:class:`HandOffRecord`) the
  pool step it came at, the decode steps its sequence ran (its first token is sampled
  at prefill, so max_new_tokens − 1), the routing inputs the policy saw (the prompt's
  expert counts, kept by a :class:`HandOffRecorder` around the pool's policy, and the
  domain) and the decoder and loads it got; per decoder, the sequences each of its
  decode steps ran (``StepRecord.decode_ids``) and the pool step it ran at.
* :func:`replay` feeds the hand-offs to :func:`moejax.eldr.simulator.simulate` as
  arrivals in virtual time — one unit per ``DecoderPool.step()``: every decode step
  lasts :data:`UNIT_STEP` — routed by a policy object of the run's kind in the state the
  run's started in, with the simulator's release mode for the decoders' scheduling
  (``step_late`` for pipelined decoders, ``before_arrivals`` for unpipelined ones; the
  simulator's docstring says why those are the real semantics), and returns the
  :class:`Prediction`: routes, loads seen at routing, and batches.
* :func:`mismatches` lists where a prediction and a run differ ([] when exact).

What the replay takes as given: the hand-off moments (the prefill stage is observed,
not simulated). What it assumes, and :func:`observe` checks: a sequence ends at its
length (a stop token, seen one step late by a pipelined decoder, would run one more row
than its tokens), no decoder preempts, and every decoder's pool holds its running rows'
whole contexts, so a decoder adopts a routed sequence exactly when it has a free row.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from moejax.core.continuous import BLOCK
from moejax.core.decoders import DecoderPool
from moejax.eldr.policies import HandOff, Policy
from moejax.eldr.simulator import CostModel, SimRequest, simulate
from moejax.sequences import SequenceSpec

UNIT_STEP = CostModel(t0=1.0, a=0.0, b=0.0)
"""Virtual time: every decode step lasts one unit, one ``DecoderPool.step()``."""

Batches = tuple[tuple[tuple[int, tuple[int, ...]], ...], ...]
"""Per decoder, its decode steps with a row as (pool step, the sequences' ids sorted)."""


class HandOffRecorder(Policy):
    """A policy that routes as ``inner`` does and keeps what each choice saw: the
    hand-off, the loads and the decoder chosen (``seen``, in routing order). Put it in
    the pool (``PipelineConfig(routing=HandOffRecorder(policy))``) so that
    :func:`observe` can record the prompt counts the router saw."""

    def __init__(self, inner: Policy):
        if not isinstance(inner, Policy):
            raise ValueError(f"HandOffRecorder wraps a moejax.eldr.policies.Policy, got "
                             f"{type(inner).__name__}")
        super().__init__(inner.num_decoders)
        self.inner = inner
        self.name = inner.name
        self.reads_counts = inner.reads_counts
        self.seen: list[tuple[HandOff, tuple[int, ...], int]] = []

    def _choose(self, request: HandOff, loads: np.ndarray) -> int:
        shown = tuple(int(n) for n in loads)
        decoder = self.inner.choose(request, shown)
        self.seen.append((request, shown, decoder))
        return decoder


@dataclasses.dataclass(frozen=True, eq=False)
class HandOffRecord:
    """One sequence's hand-off in a real run: the pool step it was routed at (0: the
    first ``step()`` of the run), the decode steps it then ran, the routing inputs
    (``counts`` [L, E], None when the policy reads none; ``domain``) and the decoder it
    got with the loads the policy saw."""

    seq_id: int
    step: int
    decode_steps: int
    counts: np.ndarray | None
    domain: str | None
    decoder: int
    loads: tuple[int, ...]


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineRun:
    """What :func:`observe` recorded of one real run: its hand-offs in routing order and
    each decoder's batches (:data:`Batches`), with what a replay needs of the pool: the
    decoders, their rows each (``max_batch_size``), whether they are pipelined, and the
    model's layers, experts and top-k (the shape of a simulated request)."""

    handoffs: tuple[HandOffRecord, ...]
    batches: Batches
    num_decoders: int
    max_batch_size: int
    pipelined: bool
    num_layers: int
    num_experts: int
    top_k: int


@dataclasses.dataclass(frozen=True)
class Prediction:
    """What :func:`replay` predicts: each sequence's decoder and the loads its routing
    saw (by seq id), and each decoder's batches (:data:`Batches`)."""

    routes: dict[int, int]
    loads: dict[int, tuple[int, ...]]
    batches: Batches


# ----------------------------------------------------------------------------- observe
def _decoder_shape(pool: DecoderPool) -> tuple[int, bool]:
    """The rows each decoder runs and whether they are pipelined: one for every decoder
    (the simulator has one batch limit and one release mode), or a ValueError."""
    shapes = {(d.layout.per_rank * d.ranks, d.pipelined) for d in pool.decoders}
    if len(shapes) != 1:
        raise ValueError(f"the decoders differ in rows or pipelining ({sorted(shapes)}): a "
                         f"replay needs one batch limit and one step semantics")
    if not all(d.options.record_steps for d in pool.decoders):
        raise ValueError("every decoder must record its steps (SchedulerOptions."
                         "record_steps=True) to be observed")
    return shapes.pop()


def _check_blocks(pool: DecoderPool, specs: Sequence[SequenceSpec]) -> None:
    """ValueError unless every decoder's pool holds its running rows' whole contexts (then
    a decoder adopts exactly when it has a free row)."""
    most = max(-(-(len(s.prompt) + s.max_new_tokens) // BLOCK) for s in specs)
    for index, decoder in enumerate(pool.decoders):
        need = decoder.layout.per_rank * most
        if decoder.num_blocks < need:
            raise ValueError(f"decoder {index} has {decoder.num_blocks} KV blocks per rank, "
                             f"fewer than its {decoder.layout.per_rank} rows of up to {most} "
                             f"blocks ({need}): adoption could wait on blocks, which the "
                             f"replay does not model")


def observe(pool: DecoderPool, specs: Sequence[SequenceSpec]) -> PipelineRun:
    """Submit ``specs`` together to the idle ``pool``, step it until idle, and record the
    run (module docstring). Raises ValueError where the run breaks what a replay assumes
    (a stop token, a preemption, decoders of different shapes, short KV pools)."""
    if pool.busy:
        raise ValueError("observe needs an idle pool: its first step is the run's step 0")
    if not specs:
        raise ValueError("specs: observe needs at least one sequence")
    max_batch, pipelined = _decoder_shape(pool)
    _check_blocks(pool, specs)
    policy = pool.policy
    recorder = policy if isinstance(policy, HandOffRecorder) else None
    if policy.reads_counts and recorder is None:
        raise ValueError(f"policy {policy.name!r} reads prompt counts: wrap it in a "
                         f"HandOffRecorder so that the run keeps what it saw")
    seen_at = len(recorder.seen) if recorder is not None else 0
    preempted = [d.stats["preemptions"] for d in pool.decoders]
    routes_at = len(pool.routes)
    records_at = [len(d.step_records) for d in pool.decoders]
    seqs = {seq.seq_id: seq for seq in (pool.submit(spec) for spec in specs)}
    # A pipelined decoder's step is recorded when its tokens are read: one pool step later.
    lag = int(pipelined)
    routed: list[tuple[int, int, tuple[int, ...], int]] = []
    batches: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in pool.decoders]
    step = 0
    while pool.busy:
        pool.step()
        routed += [(r.seq_id, r.decoder, r.loads, step)
                   for r in itertools.islice(pool.routes, routes_at, None)]
        routes_at = len(pool.routes)
        for index, decoder in enumerate(pool.decoders):
            for record in itertools.islice(decoder.step_records, records_at[index], None):
                if record.decode_ids:
                    batches[index].append((step - lag, tuple(sorted(record.decode_ids))))
            records_at[index] = len(decoder.step_records)
        step += 1
    if [d.stats["preemptions"] for d in pool.decoders] != preempted:
        raise ValueError("a decoder preempted a sequence during the run (its KV pool ran "
                         "short), which the replay does not model")
    counts = ([hand_off.counts for hand_off, _, _ in recorder.seen[seen_at:]]
              if recorder is not None else [None] * len(routed))
    handoffs = []
    for (seq_id, decoder, loads, at), seq_counts in zip(routed, counts, strict=True):
        seq = seqs[seq_id]
        if seq.output.finish_reason != "length":
            raise ValueError(f"sequence {seq_id} ended by {seq.output.finish_reason!r}, not "
                             f"at its length: the replay models length endings only")
        handoffs.append(HandOffRecord(
            seq_id=seq_id, step=at, decode_steps=len(seq.output.token_ids) - 1,
            counts=None if seq_counts is None else np.asarray(seq_counts),
            domain=seq.spec.domain, decoder=decoder, loads=loads))
    cfg = pool.prefill.runner.cfg
    return PipelineRun(handoffs=tuple(handoffs),
                       batches=tuple(tuple(b) for b in batches),
                       num_decoders=len(pool.decoders), max_batch_size=max_batch,
                       pipelined=pipelined, num_layers=cfg.num_layers,
                       num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok)


# ----------------------------------------------------------------------------- replay
def _sim_request(run: PipelineRun, handoff: HandOffRecord) -> SimRequest:
    """The hand-off as a simulated request. Under :data:`UNIT_STEP` the batches do not
    depend on the decode tokens' expert ids (every step lasts one unit), so each names
    expert 0; counts the policy does not read are zeros."""
    counts = (handoff.counts if handoff.counts is not None
              else np.zeros((run.num_layers, run.num_experts), np.int64))
    return SimRequest(counts=counts,
                      decode_experts=np.zeros((run.num_layers, handoff.decode_steps,
                                               run.top_k), np.int64),
                      domain=handoff.domain)


def replay(run: PipelineRun, policy: Policy, *, max_batch_size: int | None = None
           ) -> Prediction:
    """Replay ``run``'s hand-offs in the simulator, routed by ``policy`` (of the run's
    kind, in the state the run's policy started in: a fresh one), on decoders of
    ``max_batch_size`` rows (default: the run's), one unit per pool step (module
    docstring)."""
    if not isinstance(run, PipelineRun):
        raise ValueError(f"run must be a PipelineRun (from observe), got "
                         f"{type(run).__name__}")
    if not run.handoffs:
        raise ValueError("run: no sequence was handed off to a decoder (each ended at its "
                         "first token), so there is nothing to replay")
    recorder = HandOffRecorder(policy)
    result = simulate([_sim_request(run, h) for h in run.handoffs],
                      [float(h.step) for h in run.handoffs], recorder,
                      num_decoders=run.num_decoders, cost=UNIT_STEP,
                      max_batch_size=(run.max_batch_size if max_batch_size is None
                                      else max_batch_size),
                      release="step_late" if run.pipelined else "before_arrivals")
    ids = np.array([h.seq_id for h in run.handoffs], np.int64)
    batches: list[list[tuple[int, tuple[int, ...]]]] = [[] for _ in range(run.num_decoders)]
    for s in range(result.step_decoder.shape[0]):
        rows = result.step_rows(s)
        if rows.size:                   # a step of held rows only runs no program
            batches[int(result.step_decoder[s])].append(
                (int(result.step_start[s]), tuple(sorted(ids[rows].tolist()))))
    return Prediction(
        routes={int(i): int(d) for i, d in zip(ids, result.decoder)},
        loads={int(i): seen[1] for i, seen in zip(ids, recorder.seen)},
        batches=tuple(tuple(b) for b in batches))


def mismatches(run: PipelineRun, predicted: Prediction) -> list[str]:
    """Where ``predicted`` differs from ``run``: per sequence its decoder and the loads
    its routing saw, per decoder its first differing step; [] when the prediction is
    exact."""
    found = []
    for h in run.handoffs:
        if predicted.routes.get(h.seq_id) != h.decoder:
            found.append(f"sequence {h.seq_id}: decoder {h.decoder}, predicted "
                         f"{predicted.routes.get(h.seq_id)}")
        if predicted.loads.get(h.seq_id) != h.loads:
            found.append(f"sequence {h.seq_id}: routed seeing loads {h.loads}, predicted "
                         f"{predicted.loads.get(h.seq_id)}")
    for index, (real, guess) in enumerate(zip(run.batches, predicted.batches, strict=True)):
        for position, (got, want) in enumerate(itertools.zip_longest(real, guess)):
            if got != want:
                found.append(f"decoder {index}, its decode step {position}: ran {got}, "
                             f"predicted {want}")
                break
    return found

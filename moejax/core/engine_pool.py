"""Data-parallel engines behind one router (DESIGN.md "One request, end to end", step 3–4).

Each engine (one per device) runs the resident backend with its own prefix cache. For a
call, the router reads every prefill op (:class:`moejax.ops.PrefillOp`: its prompt is the
shareable prefix, so siblings follow their prefix's pending blocks to one engine) and
assigns ops to engines in FIFO order; then every engine runs all of its ops
at once (one packed run: the best batching), the engines in parallel threads (JAX
releases the GIL while devices compute). Afterwards each engine reports to the router
through its event channel: the blocks its cache stored and evicted, and the FLOPs it
executed (the router's estimate of its ops), so the next call routes against what is
really resident.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Hashable, Sequence

from moejax.core.router import Router, RoutingReport, report_run
from moejax.core.scoring_engine import Engine
from moejax.core.scoring_steps import SequenceOutcome
from moejax.ops import PrefillOp


@dataclasses.dataclass(frozen=True)
class OpTiming:
    """Where and when one op ran: engine, router round, seconds from the call's start
    until its engine finished."""

    engine: int
    round: int
    seconds: float


class EnginePool:
    """Routes ops over engines and runs them; results identical to one engine."""

    def __init__(self, engines: Sequence[Engine], router: Router,
                 max_num_seqs: int | None = None):
        if len(engines) != router.num_engines:
            raise ValueError(f"{len(engines)} engines but the router expects "
                             f"{router.num_engines}")
        if max_num_seqs is not None and (isinstance(max_num_seqs, bool)
                                         or not isinstance(max_num_seqs, int)
                                         or max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be None or a positive integer, got "
                             f"{max_num_seqs!r}")
        self.engines = list(engines)
        self.router = router
        # None: an engine runs all its ops of a call in one packed run (our batching);
        # n: at most n sequences per run, in the router's schedule order (PrefillOnly's
        # max-num-seqs, the paper's baseline setting).
        self.max_num_seqs = max_num_seqs
        self.last_report: RoutingReport | None = None
        self.router_theta: float | None = None     # the Θ the router was built with

    def route(self, ops: Sequence[PrefillOp]) -> RoutingReport:
        return self.router.assign(ops)

    def run(self, ops: Sequence[PrefillOp], on_batch_done: Callable[[int], None] | None = None
            ) -> tuple[dict[Hashable, SequenceOutcome], dict[int, OpTiming]]:
        """Score ``ops`` (keys distinct) -> (outputs by op key, timing by op index)."""
        start = time.perf_counter()
        report = self.route(ops)
        self.last_report = report
        work: list[list[int]] = [[] for _ in self.engines]
        for i in report.schedule():                 # each engine's ops in schedule order
            work[report.assignments[i].engine].append(i)
        outputs: dict[Hashable, SequenceOutcome] = {}
        timings: dict[int, OpTiming] = {}
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(self.engines)) as pool:
            futures = {pool.submit(self._run_engine, g, ops, indices, on_batch_done): g
                       for g, indices in enumerate(work) if indices}
            for future in concurrent.futures.as_completed(futures):
                g = futures[future]
                outputs.update(future.result())
                done = time.perf_counter() - start
                for i in work[g]:
                    timings[i] = OpTiming(engine=g, round=report.assignments[i].round,
                                          seconds=done)
                self._report(g, [report.assignments[i].cost for i in work[g]],
                             [ops[i] for i in work[g]])
        return outputs, timings

    def _run_engine(self, g: int, ops: Sequence[PrefillOp], indices: list[int],
                    on_batch_done) -> dict[Hashable, SequenceOutcome]:
        engine = self.engines[g]
        if self.max_num_seqs is None:
            return engine.run([ops[i] for i in indices], on_batch_done=on_batch_done)
        outputs: dict[Hashable, SequenceOutcome] = {}
        for start in range(0, len(indices), self.max_num_seqs):
            chunk = indices[start:start + self.max_num_seqs]
            outputs.update(engine.run([ops[i] for i in chunk], on_batch_done=on_batch_done))
        return outputs

    def _report(self, g: int, costs: list[int], ops: list[PrefillOp]) -> None:
        """Events of engine g after its run, in order: blocks stored / evicted, FLOPs."""
        engine = self.engines[g]
        stored, evicted = engine.last_cache_events
        report_run(self.router, g, ops, costs, stored, evicted,
                   kept=engine.prefix_cache is not None and not engine.kv_cache_free)

    def describe(self) -> dict[str, Any]:
        return {"engines": len(self.engines), "routing": type(self.router).__name__}

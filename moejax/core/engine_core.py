"""The one engine loop: a host-only scheduler emits a plan, a runner that owns the device
state executes it, and the scheduler takes the outputs back.

The contract (as vLLM v1 splits ``Scheduler`` / ``GPUModelRunner`` / ``EngineCore``):

* a :class:`StepScheduler` is host-only: requests, block tables, token budgets. Its
  :meth:`~StepScheduler.schedule` emits the plan of one step (which rows prefill, which
  decode, which blocks; or which packed scoring batches) and
  :meth:`~StepScheduler.update` turns the step's outputs into what its callers see;
* a :class:`StepRunner` owns the device state (the KV store, the weight placement, the
  compiled programs). :meth:`~StepRunner.execute` turns a plan into device arrays,
  dispatches the programs and returns their outputs without waiting for them;
* :class:`EngineCore` steps them. :meth:`EngineCore.step` runs one plan to its outputs
  (generation: each step's plan depends on the tokens the previous one sampled).
  :meth:`EngineCore.run` runs a scheduler whose plans do not depend on earlier outputs
  (scoring) with one step of lookahead: step n+1 is dispatched before step n's outputs
  are read, so the host unpacks while the devices compute.

Who runs on it: the scoring engine (:class:`moejax.core.scoring_engine.Engine`: packed
prefill-only batches, a level of the prefix plan per run), and every paged generation
runtime through :class:`moejax.core.continuous.Scheduler` (fused and layerwise steps,
the prefetching offload runner, and each side of the prefill/decode split,
:class:`moejax.core.decoders.DecoderPool`). The μ-queue runtime stands apart
(``docs/ARCHITECTURE.md`` says why).
"""

from __future__ import annotations

from typing import Any, Generic, Protocol, TypeVar

PlanT = TypeVar("PlanT")
OutputT = TypeVar("OutputT")
EventT = TypeVar("EventT")


class StepScheduler(Protocol[PlanT, OutputT, EventT]):
    """Host-only scheduling (module docstring)."""

    def has_work(self) -> bool:
        """Whether :meth:`schedule` has anything left to plan."""
        ...

    def schedule(self) -> PlanT:
        """The plan of the next step (blocks allocated, budgets spent)."""
        ...

    def update(self, plan: PlanT, outputs: OutputT) -> list[EventT]:
        """Take a step's outputs back (reads them: waits for the device)."""
        ...


class StepRunner(Protocol[PlanT, OutputT]):
    """The device side (module docstring)."""

    def execute(self, plan: PlanT) -> OutputT:
        """Dispatch the programs of ``plan``; the outputs are not waited for."""
        ...


class EngineCore(Generic[PlanT, OutputT, EventT]):
    """Steps a scheduler and a runner (module docstring)."""

    def __init__(self, scheduler: StepScheduler[PlanT, OutputT, EventT],
                 runner: StepRunner[PlanT, OutputT]):
        self.scheduler = scheduler
        self.runner = runner

    def step(self) -> list[EventT]:
        """Plan one step, execute it, and take its outputs back."""
        plan = self.scheduler.schedule()
        return self.scheduler.update(plan, self.runner.execute(plan))

    def run(self) -> list[EventT]:
        """Step until the scheduler has no work, dispatching each step before reading the
        previous one's outputs (for schedulers whose plans do not read earlier outputs).
        An exception from :meth:`StepRunner.execute` or :meth:`StepScheduler.update`
        propagates after nothing more is dispatched."""
        events: list[EventT] = []
        pending: tuple[Any, Any] | None = None
        while self.scheduler.has_work():
            plan = self.scheduler.schedule()
            outputs = self.runner.execute(plan)
            if pending is not None:
                events += self.scheduler.update(*pending)
            pending = (plan, outputs)
        if pending is not None:
            events += self.scheduler.update(*pending)
        return events

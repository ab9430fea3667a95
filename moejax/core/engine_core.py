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
* :class:`EngineCore` steps them. :meth:`EngineCore.step` runs one plan to its outputs.
  :meth:`EngineCore.run` runs a scheduler whose plans do not depend on earlier outputs
  (scoring) with one step of lookahead: step n+1 is dispatched before step n's outputs
  are read, so the host unpacks while the devices compute.
  :meth:`EngineCore.step_ahead` does the same one step at a time, for generation (vLLM
  v1's async scheduling): the scheduler plans step n+1 as if step n's sampled tokens
  were known (a token in flight counts as generated), the runner feeds those tokens to
  step n+1 on the device, and only then are step n's outputs read. The host plans and
  builds the next step while the device runs the current one; stop conditions are
  read one step behind, so a sequence that stopped may have run one row more, whose
  output is dropped.

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

    def step_ahead(self, previous: tuple[PlanT, OutputT] | None
                   ) -> tuple[list[EventT], tuple[PlanT, OutputT] | None]:
        """Plan and dispatch the next step (when the scheduler has work), then take the
        outputs of ``previous`` (the step dispatched by the last call) back -> (its
        events, this step: the next call's ``previous``). A plan that dispatched nothing
        (empty outputs) is taken back at once."""
        current = None
        events: list[EventT] = []
        if self.scheduler.has_work():
            plan = self.scheduler.schedule()
            current = (plan, self.runner.execute(plan))
        if previous is not None:
            events += self.scheduler.update(*previous)
        if current is not None and not current[1]:    # nothing dispatched: nothing to wait for
            events += self.scheduler.update(*current)
            current = None
        return events, current

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

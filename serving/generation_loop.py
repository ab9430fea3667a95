"""Serving many callers from one :class:`serving.Generator`: the :class:`CallGuard` that
lets one call at a time drive its engine, and the :class:`GeneratorLoop` (a background
:class:`moejax.core.continuous.GenerationLoop`) that servers submit requests to."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Mapping

from moejax.core.continuous import GenerationLoop, SequenceTooLong
from serving.generation_requests import GenerationEvent, GenerationRequest
from serving.requests import RequestError, request_id_of, request_label


class CallGuard:
    """Lets one call at a time drive a Generator's engine (its KV pool, scheduler and
    buffers are donated and rewritten by every step, so two calls interleaving steps read
    each other's deleted buffers): a ``generate`` or ``stream`` call holds it from
    :meth:`acquire` to :meth:`release`, waiting for the call before it, as the Scorer's
    runs wait on its engine's lock; a generation loop (:meth:`Generator.start_loop`)
    holds it from :meth:`open_loop` until :meth:`close_loop`.

    A call that could only deadlock is refused instead of waiting: one from the thread
    whose stream is still open (an unfinished ``stream`` iterator), and any while a loop
    is open (its thread owns the scheduler until ``close()``; a call already waiting when
    a loop opens waits for it to close)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: int | None = None      # the thread ident of the call holding it
        self._loop_open = False

    def _refuse_deadlock(self, what: str) -> None:
        if self._loop_open:
            raise RuntimeError(f"{what}: this Generator's generation loop (start_loop()) "
                               f"is open; submit to the loop, or close() it first")
        if self._holder == threading.get_ident():
            raise RuntimeError(f"{what}: this thread's earlier stream() on the Generator is "
                               f"still open; exhaust or close() it first")

    def acquire(self, what: str) -> None:
        """Wait until no other call drives the Generator, then hold it."""
        self._refuse_deadlock(what)
        self._lock.acquire()
        self._holder = threading.get_ident()

    def release(self) -> None:
        self._holder = None
        self._lock.release()

    def open_loop(self) -> None:
        """Hold the Generator for a loop (released by :meth:`close_loop`, from any thread)."""
        self.acquire("start_loop()")
        self._holder, self._loop_open = None, True

    def close_loop(self) -> None:
        if self._loop_open:
            self._loop_open = False
            self._lock.release()



class SubmittedRequest:
    """A request in a :class:`GeneratorLoop`: ``cancel()`` frees its sequence at the next
    step (its last event then has finish_reason "cancelled")."""

    def __init__(self, loop: "GeneratorLoop", sequence: Any):
        self._loop, self.sequence = loop, sequence

    def cancel(self) -> None:
        self._loop.loop.cancel(self.sequence)


class GeneratorLoop:
    """A :class:`~moejax.core.continuous.GenerationLoop` over a Generator's scheduler that
    takes requests as :meth:`Generator.generate` does."""

    def __init__(self, generator: Any):
        self.generator = generator
        self.loop = GenerationLoop(generator.scheduler)
        # Whether this loop still holds the Generator (Generator.start_loop took it): a
        # second close() must not release a later loop's hold.
        self._holds_generator = True

    def submit(self, request: GenerationRequest | Mapping[str, Any],
               on_event: Callable[[GenerationEvent], None], index: int = 0
               ) -> SubmittedRequest:
        """Queue one request; ``on_event`` gets its :class:`GenerationEvent` s from the
        loop thread (``index`` is echoed in them). A bad request raises RequestError
        naming the field (nothing is queued)."""
        generator = self.generator
        spec = generator.parse(request, index)

        def deliver(event: Any) -> None:
            result = None if event.output is None else generator.result(
                request, index, spec, event.output)
            on_event(GenerationEvent(index, event.token_ids, result))

        try:
            sequence = self.loop.submit(spec, deliver)
        except SequenceTooLong as exc:
            raise RequestError(f"{request_label(request_id_of(request), index)}: "
                               f"max_new_tokens: {exc}", index=index,
                               field="max_new_tokens") from None
        return SubmittedRequest(self, sequence)

    def occupancy(self) -> int:
        """KV blocks held by running sequences."""
        return self.generator.scheduler.occupancy()

    def decode_expert_tokens(self) -> Any:
        """The sampled decode load: tokens per expert per layer [L, E], or None before a
        counted step (``moejax.core.continuous.Scheduler.decode_expert_tokens``)."""
        return self.generator.scheduler.decode_expert_tokens

    def close(self) -> None:
        """Finish what was submitted, then stop the thread and hand the Generator back to
        ``generate``/``stream`` calls."""
        try:
            self.loop.close()
        finally:
            if self._holds_generator:
                self._holds_generator = False
                self.generator.call_guard.close_loop()



"""Generation serving on one arrival trace: moejax's batching modes, decode steps and
backends, and the Hugging Face `transformers` reference, each replaying the same requests.

    python -m benchmarks.generation_serving [--quick] [--json PATH] [--configs a,b,...]
                                            [--model demo|DIR] [--rate R | --load L]

**Workload.** ``--requests`` requests (full 200, quick 48), seeded (``--seed``):

* prompts of random token ids in [3, vocab) (no tokenizer), lengths uniform in
  16–512 tokens (quick: 16–128);
* ``max_new_tokens`` long-tailed in 1–128 (quick: 1–32): a discrete log-uniform draw,
  ``floor(exp(u · ln(max + 1)))`` with u uniform in [0, 1), so P(k) = ln((k+1)/k) /
  ln(max+1) ≈ 1/k: half the requests ask for at most about sqrt(max + 1) tokens (11 of
  128), a few ask for nearly all 128 (mean ≈ 25.9; quick: ≈ 8.7 of 32);
* greedy, ``stop_token_ids=[]`` (and EOS disabled on the `transformers` side), so every
  request generates exactly its ``max_new_tokens`` tokens (checked);
* Poisson arrivals: exponential gaps, the first request at time 0, at ``rate``
  requests/s. The rate is ``--rate``, or calibrated: ``load × max_batch_size / t_batch``
  where t_batch is the static batcher's time to generate the trace's first
  ``max_batch_size`` requests as one batch (the second of two runs; the first compiles),
  with ``--load`` 4 by default. Requests then arrive about four times as fast as static
  batching serves them, so the static batcher is always busy. (The load must exceed the
  throughput ratio being tested: no server finishes before the last arrival, so a
  server fast enough to keep up has throughput ≈ offered load, and continuous over
  static could not show more than about ``load``.)

**Configurations** (``--configs``, default all; every moejax one with float32,
``max_batch_size`` — full 16, quick 8 —, ``compilation_cache="off"`` unless
``--compilation-cache`` names one; the continuous ones with ``precompile=True``, as a
server runs: every step program is compiled when the Generator is built, timed as
``<config>_startup_s``):

* ``static``: ``Generator(batching="static")``: takes up to max_batch_size waiting
  requests and runs them to completion before taking more;
* ``continuous``: ``Generator(batching="continuous", step="auto", backend="resident")``
  (what a user gets by default), the reference of the throughput ratios below;
* ``unpipelined``: ``continuous`` with ``pipelined=False`` (each step's tokens read
  before the next is planned), so pipelining's gain shows beside it;
* ``fused`` / ``layerwise``: continuous with ``step="fused"`` / ``"layerwise"`` (on the
  resident backend "auto" is fused, so ``continuous`` and ``fused`` are the same engine
  measured twice);
* ``offload``: continuous with ``backend="offload"`` (step auto, i.e. layerwise: the
  host picks the experts to copy at each layer);
* ``transformers_padded``: ``AutoModelForCausalLM`` (float32, same weights) as its users
  run it: the waiting requests (up to max_batch_size, in arrival order) left-padded into
  one ``model.generate`` call (attention_mask, greedy, max_new_tokens = the batch's
  largest); a request counts only its own max_new_tokens tokens. Token times come from a
  ``transformers`` streamer (its ``put`` per decode step), i.e. when a token is computed,
  although a ``generate`` caller only receives them when the batch returns: generous
  to the reference;
* ``transformers_continuous``: its own continuous batching (the manager behind
  ``model.generate_batch``: ``init_continuous_batching`` with the default
  ``ContinuousBatchingConfig`` but ``max_requests_per_batch = max_batch_size``), each
  request added with ``add_request`` at its arrival (its max_new_tokens, no EOS) and
  timed by the manager's own per-token timestamps (``record_timestamps``). The manager
  rather than ``generate_batch`` itself, which takes every prompt at once with one
  max_new_tokens (no arrivals). Skipped if the installed version has no
  ``generate_batch``.

Threads: XLA's CPU client uses every core; torch uses its default (every core) unless
``--torch-threads``. On CPUs shared with other processes torch's OpenMP threads, which
wait on each other every op, slow down far more than XLA's (on a loaded 2-core VM: about
1 s per padded decode step at 2 threads, 5 ms at 1), so ``load_average_at_start`` is
recorded and a note printed when it is above 0.5.

moejax arrivals are replayed through the Generator's background loop
(``Generator.start_loop()``, a ``moejax.core.continuous.GenerationLoop`` over its
scheduler): each request is submitted at its arrival (``loop.submit(request,
on_event)``) and its first and last token times are taken in its event callbacks.
Static batching has no loop, so ``static`` is replayed here with the static batcher's
policy: whenever it is free, up to max_batch_size waiting requests (arrival order) go in
one ``Generator.stream`` call, run to completion. That stream delivers a batch's tokens
when the batch finishes, so a static request's TTFT is its batch's return (what a caller
of static generation gets) and its TPOT is not measured (null; ``static_replay`` names
the path that ran: "stream-batches", or "loop" if static batching gains a loop).

**Warm-up.** Each moejax configuration first replays warm-up traces untimed: the same
lengths and arrival times, different token ids each pass (so no prefix or KV reuse), to
compile the shapes the timed replay needs. Which shapes a replay meets depends on its
timing (a pass slowed by compiles batches differently), so passes repeat until one
compiles nothing (at most ``--warmup-passes``, 3; ``<config>_warmup_passes``); backend
compiles that still happen during the timed replay are counted
(``<config>_compiles_in_replay``, and the seconds they took,
``<config>_compile_s_in_replay``: each one stalls that replay). Passing
``--compilation-cache DIR`` and running twice makes such stalls short (the second run
loads its programs). The `transformers` configurations (eager PyTorch, nothing to
compile) warm up on one batch (padded) or a quarter of a warm-up trace (continuous,
after the manager's own ``warmup()``). Only the replay is timed.

**Metrics** (per configuration, over all requests of the replay): TTFT = first token
time − arrival (the scheduled arrival: lag of the submitting thread counts against
the server); TPOT = (last token time − first token time) / (tokens − 1), over requests
of ≥ 2 tokens; percentiles are numpy's (linear interpolation); throughput = output
tokens / (last token time − first arrival).

JSON keys (flat): per configuration ``<config>_tokens_per_s``, ``_ttft_p50_ms``,
``_ttft_p99_ms``, ``_tpot_p50_ms``, ``_tpot_p99_ms``, ``_output_tokens``, ``_seconds``
(first arrival to last token), ``_warmup_s``, ``_warmup_passes``, and for moejax
``_startup_s``, ``_compiles_in_replay``, ``_compile_s_in_replay`` and ``_step`` (the step mode it
resolved to). Ratios: ``continuous_over_static_throughput`` (target ≥ 2),
``continuous_over_transformers_throughput`` (over the faster `transformers`
configuration; target ≥ 3), ``continuous_over_transformers_padded_throughput``,
``continuous_over_transformers_continuous_throughput``, ``tpot_p50_over_transformers``
(continuous's p50 TPOT over the lowest p50 TPOT of the `transformers` configurations;
target ≤ 1),
the same three against ``unpipelined`` (``unpipelined_over_transformers_throughput``,
``unpipelined_tpot_p50_over_transformers``) and ``continuous_over_unpipelined_throughput``,
``layerwise_over_fused_tpot``
(p50 TPOTs; aim ≤ 1.3 on CPU), ``offload_over_resident_tpot`` (p50 TPOTs; resident =
the resident configuration that ran offload's step, ``layerwise`` when offload's "auto"
resolves to layerwise, else ``continuous``); a ratio whose configurations did not run
is left out. Workload: requests, seed, rate (requests/s), load and static_batch_s
(the calibration; null / absent with ``--rate``), max_batch_size, arrival_span_s,
prompt_tokens_min/max/mean, max_new_tokens_max, max_new_tokens_mean, output_tokens,
configs, skipped_configs, static_replay; and machine, date, command, cpus,
load_average_at_start, jax_backend, torch_threads, versions. Figures that could not be
measured are null.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import os
import platform
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks.lib import cli
from benchmarks.lib.compiles import counting, timed_pass
from benchmarks.lib.meta import finish_run
from benchmarks.lib.tables import print_table
from benchmarks.lib.timing import percentile

FULL = dict(requests=200, prompt_min=16, prompt_max=512, max_new=128, max_batch_size=16)
QUICK = dict(requests=48, prompt_min=16, prompt_max=128, max_new=32, max_batch_size=8)
DEFAULT_LOAD = 4.0
FIRST_TOKEN_ID = 3            # prompt ids in [3, vocab): clear of the special ids 0..2
WARMUP_SEED_OFFSET = 1000     # warm-up pass p draws its token ids from seed + this + p
REPLAY_TIMEOUT_S = 1800.0

# Configuration name -> the Generator options that make it.
MOEJAX_CONFIGS: dict[str, dict[str, Any]] = {
    "static": dict(batching="static", step="auto", backend="resident"),
    "continuous": dict(batching="continuous", step="auto", backend="resident"),
    "unpipelined": dict(batching="continuous", step="auto", backend="resident",
                        pipelined=False),
    "fused": dict(batching="continuous", step="fused", backend="resident"),
    "layerwise": dict(batching="continuous", step="layerwise", backend="resident"),
    "offload": dict(batching="continuous", step="auto", backend="offload"),
}
TRANSFORMERS_CONFIGS = ("transformers_padded", "transformers_continuous")
ALL_CONFIGS = tuple(MOEJAX_CONFIGS) + TRANSFORMERS_CONFIGS


class ConfigUnavailable(Exception):
    """This configuration cannot run here (an option or API not available); it is skipped."""


# ============================================================================ workload
@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of the trace; its arrival is ``unit_arrival / rate`` seconds after the
    first request (unit_arrival: the arrival time at one request per second)."""

    index: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    unit_arrival: float

    def as_request(self) -> dict:
        """The moejax request dict: greedy, no stop tokens (exactly max_new_tokens)."""
        return {"id": self.index, "prompt_token_ids": list(self.prompt_token_ids),
                "max_new_tokens": self.max_new_tokens, "stop_token_ids": []}


def long_tailed_max_new(rng: np.random.Generator, count: int, largest: int) -> np.ndarray:
    """Discrete log-uniform draws in [1, largest]: floor(exp(u · ln(largest + 1)))."""
    u = rng.random(count)
    return np.minimum(np.floor(np.exp(u * math.log(largest + 1))), largest).astype(int)


def poisson_unit_arrivals(rng: np.random.Generator, count: int) -> np.ndarray:
    """Arrival times of a Poisson process of rate 1, shifted so the first is at 0."""
    gaps = rng.exponential(1.0, count)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])])


def build_workload(requests: int, *, seed: int = 0, prompt_min: int = 16,
                   prompt_max: int = 512, max_new: int = 128, vocab: int = 1024
                   ) -> list[TraceRequest]:
    """The trace (see the module docstring): seeded, deterministic."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(prompt_min, prompt_max + 1, requests)
    news = long_tailed_max_new(rng, requests, max_new)
    arrivals = poisson_unit_arrivals(rng, requests)
    return [TraceRequest(i, rng.integers(FIRST_TOKEN_ID, vocab, int(n)).tolist(), int(k),
                         float(a)) for i, (n, k, a) in enumerate(zip(lengths, news, arrivals))]


def fresh_tokens(trace: Sequence[TraceRequest], seed: int, vocab: int) -> list[TraceRequest]:
    """The same trace (lengths, max_new_tokens, arrivals) with other prompt token ids."""
    rng = np.random.default_rng(seed)
    return [dataclasses.replace(r, prompt_token_ids=rng.integers(
        FIRST_TOKEN_ID, vocab, len(r.prompt_token_ids)).tolist()) for r in trace]


# ============================================================================ metrics
@dataclasses.dataclass
class Timing:
    """One request's clock (time.perf_counter seconds): scheduled arrival, first and last
    token times, tokens received and in how many deliveries (``events``)."""

    arrival: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    events: int = 0
    done: bool = False
    error: str | None = None

    def got(self, count: int, now: float) -> None:
        """``count`` new tokens arrived at ``now``."""
        if count <= 0:
            return
        if self.first is None:
            self.first = now
        self.last = now
        self.tokens += count
        self.events += 1


def ttfts(timings: Sequence[Timing]) -> list[float]:
    return [t.first - t.arrival for t in timings if t.first is not None]


def tpots(timings: Sequence[Timing]) -> list[float]:
    """(last − first) / (tokens − 1) for the requests with at least two tokens, delivered
    at two moments at least (tokens that all came at once say nothing of their pace)."""
    return [(t.last - t.first) / (t.tokens - 1) for t in timings
            if t.tokens >= 2 and t.events >= 2 and t.first is not None and t.last is not None]


def throughput(timings: Sequence[Timing]) -> float:
    """Output tokens / (last token time − first arrival)."""
    ends = [t.last for t in timings if t.last is not None]
    if not ends:
        return math.nan
    span = max(ends) - min(t.arrival for t in timings)
    return sum(t.tokens for t in timings) / span if span > 0 else math.nan


def summarize(timings: Sequence[Timing]) -> dict[str, float]:
    """The per-configuration figures (milliseconds for latencies)."""
    first_token, per_token = ttfts(timings), tpots(timings)
    ends = [t.last for t in timings if t.last is not None]
    return {
        "tokens_per_s": throughput(timings),
        "ttft_p50_ms": 1000 * percentile(first_token, 50),
        "ttft_p99_ms": 1000 * percentile(first_token, 99),
        "tpot_p50_ms": 1000 * percentile(per_token, 50),
        "tpot_p99_ms": 1000 * percentile(per_token, 99),
        "output_tokens": sum(t.tokens for t in timings),
        "seconds": (max(ends) - min(t.arrival for t in timings)) if ends else math.nan,
    }


def ratio(figures: dict, top: str, bottom: str) -> float | None:
    """figures[top] / figures[bottom], or None when either is missing or not finite."""
    a, b = figures.get(top), figures.get(bottom)
    if a is None or b is None or not math.isfinite(a) or not math.isfinite(b) or b == 0:
        return None
    return a / b


# ============================================================================ replay
def sleep_until(moment: float) -> None:
    delay = moment - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def check_counts(trace: Sequence[TraceRequest], timings: Sequence[Timing], name: str) -> None:
    for req, t in zip(trace, timings):
        if t.error:
            raise RuntimeError(f"{name}: request {req.index} failed: {t.error}")
        if t.tokens != req.max_new_tokens:
            raise RuntimeError(f"{name}: request {req.index} got {t.tokens} tokens, asked for "
                               f"exactly {req.max_new_tokens}")


# A batch server: the requests of one batch -> their Timing (arrival not set).
BatchServer = Callable[[Sequence[TraceRequest]], list[Timing]]


def replay_batches(serve: BatchServer, trace: Sequence[TraceRequest], rate: float,
                   max_batch: int) -> list[Timing]:
    """Static batching driven here: whenever the server is free, up to ``max_batch``
    requests that have arrived (arrival order) go in one call, which runs them all to the
    end; with none waiting, it waits for the next arrival."""
    start = time.perf_counter()
    timings = [Timing(arrival=start + r.unit_arrival / rate) for r in trace]
    waiting: list[int] = []
    arrived = 0
    while arrived < len(trace) or waiting:
        now = time.perf_counter()
        while arrived < len(trace) and timings[arrived].arrival <= now:
            waiting.append(arrived)
            arrived += 1
        if not waiting:
            sleep_until(timings[arrived].arrival)
            continue
        batch, waiting = waiting[:max_batch], waiting[max_batch:]
        for i, served in zip(batch, serve([trace[i] for i in batch])):
            timings[i] = dataclasses.replace(served, arrival=timings[i].arrival, done=True)
    return timings


def replay_loop(loop: Any, trace: Sequence[TraceRequest], rate: float,
                timeout: float = REPLAY_TIMEOUT_S) -> list[Timing]:
    """Submit each request to a moejax generation loop (``Generator.start_loop()``) at its
    arrival; token times are taken in the event callbacks (loop thread)."""
    start = time.perf_counter()
    timings = [Timing(arrival=start + r.unit_arrival / rate) for r in trace]
    finished = threading.Semaphore(0)
    handles = []

    def callback(timing: Timing) -> Callable[[Any], None]:
        def on_event(event: Any) -> None:
            timing.got(len(event.token_ids), time.perf_counter())
            if event.result is not None:
                timing.error = event.result.error
                timing.done = True
                finished.release()
        return on_event

    for req, timing in zip(trace, timings):
        sleep_until(timing.arrival)
        handles.append(loop.submit(req.as_request(), callback(timing)))
    deadline = time.perf_counter() + timeout
    for _ in trace:
        if not finished.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            for handle, timing in zip(handles, timings):
                if not timing.done:
                    handle.cancel()
            raise RuntimeError(f"replay: {sum(not t.done for t in timings)} requests "
                               f"unfinished after {timeout:.0f} s")
    return timings


# ============================================================================ runners
class MoejaxRunner:
    """One moejax configuration: a Generator with its options, replayed through its
    background loop (``Generator.start_loop()``), or, for static batching (which has
    none), through batches driven here (:func:`replay_batches`)."""

    def __init__(self, name: str, model: str, max_batch_size: int,
                 extra: dict[str, Any]):
        from serving import Generator

        self.name = name
        self.max_batch_size = max_batch_size
        base = dict(dtype="float32", max_batch_size=max_batch_size,
                    **{k: v for k, v in extra.items() if v is not None})
        start = time.perf_counter()
        try:
            self.generator = Generator(model, **base, **MOEJAX_CONFIGS[name])
            self.startup_s = time.perf_counter() - start
        except (TypeError, ValueError, NotImplementedError) as exc:
            raise ConfigUnavailable(f"Generator refuses {MOEJAX_CONFIGS[name]}: {exc}")
        self.step = self.generator.options.resolved_step()
        self.replay_path = "loop"
        try:
            self.generator.start_loop().close()
        except ValueError as exc:     # static batching has no loop
            if name != "static":
                raise ConfigUnavailable(f"no generation loop: {exc}")
            self.replay_path = "stream-batches"

    def serve_batch(self, batch: Sequence[TraceRequest]) -> list[Timing]:
        """One static batch through ``Generator.stream``, token times as its events come."""
        timings = [Timing(arrival=0.0) for _ in batch]
        for event in self.generator.stream([r.as_request() for r in batch]):
            timings[event.index].got(len(event.token_ids), time.perf_counter())
            if event.result is not None and event.result.error:
                raise RuntimeError(f"{self.name}: {event.result.error}")
        return timings

    def batch_seconds(self, batch: Sequence[TraceRequest]) -> float:
        """Time to generate ``batch`` in one ``generate`` call (the second of two)."""
        requests = [r.as_request() for r in batch]
        self.generator.generate(requests)
        start = time.perf_counter()
        self.generator.generate(requests)
        return time.perf_counter() - start

    def replay(self, trace: Sequence[TraceRequest], rate: float) -> list[Timing]:
        if self.replay_path != "loop":
            return replay_batches(self.serve_batch, trace, rate, self.max_batch_size)
        loop = self.generator.start_loop()
        try:
            return replay_loop(loop, trace, rate)
        finally:
            loop.close()

    def warm_up(self, trace: Sequence[TraceRequest], rate: float) -> None:
        self.replay(trace, rate)

    def close(self) -> None:
        self.generator = None


class _StepClock:
    """A `transformers` streamer (``put`` / ``end``, as ``BaseStreamer``) that stamps each
    decode step; its first ``put`` is the prompt, not a generated token."""

    def __init__(self):
        self.steps: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.steps.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_transformers_model(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None   # never stop early (stop_token_ids=[])
    return model.to("cuda" if torch.cuda.is_available() else "cpu")


class TransformersPaddedRunner:
    """Padded ``model.generate`` batches (see the module docstring)."""

    name = "transformers_padded"

    def __init__(self, model_dir: str, max_batch_size: int):
        self.model = load_transformers_model(model_dir)
        self.max_batch_size = max_batch_size
        self.pad = self.model.config.pad_token_id if self.model.config.pad_token_id is not None \
            else 0

    def _generate(self, batch: Sequence[TraceRequest]) -> list[float]:
        import torch
        from transformers import GenerationConfig

        clock = _StepClock()
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = [[self.pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids
               for r in batch]
        mask = [[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids)
                for r in batch]
        steps = max(r.max_new_tokens for r in batch)
        config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=None,
                                  eos_token_id=None, pad_token_id=self.pad)
        device = self.model.device
        self.model.generate(input_ids=torch.tensor(ids, device=device),
                            attention_mask=torch.tensor(mask, device=device),
                            generation_config=config, streamer=clock)
        if len(clock.steps) != steps:
            raise RuntimeError(f"transformers generate ran {len(clock.steps)} steps, "
                               f"asked for {steps}")
        return clock.steps

    def serve_batch(self, batch: Sequence[TraceRequest]) -> list[Timing]:
        steps = self._generate(batch)
        return [Timing(arrival=0.0, first=steps[0], last=steps[r.max_new_tokens - 1],
                       tokens=r.max_new_tokens, events=r.max_new_tokens) for r in batch]

    def batch_seconds(self, batch: Sequence[TraceRequest]) -> float:
        self._generate(batch)
        start = time.perf_counter()
        self._generate(batch)
        return time.perf_counter() - start

    def warm_up(self, trace: Sequence[TraceRequest], rate: float) -> None:
        self._generate(trace[:self.max_batch_size])

    def replay(self, trace: Sequence[TraceRequest], rate: float) -> list[Timing]:
        return replay_batches(self.serve_batch, trace, rate, self.max_batch_size)

    def close(self) -> None:
        self.model = None


class TransformersContinuousRunner:
    """`transformers` continuous batching: the manager behind ``generate_batch``, fed at
    each arrival (see the module docstring)."""

    name = "transformers_continuous"

    def __init__(self, model_dir: str, max_batch_size: int, max_new: int):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        self.model = load_transformers_model(model_dir)
        if not hasattr(self.model, "generate_batch"):
            raise ConfigUnavailable("this transformers version has no generate_batch")
        config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=-1,
                                  pad_token_id=self.model.config.pad_token_id)
        self.manager = self.model.init_continuous_batching(
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig(
                max_requests_per_batch=max_batch_size))
        self.manager.warmup()
        self.manager.start()
        self.runs = 0

    def replay(self, trace: Sequence[TraceRequest], rate: float,
               timeout: float = REPLAY_TIMEOUT_S) -> list[Timing]:
        self.runs += 1
        start = time.perf_counter()
        timings = [Timing(arrival=start + r.unit_arrival / rate) for r in trace]
        ids = {}
        for req, timing in zip(trace, timings):
            sleep_until(timing.arrival)
            rid = f"run{self.runs}-{req.index}"
            ids[rid] = timing
            self.manager.add_request(req.prompt_token_ids, request_id=rid,
                                     max_new_tokens=req.max_new_tokens, record_timestamps=True,
                                     eos_token_id=-1)
        deadline = time.perf_counter() + timeout
        left = len(trace)
        while left:
            if time.perf_counter() > deadline or not self.manager.is_running():
                raise RuntimeError(f"transformers continuous batching: {left} requests "
                                   f"unfinished")
            output = self.manager.get_result(timeout=1.0)
            if output is None or not output.is_finished() or output.request_id not in ids:
                continue
            timing = ids[output.request_id]
            stamps = output.timestamps or []
            timing.error = output.error
            timing.tokens = len(output.generated_tokens)
            timing.first, timing.last = (stamps[0], stamps[-1]) if stamps else (None, None)
            timing.events = len(set(stamps))
            timing.done = True
            left -= 1
        return timings

    def warm_up(self, trace: Sequence[TraceRequest], rate: float) -> None:
        self.replay(trace[:len(trace) // 4 or 1], rate)

    def close(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=30)
            self.manager = None
        self.model = None


# ============================================================================ driver
def machine_line() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.bench_parser(__doc__, quick_help="48 short requests, max_new_tokens up to 32, "
                              "batches of 8", model="demo")
    parser.add_argument("--configs", default=",".join(ALL_CONFIGS),
                        help=f"comma-separated subset of {','.join(ALL_CONFIGS)}")
    parser.add_argument("--requests", type=int, help="requests in the trace")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed")
    parser.add_argument("--rate", type=float, help="arrivals per second (default: calibrated)")
    parser.add_argument("--load", type=float, default=DEFAULT_LOAD,
                        help="calibrated rate = LOAD x the static batcher's requests/s")
    parser.add_argument("--max-batch-size", type=int, help="rows decoded together, every engine")
    parser.add_argument("--warmup-passes", type=int, default=3,
                        help="at most this many warm-up replays (they stop at one that "
                             "compiles nothing)")
    parser.add_argument("--compilation-cache", default="off",
                        help="moejax compilation_cache: 'off' (default), 'auto' or a "
                             "directory (reruns then load their compiled programs)")
    parser.add_argument("--torch-threads", type=int,
                        help="torch.set_num_threads for the transformers side (default: "
                             "torch's own, every core)")
    parser.add_argument("--max-prefill-tokens", type=int, help="moejax continuous option")
    parser.add_argument("--kv-cache-blocks", type=int, help="moejax continuous option")
    args = cli.parse_args(parser, argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(args.configs) - set(ALL_CONFIGS))
    if unknown or not args.configs:
        parser.error(f"--configs: unknown {unknown}; choose among {', '.join(ALL_CONFIGS)}")
    return args


def warm_up(runner: Any, trace: Sequence[TraceRequest], rate: float, seed: int, vocab: int,
            most: int) -> int:
    """Replay warm-up traces (``trace`` with fresh token ids each time) until one compiles
    nothing, at most ``most`` times; the number of passes."""
    for done in range(1, most + 1):
        with counting() as compiled:
            runner.warm_up(fresh_tokens(trace, seed + WARMUP_SEED_OFFSET + done, vocab), rate)
        if not compiled.count:
            break
    return done


def make_runner(name: str, args: argparse.Namespace, model_dir: str, shape: dict):
    batch = shape["max_batch_size"]
    if name in MOEJAX_CONFIGS:
        extra = {"compilation_cache": args.compilation_cache}
        if name != "static":    # continuous-batching options
            extra.update(max_prefill_tokens=args.max_prefill_tokens,
                         kv_cache_blocks=args.kv_cache_blocks, precompile=True)
        return MoejaxRunner(name, args.model, batch, extra)
    if name == "transformers_padded":
        return TransformersPaddedRunner(model_dir, batch)
    return TransformersContinuousRunner(model_dir, batch, shape["max_new"])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shape = cli.run_shape(args, QUICK, FULL, ("requests", "max_batch_size"))
    load_average = os.getloadavg()[0]

    import jax
    import torch
    import transformers

    from serving.api import resolve_model_dir

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)

    model_dir = resolve_model_dir(args.model)[0]
    vocab = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    trace = build_workload(shape["requests"], seed=args.seed, prompt_min=shape["prompt_min"],
                           prompt_max=shape["prompt_max"], max_new=shape["max_new"],
                           vocab=vocab)
    prompts = [len(r.prompt_token_ids) for r in trace]
    news = [r.max_new_tokens for r in trace]
    figures: dict[str, Any] = {
        "requests": len(trace), "seed": args.seed, "max_batch_size": shape["max_batch_size"],
        "prompt_tokens_min": min(prompts), "prompt_tokens_max": max(prompts),
        "prompt_tokens_mean": float(np.mean(prompts)), "max_new_tokens_max": max(news),
        "max_new_tokens_mean": float(np.mean(news)), "output_tokens": sum(news),
        "configs": ",".join(args.configs),
        "machine": machine_line(), "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "benchmarks.generation_serving",
                             *(sys.argv[1:] if argv is None else argv)]),
        "load_average_at_start": load_average, "jax_backend": jax.default_backend(),
        "torch_threads": torch.get_num_threads(),
        "versions": f"jax {jax.__version__}, torch {torch.__version__}, "
                    f"transformers {transformers.__version__}"}
    print(f"{len(trace)} requests: prompts {min(prompts)}-{max(prompts)} tokens (mean "
          f"{np.mean(prompts):.0f}), max_new_tokens 1-{shape['max_new']} long-tailed (mean "
          f"{np.mean(news):.1f}, {sum(news)} output tokens), greedy, no stop tokens; "
          f"max_batch_size {shape['max_batch_size']}; model {args.model}")
    print(f"machine: {figures['machine']}; load average {load_average:.2f}; "
          f"{figures['versions']}; JAX backend {figures['jax_backend']}; torch threads "
          f"{figures['torch_threads']}")
    if load_average > 0.5:
        print("note: other processes are using the CPUs: timings are disturbed (torch's "
              "OpenMP threads most, as they wait on each other; see --torch-threads)")

    runners: dict[str, Any] = {}
    skipped: dict[str, str] = {}

    def runner(name: str):
        if name not in runners:
            runners[name] = make_runner(name, args, model_dir, shape)
        return runners[name]

    batch = trace[:shape["max_batch_size"]]
    if args.rate is not None:
        rate, figures["load"] = args.rate, None
    else:
        try:    # the static batcher's capacity
            calibrator = runner("static")
        except ConfigUnavailable:
            calibrator = runner("transformers_padded")
        figures["static_batch_s"] = calibrator.batch_seconds(batch)
        rate = args.load * len(batch) / figures["static_batch_s"]
        figures["load"] = args.load
        print(f"calibration: {calibrator.name} generates the first {len(batch)} requests in "
              f"{figures['static_batch_s']:.2f} s -> rate {rate:.2f} requests/s "
              f"(load {args.load:g} x its capacity)")
        if calibrator.name not in args.configs:
            runners.pop(calibrator.name).close()
    figures["rate"] = rate
    figures["arrival_span_s"] = trace[-1].unit_arrival / rate
    print(f"Poisson arrivals at {rate:.2f} requests/s (span {figures['arrival_span_s']:.1f} s)")

    for name in args.configs:
        try:
            current = runner(name)
        except ConfigUnavailable as exc:
            skipped[name] = str(exc)
            print(f"{name}: skipped ({exc})")
            continue
        try:
            start = time.perf_counter()
            passes = warm_up(current, trace, rate, args.seed, vocab, args.warmup_passes)
            warmup_s = time.perf_counter() - start
            with timed_pass(f"{name}_replay") as compiled:
                timings = current.replay(trace, rate)
            compiles, compile_s = compiled.count, compiled.seconds
        except ConfigUnavailable as exc:
            skipped[name] = str(exc)
            print(f"{name}: skipped ({exc})")
            continue
        finally:
            runners.pop(name, current).close()
        check_counts(trace, timings, name)
        summary = summarize(timings)
        summary["warmup_s"] = warmup_s
        summary["warmup_passes"] = passes
        if name in MOEJAX_CONFIGS:
            summary["startup_s"] = current.startup_s
            summary["compiles_in_replay"] = compiles
            summary["compile_s_in_replay"] = compile_s
            summary["step"] = current.step
            if name == "static":
                figures["static_replay"] = current.replay_path
        figures.update({f"{name}_{key}": value for key, value in summary.items()})
        print(f"{name:24s} {summary['tokens_per_s']:9.1f} tokens/s  TTFT p50 "
              f"{summary['ttft_p50_ms']:8.1f} p99 {summary['ttft_p99_ms']:8.1f} ms  TPOT p50 "
              f"{summary['tpot_p50_ms']:7.2f} p99 {summary['tpot_p99_ms']:7.2f} ms  "
              f"({summary['seconds']:.1f} s; warm-up {passes}x {warmup_s:.1f} s"
              + (f"; {compiles} compiles in replay, {compile_s:.1f} s"
                 if name in MOEJAX_CONFIGS else "") + ")")
    for leftover in runners.values():
        leftover.close()
    figures["skipped_configs"] = ",".join(skipped)

    report_ratios(figures)
    print_results(figures, [c for c in args.configs if c not in skipped])
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
             for k, v in figures.items()}
    return finish_run(clean, args.json_path)


def report_ratios(figures: dict) -> None:
    tp = "tokens_per_s"
    best_hf = max((c for c in TRANSFORMERS_CONFIGS if figures.get(f"{c}_{tp}") is not None),
                  key=lambda c: figures[f"{c}_{tp}"], default=None)
    # Per-token latency against the `transformers` configuration with the lowest p50 TPOT
    # (padded batches decode fastest per step; its continuous batching, slower per token,
    # may still have the higher throughput).
    fastest_hf = min((c for c in TRANSFORMERS_CONFIGS
                      if figures.get(f"{c}_tpot_p50_ms") is not None),
                     key=lambda c: figures[f"{c}_tpot_p50_ms"], default=None)
    # Offload against resident with the same step: the resident config whose step is the
    # one offload ran (step "auto" is layerwise on offload), else ``continuous``.
    resident = next((c for c in ("fused", "layerwise") if figures.get("offload_step") == c
                     and figures.get(f"{c}_tpot_p50_ms") is not None), "continuous")
    wanted = {
        "continuous_over_static_throughput": ("continuous_" + tp, "static_" + tp, "target >= 2"),
        "continuous_over_transformers_throughput": (
            "continuous_" + tp, f"{best_hf}_{tp}", f"over {best_hf}; target >= 3"),
        "continuous_over_transformers_padded_throughput": (
            "continuous_" + tp, "transformers_padded_" + tp, ""),
        "continuous_over_transformers_continuous_throughput": (
            "continuous_" + tp, "transformers_continuous_" + tp, ""),
        "tpot_p50_over_transformers": ("continuous_tpot_p50_ms", f"{fastest_hf}_tpot_p50_ms",
                                       f"over {fastest_hf}; target <= 1"),
        "unpipelined_over_transformers_throughput": (
            "unpipelined_" + tp, f"{best_hf}_{tp}", f"over {best_hf}; pipelining off"),
        "unpipelined_tpot_p50_over_transformers": (
            "unpipelined_tpot_p50_ms", f"{fastest_hf}_tpot_p50_ms",
            f"over {fastest_hf}; pipelining off"),
        "continuous_over_unpipelined_throughput": ("continuous_" + tp, "unpipelined_" + tp,
                                                   "pipelining's gain"),
        "layerwise_over_fused_tpot": ("layerwise_tpot_p50_ms", "fused_tpot_p50_ms",
                                      "p50 TPOT; aim <= 1.3 on CPU"),
        "offload_over_resident_tpot": ("offload_tpot_p50_ms", f"{resident}_tpot_p50_ms",
                                       f"p50 TPOT; resident = {resident}"),
    }
    for key, (top, bottom, note) in wanted.items():
        value = ratio(figures, top, bottom)
        if value is not None:
            figures[key] = value
        shown = f"{value:.2f}" if value is not None else f"n/a (needs {top}, {bottom})"
        print(f"{key}: {shown}" + (f"  ({note})" if note and value is not None else ""))


def print_results(figures: dict, configs: list[str]) -> None:
    def cell(key: str, spec: str) -> Callable[[str], str]:
        def text(name: str) -> str:
            value = figures.get(f"{name}_{key}")
            return "n/a" if value is None or not math.isfinite(value) else format(value, spec)
        return text

    print()
    print_table([("configuration", -1, lambda name: name),
                 ("tokens/s", 1, cell("tokens_per_s", ".1f")),
                 ("TTFT p50 ms", 1, cell("ttft_p50_ms", ".1f")),
                 ("TTFT p99 ms", 1, cell("ttft_p99_ms", ".1f")),
                 ("TPOT p50 ms", 1, cell("tpot_p50_ms", ".2f")),
                 ("TPOT p99 ms", 1, cell("tpot_p99_ms", ".2f"))], configs, markdown=True)


if __name__ == "__main__":
    main()

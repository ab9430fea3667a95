"""The AsyncMoE half of ``benchmarks/ep_decode.py``: simulated μ-queue decode against
synchronous expert parallelism (``moejax.asyncmoe.simulator``, which drives the runtime's
own engine, queues, token pool and schedulers) under measured cost tables.

Per routing source (demo-e32's traced decode routing, its twin's, the seed's synthetic
exponential skew ``p_e ∝ exp(−SKEW·rank_e)``, and uniform routing as the control) and
device count: a Poisson workload at rates that are fractions of the synchronous
baseline's saturated request rate (all requests at t = 0), each run under sync_ep and the
μ-queue runtime with each scheduler. The ITL bound is ``SLO_FACTOR`` × sync_ep's p50 ITL
at the lowest rate; a system's throughput at the bound is the largest throughput of the
rates whose p50 ITL stays within it (0 when none does). Keys (``<tag>`` =
``<source>_g<G>``):

* ``mu_queue_throughput_over_sync_ep_<tag>`` (defrag), ``defrag_over_most_tokens_<tag>``,
  ``defrag_over_first_layer_<tag>`` (ratios of throughput at the bound; NaN when the
  denominator met the bound at no rate);
* per rate r (fraction of saturation) and system s: ``<tag>_r<r>_<s>_{throughput,
  itl_p50_ms, itl_p99_ms, expert_batch, attention_batch, stall, max_queue,
  queue_at_{25,50,75}pct, completion_over_arrival}`` (queue depth over time: tokens in
  μ-queues, or for sync EP requests waiting for a step, at 25/50/75 % of the run);
* the δ/lookahead sweep of the defrag scheduler at the saturation rate:
  ``defrag_d<δ>_k<K>_<tag>_{throughput,itl_p50_ms}``;
* a real run (:func:`real_runtime_figures`): demo-e32 through the μ-queue runtime on
  ``REAL_DEVICES`` CPU devices, staggered arrivals, each scheduler:
  ``mu_queue_tokens_equal_decode_runtime`` (greedy f32 tokens of the paged decode
  runtime), ``mu_queue_sim_batches_match`` (the simulator, replaying the run's own
  routing under the runtime's virtual costs, predicts its batch sequence: 1 when every
  batch matches), ``mu_queue_batches_<scheduler>`` and ``mu_queue_mean_expert_batch_
  <scheduler>`` (the real run), ``mu_queue_wall_tokens_per_s`` and
  ``decode_runtime_wall_tokens_per_s`` (CPU wall, both after a warm-up pass).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

SKEW = 0.15
SLO_FACTOR = 2.0
SCHEDULERS = ("defrag", "most_tokens", "first_layer")
SWEEP_DELTAS = (0.25, 0.5, 0.75, 1.0)
SWEEP_LOOKAHEADS = (1, 2, 4)
DTYPE_BYTES = 4
SATURATION_RATE = 1e9          # every request at t ~ 0
DEPTH_FRACTIONS = (0.25, 0.5, 0.75)   # queue depth sampled at these fractions of a run


def trace_routing(trace: Any) -> tuple[Any, int, int]:
    """(TraceRouting of the odd requests' decode routing, their count, decode steps)."""
    from moejax.asyncmoe.simulator import TraceRouting

    requests = [r for r in trace.requests if r.ok][1::2]
    steps = min(r.decode_experts.shape[1] for r in requests)
    ids = {i: r.decode_experts[:, :steps] for i, r in enumerate(requests)}
    weights = {i: r.decode_weights[:, :steps] for i, r in enumerate(requests)}
    return TraceRouting(ids, weights, trace.num_experts), len(requests), steps


class Cycled:
    """A routing whose request i replays recorded request i mod n (a workload may hold
    more requests than the trace)."""

    def __init__(self, routing: Any, num_recorded: int):
        self.routing, self.num_recorded = routing, num_recorded
        self.num_experts, self.top_k = routing.num_experts, routing.top_k

    def topk(self, request_id: int, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        return self.routing.topk(request_id % self.num_recorded, step, layer)


def routing_sources(traces: dict[str, Any], cfg: Any, seed: int) -> dict[str, tuple[Any, int]]:
    """name -> (routing, decode steps per request)."""
    from moejax.asyncmoe.simulator import SkewedRouting

    out: dict[str, tuple[Any, int]] = {}
    for name, suffix in (("trace", ""), ("twin", "_twin")):
        routing, count, steps = trace_routing(traces[suffix])
        out[name] = (Cycled(routing, count), steps)
    steps = out["trace"][1]
    k, experts = cfg.num_experts_per_tok, cfg.num_experts
    out["skewed"] = (SkewedRouting(experts, k, SKEW, seed), steps)
    out["uniform"] = (SkewedRouting(experts, k, 0.0, seed), steps)
    return out


def run(system: str, tables: Any, routing: Any, workload: Any, devices: int, cfg: Any,
        scheduler: Any = None) -> Any:
    from moejax.asyncmoe import simulator

    common = dict(num_devices=devices, num_layers=cfg.num_layers,
                  num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok)
    if system == "sync_ep":
        return simulator.simulate_sync_ep(tables, routing, workload, hidden=cfg.hidden_size,
                                          dtype_bytes=DTYPE_BYTES, **common)
    return simulator.simulate_mu_queue(tables, routing, workload, scheduler=scheduler,
                                       hidden=cfg.hidden_size, dtype_bytes=DTYPE_BYTES,
                                       **common)


def depth_at(samples: Sequence[tuple[float, int]], fraction: float) -> float:
    """The queue depth at ``fraction`` of a run's span: the last sample at or before it."""
    if not samples:
        return 0.0
    times = [t for t, _ in samples]
    at = times[0] + fraction * (times[-1] - times[0])
    return float(samples[max(bisect.bisect_right(times, at) - 1, 0)][1])


def summary(result: Any, rate: float) -> dict[str, float]:
    """The per-run figures (module docstring)."""
    depth = [n for _, n in result.queue_depth] or [0]
    done = len(result.requests) / max(result.makespan_s, 1e-12)
    out = {"throughput": result.throughput_tokens_per_s,
           "itl_p50_ms": 1e3 * result.itl_p50_s, "itl_p99_ms": 1e3 * result.itl_p99_s,
           "expert_batch": result.mean_expert_batch,
           "attention_batch": result.mean_attention_batch,
           "stall": result.stall_fraction, "max_queue": float(max(depth)),
           "completion_over_arrival": done / rate}
    for fraction in DEPTH_FRACTIONS:
        out[f"queue_at_{int(100 * fraction)}pct"] = depth_at(result.queue_depth, fraction)
    return out


def at_bound(runs: list[dict[str, float]], slo_ms: float) -> float:
    """The largest throughput among runs within the ITL bound (0 when none is)."""
    ok = [r["throughput"] for r in runs if r["itl_p50_ms"] <= slo_ms]
    return max(ok) if ok else 0.0


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def source_figures(tag: str, tables: Any, routing: Any, steps: int, devices: int, cfg: Any,
                   shape: dict[str, Any], seed: int) -> dict[str, float]:
    """Every figure of one (routing source, device count)."""
    from moejax.asyncmoe.simulator import poisson_workload

    def workload(rate: float) -> Any:
        return poisson_workload(shape["sim_requests"], rate, (shape["prompt_tokens"],) * 2,
                                (steps, steps), seed)

    saturated = run("sync_ep", tables, routing, workload(SATURATION_RATE), devices, cfg)
    sat_rate = saturated.throughput_tokens_per_s / steps          # requests per second
    out: dict[str, float] = {f"{tag}_sync_ep_saturated_requests_per_s": sat_rate}
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in ("sync_ep", *SCHEDULERS)}
    for fraction in shape["rate_fractions"]:
        rate = fraction * sat_rate
        for system in runs:
            result = (run("sync_ep", tables, routing, workload(rate), devices, cfg)
                      if system == "sync_ep" else
                      run("mu_queue", tables, routing, workload(rate), devices, cfg, system))
            figures = summary(result, rate)
            runs[system].append(figures)
            for key, value in figures.items():
                out[f"{tag}_r{fraction:g}_{system}_{key}"] = value
    slo = SLO_FACTOR * runs["sync_ep"][0]["itl_p50_ms"]
    best = {system: at_bound(values, slo) for system, values in runs.items()}
    out[f"itl_slo_ms_{tag}"] = slo
    for system, value in best.items():
        out[f"throughput_at_slo_{system}_{tag}"] = value
    out[f"mu_queue_throughput_over_sync_ep_{tag}"] = ratio(best["defrag"], best["sync_ep"])
    out[f"defrag_over_most_tokens_{tag}"] = ratio(best["defrag"], best["most_tokens"])
    out[f"defrag_over_first_layer_{tag}"] = ratio(best["defrag"], best["first_layer"])
    return out


def sweep_figures(tag: str, tables: Any, routing: Any, steps: int, devices: int, cfg: Any,
                  shape: dict[str, Any], rate: float, seed: int) -> dict[str, float]:
    """Defrag's δ and lookahead at one rate."""
    from moejax.asyncmoe.schedulers import DefragScheduler
    from moejax.asyncmoe.simulator import poisson_workload

    workload = poisson_workload(shape["sim_requests"], rate, (shape["prompt_tokens"],) * 2,
                                (steps, steps), seed)
    out: dict[str, float] = {}
    for delta in shape["sweep_deltas"]:
        for lookahead in shape["sweep_lookaheads"]:
            result = run("mu_queue", tables, routing, workload, devices, cfg,
                         DefragScheduler(delta=delta, lookahead=lookahead))
            name = f"defrag_d{delta:g}_k{lookahead}_{tag}"
            out[f"{name}_throughput"] = result.throughput_tokens_per_s
            out[f"{name}_itl_p50_ms"] = 1e3 * result.itl_p50_s
    return out


def simulation_figures(traces: dict[str, Any], tables: Any, cfg: Any, shape: dict[str, Any],
                       seed: int) -> dict[str, float]:
    """All simulated figures; the headline keys are the trace source at the first device
    count."""
    out: dict[str, float] = {}
    sources = routing_sources(traces, cfg, seed)
    for name in shape["sim_sources"]:
        routing, steps = sources[name]
        for devices in shape["sim_devices"]:
            tag = f"{name}_g{devices}"
            out.update(source_figures(tag, tables, routing, steps, devices, cfg, shape, seed))
    head = f"trace_g{shape['sim_devices'][0]}"
    for key in ("mu_queue_throughput_over_sync_ep", "defrag_over_most_tokens",
                "defrag_over_first_layer"):
        out[key] = out[f"{key}_{head}"]
    routing, steps = sources["trace"]
    rate = out[f"{head}_sync_ep_saturated_requests_per_s"]
    out.update(sweep_figures(head, tables, routing, steps, shape["sim_devices"][0], cfg, shape,
                             rate, seed))
    return out


def report(figures: dict[str, Any], shape: dict[str, Any]) -> None:
    print("\nAsyncMoE (simulated; throughput tokens/s, p50 ITL ms, mean expert batch):")
    for name in shape["sim_sources"]:
        for devices in shape["sim_devices"]:
            tag = f"{name}_g{devices}"
            print(f"  {tag}: ITL bound {figures[f'itl_slo_ms_{tag}']:.2f} ms; "
                  f"mu_queue/sync_ep {figures[f'mu_queue_throughput_over_sync_ep_{tag}']:.3f}, "
                  f"defrag/most_tokens {figures[f'defrag_over_most_tokens_{tag}']:.3f}, "
                  f"defrag/first_layer {figures[f'defrag_over_first_layer_{tag}']:.3f}")
            for fraction in shape["rate_fractions"]:
                cells = []
                for system in ("sync_ep", *SCHEDULERS):
                    key = f"{tag}_r{fraction:g}_{system}"
                    cells.append(f"{system} {figures[f'{key}_throughput']:.0f}/"
                                 f"{figures[f'{key}_itl_p50_ms']:.1f}/"
                                 f"{figures[f'{key}_expert_batch']:.1f}")
                print(f"    rate {fraction:g}x: " + "  ".join(cells))
    head = f"trace_g{shape['sim_devices'][0]}"
    print(f"  queue depth at 25/50/75 % of the run ({head}, rate 1x): " + ", ".join(
        f"{system} " + "/".join(f"{figures[f'{head}_r1_{system}_queue_at_{p}pct']:.0f}"
                                for p in (25, 50, 75))
        for system in ("sync_ep", *SCHEDULERS)))
    print(f"  real run on {REAL_DEVICES} CPU devices: tokens equal the decode runtime "
          f"{bool(figures['mu_queue_tokens_equal_decode_runtime'])}, simulator predicts its "
          f"batches {bool(figures['mu_queue_sim_batches_match'])}; wall tokens/s μ-queue "
          f"{figures['mu_queue_wall_tokens_per_s']:.1f} vs decode runtime "
          f"{figures['decode_runtime_wall_tokens_per_s']:.1f}")
    head = f"trace_g{shape['sim_devices'][0]}"
    print(f"  defrag sweep at sync_ep's saturation rate ({head}; throughput / p50 ITL ms):")
    for delta in shape["sweep_deltas"]:
        print("    " + "  ".join(
            f"d{delta:g} K{k}: {figures[f'defrag_d{delta:g}_k{k}_{head}_throughput']:.0f}/"
            f"{figures[f'defrag_d{delta:g}_k{k}_{head}_itl_p50_ms']:.1f}"
            for k in shape["sweep_lookaheads"]))


REAL_DEVICES = 4
REAL_ARRIVAL_GAP = 3.0        # virtual units between arrivals in the real run

def real_runtime_figures(cfg: Any, params: Any, prompts: list[tuple[int, ...]],
                         new_tokens: int) -> dict[str, float]:
    """The real μ-queue run on CPU devices (module docstring)."""
    import jax

    from benchmarks.lib.timing import timed_call

    from moejax.asyncmoe import simulator
    from moejax.asyncmoe.runtime import MuQueueRuntime
    from moejax.decode.programs import StepOptions
    from moejax.decode.factory import make_runner
    from moejax.sequences import SequenceSpec
    from moejax.core.continuous import Scheduler, SchedulerOptions

    specs = [SequenceSpec(prompt=p, max_new_tokens=new_tokens) for p in prompts]
    arrivals = [REAL_ARRIVAL_GAP * i for i in range(len(specs))]
    resident = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    def resident_pass(scheduler: Any) -> list[list[int]]:
        seqs = [scheduler.submit(s) for s in specs]
        scheduler.run_until_idle()
        return [list(s.output.token_ids) for s in seqs]

    want, seconds = None, 0.0
    for timed in (False, True):                          # the first pass compiles
        scheduler = Scheduler(resident, 256, SchedulerOptions(max_batch_size=len(specs),
                                                              max_prefill_tokens=256))
        if timed:
            seconds, want = timed_call(lambda: resident_pass(scheduler), label="decode_runtime")
        else:
            resident_pass(scheduler)
    tokens = sum(len(t) for t in want)
    out: dict[str, float] = {"decode_runtime_wall_tokens_per_s": tokens / seconds}
    equal, match = True, True
    for name in SCHEDULERS:
        runtime = MuQueueRuntime(cfg, params, jax.devices()[:REAL_DEVICES], scheduler=name)
        runtime.generate(specs, arrivals)                # the first pass compiles
        seconds, outputs = timed_call(lambda: runtime.generate(specs, arrivals),
                                      label=f"mu_queue_{name}")
        equal = equal and [o.token_ids for o in outputs] == want
        run = runtime.last_run
        out[f"mu_queue_batches_{name}"] = len(run.batches)
        out[f"mu_queue_mean_expert_batch_{name}"] = run.mean_expert_batch
        out[f"mu_queue_wall_tokens_per_s_{name}"] = tokens / seconds
        predicted = simulator.replay_outputs(
            outputs, [len(s.prompt) for s in specs], arrivals, simulator.CostTables.uniform(),
            REAL_DEVICES, cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok, name,
            cfg.hidden_size, DTYPE_BYTES)
        match = match and [b[:5] for b in predicted.batches] == [b[:5] for b in run.batches]
    out["mu_queue_wall_tokens_per_s"] = out["mu_queue_wall_tokens_per_s_defrag"]
    out["mu_queue_tokens_equal_decode_runtime"] = int(equal)
    out["mu_queue_sim_batches_match"] = int(match)
    return out

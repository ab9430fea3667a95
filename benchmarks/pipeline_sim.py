"""The composed prefill→decode pipeline at Qwen3-30B-A3B shape under H100 costs (issue 44):
each technique alone and combined (``moejax.pipeline_sim``).

Inputs: demo-e32's reference traces (``benchmarks/expert_traces.py``; ``--traces DIR``,
default ``out/traces``, written there when missing; ``--quick`` traces the trained model
alone, in memory, unless ``--traces`` is given), lifted to
Qwen3-30B-A3B's 48 layers, 128 experts, top-8 (``moejax.pipeline_sim.shape``). Even
requests calibrate (the ELDR fit; EPLB placement and the EPLB-even / METRO activation
tables, by running both routers on drawn steps), odd ones are the workload pool. The same
for the untrained twin (keys ending ``_twin``: its routing has little locality).

Deployment (:data:`FULL` / :data:`QUICK`): a prefill group of ``prefill_devices`` H100s
and ``decoders`` decoders of ``decoder_devices`` H100s each. Workload: ``requests``
drawn with replacement from the pool, prompt lengths uniform in :data:`PROMPT_TOKENS`
(MODELLED; the decode lengths are the traces'). Two runs per configuration:

* **saturated** (every request arrives at t = 0): ``<config>_throughput_tokens_per_s``,
  output tokens (first token + decode tokens) over the makespan -- the figure of merit;
* **loaded** (Poisson at :data:`LOAD` × the baseline's saturated request rate, one
  arrival trace for every configuration): ``<config>_ttft_p50_ms``,
  ``<config>_tpot_p50_ms``; and ``<config>_mean_active_experts`` (distinct experts per
  layer per decode step).

Configurations: the baseline (sync-EP prefill, JSQ, EPLB-even, resident experts), each
technique alone, and their combinations (all 16 in the full run; ``--quick``: baseline,
singles, the resident composition and the full one; without ``--traces``, the trained
model only). Config names join techniques with ``_plus_``. Headline keys:

* ``<technique>_over_baseline_modelled_h100`` (throughput), technique in async_ep, eldr,
  metro, offload_prefetch;
* ``composed_over_best_single_modelled_h100``: all four on, over the best single one;
* ``composed_resident_over_best_single_modelled_h100``: async_ep + eldr + metro (experts
  resident) over the best single one; ``composed_over_baseline_modelled_h100``;
* ``composed_over_offload_prefetch_modelled_h100``: all four over offload + prefetch
  alone (what the other techniques give decoders whose experts live on the host);
* ``best_single_technique``.

    python -m benchmarks.pipeline_sim [--quick] [--json PATH] [--traces DIR]
        [--requests N] [--seed N]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.reference_traces import model_trace, reference_traces
from moejax.asyncmoe import costs
from moejax.eldr.simulator import poisson_arrivals
from moejax.model_shape import QWEN3_30B_A3B
from moejax.pipeline_sim import hardware
from moejax.pipeline_sim import pipeline as pl
from moejax.pipeline_sim.shape import requests_of_trace

MODEL = "demo-e32"
FULL = dict(per_domain=64, prompt_tokens=64, new_tokens=32, requests=2000,
            prefill_devices=8, decoders=8, decoder_devices=2, table_samples=60)
QUICK = dict(per_domain=2, prompt_tokens=32, new_tokens=8, requests=200,
             prefill_devices=8, decoders=4, decoder_devices=2, table_samples=15)
PROMPT_TOKENS = (128, 1024)
"""Prompt lengths, uniform (MODELLED: chat-style prompts; no trace here has Qwen-scale
prompts, and the prompt only sets prefill work and KV length)."""
PREFILL_TOKENS_PER_DEVICE = 16384
"""Prompt tokens per device per prefill batch: the batch of docs/PERF.md's measured
resident/offload prefill runs of Qwen3-30B-A3B-shaped layers on the H100."""
MAX_BATCH = 64
"""Running requests per decoder (MODELLED; the ELDR benchmark's simulated decoders run at
most 4 × its batch of 8 = 32, the H100 cost file's fit spans up to 64 tokens)."""
TABLE_BATCHES = (1, 2, 4, 8, 16, 32, 64)
"""Batch sizes of the drawn steps behind the activation tables (up to MAX_BATCH)."""
LOAD = 0.7
"""The loaded run's arrival rate as a fraction of the baseline's saturated request rate
(MODELLED: a busy but not saturated service)."""
QUICK_CONFIGS = (pl.Techniques(), *(pl.Techniques.of([t]) for t in pl.TECHNIQUES),
                 pl.Techniques.of(["async_ep", "eldr", "metro"]),
                 pl.Techniques.of(list(pl.TECHNIQUES)))


def key_name(techniques: pl.Techniques) -> str:
    return techniques.name.replace("+", "_plus_")


def headline(throughput: dict[str, float]) -> dict[str, Any]:
    """The ratios of the module docstring from throughput by config name."""
    base = throughput[pl.BASELINE]
    singles = {t: throughput[pl.Techniques.of([t]).name] for t in pl.TECHNIQUES}
    best = max(singles, key=singles.get)
    full = throughput[pl.Techniques.of(list(pl.TECHNIQUES)).name]
    resident = throughput[pl.Techniques.of(["async_ep", "eldr", "metro"]).name]
    out: dict[str, Any] = {f"{t}_over_baseline_modelled_h100": v / base
                           for t, v in singles.items()}
    out.update(best_single_technique=best,
               composed_over_best_single_modelled_h100=full / singles[best],
               composed_resident_over_best_single_modelled_h100=resident / singles[best],
               composed_over_baseline_modelled_h100=full / base,
               composed_resident_over_baseline_modelled_h100=resident / base,
               composed_over_offload_prefetch_modelled_h100=full / singles["offload_prefetch"])
    return out


def run_model(trace: Any, shape: dict[str, Any], configs: Sequence[pl.Techniques],
              fit: hardware.ExpertFit, seed: int) -> dict[str, Any]:
    """Every configuration's figures on one trace under the H100 expert fit ``fit``."""
    requests = requests_of_trace(trace, QWEN3_30B_A3B)
    calib, pool = requests[0::2], requests[1::2]
    deployment = pl.Deployment(
        prefill_devices=shape["prefill_devices"],
        prefill_tokens_per_device=PREFILL_TOKENS_PER_DEVICE, num_decoders=shape["decoders"],
        decoder_devices=shape["decoder_devices"], max_batch_size=MAX_BATCH)
    calibration = pl.calibrate(calib, deployment, model=trace.model,
                               batch_sizes=TABLE_BATCHES, samples=shape["table_samples"],
                               seed=seed)
    n = shape["requests"]
    saturated = pl.draw_workload(pool, n, PROMPT_TOKENS, np.zeros(n), seed)
    runs = {c.name: pl.run_pipeline(c, deployment, QWEN3_30B_A3B, fit, calibration, saturated)
            for c in configs}
    base = runs[pl.BASELINE]
    rate = LOAD * n / base.makespan_s
    loaded = pl.Workload(saturated.requests, saturated.prompt_tokens,
                         poisson_arrivals(n, rate, seed))
    out: dict[str, Any] = {"devices": deployment.devices, "loaded_rate_per_s": rate}
    throughput = {}
    for config in configs:
        name, key = config.name, key_name(config)
        at_load = pl.run_pipeline(config, deployment, QWEN3_30B_A3B, fit, calibration, loaded)
        throughput[name] = runs[name].throughput_tokens_per_s
        out[f"{key}_throughput_tokens_per_s"] = throughput[name]
        out[f"{key}_ttft_p50_ms"] = 1e3 * at_load.ttft_p50_s
        out[f"{key}_tpot_p50_ms"] = 1e3 * at_load.tpot_p50_s
        out[f"{key}_mean_active_experts"] = at_load.decode.mean_active_experts
        print(f"[{trace.model}] {name:38s} {throughput[name]:9.0f} tok/s   at load: TTFT p50 "
              f"{out[f'{key}_ttft_p50_ms']:8.1f} ms  TPOT p50 {out[f'{key}_tpot_p50_ms']:7.1f}"
              f" ms  active/layer {out[f'{key}_mean_active_experts']:5.1f}")
    out.update(headline(throughput))
    tables = calibration.tables
    for router, table in tables.items():
        for union in (8, 32, 64, 128):
            out[f"{router}_max_activated_at_union{union}"] = table.at(union)[0]
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="small traces (2 requests per domain), 200 "
                          "requests, 4 decoders, the 7 headline configurations", traces=True)
    parser.add_argument("--requests", type=int, help="workload requests (default 2000)")
    # --quick traces the trained model into memory unless --traces names a folder.
    default_traces = parser.get_default("traces")
    parser.set_defaults(traces=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, ("requests",))
    configs = QUICK_CONFIGS if args.quick else tuple(pl.every_combination())
    started = time.perf_counter()
    fit = hardware.ExpertFit.from_file()
    figures: dict[str, Any] = {
        "model": MODEL, "shape": "qwen3-30b-a3b", "quick": int(args.quick),
        "fit": costs.H100_FIT, "fit_t0_us": 1e6 * fit.t0_s, "fit_a_us": 1e6 * fit.a_s,
        "fit_b_us": 1e6 * fit.b_s, "h2d_gbps": costs.H100_H2D_BPS / 1e9,
        "prompt_tokens_min": PROMPT_TOKENS[0], "prompt_tokens_max": PROMPT_TOKENS[1],
        "max_batch": MAX_BATCH, "load": LOAD, "replication": hardware.EPLB_REPLICATION,
        **{f"shape_{k}": v for k, v in shape.items()}}
    if args.quick and args.traces is None:
        # demo-e32 alone (no twin: the quick run stays under a minute)
        traces = {"": model_trace(MODEL, per_domain=shape["per_domain"],
                                  prompt_tokens=shape["prompt_tokens"],
                                  new_tokens=shape["new_tokens"], seed=args.seed)}
    else:
        traces = reference_traces(MODEL, args.traces or default_traces, shape, args.seed)
    for suffix, trace in traces.items():
        for key, value in run_model(trace, shape, configs, fit, args.seed).items():
            figures[f"{key}{suffix}"] = value
    figures["seconds"] = time.perf_counter() - started
    for suffix in traces:
        print(f"\ncomposed / best single{suffix} ({figures['best_single_technique' + suffix]}): "
              f"{figures['composed_over_best_single_modelled_h100' + suffix]:.3f} (all four), "
              f"{figures['composed_resident_over_best_single_modelled_h100' + suffix]:.3f} "
              f"(resident: async_ep + eldr + metro)")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

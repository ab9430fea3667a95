"""Expert-parallel decode on demo-e32 (issue 19): METRO token routing at every decode step.

Inputs: the reference traces of ``benchmarks/expert_traces.py`` (``--traces DIR``, written
there when missing; ``--quick`` writes small ones to a temporary folder): demo-e32, its
untrained twin ``demo-e32-init``, and a noise floor (uniform random top-k). Even requests
give each layer's expert load, from which EPLB places the replicas
(``kernels_pallas.metro.eplb_placement``); odd requests' decode tokens are routed.

**Quality.** For G devices (4, 8), replication r (1.0, 1.25, 1.5: round(r·E) replica
slots) and T decode tokens per device (8..64), each instance draws G·T decode tokens of
one layer (every layer, ``--instances`` draws each) and routes them with the routers the
sync_ep decode step runs (``route_metro_jax(impl="jax")`` and ``route_eplb_even``) and
with the optimum (max-flow, ``route_optimal``). The figure is the largest number of
activated expert replicas on any device (decode is memory-bound: a device's expert time
grows with the experts it activates). Per configuration the mean over instances of
the per-instance ratios; headline keys average the replicated configurations (r > 1;
at r = 1 every expert has one home and every router is the same):

* ``metro_over_eplb_even_active_decode`` (seed: up to 42.3 % fewer) and
  ``metro_over_optimal_decode`` (seed: within 10.9 %), with ``_twin`` and ``_uniform``;
  per configuration ``..._g<G>_x<r>_t<T>``.
* ``metro_tpot_reduction_modelled``: 1 − (METRO / EPLB-even) of the modelled MoE time of
  a decode step: per layer t0 + max over devices (a · activated + b · rows) from the H100
  cost file's ``fused_tiles_given`` fit (Qwen3-30B-A3B-shaped experts), plus the
  all-to-all of the largest device's received rows (d = 2048, bf16, both ways) at
  ``--link-gbps`` (default 450 GB/s, an NVLink 4 datasheet figure, not measured here).

**Router cost.** ``metro_router_us_per_layer``: the router one sync_ep decode layer runs
(``route_metro_jax(impl="jax")`` on the all-gathered per-expert counts), timed in-graph
(a jitted loop of ``ROUTER_REPEATS`` calls on different counts, divided by the count,
so no dispatch is in it), for demo-e32 (E = 32) at 4 and 8 devices and for 128 × 8 and
256 × 16; ``metro_router_dispatch_us``: one jitted call timed from the host.

**Real decode.** demo-e32 through ``sync_ep`` decode on 4 CPU devices, replicas 1.5,
router metro and eplb_even, and no replicas: ``tokens_equal_across_routers`` (greedy f32),
``overflow_steps`` (a decode step's dispatch buffers are sized to the worst case: must
be 0; decode never re-runs a step), ``step_ms_<router>`` and
``metro_step_overhead_us_per_layer`` ((METRO − EPLB-even) / L, CPU wall).

**AsyncMoE, simulated** (``benchmarks/asyncmoe_sim.py``): μ-queue decode under each
scheduler against synchronous EP, on the cost tables of ``benchmarks/asyncmoe_cost.py``
(``--tables``, default the committed CPU tables of demo-e32): throughput at an ITL bound,
``mu_queue_throughput_over_sync_ep``, ``defrag_over_most_tokens``,
``defrag_over_first_layer`` (demo-e32's traced routing, 4 devices; every source and
device count under longer keys), batch sizes, stalls, queue depth, completion rate, and
the defrag scheduler's δ / lookahead sweep. The real μ-queue runtime on CPU devices:
``mu_queue_real_over_decode_runtime_tokens_per_s`` (its wall tokens/s over the decode
runtime's, same requests, one run) and ``..._per_token`` (the former per-token transport).

    python -m benchmarks.ep_decode [--quick] [--json PATH] [--traces DIR] [--instances N]
        [--link-gbps 450] [--tables PATH] [--seed N]
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks import asyncmoe_sim
from benchmarks.lib.cli import REPO_ROOT, bench_parser, parse_args, run_shape
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run
from benchmarks.lib.reference_traces import reference_traces
from benchmarks.lib.timing import median, median_seconds
from moejax.asyncmoe import costs
from moejax.model_shape import QWEN3_30B_A3B

HOST_DEVICES = 8        # the real runs need several CPU devices
MODEL = "demo-e32"
FULL = dict(per_domain=64, prompt_tokens=64, new_tokens=32, devices=(4, 8),
            replication=(1.0, 1.25, 1.5), tokens=(8, 16, 32, 64), instances=24,
            real_requests=16, real_new_tokens=16,
            sim_devices=(4, 8), sim_sources=("trace", "twin", "skewed", "uniform"),
            rate_fractions=(0.1, 0.25, 0.5, 1.0, 2.0), sim_requests=64,
            sweep_deltas=(0.25, 0.5, 0.75, 1.0), sweep_lookaheads=(1, 2, 4))
QUICK = dict(per_domain=2, prompt_tokens=32, new_tokens=8, devices=(4,),
             replication=(1.0, 1.5), tokens=(8, 32), instances=3,
             real_requests=4, real_new_tokens=4,
             sim_devices=(4,), sim_sources=("trace", "uniform"), rate_fractions=(0.5, 1.0),
             sim_requests=12, sweep_deltas=(0.5,), sweep_lookaheads=(1, 2))
CPU_TABLES = REPO_ROOT / "benchmarks" / "data" / "asyncmoe_cost_cpu_demo-e32.json"
GPU_COST = Path(costs.H100_FIT_FILE)
GPU_FIT = "fused_tiles_given"
ROUTER_REPEATS = 64
ROUTER_TIMINGS = 30        # timed calls per figure (median)
ROUTER_SHAPES = ((32, 4), (32, 8), (128, 8), (256, 16))     # (experts, devices)
REAL_DEVICES = 4
REAL_REPLICAS = 1.5


# ----------------------------------------------------------------------------- inputs
def decode_pools(trace: Any) -> tuple[np.ndarray, list[np.ndarray]]:
    """(per-layer load [L, E] of the even requests' decode tokens, per layer the odd
    requests' decode top-k ids [N, k])."""
    requests = [r for r in trace.requests if r.ok]
    calib = np.concatenate([r.decode_experts for r in requests[0::2]], axis=1)
    evaluate = np.concatenate([r.decode_experts for r in requests[1::2]], axis=1)
    load = np.stack([np.bincount(calib[l].ravel(), minlength=trace.num_experts)
                     for l in range(trace.num_layers)]).astype(np.float64)
    return load, [evaluate[l] for l in range(trace.num_layers)]


def uniform_pools(num_layers: int, num_experts: int, k: int, tokens: int, seed: int
                  ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The noise floor: k distinct uniformly random experts per token, uniform load."""
    rng = np.random.default_rng(seed)
    pools = [np.argsort(rng.random((tokens, num_experts)), axis=1)[:, :k]
             for _ in range(num_layers)]
    return np.ones((num_layers, num_experts)), pools


# ----------------------------------------------------------------------------- quality
def route_instance(placement: np.ndarray, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Per router, the tokens of each expert on each device [E, G] for one batch."""
    import jax.numpy as jnp

    from kernels_pallas import metro

    num_experts, num_devices = placement.shape
    counts = metro.tokens_per_expert(ids, num_experts)
    chosen = np.asarray(metro.route_metro_jax(jnp.asarray(placement), jnp.asarray(counts),
                                              impl="jax")).astype(np.int64)
    return {"eplb_even": metro.route_eplb_even(placement, counts),
            "metro": metro.routed_tokens(chosen, counts, num_devices),
            "optimal": metro.routed_tokens(metro.route_optimal(placement, counts), counts,
                                           num_devices)}


def moe_seconds(expert_tokens: np.ndarray, fit: dict[str, float], link_bps: float) -> float:
    """Modelled MoE time of one layer: t0 + the slowest device's a·activated + b·rows,
    plus the all-to-all of the most rows any device receives (both ways)."""
    activated = (expert_tokens > 0).sum(axis=0)
    rows = expert_tokens.sum(axis=0)
    compute = fit["t0_s"] + float(np.max(fit["a_s"] * activated + fit["b_s"] * rows))
    row_bytes = QWEN3_30B_A3B.hidden_size * QWEN3_30B_A3B.dtype_bytes
    return compute + 2 * float(rows.max()) * row_bytes / link_bps


def quality_figures(load: np.ndarray, pools: list[np.ndarray], shape: dict[str, Any],
                    fit: dict[str, float], link_bps: float, seed: int) -> dict[str, float]:
    """Ratios per configuration and the headline means (module docstring)."""
    from kernels_pallas import metro

    rng = np.random.default_rng(seed)
    num_layers, num_experts = load.shape
    out: dict[str, float] = {}
    headline: dict[str, list[float]] = {"over_eplb": [], "over_optimal": [], "tpot": []}
    for devices in shape["devices"]:
        for repl in shape["replication"]:
            replicas = int(round(repl * num_experts))
            placements = [metro.eplb_placement(load[l] + 1e-9, devices, replicas)
                          for l in range(num_layers)]
            for per_device in shape["tokens"]:
                over_eplb, over_opt, seconds = [], [], {"metro": 0.0, "eplb_even": 0.0}
                for layer in range(num_layers):
                    pool = pools[layer]
                    for _ in range(shape["instances"]):
                        wanted = devices * per_device     # with replacement only if too few
                        ids = pool[rng.choice(len(pool), wanted, replace=wanted > len(pool))]
                        routed = route_instance(placements[layer], ids)
                        peak = {k: int(metro.activated_per_device(v).max())
                                for k, v in routed.items()}
                        over_eplb.append(peak["metro"] / peak["eplb_even"])
                        over_opt.append(peak["metro"] / peak["optimal"])
                        for router in seconds:
                            seconds[router] += moe_seconds(routed[router], fit, link_bps)
                tag = f"g{devices}_x{repl:g}_t{per_device}"
                out[f"metro_over_eplb_even_active_decode_{tag}"] = float(np.mean(over_eplb))
                out[f"metro_over_optimal_decode_{tag}"] = float(np.mean(over_opt))
                reduction = 1.0 - seconds["metro"] / seconds["eplb_even"]
                out[f"metro_tpot_reduction_modelled_{tag}"] = reduction
                if repl > 1.0:
                    headline["over_eplb"] += over_eplb
                    headline["over_optimal"] += over_opt
                    headline["tpot"].append(reduction)
    out["metro_over_eplb_even_active_decode"] = float(np.mean(headline["over_eplb"]))
    out["metro_over_optimal_decode"] = float(np.mean(headline["over_optimal"]))
    out["metro_tpot_reduction_modelled"] = float(np.mean(headline["tpot"]))
    return out


# ----------------------------------------------------------------------------- router cost
def router_costs(seed: int) -> dict[str, float]:
    """In-graph and dispatch time of the decode layer's METRO router (module docstring)."""
    import jax
    import jax.numpy as jnp

    from kernels_pallas import metro

    rng = np.random.default_rng(seed)
    out: dict[str, float] = {}
    for experts, devices in ROUTER_SHAPES:
        placement = jnp.asarray(metro.eplb_placement(np.ones(experts), devices,
                                                     int(1.5 * experts)))
        counts = jnp.asarray(rng.integers(0, 3, (ROUTER_REPEATS, experts)), jnp.int32)

        @jax.jit
        def repeated(placement, counts):
            def body(i, acc):
                return acc + metro.route_metro_jax(placement, counts[i], impl="jax").sum()
            return jax.lax.fori_loop(0, counts.shape[0], body, jnp.int32(0))

        one = jax.jit(lambda p, c: metro.route_metro_jax(p, c, impl="jax"))
        loop_s = median_seconds(lambda: repeated(placement, counts).block_until_ready(),
                                ROUTER_TIMINGS, label=f"router_loop_e{experts}_g{devices}")
        call_s = median_seconds(lambda: one(placement, counts[0]).block_until_ready(),
                                ROUTER_TIMINGS, label=f"router_call_e{experts}_g{devices}")
        out[f"metro_router_us_per_layer_e{experts}_g{devices}"] = 1e6 * loop_s / ROUTER_REPEATS
        out[f"metro_router_dispatch_us_e{experts}_g{devices}"] = 1e6 * call_s
    out["metro_router_us_per_layer"] = out["metro_router_us_per_layer_e32_g4"]
    out["metro_router_dispatch_us"] = out["metro_router_dispatch_us_e32_g4"]
    return out


# ----------------------------------------------------------------------------- real decode
def real_decode(trace: Any, shape: dict[str, Any]) -> dict[str, Any]:
    """demo-e32 through sync_ep decode on 4 CPU devices under each router."""
    from moejax.decode.programs import StepOptions
    from moejax.decode.factory import make_runner
    from moejax.sequences import SequenceSpec
    from moejax.prefetch.train import load_model
    from moejax.core.continuous import Scheduler, SchedulerOptions

    cfg, params = load_model(MODEL)
    prompts = [tuple(int(t) for t in r.prompt_token_ids)
               for r in trace.requests[1::2][:shape["real_requests"]]]
    out: dict[str, Any] = {}
    tokens: dict[str, list] = {}
    overflow = 0
    for name, options in (("metro", {"replicas": REAL_REPLICAS, "router": "metro"}),
                          ("eplb_even", {"replicas": REAL_REPLICAS, "router": "eplb_even"}),
                          ("no_replicas", {})):
        runner = make_runner("sync_ep", cfg, params, dtype="float32", opts=StepOptions(),
                             devices=REAL_DEVICES, **options)
        times = []
        for repeat in range(2):      # the first pass compiles
            scheduler = Scheduler(runner, 64, SchedulerOptions(
                max_batch_size=len(prompts) // REAL_DEVICES or 1, max_prefill_tokens=256,
                record_steps=True))
            seqs = [scheduler.submit(SequenceSpec(prompt=p, max_new_tokens=shape["real_new_tokens"]))
                    for p in prompts]
            if repeat:
                with timed_pass(f"decode_{name}"):
                    scheduler.run_until_idle()
            else:
                scheduler.run_until_idle()
            times = [r.seconds for r in scheduler.step_records
                     if r.prefill_sequences == 0 and r.decode_sequences > 0]
        tokens[name] = [list(s.output.token_ids) for s in seqs]
        overflow += runner.overflow_steps
        out[f"step_ms_{name}"] = 1000 * median(times)
    out["tokens_equal_across_routers"] = int(tokens["metro"] == tokens["eplb_even"]
                                             == tokens["no_replicas"])
    out["overflow_steps"] = overflow
    out["metro_step_overhead_us_per_layer"] = 1000 * (out["step_ms_metro"]
                                                      - out["step_ms_eplb_even"]) / cfg.num_layers
    return out


# ----------------------------------------------------------------------------- driver
def cost_tables(path: str) -> Any:
    """The simulator's cost tables from ``path``, or measured now (quick grid)."""
    from benchmarks import asyncmoe_cost
    from moejax.asyncmoe.simulator import CostTables

    if os.path.isfile(path):
        return CostTables.from_dict(json.loads(Path(path).read_text()))
    print(f"no cost tables at {path}: measuring a quick grid")
    return CostTables.from_dict(asyncmoe_cost.measure(MODEL, asyncmoe_cost.QUICK))


def report(figures: dict[str, Any], shape: dict[str, Any]) -> None:
    print("\nMETRO / EPLB-even, max activated replicas per device (METRO / optimal), decode:")
    for suffix, label in (("", MODEL), ("_twin", f"{MODEL}-init (twin)"),
                          ("_uniform", "uniform routing (noise floor)")):
        print(f"  {label}")
        for devices in shape["devices"]:
            for repl in shape["replication"]:
                cells = []
                for t in shape["tokens"]:
                    tag = f"g{devices}_x{repl:g}_t{t}"
                    cells.append(f"t{t} {figures[f'metro_over_eplb_even_active_decode_{tag}{suffix}']:.3f}"
                                 f" ({figures[f'metro_over_optimal_decode_{tag}{suffix}']:.3f})")
                print(f"    G={devices} x{repl:<4g} " + "  ".join(cells))
        print(f"    mean over r > 1: {figures[f'metro_over_eplb_even_active_decode{suffix}']:.3f} "
              f"(optimal {figures[f'metro_over_optimal_decode{suffix}']:.3f}); modelled MoE "
              f"time reduction {figures[f'metro_tpot_reduction_modelled{suffix}']:.1%}")
    print("router per layer in-graph / one dispatched call (us): " + ", ".join(
        f"E{e}xG{g} {figures[f'metro_router_us_per_layer_e{e}_g{g}']:.1f} / "
        f"{figures[f'metro_router_dispatch_us_e{e}_g{g}']:.1f}" for e, g in ROUTER_SHAPES))
    print(f"real sync_ep decode on {REAL_DEVICES} CPU devices: tokens equal across routers "
          f"{bool(figures['tokens_equal_across_routers'])}, overflow steps "
          f"{figures['overflow_steps']}, step ms metro {figures['step_ms_metro']:.2f} / "
          f"eplb_even {figures['step_ms_eplb_even']:.2f} / no replicas "
          f"{figures['step_ms_no_replicas']:.2f}; {figures['seconds']:.0f} s")


def mu_queue_over_decode(figures: dict[str, Any], cfg: Any, params: Any,
                         prompts: list[tuple[int, ...]], new_tokens: int) -> dict[str, float]:
    """``mu_queue_real_over_decode_runtime_tokens_per_s``: the real μ-queue runtime's
    (defrag, batched transport) wall tokens/s over the decode runtime's (the continuous
    Scheduler on the resident backend), both measured by ``real_runtime_figures`` on the
    same requests; ``..._per_token``: the same with the former per-token transport
    (``transport="per_token"``), timed here after a compiling pass."""
    import jax

    from moejax.asyncmoe.runtime import MuQueueRuntime
    from moejax.sequences import SequenceSpec

    from benchmarks.lib.timing import timed_call

    specs = [SequenceSpec(prompt=p, max_new_tokens=new_tokens) for p in prompts]
    arrivals = [asyncmoe_sim.REAL_ARRIVAL_GAP * i for i in range(len(specs))]
    runtime = MuQueueRuntime(cfg, params, jax.devices()[:asyncmoe_sim.REAL_DEVICES],
                             scheduler="defrag", transport="per_token")
    runtime.generate(specs, arrivals)                    # the first pass compiles
    seconds, outputs = timed_call(lambda: runtime.generate(specs, arrivals),
                                  label="mu_queue_defrag_per_token")
    decode = figures["decode_runtime_wall_tokens_per_s"]
    per_token = sum(len(o.token_ids) for o in outputs) / seconds
    return {"mu_queue_real_over_decode_runtime_tokens_per_s":
                figures["mu_queue_wall_tokens_per_s"] / decode,
            "mu_queue_wall_tokens_per_s_per_token_transport": per_token,
            "mu_queue_real_over_decode_runtime_tokens_per_s_per_token": per_token / decode}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="small traces, 4 devices, r 1.0 and 1.5, 8 and 32 "
                          "tokens per device, 3 instances per layer", traces=True)
    parser.add_argument("--instances", type=int, help="draws per layer and configuration")
    parser.add_argument("--link-gbps", type=float, default=450.0,
                        help="modelled all-to-all link, GB/s per device (default 450)")
    parser.add_argument("--tables", default=str(CPU_TABLES),
                        help="AsyncMoE simulator cost tables (benchmarks/asyncmoe_cost.py; "
                             "measured here, quickly, when the file is missing)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv, host_devices=HOST_DEVICES)
    shape = run_shape(args, QUICK, FULL, ("instances",))
    fit = json.loads(GPU_COST.read_text())["fits"][GPU_FIT]
    started = time.perf_counter()
    figures: dict[str, Any] = {"model": MODEL, "quick": int(args.quick), "gpu_fit": GPU_FIT,
                               "link_gbps": args.link_gbps}
    with tempfile.TemporaryDirectory(prefix="moejax-ep-decode-") as tmp:
        traces = reference_traces(MODEL, tmp if args.quick else args.traces, shape, args.seed)
        trace = traces[""]
        sources = {suffix: decode_pools(t) for suffix, t in traces.items()}
        sources["_uniform"] = uniform_pools(trace.num_layers, trace.num_experts, trace.top_k,
                                            len(sources[""][1][0]), args.seed)
        for suffix, (load, pools) in sources.items():
            for key, value in quality_figures(load, pools, shape, fit, args.link_gbps * 1e9,
                                              args.seed).items():
                figures[f"{key}{suffix}"] = value
        figures.update(router_costs(args.seed))
        figures.update(real_decode(trace, shape))
        from moejax.prefetch.train import load_model
        cfg, params = load_model(MODEL)
        figures.update(asyncmoe_sim.simulation_figures(traces, cost_tables(args.tables), cfg,
                                                       shape, args.seed))
        prompts = [tuple(int(t) for t in r.prompt_token_ids)
                   for r in trace.requests[1::2][:shape["real_requests"]]]
        figures.update(asyncmoe_sim.real_runtime_figures(cfg, params, prompts,
                                                         shape["real_new_tokens"]))
        figures.update(mu_queue_over_decode(figures, cfg, params, prompts,
                                            shape["real_new_tokens"]))
    figures["seconds"] = time.perf_counter() - started
    report(figures, shape)
    asyncmoe_sim.report(figures, shape)
    print(f"real μ-queue runtime over the decode runtime, wall tokens/s: batched transport "
          f"{figures['mu_queue_real_over_decode_runtime_tokens_per_s']:.3f}, per-token "
          f"transport {figures['mu_queue_real_over_decode_runtime_tokens_per_s_per_token']:.3f}")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

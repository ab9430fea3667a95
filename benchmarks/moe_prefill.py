"""MoE-Prefill's evaluation (the seed ``moe-prefill-asyncep.txt``, §8): the whole system
against the paper's baselines, per parallel degree, on the paper's workloads.

Systems (the paper's names), each a ``serving.Scorer`` over ``degree`` devices of the
built-in demo model in float32:

* ``DP+EP``   -- ``sync_ep`` (data-parallel attention, two all-to-alls per MoE layer);
* ``DP+TP``   -- ``dp_tp`` (data-parallel attention, experts split on f: an all-gather
  and a reduce-scatter of the rows per MoE layer);
* ``TP+EP``   -- ``tp_ep`` (heads split, each device owning whole experts; two
  all-reduces per layer);
* ``TP+TP``   -- ``tp`` (heads and expert columns split; two all-reduces);
* ``PP+PP``   -- ``pp`` (layer stages, a step's batches its micro-batches);
* ``PrefillOnly`` -- PrefillOnly's shortest-prefill-first scheduler as the router
  (``routing="prefill_only"``) over ``degree`` one-device engines with the prefix cache,
  at a batch matched to ours; ``PrefillOnly-1`` -- the same at ``max_num_seqs=1`` (each
  engine runs one sequence at a time, the paper's other setting);
* ``{baseline}/PrefillOnly`` for each of the five parallel baselines -- that group as one
  engine under PrefillOnly's scheduler (its ops shortest prefill first; the groups hold
  no prefix pool, so the router prices every op at its full FLOPs), at our batch size;
* ``AsyncEP-plain`` -- DP+AsyncEP (``async_ep``) under a plain scheduler: no prefix pool,
  the packer feeds the ranks;
* ``MoE-Prefill`` -- DP+AsyncEP whose ranks each hold a prefix pool under the
  prefix/FLOP/Θ router (``async_ep`` with ``prefix_cache_blocks``);
* ``MoE-Prefill-hybrid`` -- the same with the expert shards streamed from host memory
  (``hybrid``; ``offload`` at degree 1): where memory is the limit.

A cell a system cannot run at a degree (``tp``/``tp_ep`` split attention heads: the
demo's 2 kv heads allow degrees 1 and 2; ``pp`` needs a layer per stage: up to 4) is
recorded as ``null`` with its reason under ``skipped``.

Workloads (``benchmarks/workloads.py``, token-id requests): ``mix`` -- the aggregated
Table-2 mix; ``no_sharing`` -- pairwise unshared prompts of several lengths (the context
regimes scaled to the demo's context); ``high_share`` -- QuALITY-shaped documents with
many questions each.

Every system packs batches of at most ``--batch-tokens`` tokens (default 4,096, the
Scorer's). The rank router's Θ is at least one such batch, so the batch size sets
MoE-Prefill's trade between keeping a prefix group on one rank (FLOPs over ideal) and
spreading a small call over the ranks (the straggler factor): ``docs/PERF.md`` "Issue
39" has both.

Per cell (workload, system, degree), after one warm-up pass that compiles every shape,
``--repeats`` cold passes (prefix caches and routers reset first), the median kept:

* ``tokens_per_s`` -- prompt tokens of all prefill ops / wall seconds;
* ``flops_over_ideal`` -- FLOPs the engines executed (``EngineStats.executed_flops``) over
  the ideal (every distinct prefix once, ``benchmarks.prefill_serving.ideal_flops``);
* ``hit_rate`` -- 1 - tokens run / prompt tokens (prefix KV read instead of computed);
* ``peak_memory_per_device`` -- weight bytes per device (``Backend.memory_report``: dense
  + experts held) plus the prefix pool's bytes per device;
* ``straggler`` -- ranks x the busiest rank's tokens / all ranks' tokens, summed over
  steps (1 = balanced; ``EngineStats.rank_step_*``);
* ``critical_bytes_per_layer`` / ``background_bytes_per_layer`` -- bytes one device moves
  per layer in a step of ``--count-tokens`` tokens per rank, counted from the compiled
  programs (``Backend.step_traffic``, ``moejax.program_traffic``), and
  ``counted_over_formula``, their sum over Table 1's formula for the same shape;
* ``over_best_baseline`` -- throughput over the best of the baselines (DP+EP, DP+TP,
  TP+EP, TP+TP, PP+PP, each also under PrefillOnly's scheduler, and PrefillOnly) at that
  degree.

Table 1 in figures (``table1``): per device per layer, the bytes each strategy moves on
the critical path and in the background (overlapped), and the weight bytes it holds,
from the strategies' communication patterns (the paper's formulas) on a
Qwen3-235B-A22B-shaped config and on the demo, for a batch of ``--table-tokens`` tokens
per data-parallel rank (no weights needed). They are formulas; each cell's
``counted_over_formula`` holds them to the demo's compiled programs (DP+AsyncEP: (L-1)/L,
layer 0 being held whole; DP+EP above 1, its all-to-all buffers padded to a capacity).

On CPU, collectives are synchronous and the host devices share the machine's cores:
throughput ratios between strategies are not evidence of what a GPU cluster does. The
deterministic figures (FLOPs over ideal, hit rates, memory, stragglers, Table 1) are;
throughput ratios count only from GPUs.

    python -m benchmarks.moe_prefill [--quick] [--json PATH] [--degrees 1,2,4,8]
        [--systems ...] [--workloads mix,no_sharing,high_share] [--requests N] [--repeats N]

JSON keys (flat): ``moe_prefill_over_best_baseline_mix_{degree}``,
``frontend_gain_over_asyncep_plain_{degree}``, ``flops_over_ideal_mix_{degree}``,
``prefix_hit_rate_mix_{degree}``, ``critical_path_bytes_per_layer_{strategy}``,
``background_bytes_per_layer_{strategy}``, ``peak_memory_per_device_{strategy}`` (the
Qwen3-235B-shaped Table 1, strategy names lower-case with ``+`` as ``_``), and per cell
``{workload}_{system}_{degree}_{figure}``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Mapping, Sequence

from benchmarks.lib import cli
from benchmarks.lib.meta import finish_run
from benchmarks.lib.timing import median, timed_call
from benchmarks.prefill_serving import ideal_flops, release_programs
from moejax.config import ModelConfig

HOST_DEVICES = 8
PARALLEL = ("DP+EP", "DP+TP", "TP+EP", "TP+TP", "PP+PP")
SCHEDULED = tuple(f"{b}/PrefillOnly" for b in PARALLEL)
BASELINES = (*PARALLEL, *SCHEDULED, "PrefillOnly")
SYSTEMS = (*BASELINES, "PrefillOnly-1", "AsyncEP-plain", "MoE-Prefill", "MoE-Prefill-hybrid")

FULL = dict(degrees=(1, 2, 4, 8), workloads=("mix", "no_sharing", "high_share"),
            requests=96, scale=0.15, sweep_lengths=(64, 256, 1024, 2000), sweep_requests=4,
            repeats=3, prefix_blocks=256, systems=SYSTEMS)
QUICK = dict(degrees=(2,), workloads=("mix",), requests=32, scale=0.15,
             sweep_lengths=(64, 256), sweep_requests=2, repeats=1, prefix_blocks=128,
             systems=("DP+EP", "PrefillOnly", "AsyncEP-plain", "MoE-Prefill"))
TABLE_TOKENS = 8192
COUNT_TOKENS = 512           # per rank, for the counted bytes (the demo)
BATCH_TOKENS = 4096          # the Scorer's default

# Qwen3-235B-A22B's shape (config.json of the release): the Table 1 model.
QWEN3_235B = ModelConfig(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, num_layers=94,
    num_heads=64, num_kv_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    moe_intermediate_size=1536, norm_topk_prob=True, qk_norm=True, rms_norm_eps=1e-6,
    rope_theta=1_000_000.0, max_context=40960, tie_word_embeddings=False)


# ----------------------------------------------------------------------------- Table 1
@dataclasses.dataclass(frozen=True)
class LayerTraffic:
    """One strategy's bytes per device per layer: moved on the critical path, moved in
    the background (overlapped with compute), and the weights held (an average layer)."""

    critical: float
    background: float
    weights: float


def table1(cfg: ModelConfig, degree: int, tokens: int, itemsize: int = 2
           ) -> dict[str, LayerTraffic]:
    """The paper's Table 1 per device and layer, for ``tokens`` tokens per data-parallel
    rank (a tensor-parallel group runs the G ranks' tokens together: G·tokens) at
    ``degree`` G devices, weights and activations of ``itemsize`` bytes."""
    g, d, b = degree, cfg.hidden_size, itemsize
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    expert = 3 * d * cfg.moe_intermediate_size * b          # one expert's weights
    attention = (d * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                 + cfg.num_heads * cfg.head_dim * d) * b
    share = (g - 1) / g
    ring_all_reduce = 2 * share * g * tokens * d * b         # per device, one all-reduce
    return {
        # Two all-to-alls (dispatch, combine): k rows per token, (G-1)/G leave the device.
        "DP+EP": LayerTraffic(2 * share * tokens * k * d * b, 0.0,
                              attention + e * expert / g),
        # All-gather every rank's rows, reduce-scatter the outputs.
        "DP+TP": LayerTraffic(2 * (g - 1) * tokens * d * b, 0.0, attention + e * expert / g),
        # Two all-reduces of the group's G·tokens rows (attention out, MoE out).
        "TP+EP": LayerTraffic(2 * ring_all_reduce, 0.0, attention / g + e * expert / g),
        "TP+TP": LayerTraffic(2 * ring_all_reduce, 0.0, (attention + e * expert) / g),
        # A device holds L/G whole layers; each of the G micro-batches' rows cross the
        # G-1 stage boundaries once: (G-1)·tokens rows per device per step, over L layers.
        "PP+PP": LayerTraffic((g - 1) * tokens * d * b / cfg.num_layers, 0.0,
                              (attention + e * expert) / g),
        # The next layer's shards all-gathered under this layer's compute.
        "DP+AsyncEP": LayerTraffic(0.0, share * e * expert, attention + e * expert / g),
        # As AsyncEP, plus each device's shard copied in from host memory; it holds a
        # window of 2 shard layers and 2 gathered layers, whatever L.
        "hybrid": LayerTraffic(0.0, share * e * expert + e * expert / g,
                               attention + (2 * e * expert / g + 2 * e * expert)
                               / cfg.num_layers),
    }


# The Table 1 strategy each system runs (PrefillOnly's engines move nothing).
STRATEGY = {**{b: b for b in PARALLEL}, **{f"{b}/PrefillOnly": b for b in PARALLEL},
            "AsyncEP-plain": "DP+AsyncEP", "MoE-Prefill": "DP+AsyncEP",
            "MoE-Prefill-hybrid": "hybrid"}


def counted_traffic(scorer, tokens: int):
    """Bytes one device of ``scorer``'s first engine moves per layer in a step where every
    data-parallel rank runs one sequence of ``tokens`` tokens (a group with one rank, as
    TP's, runs the G ranks' tokens together), counted from the compiled programs
    (``Backend.step_traffic``) -> ``moejax.program_traffic.Traffic``."""
    import numpy as np

    from moejax.ops import PrefillOp
    from moejax.packing import BucketPolicy, pack

    engine = scorer.engine
    backend = engine.backend
    devices = len(backend.devices)
    length = tokens * (devices if backend.num_ranks == 1 else 1)
    op = PrefillOp(key=0, token_ids=np.arange(2, length + 2, dtype=np.int32) % 97 + 2,
                   score_positions=[length - 1], score_token_ids=[[1, 2]])
    policy = BucketPolicy(max_batch_tokens=length, min_block=engine.policy.min_block)
    (host,) = pack([op], policy, engine.options)
    traffic = backend.step_traffic([host.batch] * backend.num_ranks, host.options)
    return traffic.times(1 / scorer.config.num_layers)


def table1_figures(cfg: ModelConfig, degree: int, tokens: int, prefix: str = ""
                   ) -> dict[str, float]:
    out = {}
    for strategy, traffic in table1(cfg, degree, tokens).items():
        key = strategy.lower().replace("+", "_")
        out[f"{prefix}critical_path_bytes_per_layer_{key}"] = traffic.critical
        out[f"{prefix}background_bytes_per_layer_{key}"] = traffic.background
        out[f"{prefix}peak_memory_per_device_{key}"] = traffic.weights * cfg.num_layers
    return out


# ----------------------------------------------------------------------------- systems
def system_options(system: str, degree: int, blocks: int) -> dict[str, Any] | str:
    """The Scorer keywords of ``system`` at ``degree``, or why it cannot run there."""
    base, _, scheduler = system.partition("/")
    if base in ("TP+EP", "TP+TP") and degree > 2:
        return "heads: the demo's 2 kv heads split over at most 2 devices"
    if base == "PP+PP" and degree > 4:
        return "layers: the demo's 4 layers make at most 4 stages"
    plain = dict(devices=degree, share_prompts=False)
    cached = dict(prefix_cache_blocks=blocks)
    table: dict[str, dict[str, Any]] = {
        "DP+EP": dict(backend="sync_ep", **plain),
        "DP+TP": dict(backend="dp_tp", **plain),
        "TP+EP": dict(backend="tp_ep", **plain),
        "TP+TP": dict(backend="tp", **plain),
        "PP+PP": dict(backend="pp", **plain),
        "PrefillOnly": dict(engines=degree, routing="prefill_only", **cached),
        "PrefillOnly-1": dict(engines=degree, routing="prefill_only", max_num_seqs=1,
                              **cached),
        "AsyncEP-plain": dict(backend="async_ep", **plain),
        "MoE-Prefill": dict(backend="async_ep", devices=degree, **cached),
        "MoE-Prefill-hybrid": dict(backend="hybrid" if degree > 1 else "offload",
                                   devices=degree, **cached),
    }
    if scheduler:                    # the group as one engine, shortest prefill first
        return {**table[base], "routing": "prefill_only"}
    return table[system]


def build_scorer(system: str, options: Mapping[str, Any], model: str, batch_tokens: int):
    from serving import Scorer

    # The MoE-Prefill systems calibrate Θ (the transfer their ranks hide), as the paper's
    # frontend does; the others route by no Θ.
    return Scorer(model, dtype="float32", compilation_cache="auto",
                  max_batch_tokens=batch_tokens, calibrate=system.startswith("MoE-Prefill"),
                  **options)


# ----------------------------------------------------------------------------- passes
def _stats(scorer) -> dict[str, int]:
    out = {"flops": 0, "tokens": 0, "max": 0, "all": 0}
    for engine in scorer.engines:
        s = engine.stats
        out["flops"] += s.executed_flops
        out["tokens"] += s.real_tokens
        out["max"] += s.rank_step_max_tokens * engine.backend.num_ranks
        out["all"] += s.rank_step_tokens
    return out


def run_pass(scorer, requests: Sequence[Mapping[str, Any]], label: str | None
             ) -> dict[str, Any]:
    """One cold pass of the whole workload in one call."""
    scorer.reset_prefix_cache()
    before = _stats(scorer)
    results: list = []
    seconds, _ = timed_call(lambda: results.extend(scorer.score(list(requests),
                                                                progress=False)),
                            label=label)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    after = _stats(scorer)
    return {"seconds": seconds, **{k: after[k] - before[k] for k in after}}


def memory_per_device(scorer) -> int:
    """Weight bytes per device (dense + experts held) and the prefix pool's share."""
    engine = scorer.engine
    report = engine.backend.memory_report()
    pool = 0
    if engine.kv_store is not None:
        keys = engine.kv_store.pool
        pool = (keys.keys.nbytes + keys.values.nbytes) // max(1, engine.backend.num_ranks)
    return int(report.dense_weight_bytes + report.expert_weight_bytes + pool)


def bench_cell(scorer, requests, ideal: float, prompt_tokens: int, repeats: int,
               label: str) -> dict[str, Any]:
    run_pass(scorer, requests, None)                     # warm-up: compiles every shape
    passes = [run_pass(scorer, requests, label) for _ in range(repeats)]
    last = passes[-1]
    seconds = median([p["seconds"] for p in passes])
    return {"tokens_per_s": prompt_tokens / seconds, "seconds": seconds,
            "flops_over_ideal": last["flops"] / ideal,
            "hit_rate": 1 - last["tokens"] / prompt_tokens,
            "straggler": last["max"] / last["all"] if last["all"] else 1.0,
            "peak_memory_per_device": memory_per_device(scorer)}


def traffic_figures(scorer, system: str, degree: int, tokens: int, cfg: ModelConfig
                    ) -> dict[str, float | None]:
    """Counted bytes per device per layer (critical, background) at ``tokens`` tokens per
    rank, and the counted critical+background over Table 1's formula for the same shape
    (None where the formula is 0)."""
    traffic = counted_traffic(scorer, tokens)
    strategy = STRATEGY.get(system)
    formula = 0.0
    if strategy is not None:
        t = table1(cfg, degree, tokens, itemsize=scorer.engine.backend.dtype.itemsize)[strategy]
        formula = t.critical + t.background
    return {"critical_bytes_per_layer": traffic.critical,
            "background_bytes_per_layer": traffic.background,
            "counted_over_formula": traffic.total / formula if formula else None}


def build_workloads(shape: Mapping[str, Any], seed: int, cfg: ModelConfig
                    ) -> dict[str, list[dict[str, Any]]]:
    from benchmarks import workloads

    kw = dict(vocab_size=cfg.vocab_size, max_context=cfg.max_context, seed=seed)
    lengths = [min(n, cfg.max_context - 8) for n in shape["sweep_lengths"]]
    built = {
        "mix": lambda: workloads.aggregated(shape["requests"], scale=shape["scale"], **kw),
        "no_sharing": lambda: workloads.no_sharing_sweep(lengths, shape["sweep_requests"],
                                                         **kw),
        "high_share": lambda: workloads.generate("quality", shape["requests"],
                                                 scale=shape["scale"], **kw),
    }
    return {name: built[name]() for name in shape["workloads"]}


def workload_ops(requests, scorer) -> list:
    from serving.requests import normalize_requests

    cfg = scorer.config
    ops, errors, _ = normalize_requests(requests, scorer.tokenizer, vocab_size=cfg.vocab_size,
                                        max_context=cfg.max_context,
                                        options=scorer.normalize_options)
    if errors:
        raise RuntimeError(f"{len(errors)} requests refused, e.g. "
                           f"{next(iter(errors.values()))}")
    return ops


def headline(cells: Mapping[tuple[str, str, int], Mapping[str, Any] | None],
             degrees: Sequence[int]) -> dict[str, Any]:
    """The issue's keys from the cells (None where a cell did not run)."""
    out: dict[str, Any] = {}
    for degree in degrees:
        def tps(system: str, workload: str = "mix") -> float | None:
            cell = cells.get((workload, system, degree))
            return None if cell is None else cell["tokens_per_s"]

        best = max((t for t in map(tps, BASELINES) if t is not None), default=None)
        ours, plain = tps("MoE-Prefill"), tps("AsyncEP-plain")
        out[f"moe_prefill_over_best_baseline_mix_{degree}"] = (
            None if ours is None or not best else ours / best)
        out[f"frontend_gain_over_asyncep_plain_{degree}"] = (
            None if ours is None or not plain else ours / plain)
        cell = cells.get(("mix", "MoE-Prefill", degree))
        out[f"flops_over_ideal_mix_{degree}"] = None if cell is None else cell["flops_over_ideal"]
        out[f"prefix_hit_rate_mix_{degree}"] = None if cell is None else cell["hit_rate"]
    return out


def print_cells(workload: str, degree: int, rows: Mapping[str, Any]) -> None:
    print(f"\n{workload}, degree {degree}:")
    print(f"  {'system':20} {'tokens/s':>10} {'FLOPs/ideal':>12} {'hit rate':>9} "
          f"{'straggler':>10} {'MiB/device':>11} {'KiB/layer crit':>15} {'bg':>8} "
          f"{'/formula':>9}")
    for system, cell in rows.items():
        if isinstance(cell, str):
            print(f"  {system:20} skipped: {cell}")
            continue
        ratio = cell["counted_over_formula"]
        print(f"  {system:20} {cell['tokens_per_s']:10.0f} {cell['flops_over_ideal']:12.3f} "
              f"{cell['hit_rate']:9.3f} {cell['straggler']:10.3f} "
              f"{cell['peak_memory_per_device'] / 2**20:11.2f} "
              f"{cell['critical_bytes_per_layer'] / 1024:15.1f} "
              f"{cell['background_bytes_per_layer'] / 1024:8.1f} "
              f"{'-' if ratio is None else f'{ratio:.3f}':>9}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = cli.bench_parser(__doc__, quick_help="degree 2, the mix only, small",
                              model="demo", repeats_help="timed passes per cell (median kept; "
                                                          "default 3, quick 1)")
    parser.add_argument("--degrees", help="comma-separated parallel degrees (default 1,2,4,8)")
    parser.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)}")
    parser.add_argument("--workloads", help="comma-separated subset of mix,no_sharing,"
                                            "high_share")
    parser.add_argument("--requests", type=int, help="requests of the mix / high-share "
                                                     "workloads (default 96; quick 24)")
    parser.add_argument("--table-tokens", type=int, default=TABLE_TOKENS,
                        help=f"tokens per rank for Table 1 (default {TABLE_TOKENS})")
    parser.add_argument("--count-tokens", type=int, default=COUNT_TOKENS,
                        help="tokens per rank of the step whose programs are counted for "
                             f"the bytes moved (default {COUNT_TOKENS})")
    parser.add_argument("--batch-tokens", type=int, default=BATCH_TOKENS,
                        help=f"max_batch_tokens of every system (default {BATCH_TOKENS})")
    parser.add_argument("--seed", type=int, default=0)
    args = cli.parse_args(parser, argv)
    shape = cli.run_shape(args, QUICK, FULL, ("repeats", "requests"))
    if args.degrees:
        shape["degrees"] = tuple(int(x) for x in args.degrees.split(","))
    if args.workloads:
        shape["workloads"] = tuple(args.workloads.split(","))
    systems = list(shape["systems"]) if not args.systems else args.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        parser.error(f"unknown systems {unknown}; choose from {list(SYSTEMS)}")
    if max(shape["degrees"]) > HOST_DEVICES:
        parser.error(f"degrees go up to {HOST_DEVICES}")
    cli.force_host_devices(HOST_DEVICES)
    run_start = time.perf_counter()

    from moejax.config import load_config
    from serving.api import resolve_model_dir

    logging.getLogger("moejax.scorer").setLevel(logging.ERROR)
    cfg = load_config(resolve_model_dir(args.model)[0])
    workloads = build_workloads(shape, args.seed, cfg)
    figures: dict[str, Any] = {"model": args.model, "degrees": list(shape["degrees"]),
                               "workloads": list(shape["workloads"]), "systems": systems,
                               "requests": shape["requests"], "repeats": shape["repeats"],
                               "table_tokens": args.table_tokens, "skipped": {},
                               "batch_tokens": args.batch_tokens,
                               "count_tokens": args.count_tokens,
                               "load_average_at_start": os.getloadavg()[0]}
    cells: dict[tuple[str, str, int], dict[str, Any] | None] = {}
    ideal_of: dict[str, tuple[float, int]] = {}
    for degree in shape["degrees"]:
        rows_by_workload: dict[str, dict[str, Any]] = {w: {} for w in workloads}
        for system in systems:
            options = system_options(system, degree, shape["prefix_blocks"])
            if isinstance(options, str):
                figures["skipped"][f"{system}_{degree}"] = options
                for workload in workloads:
                    cells[(workload, system, degree)] = None
                    rows_by_workload[workload][system] = options
                continue
            scorer = build_scorer(system, options, args.model, args.batch_tokens)
            moved = traffic_figures(scorer, system, degree, args.count_tokens, cfg)
            for workload, requests in workloads.items():
                if workload not in ideal_of:
                    ops = workload_ops(requests, scorer)
                    ideal_of[workload] = (ideal_flops(cfg, ops)["flops"],
                                          sum(len(op.token_ids) for op in ops))
                ideal, prompt_tokens = ideal_of[workload]
                cell = {**bench_cell(scorer, requests, ideal, prompt_tokens, shape["repeats"],
                                     f"{workload}_{system}_{degree}"), **moved}
                cells[(workload, system, degree)] = cell
                rows_by_workload[workload][system] = cell
                for key, value in cell.items():
                    figures[f"{workload}_{system}_{degree}_{key}"] = value
            del scorer
            release_programs()
        for workload, rows in rows_by_workload.items():
            print_cells(workload, degree, rows)
            baselines = [rows[s]["tokens_per_s"] for s in BASELINES
                         if isinstance(rows.get(s), dict)]
            best = max(baselines, default=None)
            for system, cell in rows.items():
                if isinstance(cell, dict) and best:
                    figures[f"{workload}_{system}_{degree}_over_best_baseline"] = (
                        cell["tokens_per_s"] / best)
    figures.update(headline(cells, shape["degrees"]))
    top = max(shape["degrees"])
    figures.update(table1_figures(QWEN3_235B, top, args.table_tokens))
    figures.update(table1_figures(cfg, top, args.table_tokens, prefix="demo_"))
    print(f"\nTable 1 (Qwen3-235B-A22B shape, bf16, {top} devices, {args.table_tokens} "
          f"tokens per rank), per device per layer:")
    for strategy, t in table1(QWEN3_235B, top, args.table_tokens).items():
        print(f"  {strategy:11} critical {t.critical / 2**20:10.1f} MiB  background "
              f"{t.background / 2**20:10.1f} MiB  weights {t.weights / 2**20:10.1f} MiB")
    print("\nOn CPU the host devices share the cores and collectives are synchronous: "
          "the throughput ratios are not evidence; FLOPs, hit rates, memory, stragglers "
          "and Table 1 are.")
    figures["wall_seconds"] = time.perf_counter() - run_start
    return finish_run(figures, args.json_path)


__all__: Sequence[str] = ("main", "table1", "system_options", "headline")


if __name__ == "__main__":
    main()

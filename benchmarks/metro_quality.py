"""METRO routing quality against EPLB-even and the optimum, on skewed synthetic traces.

For every configuration (128 experts, top-8; 8 and 16 devices; 1.25x and 1.5x
replicas; 8..256 tokens per device) and every instance:

1. a "history" trace of :data:`HISTORY_TOKENS` tokens gives per-expert load, from
   which :func:`eplb_placement` builds the placement (so placement is tuned to the
   distribution, not to the batch it routes);
2. a batch of (tokens per device x devices) tokens is drawn from the same
   distribution and routed by EPLB-even, METRO (the Pallas kernel, default visiting
   order; checked equal to the NumPy reference), METRO with the seed's index order
   (NumPy reference), the vectorized rounds variant (``route_metro_jax(impl=
   "rounds")``; checked valid), and the optimum (max-flow);
3. the figure is each router's maximum activated experts over devices.

Expert popularity is Zipf-like, ``p_e ∝ rank_e^-ZIPF_EXPONENT`` over a random
permutation of expert ids (drawn once per instance, shared by history and batch);
each token picks top-8 distinct experts with probability ∝ popularity (Gumbel top-k,
i.e. sampling without replacement).

Ratios are means over instances of per-instance ratios. Then the greedy is timed
(256 experts, 16 devices, 1.5x): the Pallas kernel (interpreted unless JAX runs on
a GPU), the same loop as plain jitted JAX, the NumPy reference, and the optimum.

``--timing`` adds device time apart from dispatch (256 experts, 16 devices): every
``route_metro_jax`` implementation (``pallas``, ``jax``, ``rounds``) is called
repeatedly under ``jax.profiler.trace``; the Chrome trace is read with
``benchmarks.backends``' helpers, each call's device events are the device-plane
events (GPU: stream and op lines; CPU: the XLA:CPU runtime threads' thunk and op
events) that start between its host ``PjitFunction(route_metro_jax)`` event and the
next call's, and the median per-call busy time (union of those events) is reported,
with the span (first start to last end) and the host wall per call (timed without
the profiler). On a GPU the Pallas kernel's own event (``metro.KERNEL_NAME``) is
also reported. On CPU the figure is XLA:CPU's (the kernel interpreted as XLA ops,
and the profiler's per-op events inflate loops), not a GPU figure.

    python -m benchmarks.metro_quality [--quick] [--timing] [--json PATH] [--seed S]

JSON keys (flat): metro_over_optimal, metro_over_eplb_even, metro_over_eplb_even_32,
metro_index_over_optimal, metro_index_over_eplb_even_32, per-configuration
``<ratio>_g<G>_x<repl>_t<tokens/device>`` for every printed ratio,
kernel_us_256_experts_16_devices, kernel_us_128_experts_8_devices,
jax_loop_us_256_experts_16_devices, reference_us_256_experts_16_devices,
optimal_us_256_experts_16_devices, kernel_backend, kernel_interpret, instances,
targets_met (METRO/optimal <= 1.11 and METRO/EPLB-even at 32 tokens/device <= 0.80);
the rounds variant: metro_rounds_over_optimal, metro_rounds_over_metro (means of
per-instance max-activated ratios), metro_rounds_over_metro_max,
metro_rounds_over_eplb_even_32, and per configuration. With ``--timing``:
metro_kernel_device_us and metro_kernel_host_wall_us (the default implementation,
``metro.DEFAULT_IMPL``), per implementation I: metro_I_device_us,
metro_I_device_span_us, metro_I_host_wall_us, metro_I_traced_calls; and
metro_pallas_kernel_only_device_us (null where the trace has no kernel event, e.g.
CPU), metro_default_impl, metro_timing_backend, metro_timing_calls, metro_timing_shape.
"""

from __future__ import annotations

import argparse

import json
import time

import numpy as np

from benchmarks.lib import trace as chrome_trace
from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.meta import finish_run
from benchmarks.lib.tables import print_table
from benchmarks.lib.timing import median, median_seconds

NUM_EXPERTS = 128
TOP_K = 8
DEVICE_COUNTS = (8, 16)
REPLICATION = (1.25, 1.5)
TOKENS_PER_DEVICE = (8, 16, 32, 64, 128, 256)
ZIPF_EXPONENT = 1.1  # chosen before measuring; within the 1.0-1.2 of typical MoE traces
HISTORY_TOKENS = 8192
INSTANCES_FULL = 30
INSTANCES_QUICK = 4
TARGET_METRO_OVER_OPTIMAL = 1.11
TARGET_METRO_OVER_EPLB_32 = 0.80  # at least 20% fewer max activated experts
TIMING_SHAPES = ((256, 16), (128, 8))  # (experts, devices), 1.5x replicas, 32 tokens/device
TIMING_REPEATS_FULL = 200
TIMING_REPEATS_QUICK = 30
TRACED_CALLS_FULL = 50  # calls per implementation under the profiler (--timing)
TRACED_CALLS_QUICK = 5


def popularity(rng: np.random.Generator, num_experts: int) -> np.ndarray:
    """Zipf-like expert probabilities ``[N]`` over a random permutation of ids."""
    weights = np.arange(1, num_experts + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    probs = np.empty(num_experts)
    probs[rng.permutation(num_experts)] = weights / weights.sum()
    return probs


def sample_topk(rng: np.random.Generator, probs: np.ndarray, num_tokens: int, k: int) -> np.ndarray:
    """``[T, k]`` distinct expert ids per token, drawn without replacement ∝ probs (Gumbel top-k)."""
    keys = np.log(probs)[None, :] + rng.gumbel(size=(num_tokens, probs.shape[0]))
    return np.argpartition(-keys, k - 1, axis=1)[:, :k]


def config_key(devices: int, repl: float, tpd: int) -> str:
    return f"g{devices}_x{repl:g}".replace(".", "p") + f"_t{tpd}"


def run_quality(metro, instances: int, seed: int) -> tuple[dict, list[dict]]:
    """Per-configuration means; returns (flat figures, table rows)."""
    rng = np.random.default_rng(seed)
    figures, rows = {}, []
    all_opt, all_eplb, all_index, all_eplb_32, all_index_eplb_32 = [], [], [], [], []
    all_rounds_opt, all_rounds_metro, all_rounds_eplb_32 = [], [], []
    for devices in DEVICE_COUNTS:
        for repl in REPLICATION:
            replicas = round(repl * NUM_EXPERTS)
            for tpd in TOKENS_PER_DEVICE:
                per = {name: [] for name in ("eplb", "metro", "index", "opt", "rounds")}
                for _ in range(instances):
                    probs = popularity(rng, NUM_EXPERTS)
                    history = sample_topk(rng, probs, HISTORY_TOKENS, TOP_K)
                    placement = metro.eplb_placement(
                        metro.tokens_per_expert(history, NUM_EXPERTS), devices, replicas)
                    batch = sample_topk(rng, probs, tpd * devices, TOP_K)
                    tokens = metro.tokens_per_expert(batch, NUM_EXPERTS)
                    greedy = metro.route_metro(placement, tokens)
                    if not np.array_equal(greedy, metro.route_metro_reference(placement, tokens)):
                        raise AssertionError("kernel and NumPy reference disagree")
                    index = metro.route_metro_reference(placement, tokens, order="index")
                    optimal = metro.route_optimal(placement, tokens)
                    rounds = route_rounds_checked(metro, placement, tokens)

                    per["eplb"].append(int(metro.activated_per_device(
                        metro.route_eplb_even(placement, tokens)).max()))
                    for name, device in (("metro", greedy), ("index", index), ("opt", optimal),
                                         ("rounds", rounds)):
                        per[name].append(int(metro.activated_per_device(
                            metro.routed_tokens(device, tokens, devices)).max()))
                m, e, x, o, r = (np.array(per[k], np.float64)
                                 for k in ("metro", "eplb", "index", "opt", "rounds"))
                row = dict(devices=devices, repl=repl, tpd=tpd, eplb=e.mean(), metro=m.mean(),
                           index=x.mean(), opt=o.mean(), rounds=r.mean(),
                           metro_over_optimal=(m / o).mean(),
                           metro_over_eplb_even=(m / e).mean(),
                           metro_index_over_optimal=(x / o).mean(),
                           metro_rounds_over_optimal=(r / o).mean(),
                           metro_rounds_over_metro=(r / m).mean())
                rows.append(row)
                key = config_key(devices, repl, tpd)
                for name in ("metro_over_optimal", "metro_over_eplb_even", "metro_index_over_optimal",
                             "metro_rounds_over_optimal", "metro_rounds_over_metro"):
                    figures[f"{name}_{key}"] = round(float(row[name]), 4)
                all_opt.extend(m / o)
                all_eplb.extend(m / e)
                all_index.extend(x / o)
                all_rounds_opt.extend(r / o)
                all_rounds_metro.extend(r / m)
                if tpd == 32:
                    all_eplb_32.extend(m / e)
                    all_index_eplb_32.extend(x / e)
                    all_rounds_eplb_32.extend(r / e)
    figures.update(
        metro_over_optimal=round(float(np.mean(all_opt)), 4),
        metro_over_eplb_even=round(float(np.mean(all_eplb)), 4),
        metro_over_eplb_even_32=round(float(np.mean(all_eplb_32)), 4),
        metro_index_over_optimal=round(float(np.mean(all_index)), 4),
        metro_index_over_eplb_even_32=round(float(np.mean(all_index_eplb_32)), 4),
        metro_rounds_over_optimal=round(float(np.mean(all_rounds_opt)), 4),
        metro_rounds_over_metro=round(float(np.mean(all_rounds_metro)), 4),
        metro_rounds_over_metro_max=round(float(np.max(all_rounds_metro)), 4),
        metro_rounds_over_eplb_even_32=round(float(np.mean(all_rounds_eplb_32)), 4),
    )
    return figures, rows


def route_rounds_checked(metro, placement: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``route_metro_jax(impl="rounds")`` as a NumPy device per expert, checked valid.

    The rounds variant need not equal the greedy, so it cannot be checked against the
    reference; validity (every active expert on one of its devices, the rest -1) can.
    """
    import jax.numpy as jnp

    device = np.asarray(metro.route_metro_jax(jnp.asarray(placement),
                                              jnp.asarray(tokens > 0, jnp.int32),
                                              impl="rounds")).astype(np.int64)
    active = tokens > 0
    if (device[~active] != metro.NO_DEVICE).any() or not placement[
            np.flatnonzero(active), device[active]].all():
        raise AssertionError("rounds variant returned an invalid routing")
    return device


def median_us(fn, repeats: int, label: str) -> float:
    """Median wall microseconds of ``fn`` (after one warm-up call, which compiles)."""
    return median_seconds(fn, repeats, label=label) * 1e6


def run_timing(metro, repeats: int, seed: int) -> dict:
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed + 1)
    figures = {"kernel_backend": jax.default_backend(), "kernel_interpret": metro.default_interpret()}
    for experts, devices in TIMING_SHAPES:
        probs = popularity(rng, experts)
        placement = metro.eplb_placement(
            metro.tokens_per_expert(sample_topk(rng, probs, HISTORY_TOKENS, TOP_K), experts),
            devices, int(1.5 * experts))
        tokens = metro.tokens_per_expert(sample_topk(rng, probs, 32 * devices, TOP_K), experts)
        a, t = jnp.asarray(placement), jnp.asarray(tokens, jnp.int32)
        tag = f"{experts}_experts_{devices}_devices"
        timed = {"kernel_us": lambda a=a, t=t: metro.route_metro_jax(a, t, impl="pallas")
                 .block_until_ready()}
        if (experts, devices) == TIMING_SHAPES[0]:
            timed.update(
                jax_loop_us=lambda a=a, t=t: metro.route_metro_jax(a, t, impl="jax")
                .block_until_ready(),
                reference_us=lambda p=placement, n=tokens: metro.route_metro_reference(p, n),
                optimal_us=lambda p=placement, n=tokens: metro.route_optimal(p, n))
        for name, fn in timed.items():
            runs = max(repeats // 10, 3) if name == "optimal_us" else repeats
            figures[f"{name}_{tag}"] = round(median_us(fn, runs, f"{name}_{tag}"), 1)
    return figures


# --------------------------------------------------------------------------- device timing


def _outermost(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Intervals not nested in an earlier one (the host traces each jit call twice, nested)."""
    kept: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if not kept or start >= kept[-1][1]:
            kept.append((start, end))
    return kept


def call_windows(events: list[dict], function: str) -> list[tuple[float, float]]:
    """One window per host call of the jitted ``function``: [its start, the next one's start).

    The host marks each call with a ``PjitFunction(<name>)`` event (the jitted
    function's name). Calls are blocked on one by one, so a call's device work starts
    after its host call starts and ends before the next call starts (the last window
    is open-ended).
    """
    marker = f"PjitFunction({function})"
    calls = _outermost([
        (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))) for ev in events
        if ev.get("ph") == "X" and ev.get("name") == marker])
    starts = [start for start, _ in calls]
    return list(zip(starts, starts[1:] + [float("inf")]))


def device_events(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name + args) of device work in a Chrome trace, microseconds.

    Device work (:func:`benchmarks.lib.trace.device_work`): on a GPU the events of the
    device planes' stream and op lines (not the lines that only summarize, such as "XLA
    Modules" or "Steps"); on CPU the events of the XLA:CPU runtime threads (the thunk
    executor and the ops it runs), not the Python thread's. Markers and zero-length
    events are dropped.
    """
    out = []
    for _, ev in chrome_trace.device_work(trace)[1]:
        if float(ev["dur"]) <= 0.0:
            continue
        start = float(ev["ts"])
        label = f"{ev.get('name', '')} {json.dumps(ev.get('args', {}), sort_keys=True)}"
        out.append((start, start + float(ev["dur"]), label))
    return out


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of intervals (overlapping lines, e.g. ops and kernels, count once)."""
    return chrome_trace.length(chrome_trace.merge(intervals))


def per_call_device_us(trace: dict, function: str, name_filter: str | None = None
                       ) -> tuple[list[float], list[float]]:
    """Per call of ``function``: device busy time and device span (first start to last end).

    ``name_filter`` keeps only events whose name or args contain it (the kernel's own
    events); calls without any kept event are left out.
    """
    windows = call_windows(trace.get("traceEvents", []), function)
    work = [(a, b) for a, b, label in device_events(trace)
            if name_filter is None or name_filter in label]
    busy, span = [], []
    for lo, hi in windows:
        mine = [(a, b) for a, b in work if lo <= a < hi]
        if mine:
            busy.append(busy_us(mine))
            span.append(max(b for _, b in mine) - min(a for a, _ in mine))
    return busy, span


def traced_calls(fn, calls: int, label: str) -> dict:
    """Chrome trace of ``calls`` blocked calls of ``fn`` (compiled beforehand), the Python
    tracer on (as the per-call windows were first read with it)."""
    from benchmarks.lib.compiles import timed_pass

    fn()  # compile and warm up outside the trace
    with chrome_trace.profile(python_tracer=True) as captured, timed_pass(label):
        for _ in range(calls):
            fn()
    return captured.trace


def timing_instance(metro, experts: int, devices: int, seed: int):
    """(placement, tokens) device arrays of the timing shape: EPLB placement at 1.5x
    replicas from a Zipf history, a batch of 32 tokens per device."""
    import jax.numpy as jnp

    rng = np.random.default_rng(seed + 2)
    probs = popularity(rng, experts)
    placement = metro.eplb_placement(
        metro.tokens_per_expert(sample_topk(rng, probs, HISTORY_TOKENS, TOP_K), experts),
        devices, int(1.5 * experts))
    tokens = metro.tokens_per_expert(sample_topk(rng, probs, 32 * devices, TOP_K), experts)
    return jnp.asarray(placement), jnp.asarray(tokens, jnp.int32)


def run_device_timing(metro, calls: int, repeats: int, seed: int) -> dict:
    """Device time per call of every ``route_metro_jax`` implementation, from a profile.

    Per implementation: ``calls`` blocked calls under ``jax.profiler.trace``; per call
    the device busy time (union of its device events) and span; medians are reported.
    The host wall per call (dispatch + run + block, no profiler) is timed separately.
    On a GPU the Pallas kernel's own event (named :data:`metro.KERNEL_NAME`) is also
    picked out; on CPU the kernel is interpreted into XLA ops and has no event of its own.
    """
    import jax

    experts, devices = TIMING_SHAPES[0]
    placement, tokens = timing_instance(metro, experts, devices, seed)
    figures: dict = {"metro_timing_backend": jax.default_backend(),
                     "metro_default_impl": metro.DEFAULT_IMPL, "metro_timing_calls": calls,
                     "metro_timing_shape": f"{experts}_experts_{devices}_devices"}
    for impl in metro.METRO_IMPLS:
        def call(impl=impl):
            return metro.route_metro_jax(placement, tokens, impl=impl).block_until_ready()

        trace = traced_calls(call, calls, f"metro_{impl}_traced")
        busy, span = per_call_device_us(trace, "route_metro_jax")
        if not busy:
            raise RuntimeError(f"no device events of route_metro_jax(impl={impl!r}) in the trace")
        figures[f"metro_{impl}_device_us"] = round(median(busy), 1)
        figures[f"metro_{impl}_device_span_us"] = round(median(span), 1)
        figures[f"metro_{impl}_traced_calls"] = len(busy)
        figures[f"metro_{impl}_host_wall_us"] = round(median_us(call, repeats,
                                                               f"metro_{impl}_host_wall"), 1)
        if impl == "pallas":
            kernel, _ = per_call_device_us(trace, "route_metro_jax", metro.KERNEL_NAME)
            figures["metro_pallas_kernel_only_device_us"] = (
                round(median(kernel), 1) if kernel else None)
    figures["metro_kernel_device_us"] = figures[f"metro_{metro.DEFAULT_IMPL}_device_us"]
    figures["metro_kernel_host_wall_us"] = figures[f"metro_{metro.DEFAULT_IMPL}_host_wall_us"]
    return figures


def print_device_timing(figures: dict) -> None:
    backend = figures["metro_timing_backend"]
    print(f"device time per call, {figures['metro_timing_shape'].replace('_', ' ')}, median of "
          f"{figures['metro_timing_calls']} traced calls ({backend}):")
    if backend != "gpu":
        print("  NOTE: CPU figures. This is XLA:CPU running the program (the Pallas kernel "
              "in interpret mode, i.e. as XLA:CPU ops), timed from the profiler's thunk "
              "events, which the per-op tracing inflates for loops; it is NOT the GPU figure "
              "(run this with --timing on the GPU for that).")
    for impl in ("pallas", "jax", "rounds"):
        print(f"  {impl:>6}: device busy {figures[f'metro_{impl}_device_us']} us, span "
              f"{figures[f'metro_{impl}_device_span_us']} us; host wall per call "
              f"{figures[f'metro_{impl}_host_wall_us']} us")
    kernel = figures.get("metro_pallas_kernel_only_device_us")
    print(f"  Pallas kernel event alone: "
          f"{'not in the trace (no GPU kernel event)' if kernel is None else f'{kernel} us'}; "
          f"default impl {figures['metro_default_impl']!r}: device "
          f"{figures['metro_kernel_device_us']} us, host wall {figures['metro_kernel_host_wall_us']} us")


def print_rows(rows: list[dict]) -> None:
    number = lambda key, spec: lambda r: format(r[key], spec)  # noqa: E731
    print_table([("G", 3, number("devices", "")), ("repl", 6, number("repl", ".2f")),
                 ("tok/dev", 8, number("tpd", "")), (" |", 2, lambda r: " |"),
                 ("EPLB-even", 10, number("eplb", ".2f")), ("METRO", 8, number("metro", ".2f")),
                 ("METRO-idx", 10, number("index", ".2f")), ("rounds", 8, number("rounds", ".2f")),
                 ("optimal", 8, number("opt", ".2f")), (" |", 2, lambda r: " |"),
                 ("METRO/opt", 10, number("metro_over_optimal", ".3f")),
                 ("idx/opt", 8, number("metro_index_over_optimal", ".3f")),
                 ("METRO/EPLB", 11, number("metro_over_eplb_even", ".3f")),
                 ("rnd/opt", 8, number("metro_rounds_over_optimal", ".3f")),
                 ("rnd/METRO", 10, number("metro_rounds_over_metro", ".3f"))], rows,
                title="max activated experts per device (mean over instances); ratios: mean "
                      "of per-instance ratios")


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, quick_help="fewer instances and timing repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timing", action="store_true",
                        help="also trace every route_metro_jax implementation and report its "
                             "device time per call apart from the host wall (dispatch)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parse_args(build_parser(), argv)

    from kernels_pallas import metro

    instances = INSTANCES_QUICK if args.quick else INSTANCES_FULL
    start = time.perf_counter()
    figures, rows = run_quality(metro, instances, args.seed)
    print_rows(rows)
    repeats = TIMING_REPEATS_QUICK if args.quick else TIMING_REPEATS_FULL
    figures.update(run_timing(metro, repeats, args.seed))
    if args.timing:
        figures.update(run_device_timing(
            metro, TRACED_CALLS_QUICK if args.quick else TRACED_CALLS_FULL, repeats, args.seed))
    figures["instances"] = instances * len(rows)
    figures["targets_met"] = bool(figures["metro_over_optimal"] <= TARGET_METRO_OVER_OPTIMAL
                                  and figures["metro_over_eplb_even_32"] <= TARGET_METRO_OVER_EPLB_32)
    figures["seconds"] = round(time.perf_counter() - start, 1)
    print()
    print(f"METRO / optimal (mean over {figures['instances']} instances): "
          f"{figures['metro_over_optimal']:.4f}  (target <= {TARGET_METRO_OVER_OPTIMAL}); "
          f"seed index order: {figures['metro_index_over_optimal']:.4f}")
    print(f"METRO / EPLB-even at 32 tokens/device: {figures['metro_over_eplb_even_32']:.4f}  "
          f"(target <= {TARGET_METRO_OVER_EPLB_32}); seed index order: "
          f"{figures['metro_index_over_eplb_even_32']:.4f}")
    print(f"METRO / EPLB-even over all configurations: {figures['metro_over_eplb_even']:.4f}")
    mode = "interpreted" if figures["kernel_interpret"] else "compiled"
    print(f"greedy time, 256 experts x 16 devices ({figures['kernel_backend']}): Pallas kernel "
          f"({mode}) {figures['kernel_us_256_experts_16_devices']} us, plain JAX loop "
          f"{figures['jax_loop_us_256_experts_16_devices']} us, NumPy reference "
          f"{figures['reference_us_256_experts_16_devices']} us, optimum "
          f"{figures['optimal_us_256_experts_16_devices']} us; 128 x 8 kernel "
          f"{figures['kernel_us_128_experts_8_devices']} us")
    print(f"rounds variant (impl='rounds') / optimal: {figures['metro_rounds_over_optimal']:.4f}; "
          f"/ METRO greedy: {figures['metro_rounds_over_metro']:.4f} (mean; worst instance "
          f"{figures['metro_rounds_over_metro_max']:.4f}); / EPLB-even at 32 tokens/device: "
          f"{figures['metro_rounds_over_eplb_even_32']:.4f}")
    if args.timing:
        print_device_timing(figures)
    print(f"targets met: {figures['targets_met']}  ({figures['seconds']} s)")
    finish_run(figures, args.json_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

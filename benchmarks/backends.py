"""Every execution backend on one workload, read through an XLA profiler trace.

Builds one Qwen3-MoE with random weights, packs one set of random-token sequences
into batches of a single shape, and runs that same token set through each backend
(``resident``, ``offload``, ``async_ep``, ``hybrid``, ``sync_ep``, ``tp``). Per
backend: warm up (compiles the one shape), ``moejax.calibrate.calibrate`` (prints
Θ), time the whole workload (synchronized, median of ``--repeats``), then one more
pass under ``jax.profiler.trace``. The Chrome-trace JSON the profiler writes
(``plugins/profile/<run>/<host>.trace.json.gz``) is parsed into per-device lanes;
events are classified as *transfer* (collectives, host<->device copies), *compute*
(kernels / fused ops) or *other* (runtime, control flow, host), and

    exposed transfer = |∪ transfer intervals| − |∪ transfer ∩ ∪ compute|   (per lane)

i.e. the time a device moves data with no compute running. The fraction printed is
Σ_lanes exposed / (traced wall time × devices used). The transfer event names found
are printed so that a reader can check the classification.

Where it falls (``offload``, ``hybrid``): the program executions are read from the
trace (GPU: a device plane's "XLA Modules" line; CPU: the ops sharing one
``run_id``), and the streamed programs by name (``jit_streamed_embed``, ``_gather``,
``_layer``, ``_last``). Exposed transfer is split by the gaps between programs it
falls in: *step start* (before a step's first layer program: from the previous
step's last program or the trace's start, across the embedding and hybrid's first
gather), *between layers* (the device waiting between two layer programs of a step:
the host's per-layer synchronization) and *other* (the rest, e.g. inside a program).
Device idle = the time with no program running between programs. ``sync_lag``
(``--sync-lag``; ``offload_waiting`` / ``hybrid_waiting`` in ``--backends`` run the
same backend with ``sync_lag=0``) is how many layer programs the host dispatches
ahead of the one it waits for (moejax/backends/streamed.py).

MFU = useful model FLOPs (DESIGN.md: per sequence ``cfg.request_flops(len, 0,
scoring_positions=1, num_candidates=2)``; padding not counted) / (wall × peak ×
devices). Peak: ``--peak-tflops``, else a table keyed by the device kind (H100/H200
SXM: 989 TFLOP/s bf16 dense, 67 f32), else on CPU the measured rate of a large f32
matmul on one device. On CPU the forced host devices share the same cores (one
device already uses them all), so there the device factor is 1.

Model: on a GPU the Qwen3-30B-A3B shape (d=2048, 32/4 heads of 128, E=128, k=8,
f=768, V=151936) with ``--layers`` layers (default 8), bf16; on CPU a small
Qwen3-MoE (d=256, 4 layers, E=32, k=4, f=256, V=2048), f32; ``--quick``: a tiny one.
On CPU, unless ``XLA_FLAGS`` names a count, 8 host devices are forced before JAX starts.

Θ and the batch size: a streamed backend hides its copies only when one batch's
compute covers them, i.e. when one batch is at least Θ of work; each backend's line
prints "one batch = x Θ". On a GPU, raise ``--batch-tokens`` until offload's x ≥ 1
before reading its ratio to resident (a Qwen3-30B-A3B layer of experts is ~1.2 GB
in bf16: ~25 ms over PCIe, so tens of thousands of tokens per batch).

What the CPU trace can show: the mechanics only. CPU collectives are synchronous
(each device's thread waits in the rendezvous), host->device copies run on the
Python thread, and there are no separate copy or communication streams, so
transfers on CPU are (almost) always exposed. Whether transfers hide under compute
is a GPU question: run this there and record the figures in docs/PERF.md. On CPU
the multi-device backends are synchronized after every step: with two steps of a
collective program in flight, XLA:CPU was seen to deadlock in a rendezvous (8 host
devices on 2 cores) and abort after its 40 s timeout.

    python -m benchmarks.backends [--quick] [--json PATH] [--backends resident,offload,...]
        [--devices G] [--window W] [--sync-lag K] [--layers L] [--steps K] [--repeats N]
        [--block B] [--batch-tokens T] [--peak-tflops X] [--dtype bfloat16|float32]
        [--sync-steps] [--trace-dir DIR]

JSON keys (flat), per backend B: ``B_tokens_per_s``, ``B_tokens_per_s_per_device``,
``B_mfu``, ``B_exposed_transfer_fraction``, ``B_over_resident``,
``B_over_best_baseline``, ``B_expert_bytes_per_device``, ``B_expert_saving``,
``B_expected_expert_saving``, ``B_peak_temp_bytes``, ``B_theta_flops``,
``B_batch_over_theta``, ``B_devices``, ``B_wall_s``; for the streamed backends also
``B_sync_lag``, ``B_exposed_first_layer_fraction`` (step start),
``B_exposed_between_layers_fraction``, ``B_exposed_other_fraction`` (the three add up
to ``B_exposed_transfer_fraction``), ``B_device_idle_fraction``,
``B_idle_between_layers_fraction``; ``offload_lagged_over_waiting`` /
``hybrid_lagged_over_waiting`` (tokens/s, when both entries ran); and ``platform``,
``device_kind``, ``peak_tflops``, ``peak_source``, ``dtype``, ``devices``,
``tokens``, ``padded_tokens``, ``useful_flops``, ``skipped`` (backend -> reason).
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from benchmarks.lib import models, trace
from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.meta import finish_run, platform_figures
from benchmarks.lib.tables import fmt, print_table
from benchmarks.lib.timing import device_peak, median, mfu_devices
from benchmarks.lib.trace import ExposedSplit, TraceSummary

if TYPE_CHECKING:
    from moejax.config import ModelConfig
    from moejax.packing import HostBatch

HOST_DEVICES = 8        # CPU host devices for the multi-device backends
ALL_BACKENDS = ("resident", "offload", "async_ep", "hybrid", "sync_ep", "tp")
BASELINES = ("sync_ep", "tp")
SINGLE_DEVICE = ("resident", "offload")
STREAMED = ("offload", "hybrid")
# "offload_waiting": offload with sync_lag=0 (wait for each layer before the next is
# dispatched), to compare with the lagged default in the same run.
WAITING = "_waiting"


def base_backend(name: str) -> str:
    """The registered backend a benchmark entry runs ('offload_waiting' -> 'offload')."""
    if name.endswith(WAITING) and name[:-len(WAITING)] in STREAMED:
        return name[:-len(WAITING)]
    return name


# ==================================================================== backends
def backend_devices(name: str, cfg: ModelConfig, devices: int) -> int:
    """Devices a backend runs on: 1 for the single-device ones; tp shards attention by
    head, so it gets the largest count dividing both head counts."""
    name = base_backend(name)
    if name in SINGLE_DEVICE:
        return 1
    if name == "tp":
        return max(g for g in range(1, devices + 1)
                   if cfg.num_heads % g == 0 and cfg.num_kv_heads % g == 0)
    return devices


def backend_options(name: str, args, dtype: str) -> dict[str, Any]:
    options: dict[str, Any] = {"dtype": dtype}
    base = base_backend(name)
    if base in STREAMED:
        options["window"] = max(args.window, 2) if base == "hybrid" else args.window
        if name != base:
            options["sync_lag"] = 0
        elif args.sync_lag is not None:
            options["sync_lag"] = args.sync_lag
    return options


def build_backend(name: str, cfg: ModelConfig, params, devices: int, options: Mapping):
    """The backend, or (None, reason) when it cannot be built here."""
    from moejax.backends import make_backend
    from moejax.backends.base import BackendError

    try:
        return make_backend(base_backend(name), cfg, params, devices=devices, **options), None
    except (ImportError, AttributeError) as exc:
        return None, f"not importable ({type(exc).__name__}: {exc})"
    except (BackendError, ValueError) as exc:
        return None, f"cannot run here ({exc})"


def sync_each_step(backend, force: bool = False) -> bool:
    """Wait for every step before dispatching the next? On CPU with several host devices,
    yes: with steps of a collective program in flight, XLA:CPU was seen to deadlock in a
    collective rendezvous (and abort the process after its 40 s timeout)."""
    import jax

    return force or (jax.default_backend() == "cpu" and len(backend.devices) > 1)


def run_workload(backend, hosts: Sequence[HostBatch], sync: bool = False) -> None:
    """Every batch through ``backend`` in steps of its rank count; waits for the results
    (after each step when ``sync``, else once at the end)."""
    import jax

    from moejax.backends.base import padded_step, plan_steps

    outputs = []
    for step in plan_steps([h.shape_key for h in hosts], backend.num_ranks):
        batches = padded_step([hosts[i].batch for i in step], backend.num_ranks)
        outputs.append(backend.step(batches, hosts[step[0]].options))
        if sync:
            jax.block_until_ready(outputs[-1])
    jax.block_until_ready(outputs)


def pass_seconds(name: str, backend, hosts: Sequence[HostBatch], repeats: int,
                 sync: bool = False) -> list[float]:
    """Wall seconds of ``repeats`` timed passes of the workload (compiled beforehand)."""
    from benchmarks.lib.timing import sample_seconds

    return sample_seconds(lambda: run_workload(backend, hosts, sync), repeats,
                          label=f"{name}_workload", warmup=0)


def traced_pass(name: str, backend, hosts: Sequence[HostBatch], log_dir: str,
                sync: bool = False) -> tuple[float, TraceSummary]:
    """One pass under the profiler (no Python tracer): (wall s, summary)."""
    with trace.profile(log_dir) as captured:
        wall = pass_seconds(f"{name}_traced", backend, hosts, 1, sync)[0]
    return wall, trace.summarize_trace(captured.trace)


def expected_saving(name: str, cfg: ModelConfig, devices: int, window: int,
                    sync_lag: int = 0) -> float:
    """The expert-memory saving per device DESIGN.md's table implies (from first
    principles, not from the backend's own report)."""
    L, E, G = cfg.num_layers, cfg.num_experts, devices
    padded = -(-E // G) * G
    name = base_backend(name)
    if name == "offload":             # W layers, whatever the lag
        return L / min(window, L)
    if name == "async_ep":            # 1/G of every layer + layer 0 whole + two gathered
        return L * E / (L * padded / G + 3 * E)
    if name == "hybrid":              # W shard-layers + two gathered + one per lagged layer
        return L * E / (min(window, L) * padded / G + (2 + sync_lag) * E)
    if name == "sync_ep":
        return E / (padded / G)
    if name == "tp":
        f = cfg.moe_intermediate_size
        return f / (-(-f // G))
    return 1.0


# ---------------------------------------------------------- compiled temp (activation) bytes
def peak_temp_bytes(backend, host: HostBatch) -> tuple[int | None, str]:
    """Largest ``temp_size_in_bytes`` of the step's compiled program(s) (activations and
    in-program buffers such as gathered experts), else the device's peak bytes in use."""
    from moejax.backends.base import padded_step

    try:
        sizes = [lowered.compile().memory_analysis().temp_size_in_bytes
                 for lowered in backend.lowered_steps(
                     padded_step([host.batch], backend.num_ranks), host.options)]
        return int(max(sizes)), "compiled memory_analysis"
    except Exception as exc:  # noqa: BLE001  (the figure is optional)
        stats = backend.devices[0].memory_stats() or {}
        if "peak_bytes_in_use" in stats:
            return int(stats["peak_bytes_in_use"]), "device peak_bytes_in_use (all buffers)"
        return None, f"unavailable ({type(exc).__name__}: {exc})"


# ---------------------------------------------------------- one backend, measured
@dataclasses.dataclass
class Result:
    name: str
    devices: int
    wall_s: float
    tokens_per_s: float
    mfu: float
    traced_wall_s: float
    trace: TraceSummary
    exposed_fraction: float
    memory: dict[str, Any]
    expected_saving: float
    peak_temp: int | None
    peak_temp_source: str
    theta: float
    theta_source: str
    t_x: float | None
    channel: str
    batch_over_theta: float
    live_window_bytes: int | None
    synced_steps: bool
    split: ExposedSplit | None = None     # streamed backends: where exposed transfer falls
    sync_lag: int | None = None


def measure_backend(name: str, backend, hosts: Sequence[HostBatch], ctx: Mapping[str, Any]
                    ) -> Result:
    from moejax.calibrate import calibrate

    args, cfg = ctx["args"], ctx["cfg"]
    sync = sync_each_step(backend, args.sync_steps)
    run_workload(backend, hosts, sync)                             # warm-up: compiles
    calibration = calibrate(backend, reference_tokens=ctx["batch_tokens"],
                            reference_sequence=ctx["block"], repeats=args.calib_repeats,
                            max_batch_tokens=ctx["batch_tokens"])
    batch_over_theta = ctx["batch_flops"] / calibration.theta if calibration.theta else math.inf
    print(f"  [{name}] Θ = {calibration.theta:.3g} FLOPs ({calibration.source}; t_x = "
          f"{_ms(calibration.t_x)} over {calibration.channel}, R = "
          f"{_tflops(calibration.rate)}); one batch = {batch_over_theta:.3g} Θ"
          f"{'; synchronized after every step' if sync else ''}", flush=True)
    wall = median(pass_seconds(name, backend, hosts, args.repeats, sync))
    live = live_window(backend, hosts, sync)
    log_dir = os.path.join(ctx["trace_root"], name)
    traced_wall, summary = traced_pass(name, backend, hosts, log_dir, sync)
    devices = len(backend.devices)
    peak = ctx["peak_tflops"] * 1e12 * mfu_devices(devices)
    temp, temp_source = peak_temp_bytes(backend, hosts[0])
    lag = getattr(backend, "sync_lag", None)
    return Result(
        name=name, devices=devices, wall_s=wall, tokens_per_s=ctx["tokens"] / wall,
        mfu=ctx["flops"] / (wall * peak), traced_wall_s=traced_wall, trace=summary,
        exposed_fraction=summary.exposed_s / (traced_wall * devices),
        memory=backend.memory_report().as_dict(),
        expected_saving=expected_saving(name, cfg, devices, getattr(backend, "window", 0),
                                        lag or 0),
        peak_temp=temp, peak_temp_source=temp_source, theta=calibration.theta,
        theta_source=calibration.source, t_x=calibration.t_x, channel=calibration.channel,
        batch_over_theta=batch_over_theta, live_window_bytes=live, synced_steps=sync,
        split=trace.split_exposed(summary) if base_backend(name) in STREAMED else None, sync_lag=lag)


def live_window(backend, hosts: Sequence[HostBatch], sync: bool) -> int | None:
    """For the streamed backends: the peak expert bytes per device seen in JAX's live
    arrays during one (untimed) pass — a measurement beside the report's bookkeeping."""
    if not hasattr(backend, "track_memory"):
        return None
    backend.track_memory, backend.peak_window_bytes = True, 0
    try:
        run_workload(backend, hosts, sync)
    finally:
        backend.track_memory = False
    return int(backend.peak_window_bytes)


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.3g} ms"


def _tflops(rate: float | None) -> str:
    return "n/a" if rate is None else f"{rate / 1e12:.3g} TFLOP/s"


# ==================================================================== report
def ratios(results: Mapping[str, Result]) -> dict[str, dict[str, float | None]]:
    resident = results.get("resident")
    baselines = [results[b].tokens_per_s for b in BASELINES if b in results]
    best = max(baselines) if baselines else None
    return {name: {"over_resident": r.tokens_per_s / resident.tokens_per_s if resident else None,
                   "over_best_baseline": r.tokens_per_s / best if best else None}
            for name, r in results.items()}


def print_results(results: Mapping[str, Result], rel: Mapping[str, Mapping]) -> None:
    mib = lambda count: None if count is None else count / 2 ** 20  # noqa: E731
    print_table([
        ("backend", -16, lambda r: r.name), ("dev", 4, lambda r: str(r.devices)),
        ("wall s", 9, lambda r: f"{r.wall_s:.3f}"), ("tok/s", 10, lambda r: f"{r.tokens_per_s:.0f}"),
        ("tok/s/dev", 10, lambda r: f"{r.tokens_per_s / r.devices:.0f}"),
        ("×resid", 8, lambda r: fmt(rel[r.name]["over_resident"], ".2f")),
        ("×best_bl", 9, lambda r: fmt(rel[r.name]["over_best_baseline"], ".2f")),
        ("MFU %", 7, lambda r: f"{100 * r.mfu:.2f}"),
        ("exp.xfer %", 11, lambda r: f"{100 * r.exposed_fraction:.1f}"),
        ("expert MiB/dev", 15, lambda r: f"{mib(r.memory['expert_weight_bytes']):.2f}"),
        ("saving ×", 9, lambda r: f"{r.memory['expert_saving']:.2f}"),
        ("expect ×", 9, lambda r: f"{r.expected_saving:.2f}"),
        ("temp MiB", 9, lambda r: fmt(mib(r.peak_temp), ".1f")),
        ("Θ FLOPs", 10, lambda r: f"{r.theta:.3g}")], results)


def print_memory(results: Mapping[str, Result]) -> None:
    print("\nweights per device (bytes; from memory_report(); 'live peak' = expert arrays held "
          "between programs, measured from jax.live_arrays during a pass; buffers inside a "
          "program, e.g. a layer gathered in flight, count in its temp bytes instead):")
    for name, r in results.items():
        m = r.memory
        detail = ", ".join(f"{k}={v}" for k, v in m["detail"].items())
        live = "" if r.live_window_bytes is None else f", live peak={r.live_window_bytes}"
        match = "matches" if math.isclose(m["expert_saving"], r.expected_saving, rel_tol=1e-6) \
            else "DIFFERS from"
        print(f"  {name:<16} dense={m['dense_weight_bytes']} experts={m['expert_weight_bytes']} "
              f"(all layers {m['expert_bytes_all_layers']}, host {m['host_weight_bytes']}"
              f"{'; ' + detail if detail else ''}{live}); saving {m['expert_saving']:.2f}× "
              f"{match} the expected {r.expected_saving:.2f}×; peak temp "
              f"{fmt(r.peak_temp, 'd', 'n/a')} ({r.peak_temp_source})")


def print_trace_details(results: Mapping[str, Result]) -> None:
    print("\ntrace (traced pass; seconds summed over lanes; lanes = device planes on GPU/TPU, "
          "runtime threads on CPU):")
    for name, r in results.items():
        t = r.trace
        print(f"  {name:<16} wall {r.traced_wall_s:.3f} s, {t.lanes} lanes, compute "
              f"{t.compute_s:.3f} s, transfer {t.transfer_s:.3f} s, exposed {t.exposed_s:.3f} s "
              f"({100 * r.exposed_fraction:.1f}% of wall × {r.devices} device(s))")
        transfers = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in t.top("transfer", 8))
        computes = ", ".join(f"{n} {s * 1e3:.1f} ms" for n, s in t.top("compute", 4))
        print(f"      transfer events: {transfers or 'none'}")
        print(f"      top compute events: {computes or 'none'}")


def _pct(seconds: float, r: Result) -> str:
    return f"{100 * seconds / (r.traced_wall_s * r.devices):.1f}%"


def print_exposed_split(results: Mapping[str, Result]) -> None:
    streamed = [name for name in results if base_backend(name) in STREAMED]
    missing = [name for name in streamed if results[name].split is None]
    if missing:
        print(f"\nno streamed program executions found in the trace of {', '.join(missing)} "
              f"(looked for an \"XLA Modules\" line per device, or ops with hlo_module and "
              f"run_id args): exposed transfer not split")
    rows = {name: results[name] for name in streamed if results[name].split is not None}
    if not rows:
        return
    print("\nwhere the streamed backends' exposed transfer falls (% of traced wall × devices): "
          "step start = before a step's first layer program (from the previous step's last "
          "program: the embedding and hybrid's first gather are there); between layers = "
          "the device waiting between two layer programs of a step; other = the rest (e.g. "
          "inside a program). idle = no program running, between programs:")
    for name, r in rows.items():
        sp = r.split
        print(f"  {name:<16} sync_lag {r.sync_lag}: exposed {_pct(r.trace.exposed_s, r)} = "
              f"step start {_pct(sp.step_start_s, r)} + between layers "
              f"{_pct(sp.between_layers_s, r)} + other {_pct(sp.other_s, r)}; device idle "
              f"{_pct(sp.idle_s, r)} (between layers {_pct(sp.idle_between_layers_s, r)})")


def lag_ratios(results: Mapping[str, Result]) -> dict[str, float]:
    """tokens/s of each streamed backend run lagged over the same run waiting (both in
    this run: ``--backends offload,offload_waiting``)."""
    return {f"{b}_lagged_over_waiting": results[b].tokens_per_s / results[b + WAITING].tokens_per_s
            for b in STREAMED if b in results and b + WAITING in results}


LAG_CPU_NOTE = ("note (CPU): the lagged/waiting ratio is not the GPU figure: CPU copies run "
                "on the Python thread and the programs share the same cores, so there is no "
                "copy engine for the lag to keep busy beside compute. Measure it on a GPU.")


def print_lag_ratios(results: Mapping[str, Result]) -> None:
    for key, ratio in lag_ratios(results).items():
        base = key[:-len("_lagged_over_waiting")]
        print(f"\n{base}: sync_lag {results[base].sync_lag} over sync_lag 0 "
              f"({base}{WAITING}): {ratio:.3f}× tokens/s (measured one after the other, "
              f"same workload)")
        if platform_figures()["platform"] == "cpu":
            print(LAG_CPU_NOTE)


def json_figures(results: Mapping[str, Result], rel: Mapping, ctx: Mapping, skipped: Mapping
                 ) -> dict[str, Any]:
    out: dict[str, Any] = {
        **platform_figures(), "peak_tflops": ctx["peak_tflops"], "peak_source": ctx["peak_source"],
        "dtype": ctx["dtype"], "devices": ctx["devices"], "tokens": ctx["tokens"],
        "padded_tokens": ctx["padded_tokens"], "useful_flops": ctx["flops"],
        "skipped": dict(skipped)}
    for name, r in results.items():
        out.update({
            f"{name}_tokens_per_s": r.tokens_per_s,
            f"{name}_tokens_per_s_per_device": r.tokens_per_s / r.devices,
            f"{name}_mfu": r.mfu,
            f"{name}_exposed_transfer_fraction": r.exposed_fraction,
            f"{name}_over_resident": rel[name]["over_resident"],
            f"{name}_over_best_baseline": rel[name]["over_best_baseline"],
            f"{name}_expert_bytes_per_device": r.memory["expert_weight_bytes"],
            f"{name}_expert_saving": r.memory["expert_saving"],
            f"{name}_expected_expert_saving": r.expected_saving,
            f"{name}_peak_temp_bytes": r.peak_temp,
            f"{name}_theta_flops": r.theta,
            f"{name}_batch_over_theta": r.batch_over_theta if math.isfinite(r.batch_over_theta)
            else None,
            f"{name}_devices": r.devices,
            f"{name}_wall_s": r.wall_s})
        if r.split is not None:
            out.update(split_figures(name, r.split, r.traced_wall_s * r.devices, r.sync_lag))
    out.update(lag_ratios(results))
    return out


def split_figures(name: str, split: ExposedSplit, wall_devices_s: float, sync_lag: int | None
                  ) -> dict[str, Any]:
    """A streamed backend's exposed-transfer split as fractions of traced wall × devices
    (``wall_devices_s``), the denominator of ``B_exposed_transfer_fraction``."""
    return {f"{name}_sync_lag": sync_lag,
            f"{name}_exposed_first_layer_fraction": split.step_start_s / wall_devices_s,
            f"{name}_exposed_between_layers_fraction": split.between_layers_s / wall_devices_s,
            f"{name}_exposed_other_fraction": split.other_s / wall_devices_s,
            f"{name}_device_idle_fraction": split.idle_s / wall_devices_s,
            f"{name}_idle_between_layers_fraction": split.idle_between_layers_s / wall_devices_s}


CPU_NOTE = ("note (CPU): the trace shows the mechanics only. CPU collectives are synchronous "
            "(a device's thread computes nothing while it waits in the rendezvous), so they are "
            "exposed by construction; host->device copies run on the Python thread (counted "
            "exposed where no runtime thread computes); there are no copy/communication streams. "
            "Lanes are runtime threads, not devices, and the 8 host devices share the same "
            "cores, so the multi-device rows do not scale. Overlap is a GPU measurement.")


# ==================================================================== main
def build_parser():
    parser = bench_parser(__doc__, quick_help="tiny model, under a minute on CPU",
                          repeats_help="timed passes, median kept (default 3; 1 with --quick)",
                          devices_help="G for the multi-device backends (default: every device)")
    parser.add_argument("--backends", default=",".join(ALL_BACKENDS),
                        help="comma list (default: all six)")
    parser.add_argument("--window", type=int, default=2, help="offload/hybrid window (layers)")
    parser.add_argument("--sync-lag", type=int, help="offload/hybrid: layer programs "
                        "dispatched ahead of the one the host waits for (default: the "
                        "backend's, 1). Add e.g. offload_waiting to --backends for the same "
                        "backend with sync_lag 0, side by side")
    parser.add_argument("--layers", type=int, help="decoder layers (GPU default 8)")
    parser.add_argument("--block", type=int, help="attention block = longest sequence "
                        "(power of two; default 512 GPU, 128 CPU, 32 quick)")
    parser.add_argument("--batch-tokens", type=int, help="tokens per packed batch (power of "
                        "two; default 16384 GPU, 1024 CPU, 128 quick). offload hides its copies "
                        "only when one batch is >= Θ: see 'one batch = x Θ'")
    parser.add_argument("--sync-steps", action="store_true", help="wait for every step before "
                        "the next (always on for multi-device backends on CPU)")
    parser.add_argument("--steps", type=int, default=2,
                        help="batches per data-parallel rank: the workload is G·steps batches")
    parser.add_argument("--calib-repeats", type=int, default=2, help="calibrate() repeats")
    parser.add_argument("--peak-tflops", type=float, help="device peak used for MFU")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="weights/activations (default bf16 on GPU, f32 on CPU)")
    parser.add_argument("--trace-dir", help="keep the profiler traces here (default: a "
                        "temporary directory, removed at the end)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    # The GPU overlap flags and (on CPU) the host devices, before JAX starts.
    args = parse_args(parser, argv, host_devices=HOST_DEVICES, gpu_overlap_flags=True)
    import jax

    from moejax.backends import BACKENDS
    from moejax.model import init_params

    args.repeats = args.repeats or (1 if args.quick else 3)
    unknown = [b for b in args.backends.split(",") if base_backend(b) not in BACKENDS]
    if unknown:
        parser.error(f"unknown backend(s) {unknown}; choose from {sorted(BACKENDS)} "
                     f"(or {', '.join(b + WAITING for b in STREAMED)})")
    cfg, dtype = models.model_shape(args)
    devices = args.devices or len(jax.devices())
    block, batch_tokens = models.workload_shape(args.quick, args.block, args.batch_tokens)
    hosts = models.make_workload(cfg, devices * args.steps, block, batch_tokens)
    peak_tflops, peak_source = device_peak(args.peak_tflops, dtype)
    trace_root = args.trace_dir or tempfile.mkdtemp(prefix="moejax-backends-trace-")
    ctx = {"args": args, "cfg": cfg, "dtype": dtype, "devices": devices, "block": block,
           "batch_tokens": batch_tokens, "tokens": sum(h.real_tokens for h in hosts),
           "padded_tokens": len(hosts) * batch_tokens, "flops": models.useful_flops(cfg, hosts),
           "batch_flops": models.useful_flops(cfg, hosts) / len(hosts),
           "peak_tflops": peak_tflops, "peak_source": peak_source, "trace_root": trace_root}
    print(f"backends on {jax.default_backend()} ({jax.devices()[0].device_kind}), {devices} "
          f"device(s); Qwen3-MoE d={cfg.hidden_size} L={cfg.num_layers} E={cfg.num_experts} "
          f"k={cfg.num_experts_per_tok} f={cfg.moe_intermediate_size} V={cfg.vocab_size}, "
          f"{dtype}, random weights")
    print(f"workload: {len(hosts)} batches of {batch_tokens} tokens (block {block}), "
          f"{ctx['tokens']} real tokens, {ctx['flops']:.3g} useful FLOPs; peak "
          f"{peak_tflops:.3g} TFLOP/s per device ({peak_source}); median of {args.repeats} "
          f"timed pass(es)", flush=True)
    params = init_params(cfg, seed=0, dtype=np.float32)
    results: dict[str, Result] = {}
    skipped: dict[str, str] = {}
    try:
        for name in args.backends.split(","):
            count = backend_devices(name, cfg, devices)
            backend, why = build_backend(name, cfg, params, count,
                                         backend_options(name, args, dtype))
            if backend is None:
                skipped[name] = why
                print(f"  [{name}] skipped: {why}", flush=True)
                continue
            if name == "tp" and count != devices:
                print(f"  [tp] runs on {count} device(s): heads {cfg.num_heads}/"
                      f"{cfg.num_kv_heads} are not divisible by {devices}")
            try:
                results[name] = measure_backend(name, backend, hosts, ctx)
            except Exception as exc:  # noqa: BLE001  (one broken backend must not end the run)
                skipped[name] = f"failed while running ({type(exc).__name__}: {exc})"
                print(f"  [{name}] skipped: {skipped[name]}", flush=True)
            del backend
            gc.collect()          # jitted closures keep the backend (and its buffers) alive
    finally:
        if not args.trace_dir:
            shutil.rmtree(trace_root, ignore_errors=True)
    rel = ratios(results)
    print()
    print_results(results, rel)
    print_memory(results)
    print_trace_details(results)
    print_exposed_split(results)
    print_lag_ratios(results)
    if jax.default_backend() == "cpu":
        print("\n" + CPU_NOTE)
        print("MFU on CPU: peak = measured matmul of the whole machine; device factor 1 "
              "(the forced host devices share its cores).")
    figures = json_figures(results, rel, ctx, skipped)
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

"""The whole Qwen3-30B-A3B-shaped model (48 layers) on one device: tokens/s and MFU.

Model: d=2048, 32/4 heads of 128, E=128, k=8, f=768, V=151936, 48 layers, random bf16
weights (``--quick``: a tiny Qwen3-MoE in f32 on CPU). The weights are made where they
live, one layer slice at a time (a jitted fill of a preallocated stack, donated), so no
array exists twice: on the device for ``resident``, in host memory for ``offload``.

Which backend (``--backend auto``) is decided by arithmetic before anything is
allocated, and printed: weight bytes from the config's parameter shapes; activation
bytes from XLA's own memory analysis of the resident forward compiled for abstract
arguments (nothing allocated); device memory from the device's ``bytes_limit``.
``resident`` when weights + activations + 5% fit at a batch of at least
``--min-tokens`` (the largest of ``--tokens`` candidates that fits), else ``offload``
(experts in pinned host memory, a window of layers streamed in; its host memory is
checked the same way: the host copy plus the pinned copy).

Reported: tokens/s (real tokens of the packed batch, median of ``--repeats``), MFU =
useful FLOPs (``benchmarks.lib.models.useful_flops``: the config's own FLOP model, padding
not counted) / (wall × peak), the peak as ``benchmarks.lib.timing.device_peak``; for
offload also Θ and the batch over Θ (``moejax.calibrate``: offload hides its copies
when one batch is at least Θ of work; raise ``--tokens`` until it is). Beside it the
paper's per-GPU MoE-Prefill figures (29.8-36.2% MFU).

    python -m benchmarks.full_model [--quick] [--json PATH] [--backend auto|resident|offload]
        [--tokens T[,T...]] [--min-tokens T] [--block B] [--layers L] [--dtype D]
        [--window W] [--repeats N] [--peak-tflops X]

JSON keys (flat): ``full_model_tokens_per_s``, ``full_model_mfu``, ``full_model_backend``,
``full_model_layers``, ``full_model_tokens``, ``full_model_padded_tokens``,
``full_model_wall_s``, ``full_model_weight_bytes``, ``full_model_temp_bytes``,
``full_model_device_bytes``, ``full_model_batch_over_theta`` (offload),
``paper_moe_prefill_mfu_low``, ``paper_moe_prefill_mfu_high``, ``platform``,
``device_kind``, ``dtype``, ``peak_tflops``, ``decision`` (the arithmetic, as text).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks.lib import models
from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.meta import finish_run, platform_figures
from benchmarks.lib.timing import device_peak, is_gpu, median_seconds

PAPER_MFU = (0.298, 0.362)      # the paper's per-GPU MoE-Prefill MFU range
FULL_LAYERS = 48
HEADROOM = 1.05                 # weights + activations must fit with 5% to spare
GIB = 2 ** 30


# ==================================================================== arithmetic
def fmt_bytes(count: int) -> str:
    """Bytes in GiB (MiB below one GiB)."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2 ** 20:.2f} MiB"


def weight_bytes(cfg: Any, dtype: Any) -> int:
    """Bytes of every parameter of ``cfg`` in ``dtype`` (from the parameter shapes)."""
    from moejax.param_layout import num_params

    return num_params(cfg) * np.dtype(dtype).itemsize


def expert_weight_bytes(cfg: Any, dtype: Any) -> int:
    return cfg.expert_bytes_per_layer(np.dtype(dtype).itemsize) * cfg.num_layers


def abstract_params(cfg: Any, dtype: Any) -> dict[str, Any]:
    """The params as ShapeDtypeStructs (for compiling without allocating)."""
    import jax

    from moejax.param_layout import param_shapes

    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(cfg),
                        is_leaf=lambda s: isinstance(s, tuple))


def compile_resident(cfg: Any, dtype: Any, host: Any) -> Any:
    """The resident forward compiled for abstract params and this batch's shapes."""
    import jax
    import jax.numpy as jnp

    from moejax import model as model_lib

    batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), host.batch)
    jitted = jax.jit(model_lib.forward, static_argnames=("cfg", "opts"))
    return jitted.lower(abstract_params(cfg, jnp.dtype(dtype)), batch, cfg=cfg,
                        opts=host.options).compile()


def temp_bytes(compiled: Any) -> int:
    """XLA's temp + output bytes of a compiled program (0 where it reports none)."""
    analysis = compiled.memory_analysis()
    if analysis is None:
        return 0
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes)


def device_bytes(device: Any) -> int:
    """Memory one device can hold: its allocator limit, else (CPU) physical memory."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_bytes()


def host_bytes() -> int:
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclasses.dataclass
class Plan:
    backend: str
    tokens: int
    weights: int
    temp: int
    capacity: int
    lines: list[str]
    compiled: Any = None


def fits(weights: int, temp: int, capacity: int) -> bool:
    """Do weights + activations fit in ``capacity`` with the headroom to spare?"""
    return (weights + temp) * HEADROOM <= capacity


def plan_resident(cfg: Any, dtype: str, candidates: Sequence[int], min_tokens: int,
                  capacity: int, workload: Callable[[int], Any]) -> Plan:
    """The largest candidate batch (>= min_tokens) at which the resident model fits,
    else an offload plan at the smallest candidate; every step printed as arithmetic."""
    weights = weight_bytes(cfg, dtype)
    lines = [f"weights: {fmt_bytes(weights)} ({weights // np.dtype(dtype).itemsize / 1e9:.3g} B params x "
             f"{np.dtype(dtype).itemsize} B), experts {fmt_bytes(expert_weight_bytes(cfg, dtype))}"
             f"; device capacity {fmt_bytes(capacity)}"]
    if fits(weights, 0, capacity):
        for tokens in sorted(candidates, reverse=True):
            if tokens < min_tokens:
                continue
            compiled = compile_resident(cfg, dtype, workload(tokens))
            temp = temp_bytes(compiled)
            ok = fits(weights, temp, capacity)
            lines.append(f"resident at {tokens} tokens: {fmt_bytes(weights)} + "
                         f"{fmt_bytes(temp)} activations (XLA) = {fmt_bytes(weights + temp)}"
                         f" x {HEADROOM} {'<=' if ok else '>'} {fmt_bytes(capacity)}")
            if ok:
                return Plan("resident", tokens, weights, temp, capacity, lines, compiled)
    else:
        lines.append(f"resident: weights alone x {HEADROOM} exceed the device")
    return Plan("offload", min(candidates), weights, 0, capacity, lines)


def offload_host_check(cfg: Any, dtype: str) -> tuple[bool, str]:
    """Host memory for offload: the NumPy params plus the pinned copy of the experts."""
    need = weight_bytes(cfg, dtype) + expert_weight_bytes(cfg, dtype)
    have = host_bytes()
    ok = need * HEADROOM <= have
    return ok, (f"offload host memory: params {fmt_bytes(weight_bytes(cfg, dtype))} + pinned "
                f"experts {fmt_bytes(expert_weight_bytes(cfg, dtype))} = {fmt_bytes(need)} "
                f"x {HEADROOM} {'<=' if ok else '>'} {fmt_bytes(have)} host")


# ==================================================================== measuring
@dataclasses.dataclass
class Measured:
    wall_s: float
    batch_over_theta: float | None


def measure_resident(plan: Plan, cfg: Any, dtype: str, host: Any, repeats: int) -> Measured:
    import jax

    device = jax.devices()[0]
    params = models.device_params(cfg, dtype, device)
    batch = jax.device_put(host.batch, device)
    wall = median_seconds(lambda: jax.block_until_ready(plan.compiled(params, batch)), repeats,
                          label="resident_forward")
    return Measured(wall_s=wall, batch_over_theta=None)


def measure_offload(cfg: Any, dtype: str, host: Any, args: argparse.Namespace) -> Measured:
    from moejax.backends import make_backend
    from moejax.calibrate import calibrate

    import jax

    backend = make_backend("offload", cfg, models.host_params(cfg, dtype), dtype=dtype,
                           window=args.window)
    wall = median_seconds(lambda: jax.block_until_ready(backend.step([host.batch], host.options)),
                          args.repeats, label="offload_step")
    calibration = calibrate(backend, reference_tokens=host.batch.tokens.shape[0],
                            reference_sequence=host.options.attn_block, repeats=2,
                            max_batch_tokens=host.batch.tokens.shape[0])
    over = (models.useful_flops(cfg, [host]) / calibration.theta if calibration.theta
            else math.inf)
    print(f"offload: Θ = {calibration.theta:.3g} FLOPs ({calibration.source}); one batch = "
          f"{over:.3g} Θ{'' if over >= 1 else ' (< 1: copies exposed; raise --tokens)'}")
    return Measured(wall_s=wall, batch_over_theta=over if math.isfinite(over) else None)


# ==================================================================== main
def model_config(args: argparse.Namespace) -> tuple[Any, str]:
    """The benchmark model (``benchmarks.lib.models.model_shape``) at the full depth (48
    layers unless --layers)."""
    shape_args = argparse.Namespace(quick=args.quick, dtype=args.dtype,
                                    layers=args.layers or (None if args.quick else FULL_LAYERS))
    return models.model_shape(shape_args)


def token_candidates(args: argparse.Namespace) -> list[int]:
    if args.tokens:
        return [int(t) for t in args.tokens.split(",")]
    if args.quick:
        return [128]
    return [65536, 32768, 16384] if is_gpu() else [1024]


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, quick_help="tiny model, seconds on CPU", repeats=3,
                          repeats_help="timed runs (median)")
    parser.add_argument("--backend", choices=("auto", "resident", "offload"), default="auto")
    parser.add_argument("--tokens", help="batch sizes to try, largest first that fits "
                        "(powers of two; default 65536,32768,16384 GPU, 1024 CPU, 128 quick)")
    parser.add_argument("--min-tokens", type=int, help="smallest useful resident batch "
                        "(default: the smallest candidate)")
    parser.add_argument("--block", type=int, help="attention block (default 512 GPU, 128 CPU, "
                        "32 quick)")
    parser.add_argument("--layers", type=int, help=f"decoder layers (default {FULL_LAYERS})")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"))
    parser.add_argument("--window", type=int, default=2, help="offload window (layers)")
    parser.add_argument("--peak-tflops", type=float, help="device peak used for MFU")
    return parser


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    cfg, dtype = model_config(args)
    candidates = token_candidates(args)
    block, _ = models.workload_shape(args.quick, args.block, min(candidates), tokens_flag="--tokens")
    workload = lambda tokens: models.make_workload(cfg, 1, block, tokens)[0]  # noqa: E731
    capacity = device_bytes(jax.devices()[0])
    plan = plan_resident(cfg, dtype, candidates, args.min_tokens or min(candidates), capacity,
                         workload) if args.backend != "offload" else \
        Plan("offload", min(candidates), weight_bytes(cfg, dtype), 0, capacity, [])
    if args.backend == "resident" and plan.backend != "resident":
        raise SystemExit("resident does not fit:\n  " + "\n  ".join(plan.lines))
    if plan.backend == "offload":
        ok, line = offload_host_check(cfg, dtype)
        plan.lines.append(line)
        if not ok:
            raise SystemExit("neither backend fits:\n  " + "\n  ".join(plan.lines))
    print("memory arithmetic:\n  " + "\n  ".join(plan.lines) + f"\n-> {plan.backend} at "
          f"{plan.tokens} tokens per batch", flush=True)
    host = workload(plan.tokens)
    measured = (measure_resident(plan, cfg, dtype, host, args.repeats) if plan.backend ==
                "resident" else measure_offload(cfg, dtype, host, args))
    peak, peak_source = device_peak(args.peak_tflops, dtype)
    mfu = models.useful_flops(cfg, [host]) / (measured.wall_s * peak * 1e12)
    tokens_per_s = host.real_tokens / measured.wall_s
    print(f"full model ({cfg.num_layers} layers, {plan.backend}, {dtype}) on "
          f"{jax.devices()[0].device_kind}: {plan.tokens}-token batch ({host.real_tokens} real) "
          f"in {measured.wall_s * 1e3:.1f} ms -> {tokens_per_s:.0f} tokens/s, MFU "
          f"{100 * mfu:.2f}% of {peak:.3g} TFLOP/s ({peak_source}); paper MoE-Prefill per GPU: "
          f"{100 * PAPER_MFU[0]:.1f}-{100 * PAPER_MFU[1]:.1f}% MFU")
    return {
        **platform_figures(), "dtype": dtype, "peak_tflops": peak, "full_model_backend": plan.backend,
        "full_model_layers": cfg.num_layers, "full_model_tokens": host.real_tokens,
        "full_model_padded_tokens": plan.tokens, "full_model_wall_s": measured.wall_s,
        "full_model_tokens_per_s": tokens_per_s, "full_model_mfu": mfu,
        "full_model_weight_bytes": plan.weights, "full_model_temp_bytes": plan.temp,
        "full_model_device_bytes": plan.capacity,
        "full_model_batch_over_theta": measured.batch_over_theta,
        "paper_moe_prefill_mfu_low": PAPER_MFU[0], "paper_moe_prefill_mfu_high": PAPER_MFU[1],
        "decision": "; ".join(plan.lines)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(build_parser(), argv, gpu_overlap_flags=True)
    figures = run(args)
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

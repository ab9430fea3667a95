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
useful FLOPs (``benchmarks.backends.useful_flops``: the config's own FLOP model, padding
not counted) / (wall × peak), the peak as ``benchmarks.backends.device_peak``; for
offload also Θ and the batch over Θ (``moejax.calibrate``: offload hides its copies
when one batch is at least Θ of work; raise ``--tokens`` until it is). Beside it the
paper's per-GPU MoE-Prefill figures (29.8-36.2% MFU).

    python benchmarks/full_model.py [--quick] [--json PATH] [--backend auto|resident|offload]
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
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks import backends as bk  # noqa: E402  (sets the CPU host-device flag)
from benchmarks.figures import write_json  # noqa: E402

import moejax  # noqa: E402

PAPER_MFU = (0.298, 0.362)      # the paper's per-GPU MoE-Prefill MFU range
FULL_LAYERS = 48
SCALE = 0.02
HEADROOM = 1.05                 # weights + activations must fit with 5% to spare
GIB = 2 ** 30


# ==================================================================== random weights
def is_norm(name: str) -> bool:
    return name.endswith("norm")


def random_slice(key: Any, shape: tuple[int, ...], dtype: Any, norm: bool) -> Any:
    """One array of random weights on the default device: ones for a norm, else
    N(0, SCALE²) drawn in f32 and cast."""
    import jax
    import jax.numpy as jnp

    if norm:
        return jnp.ones(shape, dtype)
    return (jax.random.normal(key, shape, jnp.float32) * SCALE).astype(dtype)


def _fill_layer(stack: Any, index: Any, key: Any, *, norm: bool) -> Any:
    import jax

    piece = random_slice(key, stack.shape[1:], stack.dtype, norm)
    return jax.lax.dynamic_update_index_in_dim(stack, piece, index, axis=0)


def device_stack(name: str, shape: tuple[int, ...], dtype: Any, key: Any, device: Any) -> Any:
    """A stacked [L, ...] leaf made on ``device`` one layer at a time (the stack is
    donated to each fill: the only extra memory is one layer's f32 draw)."""
    import functools

    import jax
    import jax.numpy as jnp

    fill = jax.jit(functools.partial(_fill_layer, norm=is_norm(name)), donate_argnums=0)
    stack = jax.device_put(jnp.zeros(shape, dtype), device)
    for layer in range(shape[0]):
        stack = fill(stack, layer, jax.random.fold_in(key, layer))
    return stack


def leaf_keys(cfg: Any, seed: int) -> dict[str, Any]:
    """One PRNG key per parameter path ('embed', 'layers.w_gate', ...)."""
    import jax

    from moejax.param_layout import param_shapes, tree_items

    root = jax.random.PRNGKey(seed)
    return {path: jax.random.fold_in(root, i)
            for i, (path, _) in enumerate(tree_items(param_shapes(cfg)))}


def device_params(cfg: Any, dtype: Any, device: Any, seed: int = 0) -> dict[str, Any]:
    """Random params (the layout of ``moejax.param_layout``) made on ``device``."""
    import jax
    import jax.numpy as jnp

    from moejax.param_layout import param_shapes

    dtype, keys = jnp.dtype(dtype), leaf_keys(cfg, seed)
    out: dict[str, Any] = {"layers": {}}
    for name, shape in param_shapes(cfg).items():
        if name == "layers":
            for sub, sub_shape in shape.items():
                out["layers"][sub] = device_stack(sub, sub_shape, dtype,
                                                  keys[f"layers.{sub}"], device)
        else:
            with jax.default_device(device):
                out[name] = random_slice(keys[name], shape, dtype, is_norm(name))
    return out


def host_params(cfg: Any, dtype: Any, seed: int = 0) -> dict[str, Any]:
    """The same random params as NumPy arrays in host memory, drawn on the default
    device one layer slice at a time and copied into a preallocated host stack."""
    import jax
    import jax.numpy as jnp

    from moejax.param_layout import param_shapes

    dtype, keys = jnp.dtype(dtype), leaf_keys(cfg, seed)
    out: dict[str, Any] = {"layers": {}}
    for name, shape in param_shapes(cfg).items():
        if name == "layers":
            for sub, sub_shape in shape.items():
                stack = np.empty(sub_shape, dtype)
                for layer in range(sub_shape[0]):
                    key = jax.random.fold_in(keys[f"layers.{sub}"], layer)
                    stack[layer] = np.asarray(random_slice(key, sub_shape[1:], dtype, is_norm(sub)))
                out["layers"][sub] = stack
        else:
            out[name] = np.asarray(random_slice(keys[name], shape, dtype, is_norm(name)))
    return out


# ==================================================================== arithmetic
def fmt_bytes(count: int) -> str:
    """Bytes in GiB (MiB below one GiB)."""
    return f"{count / GIB:.2f} GiB" if count >= GIB else f"{count / 2 ** 20:.2f} MiB"


def weight_bytes(cfg: Any, dtype: Any) -> int:
    """Bytes of every parameter of ``cfg`` in ``dtype`` (from the parameter shapes)."""
    from moejax.param_layout import param_shapes, tree_items

    itemsize = np.dtype(dtype).itemsize
    return int(sum(math.prod(shape) * itemsize for _, shape in tree_items(param_shapes(cfg))))


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
    lines = [f"weights: {fmt_bytes(weights)} ({cfg.num_params() / 1e9:.3g} B params x "
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


def median_wall(run: Callable[[], Any], repeats: int) -> float:
    """Median synchronized wall seconds of ``run`` (after one warm-up)."""
    import jax

    from moejax.calibrate import median_seconds

    return median_seconds(lambda: jax.block_until_ready(run()), repeats)


def measure_resident(plan: Plan, cfg: Any, dtype: str, host: Any, repeats: int) -> Measured:
    import jax

    device = jax.devices()[0]
    params = device_params(cfg, dtype, device)
    batch = jax.device_put(host.batch, device)
    wall = median_wall(lambda: plan.compiled(params, batch), repeats)
    return Measured(wall_s=wall, batch_over_theta=None)


def measure_offload(cfg: Any, dtype: str, host: Any, args: argparse.Namespace) -> Measured:
    from moejax.backends import make_backend
    from moejax.calibrate import calibrate

    backend = make_backend("offload", cfg, host_params(cfg, dtype), dtype=dtype,
                           window=args.window)
    wall = median_wall(lambda: backend.step([host.batch], host.options), args.repeats)
    calibration = calibrate(backend, reference_tokens=host.batch.tokens.shape[0],
                            reference_sequence=host.options.attn_block, repeats=2,
                            max_batch_tokens=host.batch.tokens.shape[0])
    over = (bk.useful_flops(cfg, [host]) / calibration.theta if calibration.theta
            else math.inf)
    print(f"offload: Θ = {calibration.theta:.3g} FLOPs ({calibration.source}); one batch = "
          f"{over:.3g} Θ{'' if over >= 1 else ' (< 1: copies exposed; raise --tokens)'}")
    return Measured(wall_s=wall, batch_over_theta=over if math.isfinite(over) else None)


# ==================================================================== main
def model_config(args: argparse.Namespace) -> tuple[Any, str]:
    """benchmarks.backends' model shape at the full depth (48 layers unless --layers)."""
    shape_args = argparse.Namespace(quick=args.quick, dtype=args.dtype,
                                    layers=args.layers or (None if args.quick else FULL_LAYERS))
    return bk.model_shape(shape_args)


def token_candidates(args: argparse.Namespace) -> list[int]:
    if args.tokens:
        return [int(t) for t in args.tokens.split(",")]
    if args.quick:
        return [128]
    return [65536, 32768, 16384] if bk.is_gpu() else [1024]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, seconds on CPU")
    parser.add_argument("--json", dest="json_path", help="write the figures to this JSON file")
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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, help="device peak used for MFU")
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    cfg, dtype = model_config(args)
    block = args.block or (32 if args.quick else 512 if bk.is_gpu() else 128)
    candidates = token_candidates(args)
    workload = lambda tokens: bk.make_workload(cfg, 1, block, tokens)[0]  # noqa: E731
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
    peak, peak_source = bk.device_peak(args, dtype)
    mfu = bk.useful_flops(cfg, [host]) / (measured.wall_s * peak * 1e12)
    tokens_per_s = host.real_tokens / measured.wall_s
    print(f"full model ({cfg.num_layers} layers, {plan.backend}, {dtype}) on "
          f"{jax.devices()[0].device_kind}: {plan.tokens}-token batch ({host.real_tokens} real) "
          f"in {measured.wall_s * 1e3:.1f} ms -> {tokens_per_s:.0f} tokens/s, MFU "
          f"{100 * mfu:.2f}% of {peak:.3g} TFLOP/s ({peak_source}); paper MoE-Prefill per GPU: "
          f"{100 * PAPER_MFU[0]:.1f}-{100 * PAPER_MFU[1]:.1f}% MFU")
    return {
        "platform": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
        "dtype": dtype, "peak_tflops": peak, "full_model_backend": plan.backend,
        "full_model_layers": cfg.num_layers, "full_model_tokens": host.real_tokens,
        "full_model_padded_tokens": plan.tokens, "full_model_wall_s": measured.wall_s,
        "full_model_tokens_per_s": tokens_per_s, "full_model_mfu": mfu,
        "full_model_weight_bytes": plan.weights, "full_model_temp_bytes": plan.temp,
        "full_model_device_bytes": plan.capacity,
        "full_model_batch_over_theta": measured.batch_over_theta,
        "paper_moe_prefill_mfu_low": PAPER_MFU[0], "paper_moe_prefill_mfu_high": PAPER_MFU[1],
        "decision": "; ".join(plan.lines)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    moejax.configure_xla()          # before JAX starts: the GPU flags
    figures = run(args)
    write_json(args.json_path, figures)
    return figures


if __name__ == "__main__":
    main()

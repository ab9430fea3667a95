"""Grouped GEMM for MoE experts: the Pallas kernel against its peers, side by side.

Times ``lhs [T·k, d] × rhs [E, d, f]`` with rows sorted by expert (group sizes from a
random top-k routing of T tokens) on the expert shapes of Qwen3-30B-A3B (d=2048,
f=768, E=128, k=8) and Mixtral-8x7B (d=4096, f=14336, E=8, k=2) at 4K–64K tokens:

* ``pallas``       kernels_pallas.gmm.gmm on its Triton backend (interpreted off GPU)
* ``mosaic``       the same kernel's Mosaic GPU port (kernels_pallas.gmm_mosaic; bf16/f16
                   on a GPU; off GPU only where its tiles divide the shape, simulated)
* ``ragged_dot``   jax.lax.ragged_dot (XLA's own; the reference the ratios divide by)
* ``tokamax``      tokamax.ragged_dot, where the package is installed (skipped otherwise)
* ``jax_tiles``    moejax.grouped_gemm.gmm, the pure-JAX tiled loop (the CPU default)
* ``dense_onehot`` every row through every expert, masked (E× the work; skipped past
                   ``DENSE_MAX_BYTES`` of intermediate)

plus the fused gate/up kernel against two grouped GEMMs and a SiLU, and a plain dense
matmul of the same dtype as the device's measured matmul rate. Prints TFLOP/s (routed
FLOPs 2·T·k·d·f over median time) and each path's ratio to ``ragged_dot``.

On a GPU the targets are pallas ≥ 1.0× ragged_dot at ≥ 16K tokens and ≥ 50% of the
measured matmul rate (issue 22: ≥ 65% on the Qwen3 shape, ≥ 75% on Mixtral's, by the
faster of the two backends). ``{M}_{N}_mosaic_over_triton`` ≥ 1.0 on both shapes is
the rule that makes ``kernels_pallas.gmm_select`` run Mosaic on that device. Each shape
also prints what the group-aware schedule costs: the share of multiplied rows that are
masked (``work_item_waste``: one whole tile per (group, tile) pair) against padding each
group to whole tiles (``padded_waste``). Off GPU the defaults shrink to CPU-sized shapes: the run only
shows the paths work (Pallas is interpreted there).

    python -m benchmarks.gmm [--quick] [--json PATH] [--models qwen3,mixtral] [--tokens 4096,16384]
        [--matmul-tflops X]   (the rate the fractions divide by; default: measured here)

JSON keys (flat): ``matmul_tflops``, ``matmul_source``; per model M and token count N:
``{M}_{N}_{path}_tflops``, ``{M}_{N}_{path}_over_ragged_dot``,
``{M}_{N}_pallas_fraction_of_matmul``, ``{M}_{N}_swiglu_fused_over_separate``,
``{M}_{N}_mosaic_fraction_of_matmul``, ``{M}_{N}_mosaic_over_triton``,
``{M}_{N}_swiglu_mosaic_over_triton``, ``{M}_{N}_best_fraction_of_matmul``,
``{M}_{N}_best_backend``, ``{M}_{N}_work_item_waste``, ``{M}_{N}_padded_waste``;
and ``platform``, ``dtype``. A path that fails (``ragged_dot`` materializes the dense
``[E, T·k, f]`` product on GPUs and runs out of memory at large shapes) is recorded as
``{M}_{N}_{path}_failed`` with the error's first line, and has no ratio. With
``--sweep-tiles`` (GPU: times the Pallas kernels over :data:`TILE_CANDIDATES` to fill
``kernels_pallas.gmm.GMM_TILES`` and ``SWIGLU_TILES``):
``{M}_{N}_pallas_best_tflops``, ``{M}_{N}_pallas_best_over_table`` and
``{M}_{N}_pallas_best_tiles`` (a string ``m128_k64_n128_w8_s3``), and the same three for
the fused kernel under ``{M}_{N}_swiglu_pallas_best_*``; with a Mosaic path, the same
over :data:`MOSAIC_TILE_CANDIDATES` under ``{M}_{N}_mosaic_best_*``.
"""

from __future__ import annotations

import argparse

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.meta import finish_run
from benchmarks.lib.timing import is_gpu, matmul_tflops, median_seconds_rotating
from kernels_pallas import gmm as pallas_gmm
from kernels_pallas import gmm_mosaic, gmm_select, tile_schedule
from moejax import grouped_gemm


@dataclasses.dataclass(frozen=True)
class ExpertShape:
    hidden: int
    intermediate: int
    experts: int
    top_k: int

    @property
    def gemm_shape(self) -> tuple[int, int, int]:
        """(d, f, E): the key of the tile tables' shape entries."""
        return self.hidden, self.intermediate, self.experts


MODELS = {
    "qwen3": ExpertShape(hidden=2048, intermediate=768, experts=128, top_k=8),
    "mixtral": ExpertShape(hidden=4096, intermediate=14336, experts=8, top_k=2),
    # CPU stand-ins: same E and k, narrower matrices.
    "qwen3_cpu": ExpertShape(hidden=256, intermediate=128, experts=128, top_k=8),
    "mixtral_cpu": ExpertShape(hidden=512, intermediate=1024, experts=8, top_k=2),
    "tiny": ExpertShape(hidden=128, intermediate=64, experts=16, top_k=4),
}
GPU_DEFAULT = (("qwen3", "mixtral"), (4096, 16384, 65536))
CPU_DEFAULT = (("qwen3_cpu", "mixtral_cpu"), (512, 2048))
QUICK = (("tiny",), (256,))
DENSE_MAX_BYTES = 4 << 30      # the one-hot path materializes [E, T·k, f] in f32
INPUT_SETS = 2                 # rotate inputs so repeated runs do not just hit the cache
# Tiles tried by --sweep-tiles: (block_m, block_k, block_n, num_warps, num_stages).
TILE_CANDIDATES = ((64, 64, 64, 4, 3), (64, 64, 128, 4, 3), (64, 32, 128, 4, 4),
                   (128, 64, 64, 4, 3), (128, 64, 128, 4, 3), (128, 64, 128, 8, 3),
                   (128, 64, 128, 8, 4), (128, 32, 128, 8, 4), (128, 64, 256, 8, 3),
                   (64, 64, 256, 8, 3), (256, 64, 128, 8, 3), (128, 128, 128, 8, 2),
                   (128, 64, 256, 8, 4), (128, 32, 256, 8, 4), (256, 64, 256, 8, 3))

# Mosaic GPU tiles tried by --sweep-tiles: (block_m, block_n, stages, grid_block_n); those
# over an H100 block's shared memory or the accumulator register budget are left out.
MOSAIC_TILE_CANDIDATES = ((128, 128, 4, 1), (128, 128, 4, 4), (128, 128, 3, 8),
                          (128, 128, 6, 4), (64, 256, 4, 4), (64, 256, 3, 1),
                          (64, 128, 6, 4), (128, 64, 6, 8), (64, 192, 4, 4))


def routed_group_sizes(tokens: int, shape: ExpertShape, seed: int) -> np.ndarray:
    """Rows per expert after a random top-k routing of ``tokens`` tokens."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((tokens, shape.experts)).astype(np.float32)
    topk = np.argpartition(-logits, shape.top_k - 1, axis=1)[:, :shape.top_k]
    return np.bincount(topk.reshape(-1), minlength=shape.experts).astype(np.int32)


def mosaic_path(shape: ExpertShape, dtype):
    """The Mosaic GPU kernel as a path, or why it cannot run this shape here."""
    if not is_gpu():
        return ("off a GPU Mosaic GPU only runs simulated (seconds per call; "
                "tests/test_gmm_mosaic.py checks it there)")
    if jnp.dtype(dtype).name not in gmm_mosaic.SUPPORTED_DTYPES:
        return f"Mosaic GPU takes {gmm_mosaic.SUPPORTED_DTYPES}, not {jnp.dtype(dtype).name}"
    tiles = gmm_select.mosaic_tiles_for(dtype, shape=shape.gemm_shape)
    if shape.hidden % tiles.block_k or shape.intermediate % tiles.block_n:
        return f"its tiles {tiles} do not divide d={shape.hidden}, f={shape.intermediate}"
    return jax.jit(lambda x, w, s: gmm_mosaic.gmm_mosaic(x, w, s, tiles=tiles))


def grouped_paths(shape: ExpertShape, rows: int, dtype, skip: frozenset[str] = frozenset()):
    """name -> jitted fn(lhs, rhs, group_sizes), or name -> reason it is skipped."""
    paths = {
        "pallas": jax.jit(lambda x, w, s: pallas_gmm.gmm(x, w, s, backend="triton")),
        "mosaic": mosaic_path(shape, dtype),
        "ragged_dot": jax.jit(lambda x, w, s: jax.lax.ragged_dot(
            x, w, s, preferred_element_type=jnp.float32).astype(x.dtype)),
        "jax_tiles": jax.jit(lambda x, w, s: grouped_gemm.gmm(x, w, s)),
    }
    try:
        import tokamax
        from absl import flags
        # tokamax reads absl flags, which would otherwise parse this script's own argv.
        if not flags.FLAGS.is_parsed():
            flags.FLAGS([sys.argv[0]])
        paths["tokamax"] = jax.jit(lambda x, w, s: tokamax.ragged_dot(
            x, w, s, preferred_element_type=jnp.float32).astype(x.dtype))
    except ImportError as exc:
        paths["tokamax"] = f"tokamax not importable ({exc}; pip install tokamax)"
    dense_bytes = shape.experts * rows * shape.intermediate * 4
    if dense_bytes <= DENSE_MAX_BYTES:
        paths["dense_onehot"] = jax.jit(dense_onehot)
    else:
        paths["dense_onehot"] = (f"needs {dense_bytes / 2**30:.0f} GiB for [E, T·k, f] "
                                 f"(> {DENSE_MAX_BYTES >> 30} GiB)")
    for name in skip & set(paths):
        paths[name] = "--skip"
    return paths


def dense_onehot(x: jax.Array, w: jax.Array, sizes: jax.Array) -> jax.Array:
    one_hot = jax.nn.one_hot(grouped_gemm.group_ids(sizes, x.shape[0]), w.shape[0],
                             dtype=jnp.float32)
    per_expert = jnp.einsum("md,edf->emf", x, w, preferred_element_type=jnp.float32)
    return jnp.einsum("emf,me->mf", per_expert, one_hot).astype(x.dtype)


def separate_swiglu(x, w_gate, w_up, sizes):
    gate = pallas_gmm.gmm(x, w_gate, sizes).astype(jnp.float32)
    up = pallas_gmm.gmm(x, w_up, sizes).astype(jnp.float32)
    return (jax.nn.silu(gate) * up).astype(x.dtype)


def tiles_name(tiles: pallas_gmm.GmmTiles) -> str:
    return (f"m{tiles.block_m}_k{tiles.block_k}_n{tiles.block_n}_w{tiles.num_warps}"
            f"_s{tiles.num_stages}")


def rank_tiles(key: str, candidates: dict, table_name: str, run, sets, flops: float,
               repeats: int) -> dict:
    """Time ``run(*inputs, tiles=t)`` for every named candidate ``t``; print them fastest
    first (the table's own marked) and return ``{key}_best_tiles``, ``{key}_best_tflops``
    and ``{key}_best_over_table`` (None: the table's own tiles failed on this device)."""
    seconds = {}
    for name, tiles in candidates.items():
        fn = jax.jit(lambda *args, _t=tiles: run(*args, tiles=_t))
        try:
            seconds[name] = median_seconds_rotating(fn, sets, repeats, label=f"{key}_{name}")
        except Exception as exc:  # noqa: BLE001  (a tile the chip or compiler refuses)
            print(f"    tiles {name:<22} failed: {type(exc).__name__}: {str(exc)[:120]}")
    ranked = sorted(seconds, key=seconds.get)
    if not ranked:
        return {}
    for name in ranked:
        mark = "  (table)" if name == table_name else ""
        print(f"    tiles {name:<22} {seconds[name] * 1e3:9.3f} ms "
              f"{flops / seconds[name] / 1e12:8.1f} TFLOP/s{mark}")
    best, table_seconds = ranked[0], seconds.get(table_name)
    return {f"{key}_best_tiles": best,
            f"{key}_best_tflops": flops / seconds[best] / 1e12,
            f"{key}_best_over_table": (table_seconds / seconds[best]
                                       if table_seconds is not None else None)}


def sweep_tiles(prefix: str, sets, flops: float, dtype, repeats: int,
                kernel: str = "gmm") -> dict:
    """Time a Pallas kernel (``gmm`` or the fused ``swiglu``) with each of
    :data:`TILE_CANDIDATES` (and the table's entry); print them fastest first and return
    the best."""
    table = pallas_gmm.tiles_for(dtype, kernel=kernel)
    run = pallas_gmm.gmm if kernel == "gmm" else pallas_gmm.gmm_swiglu
    candidates = {tiles_name(table): table}
    for m, k, n, warps, stages in TILE_CANDIDATES:
        tiles = pallas_gmm.GmmTiles(block_m=m, block_k=k, block_n=n, num_warps=warps,
                                    num_stages=stages)
        candidates.setdefault(tiles_name(tiles), tiles)
    return rank_tiles(f"{prefix}_pallas", candidates, tiles_name(table), run, sets, flops,
                      repeats)


def bench_shape(name: str, shape: ExpertShape, tokens: int, dtype, repeats: int,
                matmul_rate: float, sweep: bool = False,
                skip: frozenset[str] = frozenset()) -> dict:
    rows = tokens * shape.top_k
    sizes = jnp.asarray(routed_group_sizes(tokens, shape, seed=tokens))
    rng = np.random.default_rng(1)

    def inputs():
        x = jnp.asarray(rng.standard_normal((rows, shape.hidden)), dtype)
        w = jnp.asarray(rng.standard_normal((shape.experts, shape.hidden, shape.intermediate))
                        / np.sqrt(shape.hidden), dtype)
        return x, w, sizes

    sets = [inputs() for _ in range(INPUT_SETS)]
    flops = 2 * rows * shape.hidden * shape.intermediate
    prefix = f"{name}_{tokens}"
    figures, seconds = {}, {}
    print(f"\n{name} d={shape.hidden} f={shape.intermediate} E={shape.experts} "
          f"k={shape.top_k}, {tokens} tokens ({rows} rows, {flops / 1e9:.2f} GFLOP routed)")
    for path, fn in grouped_paths(shape, rows, dtype, skip).items():
        if isinstance(fn, str):
            print(f"  {path:<13} skipped: {fn}")
            continue
        try:
            seconds[path] = median_seconds_rotating(fn, sets, repeats, label=f"{prefix}_{path}")
        except jax.errors.JaxRuntimeError as exc:   # ragged_dot's dense product can OOM
            reason = str(exc).split("\n")[0][:160]
            figures[f"{prefix}_{path}_failed"] = reason
            print(f"  {path:<13} failed: {reason}")
            continue
        figures[f"{prefix}_{path}_tflops"] = flops / seconds[path] / 1e12
    reference = seconds.get("ragged_dot")
    for path, t in seconds.items():
        line = f"  {path:<13} {t * 1e3:10.3f} ms  {flops / t / 1e12:8.3f} TFLOP/s"
        if reference is not None:
            figures[f"{prefix}_{path}_over_ragged_dot"] = reference / t
            line += f"  {reference / t:6.2f}× ragged_dot"
        print(line)
    if "pallas" not in seconds:
        return figures
    figures[f"{prefix}_pallas_fraction_of_matmul"] = (
        figures[f"{prefix}_pallas_tflops"] / matmul_rate)
    print(f"  pallas at {figures[f'{prefix}_pallas_fraction_of_matmul']:.0%} of the dense "
          f"matmul rate ({matmul_rate:.3f} TFLOP/s)")

    swiglu_sets = [(x, w, w[:, :, ::-1], s) for x, w, s in sets]
    fused = median_seconds_rotating(jax.jit(pallas_gmm.gmm_swiglu), swiglu_sets, repeats,
                                    label=f"{prefix}_swiglu_fused")
    separate = median_seconds_rotating(jax.jit(separate_swiglu), swiglu_sets, repeats,
                                       label=f"{prefix}_swiglu_separate")
    figures[f"{prefix}_swiglu_fused_over_separate"] = separate / fused
    print(f"  gate/up+SiLU: fused kernel {fused * 1e3:.3f} ms, two GEMMs + SiLU "
          f"{separate * 1e3:.3f} ms ({separate / fused:.2f}×)")
    figures.update(schedule_waste(prefix, np.asarray(sizes), rows, dtype))
    if "mosaic" in seconds:
        figures.update(mosaic_figures(prefix, figures, seconds, matmul_rate, swiglu_sets,
                                      fused, repeats, shape, dtype))
    best = max(("pallas", "mosaic"), key=lambda p: figures.get(f"{prefix}_{p}_tflops", 0.0))
    figures[f"{prefix}_best_backend"] = "triton" if best == "pallas" else "mosaic"
    figures[f"{prefix}_best_fraction_of_matmul"] = figures[f"{prefix}_{best}_tflops"] / matmul_rate
    if sweep:
        print("  tile sweep, grouped GEMM:")
        figures.update(sweep_tiles(prefix, sets, flops, dtype, repeats))
        print("  tile sweep, fused gate/up kernel:")
        figures.update(sweep_tiles(f"{prefix}_swiglu", swiglu_sets, 2 * flops, dtype, repeats,
                                   kernel="swiglu"))
        if "mosaic" in seconds:
            print("  tile sweep, Mosaic GPU grouped GEMM:")
            figures.update(sweep_mosaic_tiles(prefix, sets, flops, dtype, repeats, shape))
    return figures


def schedule_waste(prefix: str, sizes: np.ndarray, rows: int, dtype) -> dict:
    """Masked share of the rows the work-item schedule multiplies, against padding each
    group to whole tiles, at the table's block_m (the rows past the groups included)."""
    block_m = pallas_gmm.tiles_for(dtype).block_m
    with_tail = np.append(sizes, rows - sizes.sum())
    items = tile_schedule.schedule_cost(with_tail, block_m)
    padded = tile_schedule.schedule_cost(with_tail, block_m, schedule="padded")
    print(f"  schedule at block_m={block_m}: {items.items} work items, {items.waste:.1%} of "
          f"multiplied rows masked; padding groups to tiles would waste {padded.waste:.1%}")
    return {f"{prefix}_work_item_waste": items.waste, f"{prefix}_padded_waste": padded.waste}


def mosaic_figures(prefix: str, figures: dict, seconds: dict, matmul_rate: float,
                   swiglu_sets, fused_triton: float, repeats: int, shape: ExpertShape,
                   dtype) -> dict:
    """The Mosaic kernels against the Triton ones (the measured rule's inputs)."""
    tiles = gmm_select.mosaic_tiles_for(dtype, kernel="swiglu", shape=shape.gemm_shape)
    fused = median_seconds_rotating(
        jax.jit(lambda *a: gmm_mosaic.gmm_swiglu_mosaic(*a, tiles=tiles)), swiglu_sets, repeats,
        label=f"{prefix}_swiglu_mosaic")
    out = {f"{prefix}_mosaic_fraction_of_matmul": figures[f"{prefix}_mosaic_tflops"] / matmul_rate,
           f"{prefix}_mosaic_over_triton": seconds["pallas"] / seconds["mosaic"],
           f"{prefix}_swiglu_mosaic_over_triton": fused_triton / fused}
    print(f"  mosaic at {out[f'{prefix}_mosaic_fraction_of_matmul']:.0%} of the matmul rate; "
          f"{out[f'{prefix}_mosaic_over_triton']:.2f}× triton (grouped GEMM), "
          f"{out[f'{prefix}_swiglu_mosaic_over_triton']:.2f}× (fused gate/up)")
    return out


def sweep_mosaic_tiles(prefix: str, sets, flops: float, dtype, repeats: int,
                       shape: ExpertShape) -> dict:
    """Time the Mosaic grouped GEMM over :data:`MOSAIC_TILE_CANDIDATES` that fit."""
    table = gmm_select.mosaic_tiles_for(dtype, shape=shape.gemm_shape)
    item = jnp.dtype(dtype).itemsize
    candidates = {mosaic_tiles_name(table): table}
    for m, n, stages, group_n in MOSAIC_TILE_CANDIDATES:
        tiles = gmm_mosaic.MosaicTiles(block_m=m, block_n=n, stages=stages, grid_block_n=group_n)
        if (tiles.smem_bytes(item, 1) <= gmm_mosaic.HOPPER_SMEM_BYTES
                and tiles.accumulator_registers(1) <= gmm_mosaic.ACCUMULATOR_REGISTERS
                and shape.intermediate % n == 0):
            candidates.setdefault(mosaic_tiles_name(tiles), tiles)
    return rank_tiles(f"{prefix}_mosaic", candidates, mosaic_tiles_name(table),
                      gmm_mosaic.gmm_mosaic, sets, flops, repeats)


def mosaic_tiles_name(tiles: gmm_mosaic.MosaicTiles) -> str:
    return (f"m{tiles.block_m}_n{tiles.block_n}_k{tiles.block_k}_s{tiles.stages}"
            f"_g{tiles.grid_block_n}")


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, quick_help="one tiny shape (under a minute)",
                          repeats_help="timed runs per path, median kept (default 20 GPU, 3 CPU)")
    parser.add_argument("--models", help=f"comma-separated, from {sorted(MODELS)}")
    parser.add_argument("--tokens", help="comma-separated token counts")
    parser.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 "
                                                      "(CPU default)")
    parser.add_argument("--sweep-tiles", action="store_true",
                        help="also time the Pallas kernel over TILE_CANDIDATES per shape")
    parser.add_argument("--skip", default="",
                        help="comma-separated paths not to time (e.g. jax_tiles,dense_onehot)")
    parser.add_argument("--matmul-tflops", type=float,
                        help="the dense matmul rate the fractions divide by, measured "
                             "already (benchmarks.device_env); default: measured here")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parse_args(parser, argv)

    gpu = is_gpu()
    models, token_counts = QUICK if args.quick else (GPU_DEFAULT if gpu else CPU_DEFAULT)
    if args.models:
        models = tuple(args.models.split(","))
        unknown = [m for m in models if m not in MODELS]
        if unknown:
            parser.error(f"unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    skip = frozenset(filter(None, args.skip.split(",")))
    if skip & {"pallas", "ragged_dot"}:
        parser.error("--skip: pallas and ragged_dot are always timed (ragged_dot is the reference)")
    if args.tokens:
        token_counts = tuple(int(t) for t in args.tokens.split(","))
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    repeats = args.repeats or (20 if gpu else 3)
    print(f"platform {jax.default_backend()} ({jax.devices()[0].device_kind}), dtype "
          f"{dtype.name}, median of {repeats} runs")
    if not gpu:
        print("note: no GPU; Pallas runs interpreted, so its times here only show it works")

    if args.matmul_tflops:
        matmul_rate, matmul_source = args.matmul_tflops, "--matmul-tflops"
    else:
        matmul_rate = matmul_tflops(dtype, 8192 if gpu else 1024, repeats, INPUT_SETS)
        matmul_source = "measured here"
    print(f"dense matmul rate: {matmul_rate:.3f} TFLOP/s ({matmul_source})")
    figures: dict = {"platform": jax.default_backend(), "dtype": dtype.name,
                     "matmul_tflops": matmul_rate, "matmul_source": matmul_source}
    for model in models:
        for tokens in token_counts:
            figures.update(bench_shape(model, MODELS[model], tokens, dtype, repeats,
                                       matmul_rate, args.sweep_tiles, skip))
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

"""The expert paths side by side on a decode step's routed rows: which one
``expert_impl: auto`` should pick, by rows per expert and device (issue 43).

Times ``moe.expert_compute`` (the whole SwiGLU: gate/up, SiLU, down) with each path on
the routed rows of a decode step of T tokens (M = T·k rows sorted by expert, a uniformly
random top-k routing, new inputs and routing per input set), the experts given as a
:class:`moejax.expert_views.StackLayer` view of a 2-layer stack with a traced layer index,
as serving runs them (what is timed is the in-place read; the input sets alternate the
layer):

* ``fused_tiles``  moejax.grouped_gemm.grouped_swiglu_tiles, one loop of row tiles
* ``dense``        every row through every expert, masked (grouped_gemm.swiglu_dense: a
                   loop over the E experts; E× the routed work, skipped off GPU past
                   ``DENSE_MAX_FLOPS_CPU``)
* ``gmm``          three grouped GEMMs of the tiled loop and a SiLU
* ``pallas``       kernels_pallas.gmm (fused gate/up, then the down GEMM); GPU only (off
                   GPU it runs interpreted, which times nothing useful)

Shapes: ``demo`` (the built-in demo model, moejax/demo/configs/demo.yaml), ``demo_e32``
(demo-e32.yaml) and ``qwen3`` (a Qwen3-30B-A3B layer: d=2048, f=768, E=128, k=8), with
random weights, bfloat16 on a GPU and float32 on CPU. ``--quick`` on CPU replaces qwen3
by ``qwen3_cpu`` (same E=128 and k=8, d=256, f=128) and times fewer batch sizes. Prints,
per shape, the milliseconds of every path per batch size, the winner per rows per expert
(M / E), what ``choose_expert_impl`` picks there and the table entries (``max rows per
expert: impl``, ascending) that follow from the winners
(moejax/expert_impl_table.py holds the table).

    python -m benchmarks.expert_impls [--quick] [--json PATH] [--shapes demo,qwen3]
        [--tokens 1,4,16] [--repeats N] [--dtype float32]

JSON keys (flat), per shape S and token count T: ``expert_impl_ms_{S}_{impl}_{T}``
(median milliseconds; a path not timed has a ``expert_impl_skipped_{S}_{impl}_{T}``
reason instead), ``expert_impl_best_{S}_{T}`` (the fastest path's name),
``expert_impl_rows_per_expert_{S}_{T}``, ``expert_impl_chosen_{S}_{T}`` (what the table
picks) and ``expert_impl_chosen_over_best_{S}_{T}`` (its time over the best, ≥ 1); per
shape ``expert_impl_entries_{S}`` (the entries that follow, as ``"2:dense,inf:fused_tiles"``);
and ``platform``, ``device_kind``, ``dtype``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.gmm import ExpertShape, routed_group_sizes
from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run, platform_figures
from benchmarks.lib.tables import fmt, print_table
from benchmarks.lib.timing import is_gpu, median, timed_call
from moejax import expert_impl_table, grouped_gemm, moe
from moejax.expert_views import StackLayer

IMPLS = ("fused_tiles", "dense", "gmm", "pallas")
TOKENS = (1, 4, 8, 16, 32, 64, 128, 256)
QUICK_TOKENS = (1, 4, 16, 64, 256)
LAYERS = 2                   # the stack the views read (the input sets alternate layers)
INPUT_SETS = 2
SCALE = 0.02
ROUND_SECONDS = 0.15         # timed seconds per path and point (cheap calls: more rounds)
MAX_ROUNDS = 40
DEFAULT = "fused_tiles"
TIE_MARGIN = 0.05            # a path must beat fused_tiles by more than this to be picked
# Off GPU the dense path's E× work at E=128 takes seconds per call at the larger
# batches (6·E·M·d·f FLOPs; the 2-core CPU runs ~50 GFLOP/s in f32): not timed past this.
DENSE_MAX_FLOPS_CPU = 2e10


def demo_shape(name: str) -> ExpertShape:
    from moejax.demo.specs import demo_config

    cfg = demo_config(name)
    return ExpertShape(hidden=cfg.hidden_size, intermediate=cfg.moe_intermediate_size,
                       experts=cfg.num_experts, top_k=cfg.num_experts_per_tok)


def shapes() -> dict[str, ExpertShape]:
    return {"demo": demo_shape("demo"), "demo_e32": demo_shape("demo-e32"),
            "qwen3": ExpertShape(hidden=2048, intermediate=768, experts=128, top_k=8),
            # CPU stand-in for --quick: Qwen3's E and k, narrower matrices.
            "qwen3_cpu": ExpertShape(hidden=256, intermediate=128, experts=128, top_k=8)}


def default_run(gpu: bool, quick: bool) -> tuple[tuple[str, ...], tuple[int, ...]]:
    if gpu:
        return ("demo", "qwen3"), (QUICK_TOKENS if quick else TOKENS)
    if quick:
        return ("demo", "qwen3_cpu"), QUICK_TOKENS
    return ("demo", "demo_e32", "qwen3_cpu", "qwen3"), TOKENS


def expert_fn(impl: str):
    """jit of fn(x, sizes, gate, up, down, layer): the expert compute on layer ``layer``
    of the stacks, read in place."""
    def run(x, sizes, gate, up, down, layer):
        perm = moe.Permutation(x_sorted=x, order=jnp.arange(x.shape[0], dtype=jnp.int32),
                               group_sizes=sizes)
        return moe.expert_compute(perm, StackLayer(gate, layer), StackLayer(up, layer),
                                  StackLayer(down, layer), impl=impl)

    return jax.jit(run)


def weight_stacks(shape: ExpertShape, dtype, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random [L, E, d, f], [L, E, d, f], [L, E, f, d] stacks, made on the device."""
    d, f, e = shape.hidden, shape.intermediate, shape.experts
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    dims = ((LAYERS, e, d, f), (LAYERS, e, d, f), (LAYERS, e, f, d))
    return tuple(jax.jit(lambda key, s=s: (SCALE * jax.random.normal(key, s, jnp.float32)
                                           ).astype(dtype))(key)
                 for key, s in zip(keys, dims))


def skip_reason(impl: str, shape: ExpertShape, rows: int, gpu: bool) -> str | None:
    if impl == "pallas":
        if not gpu:
            return "no GPU (Pallas runs interpreted off GPU)"
        if (shape.hidden % expert_impl_table.PALLAS_MIN_DIM_MULTIPLE
                or shape.intermediate % expert_impl_table.PALLAS_MIN_DIM_MULTIPLE):
            return f"d, f not multiples of {expert_impl_table.PALLAS_MIN_DIM_MULTIPLE}"
    if impl == "dense" and not gpu:
        flops = 6 * shape.experts * rows * shape.hidden * shape.intermediate
        if flops > DENSE_MAX_FLOPS_CPU:
            return (f"{flops / 1e9:.0f} GFLOP (E× the routed work) > "
                    f"{DENSE_MAX_FLOPS_CPU / 1e9:.0f}")
    return None


def interleaved_medians(fns: dict, input_sets, repeats: int, *, label: str
                        ) -> dict[str, float]:
    """Median synchronized seconds of each ``fns[name](*inputs)``, the inputs taken in
    turn from ``input_sets``: one warm-up call per input set each, then rounds in which
    every path runs once (in a rotating order), so a change in the machine's load (a
    shared CPU) falls on every path alike. Cheap calls get more rounds: as many as fit
    :data:`ROUND_SECONDS` per path, up to :data:`MAX_ROUNDS`, never fewer than
    ``repeats``."""
    turn = itertools.cycle(input_sets)
    names = list(fns)
    warm = {}
    for name in names:
        for _ in input_sets:
            warm[name], _ = timed_call(lambda: jax.block_until_ready(fns[name](*next(turn))),
                                       label=None)
    rounds = max(repeats, min(MAX_ROUNDS, int(ROUND_SECONDS / max(max(warm.values()), 1e-6))))
    seconds: dict[str, list[float]] = {name: [] for name in names}
    with timed_pass(label):
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                inputs = next(turn)
                start = time.perf_counter()
                jax.block_until_ready(fns[name](*inputs))
                seconds[name].append(time.perf_counter() - start)
    return {name: median(values) for name, values in seconds.items()}


def table_pick(ms: dict[str, float]) -> str:
    """The path a table entry should name at one point: the fastest, unless it beats
    ``fused_tiles`` (the general default) by no more than :data:`TIE_MARGIN` (noise on
    a shared machine; the default keeps the point)."""
    best = min(ms, key=ms.get)
    if DEFAULT in ms and ms[DEFAULT] <= ms[best] * (1 + TIE_MARGIN):
        return DEFAULT
    return best


def entries_from(winners: list[tuple[float, str]]) -> list[tuple[float, str]]:
    """Table entries (max rows per expert, impl), ascending, from the pick
    (:func:`table_pick`) at each measured rows per expert: one entry per run of one
    pick, up to its last point; the last entry open-ended (inf)."""
    entries: list[tuple[float, str]] = []
    for rpe, impl in sorted(winners):
        if entries and entries[-1][1] == impl:
            entries[-1] = (rpe, impl)
        else:
            entries.append((rpe, impl))
    if entries:
        entries[-1] = (math.inf, entries[-1][1])
    return entries


def entries_text(entries: list[tuple[float, str]]) -> str:
    return ",".join(f"{'inf' if math.isinf(m) else f'{m:g}'}:{impl}" for m, impl in entries)


def bench_shape(name: str, shape: ExpertShape, token_counts, dtype, repeats: int,
                gpu: bool, platform: str) -> dict:
    d, f, e, k = shape.hidden, shape.intermediate, shape.experts, shape.top_k
    print(f"\n{name}: d={d} f={f} E={e} k={k}, {jnp.dtype(dtype).name}, experts as a "
          f"StackLayer view of a {LAYERS}-layer stack")
    stacks = weight_stacks(shape, dtype)
    fns = {impl: expert_fn(impl) for impl in IMPLS}
    rng = np.random.default_rng(0)
    figures, rows_out, winners = {}, [], []
    for tokens in token_counts:
        rows = tokens * k
        rpe = rows / e
        sets = [(jnp.asarray(rng.standard_normal((rows, d)), dtype),
                 jnp.asarray(routed_group_sizes(tokens, shape, seed=1000 * tokens + i)),
                 *stacks, jnp.int32(i % LAYERS)) for i in range(INPUT_SETS)]
        timed = {}
        for impl in IMPLS:
            reason = skip_reason(impl, shape, rows, gpu)
            if reason:
                figures[f"expert_impl_skipped_{name}_{impl}_{tokens}"] = reason
            else:
                timed[impl] = fns[impl]
        ms = {impl: seconds * 1e3 for impl, seconds in
              interleaved_medians(timed, sets, repeats, label=f"{name}_{tokens}").items()}
        figures.update({f"expert_impl_ms_{name}_{impl}_{tokens}": ms[impl] for impl in ms})
        best = min(ms, key=ms.get)
        chosen = grouped_gemm.choose_expert_impl(d, f, platform, rows=rows, num_experts=e)
        ratio = ms[chosen] / ms[best] if chosen in ms else None
        winners.append((rpe, table_pick(ms)))
        figures.update({f"expert_impl_best_{name}_{tokens}": best,
                        f"expert_impl_rows_per_expert_{name}_{tokens}": rpe,
                        f"expert_impl_chosen_{name}_{tokens}": chosen,
                        f"expert_impl_chosen_over_best_{name}_{tokens}": ratio})
        rows_out.append(dict(tokens=tokens, rows=rows, rpe=rpe, ms=ms, best=best,
                             chosen=chosen, ratio=ratio))
    columns = [("tokens", 7, lambda r: str(r["tokens"])), ("rows", 6, lambda r: str(r["rows"])),
               ("rows/E", 8, lambda r: f"{r['rpe']:.3g}")]
    columns += [(impl, 12, lambda r, i=impl: fmt(r["ms"].get(i), ".3f"))
                for impl in IMPLS]
    columns += [("best", 13, lambda r: r["best"]), ("chosen", 13, lambda r: r["chosen"]),
                ("chosen/best", 12, lambda r: fmt(r["ratio"], ".2f"))]
    print_table(columns, rows_out, title="  milliseconds per expert compute (median)")
    entries = entries_from(winners)
    figures[f"expert_impl_entries_{name}"] = entries_text(entries)
    print(f"  entries that follow (max rows per expert, impl): {entries}")
    return figures


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, quick_help="demo and a narrow E=128 shape, five batch "
                                              "sizes (under a minute on CPU)",
                          repeats_help="timed runs per path, median kept (default 20 GPU, "
                                       "5 CPU)")
    parser.add_argument("--shapes", help="comma-separated, from demo, demo_e32, qwen3, "
                                         "qwen3_cpu")
    parser.add_argument("--tokens", help="comma-separated decode batch sizes (tokens)")
    parser.add_argument("--dtype", default=None,
                        help="bfloat16 (GPU default) or float32 (CPU default)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    parser = build_parser()
    args = parse_args(parser, argv)
    gpu = is_gpu()
    known = shapes()
    names, token_counts = default_run(gpu, args.quick)
    if args.shapes:
        names = tuple(args.shapes.split(","))
        unknown = [n for n in names if n not in known]
        if unknown:
            parser.error(f"unknown shape(s) {unknown}; choose from {sorted(known)}")
    if args.tokens:
        token_counts = tuple(int(t) for t in args.tokens.split(","))
    dtype = jnp.dtype(args.dtype or ("bfloat16" if gpu else "float32"))
    repeats = args.repeats or (20 if gpu else 5)
    platform = jax.default_backend()
    print(f"platform {platform} ({jax.devices()[0].device_kind}), dtype {dtype.name}, "
          f"median of {repeats} runs")
    figures: dict = {**platform_figures(), "dtype": dtype.name}
    for name in names:
        figures.update(bench_shape(name, known[name], token_counts, dtype, repeats, gpu,
                                   platform))
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

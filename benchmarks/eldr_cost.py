"""MoE decode-layer time against the number of active experts: the ELDR step cost model.

ELDR (decode-request routing, ``../shared/DESIGN.md``, "Decode-side seeds: ELDR") models
one decode step of a decoder as

    t = t0 + Σ_l (a · |active experts at layer l| + b · batch)

and this script measures the terms: one MoE layer's time (route → permute → experts →
combine, moejax's own stages; no attention) at n distinct active experts and batch B,
then fits per-layer ``a`` (seconds per active expert), ``b`` (seconds per batch row) and
``t0`` (seconds per layer, constant) by least squares, with R².

How:

* **Routing, built synthetically.** B tokens each choose k *distinct* experts from a
  subset of exactly n experts, so the batch's union is exactly n (needs B·k ≥ n ≥ k):
  the n experts go round-robin over the B·k slots (token t takes subset entries
  (t·k + j) mod n), then duplicates within a token are fixed (:func:`synthetic_experts`).
  The subset is a different seeded draw for each layer. The layer still runs moejax's
  own router (``moe.route``, norm_topk_prob): its inputs are built so that it returns
  exactly that routing with gate weights 1/k (:func:`router_inputs`: token t's row holds
  1 at coordinate t and random values beyond B; router row t holds a logit of 16 on
  token t's experts, rows past B are zero, so the logits are exact). Each point checks
  that the router reproduces the synthetic routing before it is timed.
* **The layer.** ``moejax.dispatch.local_dispatcher`` with the expert path
  ``--expert-impl`` (``auto``: ``choose_expert_impl``, ``pallas`` on GPUs and
  ``fused_tiles`` on CPUs; a comma list measures several). ``--source`` says where the
  layer's weights come from: ``stacked`` — every layer's experts stacked [L, E, ...]
  (``StackedExperts``) and the layers run in one ``fori_loop`` with a traced layer
  index, as the decode programs (``moejax.decode.programs``) run them; ``given`` —
  each layer's experts separate arrays (``GivenExperts``) and the L layers unrolled.
  If a path copies the indexed layer's whole expert stack, ``stacked`` shows it as a
  time that hardly grows with n (each compile's temporary memory is reported too).
* **Timing.** One jitted program (compiled once per B) runs ``--layers`` L MoE layers
  (different weights and subsets per layer, so repeated calls do not run out of a
  cache); per-layer time is the program's median wall time (two warm-up calls,
  ``block_until_ready``, ``--repeats`` calls taken round-robin over all the points of a
  configuration) over L. It includes one program launch per L layers.

Shapes (``--shape``): ``qwen3-30b-a3b`` (d=2048, f=768, E=128, k=8, bf16; n ∈
{8..128}, B ∈ {8..64}) and ``demo-e32`` (moejax/demo/configs/demo-e32.yaml: d=128, f=64,
E=32, k=4, f32; n ∈ {4..32}, B ∈ {1..16}). Points with B·k < n are skipped.

    python -m benchmarks.eldr_cost [--quick] [--shape qwen3-30b-a3b] [--expert-impl auto]
        [--source stacked] [--json PATH] [--cost-out PATH]

JSON keys (flat), for the first (impl, source) configuration: ``a_us_per_expert``,
``b_us_per_row``, ``t0_us``, ``r2``, ``n_max_over_n_min_time_ratio`` (time at the
largest n over the smallest n at the largest B), ``n_max_over_n16_time_ratio`` (the
seed reports 4.7× for 16 → 128 experts), ``t_ratio_n{n}_over_n{n_min}`` for every n at
the largest B; the line in n at each B alone: ``a_us_per_expert_b{B}``, ``t0_us_b{B}``,
``r2_b{B}``; the raw table ``t_us_n{n}_b{b}`` (per-layer µs) and ``temp_mib_b{b}``
(the compiled program's temporary memory); every configuration's figures again under
``{impl}_{source}_…``; and ``device``, ``platform``, ``shape``, ``expert_impl``,
``source``, ``layers``, ``repeats``, ``dtype``, ``jax_version``.

``--cost-out`` writes the cost model the ELDR simulator reads: ``{"t0_s", "a_s", "b_s",
"r2", "by_batch": {B: {"t0_s", "a_s", "r2"}}, "shape", "device", "machine",
"expert_impl", "source", "date", "command", ...}`` for the first configuration, and
``fits`` with every configuration's. Where a path's cost per expert depends on B (the
Pallas kernel runs ceil(B·k / 128) row tiles in parallel, so more rows share an
expert's weight reads), the one-plane fit is poor (see its r2) and ``by_batch`` is the
model to use.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize

from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run, write_json
from benchmarks.lib.timing import is_gpu, median
from moejax import grouped_gemm, moe
from moejax.dispatch import GivenExperts, StackedExperts, local_dispatcher


@dataclasses.dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    dtype: str
    active: tuple[int, ...]      # n: distinct active experts per layer
    batches: tuple[int, ...]     # B: decode rows (one token each)


SHAPES = {
    # The seed paper's Fig. 2 model.
    "qwen3-30b-a3b": Shape(2048, 768, 128, 8, "bfloat16", (8, 16, 32, 64, 96, 128),
                           (8, 16, 32, 64)),
    # moejax/demo/configs/demo-e32.yaml
    "demo-e32": Shape(128, 64, 32, 4, "float32", (4, 8, 16, 24, 32), (1, 2, 4, 8, 16)),
}
QUICK_POINTS = ((4, 16, 32), (4, 16))     # demo-e32 only
ROUTER_LOGIT = 16.0       # the chosen experts' logit (the others get 0): exp(-16) ≈ 1e-7
SOURCES = ("stacked", "given")
SEED_RATIO_FROM = 16      # the seed reports t(128 experts) / t(16 experts) = 4.7


# ----------------------------------------------------------------------------- routing
def synthetic_experts(n: int, batch: int, k: int, num_experts: int,
                      subset: np.ndarray | None = None, seed: int = 0) -> np.ndarray:
    """[batch, k] int32 expert ids: every row k distinct experts, the union exactly n.

    ``subset``: the n experts to use (default: a seeded draw of n of ``num_experts``).
    The subset is spread round-robin over the batch·k slots (row t, slot j takes
    subset[(t·k + j) mod n]), then any expert repeated within a row is swapped for one
    of the subset the row lacks (with n ≥ k the round-robin never repeats one; the fix
    keeps the function correct for any layout). Needs batch·k ≥ n ≥ k.
    """
    if not k <= n <= num_experts:
        raise ValueError(f"need k={k} <= n={n} <= E={num_experts}")
    if batch * k < n:
        raise ValueError(f"B·k = {batch}·{k} < n = {n}: the batch cannot touch n experts")
    if subset is None:
        subset = np.sort(np.random.default_rng(seed).choice(num_experts, n, replace=False))
    subset = np.asarray(subset, dtype=np.int32)
    if subset.shape != (n,) or len(set(subset.tolist())) != n:
        raise ValueError(f"subset must hold {n} distinct experts, got {subset}")
    slots = (np.arange(batch * k) % n).reshape(batch, k)
    experts = subset[slots]
    for row in experts:
        seen: set[int] = set()
        for j, e in enumerate(row):
            if int(e) in seen:
                row[j] = next(x for x in subset.tolist() if x not in seen and x not in row)
            seen.add(int(row[j]))
    return experts.astype(np.int32)


def router_inputs(experts: np.ndarray, hidden: int, num_experts: int, dtype,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """MoE inputs x [B, d] and router weights [d, E] on which ``moe.route`` picks ``experts``
    [B, k] with gate weights 1/k (norm_topk_prob): x[t] is 1 at coordinate t and random
    (N(0, 1)) past B; router row t is ROUTER_LOGIT on row t's experts, rows ≥ B are 0,
    so every logit is exactly ROUTER_LOGIT or 0 in any dtype. Needs d ≥ B."""
    batch = experts.shape[0]
    if hidden < batch:
        raise ValueError(f"router_inputs needs d={hidden} >= B={batch}")
    rng = np.random.default_rng(seed)
    x = np.zeros((batch, hidden), np.float32)
    x[:, batch:] = rng.standard_normal((batch, hidden - batch))
    x[np.arange(batch), np.arange(batch)] = 1.0
    router = np.zeros((hidden, num_experts), np.float32)
    router[np.arange(batch)[:, None], experts] = ROUTER_LOGIT
    return x.astype(dtype), router.astype(dtype)


# ----------------------------------------------------------------------------- the fit
def fit_cost(n, batch, seconds, non_negative: bool = False) -> dict[str, float]:
    """Least squares of t = t0 + a·n + b·B over the points (n[i], batch[i], seconds[i])
    (``non_negative``: with t0, a, b >= 0, scipy's NNLS — a time never shrinks with
    more work, so a negative coefficient is noise).

    Returns ``{"a": s per active expert, "b": s per batch row, "t0": s constant,
    "r2": 1 − SS_res / SS_tot}`` (r2 is 1.0 for an exact fit, also when every time is
    equal). Needs at least 3 points that do not lie on a line in (n, B); with a single
    B value, b is 0 and the fit is t0 + a·n.
    """
    n = np.asarray(n, np.float64)
    batch = np.asarray(batch, np.float64)
    t = np.asarray(seconds, np.float64)
    one_b = np.ptp(batch) == 0
    design = np.stack([np.ones_like(n), n] + ([] if one_b else [batch]), axis=1)
    if len(t) < design.shape[1] or np.linalg.matrix_rank(design) < design.shape[1]:
        raise ValueError(f"{len(t)} points do not determine the fit (need distinct n and B)")
    if non_negative:
        coef, _ = scipy.optimize.nnls(design, t)
    else:
        coef, *_ = np.linalg.lstsq(design, t, rcond=None)
    resid = t - design @ coef
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    ss_res = float(np.sum(resid ** 2))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return {"t0": float(coef[0]), "a": float(coef[1]),
            "b": 0.0 if one_b else float(coef[2]), "r2": r2}


# ----------------------------------------------------------------------------- the layer
def make_program(shape: Shape, impl: str, source: str, layers: int):
    """jitted fn(weights, x_all [L, B, d], router_all [L, d, E]) -> [B, d]: L MoE layers
    (route → dispatcher: permute, experts, combine), their outputs summed."""
    k, num_experts = shape.top_k, shape.experts

    def one_layer(dispatcher, layer, x, router):
        routing = moe.route(x, router, k, norm_topk_prob=True)
        y, _ = dispatcher.apply(layer, x, routing, None, dispatcher.init_carry())
        return y

    if source == "stacked":
        def run(stacked, x_all, router_all):
            dispatcher = local_dispatcher(StackedExperts(stacked), num_experts, impl)

            def body(layer, acc):
                x = jax.lax.dynamic_index_in_dim(x_all, layer, keepdims=False)
                router = jax.lax.dynamic_index_in_dim(router_all, layer, keepdims=False)
                return acc + one_layer(dispatcher, layer, x, router)

            return jax.lax.fori_loop(0, layers, body, jnp.zeros(x_all.shape[1:], x_all.dtype))
    elif source == "given":
        def run(per_layer, x_all, router_all):
            acc = jnp.zeros(x_all.shape[1:], x_all.dtype)
            for layer, weights in enumerate(per_layer):
                dispatcher = local_dispatcher(GivenExperts(weights), num_experts, impl)
                acc = acc + one_layer(dispatcher, layer, x_all[layer], router_all[layer])
            return acc
    else:
        raise ValueError(f"unknown source {source!r}; choose from {SOURCES}")
    return jax.jit(run)


def make_weights(shape: Shape, layers: int, seed: int = 0) -> dict[str, jax.Array]:
    """Random expert weights stacked [L, E, ...] (N(0, 1)/√fan-in, in the shape's dtype)."""
    key = jax.random.key(seed)
    d, f, e = shape.hidden, shape.intermediate, shape.experts
    out = {}
    for i, (name, dims, fan_in) in enumerate((("w_gate", (layers, e, d, f), d),
                                              ("w_up", (layers, e, d, f), d),
                                              ("w_down", (layers, e, f, d), f))):
        out[name] = (jax.random.normal(jax.random.fold_in(key, i), dims, jnp.float32)
                     / np.sqrt(fan_in)).astype(shape.dtype)
    return out


def point_inputs(shape: Shape, n: int, batch: int, layers: int, seed: int = 0):
    """Per-layer synthetic routing [L, B, k] and the router inputs that produce it."""
    experts, xs, routers = [], [], []
    for layer in range(layers):
        ex = synthetic_experts(n, batch, shape.top_k, shape.experts,
                               seed=seed * 1009 + layer * 31 + n)
        x, r = router_inputs(ex, shape.hidden, shape.experts, np.float32, seed=seed + layer)
        experts.append(ex), xs.append(x), routers.append(r)
    return (np.stack(experts), jnp.asarray(np.stack(xs), shape.dtype),
            jnp.asarray(np.stack(routers), shape.dtype))


_ROUTE = jax.jit(jax.vmap(lambda x, r, k: moe.route(x, r, k, True), in_axes=(0, 0, None)),
                 static_argnums=2)


def check_routing(experts: np.ndarray, x_all, router_all, k: int) -> None:
    """moe.route on the built inputs must give each row exactly its synthetic experts,
    with weights 1/k."""
    routing = _ROUTE(x_all, router_all, k)
    got = np.sort(np.asarray(routing.experts), axis=-1)
    if not np.array_equal(got, np.sort(experts, axis=-1)):
        raise AssertionError("moe.route did not reproduce the synthetic routing")
    weights = np.asarray(routing.weights, np.float64)
    if np.max(np.abs(weights - 1.0 / k)) > 1e-5:
        raise AssertionError(f"gate weights are not 1/k: {weights.min()}..{weights.max()}")


def interleaved_medians(calls: dict, repeats: int, label: str, warmup: int = 2) -> dict:
    """Median wall time of each ``fn(*args)`` in ``calls`` (key -> (fn, args)), synchronized,
    after ``warmup`` calls of each. The repeats go round-robin over the calls, so a slow
    spell of the machine (another process) falls on every point alike, not on a few."""
    for fn, args in calls.values():
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
    times: dict = {key: [] for key in calls}
    with timed_pass(label):
        for _ in range(repeats):
            for key, (fn, args) in calls.items():
                start = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[key].append(time.perf_counter() - start)
    return {key: median(values) for key, values in times.items()}


def temp_mib(compiled) -> float | None:
    """A compiled program's temporary memory in MiB (None where not reported)."""
    try:
        return round(compiled.memory_analysis().temp_size_in_bytes / 2**20, 3)
    except Exception:   # noqa: BLE001 - a diagnostic only
        return None


def measure(shape: Shape, impl: str, source: str, points: list[tuple[int, int]],
            layers: int, repeats: int, stacked: dict[str, jax.Array]) -> dict:
    """Per-layer seconds at each (n, B), and temporary MiB per B, for one configuration."""
    program = make_program(shape, impl, source, layers)
    if source == "stacked":
        weights = stacked
    else:
        weights = [{name: w[layer] for name, w in stacked.items()} for layer in range(layers)]
    temps, compiled, calls = {}, {}, {}
    for n, batch in points:
        experts, x_all, router_all = point_inputs(shape, n, batch, layers)
        check_routing(experts, x_all, router_all, shape.top_k)
        args = (weights, x_all, router_all)
        if batch not in compiled:   # one compile per B: n changes only the data
            start = time.perf_counter()
            compiled[batch] = program.lower(*args).compile()
            temps[batch] = temp_mib(compiled[batch])
            print(f"  {impl} {source}: compiled B={batch} in {time.perf_counter() - start:.1f}"
                  f" s, temporary memory {temps[batch]} MiB", flush=True)
        calls[(n, batch)] = (compiled[batch], args)
    table = {point: seconds / layers
             for point, seconds in interleaved_medians(calls, repeats, f"{impl}_{source}").items()}
    for (n, batch), seconds in table.items():
        print(f"  {impl:>11} {source:>7}  n={n:4d} B={batch:3d}  {seconds * 1e6:10.1f} us/layer",
              flush=True)
    del calls
    del weights
    return {"table": table, "temp_mib": temps}


def figures_of(table: dict[tuple[int, int], float], temps: dict[int, float | None]) -> dict:
    """The flat figures of one configuration's table (module docstring)."""
    pts = sorted(table)
    fit = fit_cost([p[0] for p in pts], [p[1] for p in pts], [table[p] for p in pts])
    out = {"a_us_per_expert": fit["a"] * 1e6, "b_us_per_row": fit["b"] * 1e6,
           "t0_us": fit["t0"] * 1e6, "r2": fit["r2"],
           "fit": {"t0_s": fit["t0"], "a_s": fit["a"], "b_s": fit["b"], "r2": fit["r2"]}}
    b_max = max(b for _, b in pts)
    at_bmax = sorted(n for n, b in pts if b == b_max)
    n_min = at_bmax[0]
    out["n_max_over_n_min_time_ratio"] = table[(at_bmax[-1], b_max)] / table[(n_min, b_max)]
    out["ratio_n_min"], out["ratio_n_max"], out["ratio_b"] = n_min, at_bmax[-1], b_max
    for n in at_bmax[1:]:
        out[f"t_ratio_n{n}_over_n{n_min}"] = table[(n, b_max)] / table[(n_min, b_max)]
    if SEED_RATIO_FROM in at_bmax[1:-1]:   # the seed's 16 -> 128 experts comparison
        out[f"n_max_over_n{SEED_RATIO_FROM}_time_ratio"] = (
            table[(at_bmax[-1], b_max)] / table[(SEED_RATIO_FROM, b_max)])
    by_batch = {}
    for batch in sorted({b for _, b in pts}):
        ns = sorted(n for n, b in pts if b == batch)
        if len(ns) >= 2:
            line = fit_cost(ns, [batch] * len(ns), [table[(n, batch)] for n in ns])
            out[f"a_us_per_expert_b{batch}"] = line["a"] * 1e6
            out[f"t0_us_b{batch}"] = line["t0"] * 1e6
            out[f"r2_b{batch}"] = line["r2"]
            by_batch[str(batch)] = {"t0_s": line["t0"], "a_s": line["a"], "r2": line["r2"]}
    out["fit"]["by_batch"] = by_batch
    for (n, batch) in pts:
        out[f"t_us_n{n}_b{batch}"] = table[(n, batch)] * 1e6
    for batch, mib in sorted(temps.items()):
        if mib is not None:
            out[f"temp_mib_b{batch}"] = mib
    return out


def device_description() -> str:
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        model = platform.processor() or "cpu"
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as fh:
                model = next(line.split(":", 1)[1].strip() for line in fh
                             if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
        return f"{model}, {os.cpu_count()} cores (CPU)"
    return dev.device_kind


def main(argv: list[str] | None = None) -> dict:
    parser = bench_parser(__doc__, quick_help="demo-e32 at 6 points, 2 layers (under a minute "
                          "on 2 CPU cores)", repeats_help="timed rounds over the points, median "
                          "kept (default 3 quick, 20 GPU, 7 CPU)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="default: qwen3-30b-a3b on GPUs, demo-e32 elsewhere")
    parser.add_argument("--expert-impl", default="auto",
                        help=f"comma list of {moe.EXPERT_IMPLS} (auto: choose_expert_impl)")
    parser.add_argument("--source", default="stacked",
                        help=f"comma list of {SOURCES} (module docstring)")
    parser.add_argument("--active", help="comma list of n (default: the shape's)")
    parser.add_argument("--batches", help="comma list of B (default: the shape's)")
    parser.add_argument("--layers", type=int, default=None,
                        help="MoE layers per timed program (default 8 on GPUs, 4 on CPUs)")
    parser.add_argument("--cost-out", help="write the ELDR cost model (JSON) here")
    parser.add_argument("--machine", default=None,
                        help="machine description for the cost model (default: the device)")
    parser.add_argument("--date", default=None, help="date for the cost model (default: today)")
    args = parse_args(parser, argv)

    gpu = is_gpu()
    shape_name = args.shape or ("demo-e32" if args.quick or not gpu else "qwen3-30b-a3b")
    shape = SHAPES[shape_name]
    active, batches = shape.active, shape.batches
    if args.quick:
        if shape_name != "demo-e32":
            parser.error("--quick runs the demo-e32 shape only")
        active, batches = QUICK_POINTS
    if args.active:
        active = tuple(int(v) for v in args.active.split(","))
    if args.batches:
        batches = tuple(int(v) for v in args.batches.split(","))
    points = [(n, b) for b in batches for n in active
              if b * shape.top_k >= n and shape.top_k <= n <= shape.experts]
    layers = args.layers or (2 if args.quick else 8 if gpu else 4)
    repeats = args.repeats or (3 if args.quick else 20 if gpu else 7)
    impls = []
    for name in args.expert_impl.split(","):
        if name not in moe.EXPERT_IMPLS:
            parser.error(f"unknown expert impl {name!r}; choose from {moe.EXPERT_IMPLS}")
        resolved = (grouped_gemm.choose_expert_impl(shape.hidden, shape.intermediate)
                    if name == "auto" else name)
        impls.append((name, resolved))
    sources = args.source.split(",")
    for source in sources:
        if source not in SOURCES:
            parser.error(f"unknown source {source!r}; choose from {SOURCES}")
    device = device_description()
    print(f"{shape_name}: d={shape.hidden} f={shape.intermediate} E={shape.experts} "
          f"k={shape.top_k} {shape.dtype}; device {device}; {len(points)} points, "
          f"{layers} layers per program, median of {repeats}", flush=True)

    stacked = make_weights(shape, layers)
    configs = {}
    for name, resolved in impls:
        for source in sources:
            label = f"{resolved}_{source}"
            if label in configs:
                continue
            result = measure(shape, resolved, source, points, layers, repeats, stacked)
            configs[label] = (name, resolved, source, figures_of(result["table"],
                                                                 result["temp_mib"]))

    figures: dict = {"device": device, "platform": jax.default_backend(), "shape": shape_name,
                     "dtype": shape.dtype, "layers": layers, "repeats": repeats,
                     "jax_version": jax.__version__}
    fits = {}
    print(f"\n{'config':>22} {'a us/expert':>12} {'b us/row':>10} {'t0 us':>9} {'R2':>7} "
          f"{'t(n_max)/t(n_min)':>18}")
    for label, (name, resolved, source, figs) in configs.items():
        fits[label] = {**figs.pop("fit"),
                       "n_max_over_n_min_time_ratio": figs["n_max_over_n_min_time_ratio"]}
        print(f"{label:>22} {figs['a_us_per_expert']:12.3f} {figs['b_us_per_row']:10.3f} "
              f"{figs['t0_us']:9.1f} {figs['r2']:7.4f} {figs['n_max_over_n_min_time_ratio']:12.2f}"
              f" (n {figs['ratio_n_max']}/{figs['ratio_n_min']}, B={figs['ratio_b']})")
        if len(fits) == 1:   # the first configuration: the unprefixed figures
            figures.update({"expert_impl": resolved, "expert_impl_asked": name,
                            "source": source, **figs})
        if len(configs) > 1:
            figures.update({f"{label}_{key}": value for key, value in figs.items()})
    finish_run(figures, args.json_path)

    if args.cost_out:
        label = next(iter(configs))
        _, resolved, source, _ = configs[label]
        machine = args.machine or (
            f"{device}, JAX {jax.__version__}, Python {platform.python_version()}" if not gpu
            else f"{jax.device_count()} x {device}, {os.cpu_count()} CPU cores, "
                 f"JAX {jax.__version__}, Python {platform.python_version()}")
        model = {**fits[label], "shape": shape_name, "device": device, "machine": machine,
                 "expert_impl": resolved, "source": source, "dtype": shape.dtype,
                 "layers_per_program": layers, "repeats": repeats,
                 "points_n_b": [list(p) for p in points],
                 "date": args.date or datetime.date.today().isoformat(),
                 "command": "python -m benchmarks.eldr_cost " + shlex.join(
                     sys.argv[1:] if argv is None else argv),
                 "fits": fits}
        write_json(args.cost_out, model)
    return figures


if __name__ == "__main__":
    main()

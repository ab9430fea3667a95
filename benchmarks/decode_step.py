"""Decode-step time against the bytes floor, with the experts read in place and with each
layer sliced out of the stack (issue 43).

    python -m benchmarks.decode_step [--quick] [--json PATH] [--shapes demo,qwen3-30b-a3b]
                                     [--batches 8,16,32] [--steps N] [--prompt-tokens P]

A decode step runs every layer in one program (``moejax.decode.programs.FUSED_STEP``) over
the expert weights stacked ``[L, E, d, f]``. The dispatcher's ``StackedExperts`` reads
each layer's experts where they lie (``moejax.expert_views``); ``SlicedExperts`` slices
the layer out first, which XLA materializes: a copy of the whole layer per layer per
step. This script times one decode step both ways, side by side, and sets each against
the least time the step could take on this machine: the bytes it must read over the
measured copy bandwidth.

**Shapes** (``--shapes``, default both):

* ``demo``: the demo model (``serving.api.resolve_model_dir("demo")``, float32);
* ``qwen3-30b-a3b``: Qwen3-30B-A3B's layer (d=2048, f=768, E=128, k=8, 32 query / 4 KV
  heads of 128) with random weights, ``--layers`` layers (default 2 on CPU: 2.25 GiB of
  float32 experts a layer; 8 on GPU) and a vocabulary of 1024; float32 on
  CPU, bfloat16 on GPU (``--dtype``). The weights are made on the device
  (:func:`random_params`: init_params' layout and distribution, each expert matrix
  copied from one pool of random values at its own offset): ``moejax.model.init_params``
  draws every value on the host, and the runner copies them over, about a minute for 2
  layers on a 2-core VM, more than the whole quick run.

**The step.** ``--batches`` decode rows (full 8, 16, 32; quick 8): a resident runner
(``make_runner("resident", ...)``, expert path ``auto``) and a
``moejax.core.continuous.Scheduler`` (unpipelined) get the largest batch's sequences
(random prompts of ``--prompt-tokens`` tokens: full 64 on CPU, 1024 on GPU, quick 1)
and step once: their prompts are prefilled and each has its first token (a one-token
prompt is a decode row already: quick compiles no prefill program, and its steps read
one token of context). The scheduler's next plan is then all decode rows, with their KV
blocks allocated; the batch of its first ``rows`` rows (``scheduler.paged.build_batch``)
is what is timed, through two jitted programs on the same params, pool and batch:

* ``in_place``: the runner's own ``FUSED_STEP``;
* ``sliced``: :func:`sliced_step`, ``programs.fused_step`` with the dispatcher's expert
  source ``SlicedExperts`` (everything else, the expert path, tile rows, activation and
  FP8 block, as ``MoEDecoder.local_dispatcher`` builds it).

A step program does not write the pool (the runner writes the step's keys and values
afterwards), so the same batch is run again and again. After one untimed call of each
(the compile), calls of each alternate in place / sliced, synchronized, for ``--steps``
rounds (full 5, quick 2), or more while the rounds so far took under a second (up to
100: a demo step takes milliseconds); the median of each is kept. Both give the same
routing (checked: a warning otherwise).

**The floor** (:func:`floor_bytes`): the bytes the step must read —

* experts: per layer, the distinct experts the rows chose (from the step's
  ``StepResult.experts`` [L, rows, k], choices of weight 0 left out) × one expert's
  bytes (3·d·f·itemsize, plus FP8 block scales where kept);
* KV: the rows' context tokens (``batch.context_len``, what is in the pool before the
  step) × the model's KV bytes per token (L × KV heads × head dim × 2 × itemsize);
* dense weights: every other weight (attention, norms, router, final norm, LM head
  [d, V]), the embedding table left out (a step gathers ``rows`` of its rows);

over the copy bandwidth: a jitted ``a + 1`` over ``--copy-mib`` MiB (256), its input
donated (the output reuses its buffer), best of 5, counting the bytes read and written
(STREAM's convention). "x over the floor" is step time / (floor bytes / bandwidth); the
copy's cost per layer is (sliced − in place) / L, beside the floor of copying one layer
(its experts' bytes read and written over the bandwidth).

JSON keys (flat): ``decode_step_ms_{shape}_{rows}_in_place``, ``..._sliced``,
``decode_step_floor_ms_{shape}_{rows}``, ``decode_step_over_floor_{shape}_{rows}_in_place``,
``..._sliced``, ``copy_per_layer_ms_{shape}_{rows}``, ``floor_bytes_{shape}_{rows}``
(and its parts ``floor_expert_bytes_…``, ``floor_kv_bytes_…``, ``floor_dense_bytes_…``),
``active_experts_mean_{shape}_{rows}`` (distinct experts per layer),
``context_tokens_{shape}_{rows}``, ``timed_steps_{shape}_{rows}`` (rounds timed),
``expert_impl_{shape}_{rows}`` (the path ``auto`` resolves to at that step size),
``first_call_s_{shape}_{rows}_in_place`` / ``_sliced`` (the untimed call, its compile
included where it compiled); ``layer_copy_floor_ms_{shape}``,
``layer_expert_bytes_{shape}``, ``layers_{shape}``, ``dtype_{shape}``;
``copy_bandwidth_gb_s``, ``shapes``, ``batches``, ``steps``, ``prompt_tokens``,
``machine``, ``date``, ``command``, ``platform``, ``device_kind``; and the ``meta_*`` and
compile keys of every benchmark (``benchmarks.lib.meta.finish_run``).
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from typing import Any, Sequence

import numpy as np

from benchmarks.lib import cli
from benchmarks.lib.compiles import timed_pass
from benchmarks.lib.meta import finish_run, platform_figures
from benchmarks.lib.tables import fmt, print_table
from benchmarks.lib.timing import is_gpu, median

SHAPES = ("demo", "qwen3-30b-a3b")
QUICK = dict(batches=(8,), steps=2, prompt_tokens=1)
FULL = dict(batches=(8, 16, 32), steps=5, prompt_tokens=64)
GPU_PROMPT_TOKENS = 1024
QWEN_VOCAB = 1024
SCALE = 0.02                   # random weights ~ N(0, SCALE²), as moejax.model.init_params
POOL_VALUES = 1 << 23          # the random values the expert matrices are copied from
COPY_REPEATS = 5
MIN_SECONDS = 1.0              # timed rounds go on (to MAX_ROUNDS) while under this
MAX_ROUNDS = 100


# ----------------------------------------------------------------------------- models
def qwen_config(layers: int, vocab: int = QWEN_VOCAB, max_context: int = 4096) -> Any:
    """Qwen3-30B-A3B's layer shape with ``layers`` layers and a ``vocab`` vocabulary."""
    from moejax.config import ModelConfig

    return ModelConfig(model_type="qwen3_moe", vocab_size=vocab, hidden_size=2048,
                       num_layers=layers, num_heads=32, num_kv_heads=4, head_dim=128,
                       num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                       norm_topk_prob=True, qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e6,
                       max_context=max_context, tie_word_embeddings=False)


def _pooled_stack(pool, offsets, *, shape):
    """[*shape] whose [L·E] matrices are ``pool[o : o + size]`` for each offset o, copied
    in one loop into one buffer."""
    import jax
    import jax.numpy as jnp

    size = int(np.prod(shape[2:]))
    out = jnp.zeros((offsets.shape[0], size), pool.dtype)

    def body(i, out):
        piece = jax.lax.dynamic_slice(pool, (offsets[i],), (size,))
        return jax.lax.dynamic_update_slice(out, piece[None], (i, 0))

    return jax.lax.fori_loop(0, offsets.shape[0], body, out).reshape(shape)


def random_params(cfg: Any, dtype: Any = np.float32, device: Any = None, seed: int = 0
                  ) -> dict[str, Any]:
    """Random params on ``device`` (default: the first) in ``moejax.model.init_params``'s
    layout and distribution (norms 1, matrices N(0, SCALE²) drawn in float32 and cast),
    each expert matrix a copy of POOL_VALUES random values at its own random offset
    (drawing every expert value on the host, and copying it over, is most of a minute
    at the qwen3-30b-a3b shape on a 2-core VM)."""
    import jax
    import jax.numpy as jnp

    from moejax.param_layout import EXPERT_KEYS, param_shapes

    dtype = jnp.dtype(dtype)
    device = device or jax.devices()[0]
    rng = np.random.default_rng(seed)
    pool = jax.device_put((rng.standard_normal(POOL_VALUES, dtype=np.float32) * SCALE)
                          .astype(dtype), device)
    stack = jax.jit(_pooled_stack, static_argnames="shape")

    def make(name: str, shape: tuple[int, ...]) -> Any:
        if name.endswith("norm"):
            return jax.device_put(np.ones(shape, dtype), device)
        if name not in EXPERT_KEYS:
            return jax.device_put((rng.standard_normal(shape, dtype=np.float32) * SCALE)
                                  .astype(dtype), device)
        size = int(np.prod(shape[2:]))
        if size > POOL_VALUES // 2:
            raise ValueError(f"{name}: a matrix of {size} values needs a larger pool")
        offsets = rng.integers(0, POOL_VALUES - size + 1, int(np.prod(shape[:2])))
        return stack(pool, jax.device_put(offsets.astype(np.int32), device),
                     shape=tuple(shape))

    params: dict[str, Any] = {}
    for name, shape in param_shapes(cfg).items():
        if name == "layers":
            params["layers"] = {n: make(n, s) for n, s in shape.items()}
        else:
            params[name] = make(name, shape)
    return jax.block_until_ready(params)


def load_shape(name: str, args: Any, opts: Any) -> tuple[Any, Any]:
    """(config, resident decode runner) of a shape."""
    from moejax.decode.factory import make_runner

    if name == "demo":
        from moejax.checkpoint import load_model_dir
        from serving.api import resolve_model_dir

        cfg, params, _ = load_model_dir(resolve_model_dir("demo")[0], "float32")
        return cfg, make_runner("resident", cfg, params, dtype="float32", opts=opts)
    if name == "qwen3-30b-a3b":
        import jax
        import jax.numpy as jnp

        from moejax.backends.resident import ResidentPlacement
        from moejax.model import check_params

        dtype = jnp.dtype(args.dtype or ("bfloat16" if is_gpu() else "float32"))
        layers = args.layers or (8 if is_gpu() else 2)
        cfg = qwen_config(layers, max_context=max(4096, 2 * args.prompt_tokens))
        device = jax.devices()[0]
        params = random_params(cfg, dtype, device)
        check_params(params, cfg)
        # Placed as made: the runner's own placement would take the weights back to the
        # host to cast them (ResidentPlacement.place), and copy them over again.
        placement = ResidentPlacement(cfg, dtype, device, params)
        return cfg, make_runner("resident", cfg, None, dtype=dtype, opts=opts,
                                placement=placement)
    raise ValueError(f"unknown shape {name!r}; choose from {SHAPES}")


# ----------------------------------------------------------------------------- the floor
def expert_bytes_per_expert(params: dict[str, Any], cfg: Any) -> int:
    """The bytes of one expert at one layer: its matrices (3·d·f·itemsize) and, where the
    experts are kept in FP8, their block scales (biases are counted as dense weights)."""
    from moejax.backends.base import expert_bytes_per_layer

    return expert_bytes_per_layer(params) // cfg.num_experts


def dense_weight_bytes(params: dict[str, Any], cfg: Any) -> int:
    """The bytes of every weight a decode step reads whole: all but the expert matrices
    (and scales) and the embedding table (a step gathers only its rows' rows; with tied
    embeddings the table is the LM head, read whole)."""
    from moejax.backends.base import dense_bytes, nbytes

    embed = 0 if cfg.tie_word_embeddings else nbytes(params["embed"])
    return dense_bytes(params) - embed


def floor_bytes(experts: np.ndarray, *, expert_bytes: int, context_tokens: int,
                kv_token_bytes: int, dense_bytes: int, weights: np.ndarray | None = None
                ) -> dict[str, int]:
    """The bytes a decode step must read, by part.

    ``experts`` [L, rows, k]: each row's chosen experts at each layer (only real rows);
    ``weights`` (same shape, optional): their gate weights, a choice of weight 0 reading
    nothing (a dense layer routes with weight 0); ``expert_bytes``: one expert's bytes;
    ``context_tokens``: the rows' tokens already in the KV pool, summed; ``kv_token_bytes``:
    one token's keys and values over every layer; ``dense_bytes``: the weights read whole.
    Returns ``{"experts", "kv", "dense", "total"}`` bytes and ``"active"`` (distinct
    experts summed over layers)."""
    experts = np.asarray(experts)
    if experts.ndim != 3:
        raise ValueError(f"experts must be [L, rows, k], got shape {experts.shape}")
    taken = (np.ones(experts.shape, bool) if weights is None
             else np.asarray(weights) != 0)
    active = sum(len(np.unique(experts[layer][taken[layer]]))
                 for layer in range(experts.shape[0]))
    parts = {"experts": active * int(expert_bytes),
             "kv": int(context_tokens) * int(kv_token_bytes),
             "dense": int(dense_bytes)}
    return {**parts, "total": sum(parts.values()), "active": int(active)}


def kv_token_bytes(cfg: Any, itemsize: int) -> int:
    """One token's keys and values over every layer (L × KV heads × head dim × 2 ×
    itemsize for grouped-query attention; the config's own count, e.g. for MLA)."""
    return int(cfg.kv_bytes_per_token(itemsize))


def copy_bandwidth(mib: int = 256, repeats: int = COPY_REPEATS) -> float:
    """Bytes per second of a jitted ``a + 1`` over ``mib`` MiB of float32 (read and
    written both counted), best of ``repeats`` after one warm-up. The input is donated,
    so the output reuses its buffer: a fresh output each call would time the allocator's
    first touch of its pages too (on a CPU several times the copy itself)."""
    import jax
    import jax.numpy as jnp

    n = mib * 2**20 // 4
    fn = jax.jit(lambda a: a + 1, donate_argnums=0)
    a = jax.block_until_ready(fn(jnp.zeros((n,), jnp.float32)))
    best = float("inf")
    with timed_pass("copy_bandwidth"):
        for _ in range(repeats):
            start = time.perf_counter()
            a = jax.block_until_ready(fn(a))
            best = min(best, time.perf_counter() - start)
    del a
    return 2 * n * 4 / best


# ----------------------------------------------------------------------------- the steps
def sliced_step(params, kv, batch, samp, *, cfg, opts):
    """``programs.fused_step`` with each layer's experts sliced out of the stack
    (``dispatch.SlicedExperts``): XLA copies the layer per layer per step."""
    from moejax import model, moe
    from moejax.decode import programs
    from moejax.dispatch import SlicedExperts, local_dispatcher

    module = model.decoder(cfg, params)
    dispatcher = local_dispatcher(SlicedExperts(module.layers.experts()), cfg.num_experts,
                                  opts.expert_impl, opts.tile_rows,
                                  activation=moe.expert_activation_of(cfg),
                                  fp8_block=cfg.expert_fp8_block)
    return programs.paged_forward(module, kv, batch, samp, dispatcher, opts)[0]


_SLICED_STEP = None


def sliced_program():
    global _SLICED_STEP
    if _SLICED_STEP is None:
        import jax

        _SLICED_STEP = jax.jit(sliced_step, static_argnames=("cfg", "opts"))
    return _SLICED_STEP


def decode_plan(runner: Any, rows: int, prompt_tokens: int, seed: int = 0):
    """A scheduler over ``runner`` with ``rows`` sequences prefilled, and its next plan's
    decode work items (all ``rows`` of them, blocks allocated)."""
    from moejax.core.continuous import BLOCK, Scheduler, SchedulerOptions
    from moejax.sequences import SequenceSpec

    blocks_per_seq = -(-(prompt_tokens + 2) // BLOCK)
    scheduler = Scheduler(runner, rows * blocks_per_seq + 2, SchedulerOptions(
        max_batch_size=rows, max_prefill_tokens=rows * prompt_tokens,
        prefill_row_tokens=prompt_tokens, pipelined=False))
    rng = np.random.default_rng(seed)
    vocab = runner.cfg.vocab_size
    for i in range(rows):
        prompt = tuple(int(t) for t in rng.integers(3, vocab, prompt_tokens))
        scheduler.submit(SequenceSpec(prompt=prompt, max_new_tokens=64, seed=i))
    for _ in range(4):             # one step prefills every prompt (each fits one row)
        scheduler.step()
        if all(s.pending == 1 for s in scheduler.running) and not scheduler.waiting:
            break
    else:
        raise AssertionError("the prompts did not all finish prefilling")
    plan = scheduler.schedule()
    if plan.prefill or len(plan.decode) != rows:
        raise AssertionError(f"expected {rows} decode rows, got {len(plan.decode)} "
                             f"(and {len(plan.prefill)} prefill)")
    return scheduler, plan.decode


def time_variants(calls: dict[str, Any], steps: int, label: str,
                  min_seconds: float = MIN_SECONDS, max_rounds: int = MAX_ROUNDS
                  ) -> tuple[dict[str, float], int]:
    """Median synchronized seconds of each call, the calls alternating each round: at
    least ``steps`` rounds, more (up to ``max_rounds``) while all of them took under
    ``min_seconds`` (a step of milliseconds gets a median of many). Also the rounds."""
    import jax

    times: dict[str, list[float]] = {name: [] for name in calls}
    rounds, began = 0, time.perf_counter()
    with timed_pass(label):
        while rounds < steps or (rounds < max_rounds
                                 and time.perf_counter() - began < min_seconds):
            for name, fn in calls.items():
                start = time.perf_counter()
                jax.block_until_ready(fn())
                times[name].append(time.perf_counter() - start)
            rounds += 1
    return {name: median(values) for name, values in times.items()}, rounds


def measure_shape(name: str, args: Any, shape: dict[str, Any], bandwidth: float
                  ) -> dict[str, Any]:
    """Every batch size of one shape: times, floors and ratios (flat figures)."""
    import jax

    from moejax import grouped_gemm
    from moejax.decode import programs
    from moejax.decode.programs import StepOptions

    started = time.perf_counter()
    opts = StepOptions(expert_impl=args.expert_impl)
    cfg, runner = load_shape(name, args, opts)
    dtype = runner.dtype.name

    def impl_at(rows: int) -> str:     # what "auto" resolves to in the step's MoE
        if args.expert_impl != "auto":
            return args.expert_impl
        return grouped_gemm.choose_expert_impl(
            cfg.hidden_size, cfg.moe_intermediate_size,
            rows=rows * cfg.num_experts_per_tok, num_experts=cfg.num_experts)

    per_expert = expert_bytes_per_expert(runner.params, cfg)
    dense = dense_weight_bytes(runner.params, cfg)
    token_kv = kv_token_bytes(cfg, runner.dtype.itemsize)
    layer_bytes = per_expert * cfg.num_experts
    rows_max = max(shape["batches"])
    scheduler, works = decode_plan(runner, rows_max, shape["prompt_tokens"])
    print(f"{name}: d={cfg.hidden_size} f={cfg.moe_intermediate_size} E={cfg.num_experts} "
          f"k={cfg.num_experts_per_tok} L={cfg.num_layers} V={cfg.vocab_size} {dtype}, "
          f"expert path {args.expert_impl}; one layer's experts "
          f"{layer_bytes / 2**20:.1f} MiB; "
          f"{rows_max} sequences started ({shape['prompt_tokens']}-token prompts) in "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    figures: dict[str, Any] = {
        f"layers_{name}": cfg.num_layers, f"dtype_{name}": dtype,
        f"layer_expert_bytes_{name}": layer_bytes,
        f"layer_copy_floor_ms_{name}": 2 * layer_bytes / bandwidth * 1e3}
    sliced = sliced_program()
    pool = scheduler.store.pool
    for rows in shape["batches"]:
        batch, samp, _, last_rows = scheduler.paged.build_batch([list(works[:rows])], rows, 1)
        batch, samp = jax.device_put((batch, samp), runner.device)
        calls = {
            "in_place": lambda: programs.FUSED_STEP(runner.params, pool, batch, samp,
                                                    cfg=cfg, opts=opts),
            "sliced": lambda: sliced(runner.params, pool, batch, samp, cfg=cfg, opts=opts)}
        results = {}
        for variant, fn in calls.items():          # the compile (if any), untimed
            start = time.perf_counter()
            results[variant] = jax.block_until_ready(fn())
            figures[f"first_call_s_{name}_{rows}_{variant}"] = time.perf_counter() - start
        experts = np.asarray(results["in_place"].experts)[:, last_rows]
        weights = np.asarray(results["in_place"].weights)[:, last_rows]
        if not np.array_equal(experts, np.asarray(results["sliced"].experts)[:, last_rows]):
            print(f"WARNING: {name} rows={rows}: the sliced step routed differently",
                  flush=True)
        del results
        seconds, rounds = time_variants(calls, shape["steps"], f"{name}_{rows}")
        context = int(np.asarray(batch.context_len)[last_rows].sum())
        floor = floor_bytes(experts, weights=weights, expert_bytes=per_expert,
                            context_tokens=context, kv_token_bytes=token_kv,
                            dense_bytes=dense)
        floor_s = floor["total"] / bandwidth
        key = f"{name}_{rows}"
        figures.update({
            f"decode_step_ms_{key}_in_place": seconds["in_place"] * 1e3,
            f"decode_step_ms_{key}_sliced": seconds["sliced"] * 1e3,
            f"decode_step_floor_ms_{key}": floor_s * 1e3,
            f"decode_step_over_floor_{key}_in_place": seconds["in_place"] / floor_s,
            f"decode_step_over_floor_{key}_sliced": seconds["sliced"] / floor_s,
            f"copy_per_layer_ms_{key}": (seconds["sliced"] - seconds["in_place"])
            / cfg.num_layers * 1e3,
            f"floor_bytes_{key}": floor["total"], f"floor_expert_bytes_{key}": floor["experts"],
            f"floor_kv_bytes_{key}": floor["kv"], f"floor_dense_bytes_{key}": floor["dense"],
            f"active_experts_mean_{key}": floor["active"] / cfg.num_layers,
            f"context_tokens_{key}": context, f"expert_impl_{key}": impl_at(rows),
            f"timed_steps_{key}": rounds})
        print(f"  rows={rows:3d} ({impl_at(rows)}): in place "
              f"{seconds['in_place'] * 1e3:9.2f} ms, sliced "
              f"{seconds['sliced'] * 1e3:9.2f} ms, floor {floor_s * 1e3:8.3f} ms "
              f"({floor['total'] / 2**20:.1f} MiB, {floor['active'] / cfg.num_layers:.1f} "
              f"experts/layer; median of {rounds})", flush=True)
    return figures


# ----------------------------------------------------------------------------- the run
def machine_line() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            model = next((line.split(":", 1)[1].strip() for line in fh
                          if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}"


def parse_args(argv: Sequence[str] | None):
    parser = cli.bench_parser(__doc__, quick_help="8 rows, 2 timed steps, one-token "
                              "prompts (about a minute on 2 CPU cores)")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"comma list of {','.join(SHAPES)}")
    parser.add_argument("--batches", help="comma list of decode rows (default 8,16,32; "
                        "quick 8)")
    parser.add_argument("--steps", type=int, help="timed steps per variant (median kept; "
                        "default 7, quick 3)")
    parser.add_argument("--prompt-tokens", type=int, help="each sequence's prompt "
                        "(the context of its decode step; default 64 on CPU, 1024 on "
                        "GPU, quick 1)")
    parser.add_argument("--layers", type=int, help="layers of the qwen3-30b-a3b shape "
                        "(default 2 on CPU, 8 on GPU; at least 2: XLA turns a loop of one layer "
                        "into straight code, and its slice into no copy)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="the qwen3-30b-a3b shape's dtype (default float32 on CPU, "
                             "bfloat16 on GPU)")
    parser.add_argument("--expert-impl", default="auto", help="the expert path (auto: "
                        "choose_expert_impl)")
    parser.add_argument("--copy-mib", type=int, default=256,
                        help="MiB of the bandwidth measurement's array (default 256)")
    return parser, cli.parse_args(parser, argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser, args = parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"unknown shape {name!r}; choose from {','.join(SHAPES)}")
    shape = cli.run_shape(args, QUICK, FULL, ("steps", "prompt_tokens"))
    if args.prompt_tokens is None and not args.quick and is_gpu():
        shape["prompt_tokens"] = GPU_PROMPT_TOKENS
    if args.batches:
        shape["batches"] = tuple(int(v) for v in args.batches.split(","))
    args.prompt_tokens = shape["prompt_tokens"]
    if min(shape["batches"]) < 1 or shape["steps"] < 1 or shape["prompt_tokens"] < 1:
        parser.error("--batches, --steps and --prompt-tokens must be >= 1")
    if args.layers is not None and args.layers < 2:
        parser.error("--layers must be >= 2 (one layer's slice is no copy)")

    figures: dict[str, Any] = {
        **platform_figures(), "machine": machine_line(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", "-m", "benchmarks.decode_step",
                             *(sys.argv[1:] if argv is None else argv)]),
        "shapes": ",".join(shapes), "batches": ",".join(map(str, shape["batches"])),
        "steps": shape["steps"], "prompt_tokens": shape["prompt_tokens"]}
    bandwidth = copy_bandwidth(args.copy_mib)
    figures["copy_bandwidth_gb_s"] = bandwidth / 1e9
    print(f"machine: {figures['machine']} ({figures['platform']}, {figures['device_kind']}); "
          f"copy bandwidth {bandwidth / 1e9:.2f} GB/s (a + 1 over {args.copy_mib} MiB, read "
          f"and written); {shape['steps']} timed steps per variant", flush=True)
    for name in shapes:
        figures.update(measure_shape(name, args, shape, bandwidth))

    rows = [(name, n) for name in shapes for n in shape["batches"]]

    def get(prefix: str, suffix: str = ""):
        return lambda r: figures[f"{prefix}_{r[0]}_{r[1]}{suffix}"]

    print_table([
        ("shape", -15, lambda r: r[0]),
        ("rows", 5, lambda r: str(r[1])),
        ("in place ms", 13, lambda r: fmt(get("decode_step_ms", "_in_place")(r), ".2f")),
        ("sliced ms", 11, lambda r: fmt(get("decode_step_ms", "_sliced")(r), ".2f")),
        ("floor ms", 10, lambda r: fmt(get("decode_step_floor_ms")(r), ".3f")),
        ("x floor in place", 18,
         lambda r: fmt(get("decode_step_over_floor", "_in_place")(r), ".2f")),
        ("x floor sliced", 16, lambda r: fmt(get("decode_step_over_floor", "_sliced")(r), ".2f")),
        ("copy ms/layer", 15, lambda r: fmt(get("copy_per_layer_ms")(r), ".3f")),
        ("layer copy floor ms", 21,
         lambda r: fmt(figures[f"layer_copy_floor_ms_{r[0]}"], ".3f")),
        ("experts/layer", 15, lambda r: fmt(get("active_experts_mean")(r), ".1f")),
    ], rows, title=f"\ndecode step, median of at least {shape['steps']}; floor = bytes "
                   f"read / {bandwidth / 1e9:.2f} GB/s")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

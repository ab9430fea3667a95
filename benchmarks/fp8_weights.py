"""Experts kept in FP8 (``weights_dtype="fp8"``, issue 41) against the same weights in bf16.

Issue 41 lets ``weights_dtype="fp8"`` become a default only where a GPU run shows it faster
at the same accuracy. This measures both on weights quantized as the FP8 checkpoints are
(float8_e4m3fn, one scale per 128x128 block: ``scale = max|w| / 448``); the bf16 side holds
those weights dequantized (what ``weights_dtype="auto"`` loads), so the two paths multiply
by the same values and any difference is the kernels':

1. **expert stage**: ``moe.expert_compute`` over one layer of routed rows (random top-k of
   T tokens) at the expert shapes of Qwen3-30B-A3B (d=2048, f=768, E=128, k=8) and
   DeepSeek-V3 (d=7168, f=2048, E=256, k=8), for ``pallas`` (the Triton kernels:
   ``kernels_pallas.gmm_fp8`` against ``kernels_pallas.gmm``) and ``fused_tiles``;
2. **model**: the resident scoring forward (``moejax.model.score_readout``) of a
   Qwen3-30B-A3B-shaped model (8 layers on a GPU; ``--layers``) over a packed batch, read
   over the whole vocabulary at each sequence's last position: seconds, tokens/s, the
   largest log-probability difference and the share of positions whose argmax agrees.

The rule: FP8 may become the default where ``model_fp8_over_bf16`` (bf16 seconds over FP8
seconds) is at least 1.0 and ``model_max_logprob_diff`` is within the bf16 parity bound
(2e-2) with ``model_argmax_agreement`` 1.0. A path that fails (a first Triton compile of
the FP8 kernel, say) is recorded as ``..._failed`` with the error's first line and the run
goes on. Off a GPU the shapes shrink to CPU sizes (Pallas is interpreted): a dry run.

    python -m benchmarks.fp8_weights [--quick] [--json PATH] [--tokens N] [--layers L]
        [--repeats R] [--parts experts,model]

JSON keys (flat): per expert shape S (``qwen3``, ``deepseek``) and path P: ``{S}_{P}_bf16_ms``,
``{S}_{P}_fp8_ms``, ``{S}_{P}_fp8_over_bf16``, ``{S}_{P}_fp8_rel_diff`` (max |fp8 - bf16| over
max |bf16| of the outputs); ``{S}_expert_bytes_bf16`` / ``_fp8``; the model's
``model_bf16_s``, ``model_fp8_s``, ``model_fp8_over_bf16``, ``model_tokens_per_s_bf16`` /
``_fp8``, ``model_max_logprob_diff``, ``model_argmax_agreement``,
``model_expert_bytes_bf16`` / ``_fp8``, ``model_expert_impl``; ``platform``, ``device_kind``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable

import numpy as np

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run, platform_figures
from benchmarks.lib.timing import is_gpu, median_seconds

BLOCK = (128, 128)
E4M3_MAX = 448.0
# name -> (d, f, E, k): the expert shapes of the models.
EXPERT_SHAPES = {"qwen3": (2048, 768, 128, 8), "deepseek": (7168, 2048, 256, 8)}
QUICK = dict(tokens=64, layers=2, repeats=2, shapes={"qwen3": (256, 128, 8, 2)})
CPU = dict(tokens=256, layers=2, repeats=3, shapes={"qwen3": (512, 256, 16, 4)})
GPU = dict(tokens=16384, layers=8, repeats=10, shapes=EXPERT_SHAPES)


def quantize(w, block=BLOCK):
    """(FP8 values, float32 scales) of ``w [E, in, out]`` as the official checkpoints
    quantize (per block: scale = max|w| / 448, 1 for an all-zero block; w / scale rounded
    to E4M3), on the device."""
    import jax.numpy as jnp

    from moejax.fp8_experts import FP8_DTYPE

    E, rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    w = w.astype(jnp.float32)
    padded = jnp.pad(jnp.abs(w), ((0, 0), (0, grid[0] * block[0] - rows),
                                  (0, grid[1] * block[1] - cols)))
    amax = padded.reshape(E, grid[0], block[0], grid[1], block[1]).max(axis=(2, 4))
    scale = jnp.where(amax > 0, amax / E4M3_MAX, 1.0).astype(jnp.float32)
    expanded = jnp.repeat(jnp.repeat(scale, block[0], 1)[:, :rows], block[1], 2)[:, :, :cols]
    return jnp.clip(w / expanded, -E4M3_MAX, E4M3_MAX).astype(FP8_DTYPE), scale


def _stack_pair(key, shape, dtype):
    """(FP8 bytes, scale, the same weights dequantized to ``dtype``) of a random stack."""
    import jax
    import jax.numpy as jnp

    from moejax.fp8_experts import dequantize_blocks

    values, scale = jax.jit(quantize)(jax.random.normal(key, shape, jnp.float32) * 0.02)
    bf16 = jax.jit(functools.partial(dequantize_blocks, block=BLOCK, dtype=dtype))(values, scale)
    return jax.lax.bitcast_convert_type(values, jnp.uint8), scale, bf16


def _record(figures: dict[str, Any], key: str, fn: Callable[[], dict[str, Any]]) -> None:
    """``fn``'s figures into ``figures``; a failure as ``{key}_failed``."""
    try:
        figures.update(fn())
    except Exception as exc:   # noqa: BLE001 - a failed path is a figure, the run goes on
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        figures[f"{key}_failed"] = f"{type(exc).__name__}: {first[:300]}"
        print(f"{key}: FAILED {figures[f'{key}_failed']}", flush=True)


def expert_stage(name: str, shape: tuple[int, int, int, int], tokens: int, repeats: int
                 ) -> dict[str, Any]:
    """Part 1 for one expert shape: pallas and fused_tiles, bf16 against FP8."""
    import jax
    import jax.numpy as jnp

    from moejax import moe
    from moejax.fp8_experts import Fp8Experts

    d, f, E, k = shape
    dtype = jnp.bfloat16 if is_gpu() else jnp.float32
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    stacks = [_stack_pair(keys[i], s, dtype) for i, s in enumerate(((E, d, f), (E, d, f),
                                                                   (E, f, d)))]
    rows = tokens * k
    x = (jax.random.normal(keys[3], (rows, d), jnp.float32)).astype(dtype)
    sizes = jnp.bincount(jax.random.randint(keys[4], (rows,), 0, E), length=E).astype(jnp.int32)
    perm = moe.Permutation(x_sorted=x, order=jnp.arange(rows, dtype=jnp.int32),
                           group_sizes=sizes)
    fp8 = [Fp8Experts(v, s, BLOCK) for v, s, _ in stacks]
    bf16 = [w for _, _, w in stacks]
    figures: dict[str, Any] = {
        f"{name}_expert_bytes_bf16": sum(int(w.nbytes) for w in bf16),
        f"{name}_expert_bytes_fp8": sum(int(v.nbytes + s.nbytes) for v, s, _ in stacks)}
    for impl in ("pallas", "fused_tiles"):
        def measure(impl=impl) -> dict[str, Any]:
            run = jax.jit(lambda p, ws: moe.expert_compute(p, *ws, impl=impl))
            out = {}
            results = {}
            for side, weights in (("bf16", bf16), ("fp8", fp8)):
                results[side] = jax.block_until_ready(run(perm, weights))
                seconds = median_seconds(lambda: jax.block_until_ready(run(perm, weights)),
                                         repeats, label=f"{name}_{impl}_{side}")
                out[f"{name}_{impl}_{side}_ms"] = round(seconds * 1e3, 3)
            want = np.asarray(results["bf16"], np.float32)
            got = np.asarray(results["fp8"], np.float32)
            out[f"{name}_{impl}_fp8_over_bf16"] = round(
                out[f"{name}_{impl}_bf16_ms"] / out[f"{name}_{impl}_fp8_ms"], 3)
            out[f"{name}_{impl}_fp8_rel_diff"] = float(np.max(np.abs(got - want))
                                                       / max(np.max(np.abs(want)), 1e-30))
            print(f"{name} {impl}: bf16 {out[f'{name}_{impl}_bf16_ms']} ms, fp8 "
                  f"{out[f'{name}_{impl}_fp8_ms']} ms ({out[f'{name}_{impl}_fp8_over_bf16']}x),"
                  f" rel diff {out[f'{name}_{impl}_fp8_rel_diff']:.2e}", flush=True)
            return out

        _record(figures, f"{name}_{impl}", measure)
    return figures


def _model_batch(cfg: Any, tokens: int, block: int):
    """A packed batch of tokens // block sequences of ``block`` random tokens, each read at
    its last position (two candidate ids; the readout's lse gives the whole vocabulary)."""
    from moejax.model import PackedBatch

    rng = np.random.default_rng(0)
    count = tokens // block
    return PackedBatch(
        tokens=rng.integers(3, cfg.vocab_size, tokens).astype(np.int32),
        positions=np.tile(np.arange(block, dtype=np.int32), count),
        segment_ids=np.repeat(np.arange(count, dtype=np.int32), block),
        score_positions=(np.arange(count, dtype=np.int32) + 1) * block - 1,
        score_token_ids=rng.integers(3, cfg.vocab_size, (count, 2)).astype(np.int32))


def model_forward(args: Any, tokens: int, layers: int, repeats: int) -> dict[str, Any]:
    """Part 2: the resident scoring forward with FP8 experts against their bf16 twin."""
    import jax
    import jax.numpy as jnp

    from benchmarks.lib.models import device_params, model_shape
    from moejax import grouped_gemm
    from moejax import model as mdl
    from moejax.fp8_experts import dequantize_blocks
    from moejax.param_layout import EXPERT_KEYS

    cfg, dtype = model_shape(argparse_namespace(args, layers))
    device = jax.devices()[0]
    params = device_params(cfg, dtype, device)
    fp8_layers = dict(params["layers"])
    for name in EXPERT_KEYS:               # quantize layer by layer; bf16 side = dequantized
        stack, values, scales = params["layers"][name], [], []
        for layer in range(cfg.num_layers):
            v, s = jax.jit(quantize)(stack[layer])
            values.append(jax.lax.bitcast_convert_type(v, jnp.uint8))
            scales.append(s)
        fp8_layers[name], fp8_layers[f"{name}_scale"] = jnp.stack(values), jnp.stack(scales)
        params["layers"][name] = jax.jit(functools.partial(
            dequantize_blocks, block=BLOCK, dtype=jnp.dtype(dtype)))(fp8_layers[name],
                                                                     fp8_layers[f"{name}_scale"])
    fp8_params = {**params, "layers": fp8_layers}
    fp8_cfg = dataclasses.replace(cfg, expert_fp8_block=BLOCK)
    block = min(512, tokens)
    batch = jax.device_put(_model_batch(cfg, tokens, block), device)
    opts = mdl.ForwardOptions(attn_block=block, full_vocab=True)
    forward = jax.jit(mdl.score_readout, static_argnames=("cfg", "opts"))
    figures: dict[str, Any] = {"model_layers": cfg.num_layers, "model_tokens": tokens,
                               "model_expert_impl": grouped_gemm.choose_expert_impl(
                                   cfg.hidden_size, cfg.moe_intermediate_size)}
    readouts = {}
    for side, p, c in (("bf16", params, cfg), ("fp8", fp8_params, fp8_cfg)):
        def run(p=p, c=c):
            return jax.block_until_ready(forward(p, batch, cfg=c, opts=opts))

        def measure(side=side, run=run) -> dict[str, Any]:
            readouts[side] = run()
            seconds = median_seconds(run, repeats, label=f"model_{side}")
            experts = sum(int(p["layers"][k].nbytes) for k in p["layers"]
                          if k.split("_scale")[0] in EXPERT_KEYS)
            print(f"model {side}: {seconds:.4f} s, {tokens / seconds:.0f} tokens/s, expert "
                  f"bytes {experts}", flush=True)
            return {f"model_{side}_s": round(seconds, 5),
                    f"model_tokens_per_s_{side}": round(tokens / seconds, 1),
                    f"model_expert_bytes_{side}": experts}

        _record(figures, f"model_{side}", measure)
    if len(readouts) == 2:
        logprob = {s: np.asarray(r.logits, np.float64) - np.asarray(r.lse, np.float64)[:, None]
                   for s, r in readouts.items()}
        figures["model_fp8_over_bf16"] = round(figures["model_bf16_s"] / figures["model_fp8_s"], 3)
        figures["model_max_logprob_diff"] = float(np.max(np.abs(logprob["fp8"] - logprob["bf16"])))
        figures["model_argmax_agreement"] = float(np.mean(
            np.argmax(logprob["fp8"], 1) == np.argmax(logprob["bf16"], 1)))
        print(f"model: fp8 over bf16 {figures['model_fp8_over_bf16']}x, max log-prob diff "
              f"{figures['model_max_logprob_diff']:.2e}, argmax agreement "
              f"{figures['model_argmax_agreement']}", flush=True)
    return figures


def argparse_namespace(args: Any, layers: int) -> Any:
    """What ``benchmarks.lib.models.model_shape`` reads: quick, layers, dtype (bf16 on a
    GPU, f32 off it)."""
    import argparse

    return argparse.Namespace(quick=args.quick, layers=layers, dtype=None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="tiny shapes (a CPU smoke run)",
                          repeats=None, repeats_help="timed calls per path")
    parser.add_argument("--tokens", type=int, help="tokens per expert-stage call and per "
                                                   "model batch (a power of two)")
    parser.add_argument("--layers", type=int, help="layers of the model (part 2)")
    parser.add_argument("--parts", default="experts,model",
                        help="what to run: experts, model or both (default)")
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, GPU if is_gpu() else CPU, ("tokens", "layers", "repeats"))
    figures: dict[str, Any] = {**platform_figures(), "block": list(BLOCK)}
    parts = set(args.parts.split(","))
    if "experts" in parts:
        for name, dims in shape["shapes"].items():
            figures.update(expert_stage(name, dims, shape["tokens"], shape["repeats"]))
    if "model" in parts:
        figures.update(model_forward(args, shape["tokens"], shape["layers"], shape["repeats"]))
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Random-weight models and packed workloads for the prefill benchmarks.

:func:`model_shape` is the benchmark model: on a GPU the Qwen3-30B-A3B shape (d=2048,
32/4 heads of 128, E=128, k=8, f=768, V=151936; 8 layers unless told), bf16; on CPU a
small Qwen3-MoE (d=256, 4 layers, E=32, k=4, f=256, V=2048), f32; quick: a tiny one.
:func:`device_params` / :func:`host_params` make its random weights where they live, one
layer slice at a time (a jitted fill of a preallocated stack, donated), so no array
exists twice. :func:`make_workload` packs random-token sequences into batches of one
shape; :func:`useful_flops` is DESIGN.md's FLOP count of their real tokens.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

import numpy as np

from benchmarks.lib.timing import is_gpu

SCALE = 0.02            # random weights ~ N(0, SCALE²)
CANDIDATES = 2          # candidates scored per sequence of a workload


def model_shape(args: argparse.Namespace) -> tuple[Any, str]:
    """The benchmark model (a ``moejax.config.ModelConfig``) and its dtype, from
    ``args.quick``, ``args.layers`` and ``args.dtype`` (None: the platform's default)."""
    from moejax.config import ModelConfig

    common = dict(model_type="qwen3_moe", norm_topk_prob=True, qk_norm=True, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False)
    if args.quick:
        shape = dict(vocab_size=512, hidden_size=64, num_layers=3, num_heads=16, num_kv_heads=8,
                     head_dim=8, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     max_context=1024)
        dtype = "float32"
    elif is_gpu():
        shape = dict(vocab_size=151936, hidden_size=2048, num_layers=8, num_heads=32,
                     num_kv_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                     moe_intermediate_size=768, max_context=40960)
        dtype = "bfloat16"
    else:
        shape = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=16,
                     num_kv_heads=8, head_dim=16, num_experts=32, num_experts_per_tok=4,
                     moe_intermediate_size=256, max_context=4096)
        dtype = "float32"
    if args.layers:
        shape["num_layers"] = args.layers
    return ModelConfig(**shape, **common), args.dtype or dtype


def make_workload(cfg: Any, num_batches: int, block: int, batch_tokens: int,
                  seed: int = 0) -> list[Any]:
    """``num_batches`` full ``moejax.packing.HostBatch`` es of one shape: sequences of
    block/2+1 … block tokens, one per attention block, each scored at its last position
    over :data:`CANDIDATES` candidates."""
    from moejax.ops import PrefillOp
    from moejax.packing import BucketPolicy, pack

    per_batch = batch_tokens // block
    rng = np.random.default_rng(seed)
    sequences = []
    for i in range(num_batches * per_batch):
        n = int(rng.integers(block // 2 + 1, block + 1))
        sequences.append(PrefillOp(
            key=i, token_ids=rng.integers(0, cfg.vocab_size, n).astype(np.int32),
            score_positions=(n - 1,),
            score_token_ids=(tuple(int(t) for t in rng.integers(0, cfg.vocab_size, CANDIDATES)),)))
    hosts = pack(sequences, BucketPolicy(max_batch_tokens=batch_tokens, min_block=block))
    shapes = {h.shape_key for h in hosts}
    if len(shapes) != 1 or len(hosts) != num_batches:
        raise AssertionError(f"workload packed into {len(hosts)} batches of shapes {shapes}")
    return hosts


def useful_flops(cfg: Any, hosts: Sequence[Any]) -> float:
    """DESIGN.md's FLOPs of every real sequence (no padding)."""
    return float(sum(cfg.request_flops(len(s.token_ids), 0, scoring_positions=len(s.score_positions),
                                       num_candidates=CANDIDATES)
                     for h in hosts for s in h.sequences))


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



def workload_shape(quick: bool, block: int | None, tokens: int | None, *,
                   gpu_tokens: int = 16384, tokens_flag: str = "--batch-tokens"
                   ) -> tuple[int, int]:
    """(attention block = longest sequence, tokens per batch), both powers of two with
    tokens >= block: given values first, else block 512 on a GPU, 128 on CPU, 32 quick,
    and tokens ``gpu_tokens`` on a GPU, 1024 on CPU, 128 quick."""
    if quick:
        default_block, default_tokens = 32, 128
    elif is_gpu():
        default_block, default_tokens = 512, gpu_tokens
    else:
        default_block, default_tokens = 128, 1024
    block, tokens = block or default_block, tokens or default_tokens
    if block & (block - 1) or tokens & (tokens - 1) or tokens < block:
        raise SystemExit(f"--block ({block}) and {tokens_flag} ({tokens}) must be powers of "
                         f"two with {tokens_flag} >= --block")
    return block, tokens

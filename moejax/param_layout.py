"""The params layout shared by the model, the checkpoint loader and the backends.

A params pytree is a nested dict; every layer is stacked on a leading L axis and
matrices are stored [in, out]:

    embed [V, d]
    layers: attn_norm [L, d], wq [L, d, n_q·h], wk / wv [L, d, n_kv·h], wo [L, n_q·h, d],
            q_norm / k_norm [L, h] (qk_norm models), mlp_norm [L, d], router [L, d, E],
            w_gate / w_up [L, E, d, f], w_down [L, E, f, d]
    final_norm [d]
    lm_head [d, V] (absent when the embeddings are tied)
    score [d, num_labels] (a sequence classifier's head, instead of lm_head)

Family pieces (present only where the config has them): q_norm [L, n_q·h] / k_norm
[L, n_kv·h] (norm over all heads, OLMoE); bq [L, n_q·h], bk / bv [L, n_kv·h] (Qwen2-MoE);
MLA instead of wq/wk/wv and the q/k norms (``moejax.mla_shape.mla_param_shapes``,
stacked); score_bias [L, E] (DeepSeek-V3's correction bias, used for the choice only);
mlp_gate / mlp_up [L, d, F_r], mlp_down [L, F_r, d]: the resident MLP of each layer (the
shared experts of an MoE layer, the MLP of a dense layer; F_r the wider of the two, the
narrower zero-padded); shared_gate [L, d] (Qwen2-MoE's sigmoid gate of the shared
expert). GPT-OSS: sinks [L, n_q] (attention sink logits), bo [L, d] (output projection
bias), router_bias [L, E], and the expert biases b_gate / b_up [L, E, f], b_down [L, E, d]
(expert weights: they travel with the experts). Experts kept in FP8
(``cfg.expert_fp8_block``): w_gate / w_up / w_down float8_e4m3fn, and beside them
w_gate_scale / w_up_scale [L, E, ceil(d/b_in), ceil(f/b_out)], w_down_scale [L, E,
ceil(f/b_in), ceil(d/b_out)] float32 (``moejax.fp8_experts``). Dense layers keep zero expert weights and a zero router in the expert stacks, and
the layer multiplies their routed output by 0: every layer has one structure, so one
compiled loop body serves them all.

No JAX import here, so the checkpoint reader stays cheap to import.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from typing import Any

from moejax.config import ModelConfig
from moejax.mla_shape import mla_param_shapes

Params = dict[str, Any]

# The per-layer expert weights: what the backends place, shard and stream apart from
# the rest (attention, norms, router), which every device keeps whole.
EXPERT_KEYS = ("w_gate", "w_up", "w_down")
# The routed experts' biases (GPT-OSS): expert weights too, present only where the family
# has them. Only the backends that pass them to the expert compute serve such a family
# (``moejax.backends.base.check_expert_bias``).
EXPERT_BIAS_KEYS = ("b_gate", "b_up", "b_down")
# The block scales of expert matrices kept in FP8 (``ModelConfig.expert_fp8_block``,
# ``weights_dtype="fp8"``): ``<name>_scale [L, E, ceil(in/b_in), ceil(out/b_out)]`` float32
# beside each float8_e4m3fn ``<name> [L, E, in, out]``; expert weights too (they travel
# with the matrices they scale).
EXPERT_SCALE_KEYS = tuple(f"{name}_scale" for name in EXPERT_KEYS)
ALL_EXPERT_KEYS = EXPERT_KEYS + EXPERT_BIAS_KEYS + EXPERT_SCALE_KEYS


def expert_names(layers: Mapping[str, Any]) -> tuple[str, ...]:
    """The expert weight names present in ``layers`` (the matrices, and their biases or
    FP8 block scales if any)."""
    return EXPERT_KEYS + tuple(k for k in EXPERT_BIAS_KEYS + EXPERT_SCALE_KEYS if k in layers)


def expert_matrix_names(layers: Mapping[str, Any]) -> tuple[str, ...]:
    """The expert matrices and, where they are kept in FP8, their block scales: the bytes
    a memory report counts as expert weights (biases are counted with the dense ones)."""
    return EXPERT_KEYS + tuple(k for k in EXPERT_SCALE_KEYS if k in layers)


def scale_grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The block-scale shape of a matrix stack ``[..., in, out]``: ``[..., ceil(in/b_in),
    ceil(out/b_out)]`` (a partial edge block has a scale of its own)."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def split_experts(layers: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stacked layer params -> (everything but the experts, the expert weights)."""
    dense = {k: v for k, v in layers.items() if k not in ALL_EXPERT_KEYS}
    experts = {k: layers[k] for k in expert_names(layers)}
    return dense, experts


def param_shapes(cfg: ModelConfig) -> Params:
    """The params pytree of ``cfg`` with shape tuples as leaves."""
    d, L, h, E = cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.num_experts
    f, V = cfg.moe_intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * h, cfg.num_kv_heads * h
    layers: dict[str, tuple[int, ...]] = {"attn_norm": (L, d)}
    if cfg.mla is not None:
        layers.update({name: (L, *shape)
                       for name, shape in mla_param_shapes(cfg.mla, d).items()})
    else:
        layers.update({"wq": (L, d, q), "wk": (L, d, kv), "wv": (L, d, kv), "wo": (L, q, d)})
    layers.update({"mlp_norm": (L, d), "router": (L, d, E),
                   "w_gate": (L, E, d, f), "w_up": (L, E, d, f), "w_down": (L, E, f, d)})
    if cfg.qk_norm:
        layers["q_norm"] = (L, q) if cfg.qk_norm_over_heads else (L, h)
        layers["k_norm"] = (L, kv) if cfg.qk_norm_over_heads else (L, h)
    if cfg.qkv_bias:
        layers.update({"bq": (L, q), "bk": (L, kv), "bv": (L, kv)})
    if cfg.score_correction_bias:
        layers["score_bias"] = (L, E)
    if cfg.resident_mlp_size:
        fr = cfg.resident_mlp_size
        layers.update({"mlp_gate": (L, d, fr), "mlp_up": (L, d, fr), "mlp_down": (L, fr, d)})
    if cfg.shared_expert_gate:
        layers["shared_gate"] = (L, d)
    if cfg.attention_sinks:
        layers["sinks"] = (L, cfg.num_heads)
    if cfg.o_bias:
        layers["bo"] = (L, d)
    if cfg.router_bias:
        layers["router_bias"] = (L, E)
    if cfg.expert_bias:
        layers.update({"b_gate": (L, E, f), "b_up": (L, E, f), "b_down": (L, E, d)})
    if cfg.expert_fp8_block is not None:
        layers.update({f"{name}_scale": scale_grid(layers[name], cfg.expert_fp8_block)
                       for name in EXPERT_KEYS})
    shapes: Params = {"embed": (V, d), "layers": layers, "final_norm": (d,)}
    if cfg.num_labels:
        shapes["score"] = (d, cfg.num_labels)
    elif not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, V)
    return shapes


def num_params(cfg: ModelConfig) -> int:
    """Parameters of ``cfg``'s params pytree (every leaf of :func:`param_shapes` but the
    FP8 block scales, which describe parameters rather than add any)."""
    scales = {f"layers.{name}" for name in EXPERT_SCALE_KEYS}
    return sum(math.prod(shape) for key, shape in tree_items(param_shapes(cfg))
               if key not in scales)


def tree_items(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, leaf) pairs of a nested dict, in insertion order."""
    if isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from tree_items(value, f"{prefix}{key}.")
    else:
        yield prefix[:-1], tree


def shape_problems(params: Params, cfg: ModelConfig, leave_out: Collection[str] = ()
                   ) -> list[str]:
    """Every missing, mis-shaped or unexpected parameter, as messages naming it.
    ``leave_out``: dotted names (e.g. ``layers.w_gate``) not checked either way."""
    expected = {k: v for k, v in tree_items(param_shapes(cfg)) if k not in leave_out}
    found = {key: tuple(getattr(value, "shape", ())) for key, value in tree_items(params)
             if key not in leave_out}
    problems = [f"{key}: expected shape {shape}, found "
                f"{found[key] if key in found else 'nothing (missing)'}"
                for key, shape in expected.items() if found.get(key) != tuple(shape)]
    problems += [f"{key}: unexpected parameter" for key in found if key not in expected]
    return problems

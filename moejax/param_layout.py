"""The params layout shared by the model, the checkpoint loader and the backends.

A params pytree is a nested dict; every layer is stacked on a leading L axis and
matrices are stored [in, out]:

    embed [V, d]
    layers: attn_norm [L, d], wq [L, d, n_q·h], wk / wv [L, d, n_kv·h], wo [L, n_q·h, d],
            q_norm / k_norm [L, h] (qk_norm models), mlp_norm [L, d], router [L, d, E],
            w_gate / w_up [L, E, d, f], w_down [L, E, f, d]
    final_norm [d]
    lm_head [d, V] (absent when the embeddings are tied)

No JAX import here, so the checkpoint reader stays cheap to import.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

from moejax.config import ModelConfig

Params = dict[str, Any]

# The per-layer expert weights: what the backends place, shard and stream apart from
# the rest (attention, norms, router), which every device keeps whole.
EXPERT_KEYS = ("w_gate", "w_up", "w_down")


def split_experts(layers: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Stacked layer params -> (everything but the experts, the expert weights)."""
    dense = {k: v for k, v in layers.items() if k not in EXPERT_KEYS}
    experts = {k: layers[k] for k in EXPERT_KEYS}
    return dense, experts


def param_shapes(cfg: ModelConfig) -> Params:
    """The params pytree of ``cfg`` with shape tuples as leaves."""
    d, L, h, E = cfg.hidden_size, cfg.num_layers, cfg.head_dim, cfg.num_experts
    f, V = cfg.moe_intermediate_size, cfg.vocab_size
    q, kv = cfg.num_heads * h, cfg.num_kv_heads * h
    layers = {"attn_norm": (L, d), "wq": (L, d, q), "wk": (L, d, kv), "wv": (L, d, kv),
              "wo": (L, q, d), "mlp_norm": (L, d), "router": (L, d, E),
              "w_gate": (L, E, d, f), "w_up": (L, E, d, f), "w_down": (L, E, f, d)}
    if cfg.qk_norm:
        layers["q_norm"] = (L, h)
        layers["k_norm"] = (L, h)
    shapes: Params = {"embed": (V, d), "layers": layers, "final_norm": (d,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, V)
    return shapes


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

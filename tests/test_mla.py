"""DeepSeek-V2/V3 Multi-head Latent Attention (``moejax.mla``) against transformers.

Tiny seeded ``DeepseekV3Attention`` / ``DeepseekV2Attention`` modules (eager attention,
explicit causal mask, the model's own rotary module for the position embeddings) run in
float32 on one random sequence at offset positions; our projections, with a plain causal
softmax attention that divides scores by sqrt(qk_head_dim), must give the same attention
output to 1e-5 (max error relative to the output's max). Weights are scaled up so the
attention is far from uniform and rope/position/scale mistakes show.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import beartype  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import jaxtyping  # noqa: E402
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3  # noqa: E402

from moejax import mla  # noqa: E402


def _checked(fn):
    """The function with its jaxtyping shape annotations checked on every call."""
    return jaxtyping.jaxtyped(typechecker=beartype.beartype)(fn)


mla_queries, mla_latent, mla_expand, apply_rope = (
    _checked(mla.mla_queries), _checked(mla.mla_latent), _checked(mla.mla_expand),
    _checked(mla.apply_rope))

D, HEADS, KV_RANK, NOPE, ROPE, V_DIM = 32, 4, 12, 8, 4, 6
N, OFFSET, TOL = 8, 5, 1e-5
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
            mscale=1.0, mscale_all_dim=0.8, beta_fast=32, beta_slow=1)
DEFAULT = dict(rope_type="default", rope_theta=10000.0)


def _config(family: str, q_lora_rank, rope: dict, interleave: bool | None = None):
    common = dict(vocab_size=64, hidden_size=D, num_hidden_layers=1, num_attention_heads=HEADS,
                  num_key_value_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK,
                  qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
                  max_position_embeddings=32, rope_parameters=dict(rope))
    if family == "v3":
        cfg = transformers.DeepseekV3Config(rope_interleave=interleave, n_routed_experts=4,
                                            n_group=1, topk_group=1, num_experts_per_tok=2,
                                            **common)
    else:
        cfg = transformers.DeepseekV2Config(**common)
    cfg._attn_implementation = "eager"
    return cfg


def _build(cfg, seed: int = 0):
    """(attention module, rotary module) with the robustness scalings."""
    mod = hf_v3 if cfg.model_type == "deepseek_v3" else hf_v2
    torch.manual_seed(seed)
    prefix = "DeepseekV3" if mod is hf_v3 else "DeepseekV2"
    attn = getattr(mod, prefix + "Attention")(cfg, 0).eval()
    rotary = getattr(mod, prefix + "RotaryEmbedding")(cfg)
    with torch.no_grad():
        for name, param in attn.named_parameters():
            if "layernorm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name != "o_proj.weight":
                param.mul_(3.0)
    return attn, rotary


def _torch_attention(attn, rotary, x, positions):
    mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        pe = rotary(x, positions[None])
        out, _ = attn(x, position_embeddings=pe, attention_mask=mask)
    return out[0].numpy()


def _params(attn) -> dict[str, jax.Array]:
    """Torch weights -> our layout (matrices transposed), via the checkpoint-name table."""
    state = {f"self_attn.{k}": v for k, v in attn.state_dict().items()}
    out = {}
    for ours, theirs in mla.HF_TENSOR_NAMES.items():
        if theirs in state:
            w = state[theirs].numpy()
            out[ours] = jnp.asarray(w.T if w.ndim == 2 else w)
    return out


def _ours(p, x, positions, shape):
    q = mla_queries(p, x, positions, shape)
    keys, values = mla_expand(p, *mla_latent(p, x, positions, shape), shape)
    scores = jnp.einsum("qhd,khd->hqk", q, keys) / math.sqrt(shape.qk_head_dim)
    n = x.shape[0]
    scores = jnp.where(jnp.tril(jnp.ones((n, n), bool))[None], scores, -jnp.inf)
    heads = jnp.einsum("hqk,khv->qhv", jax.nn.softmax(scores, axis=-1), values)
    return np.asarray(heads.reshape(n, -1) @ p["wo"])


def _rel(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, N, D, generator=g)
    return x, torch.arange(N) + OFFSET


CASES = {
    "v3-default": ("v3", 16, DEFAULT, True),
    "v3-yarn": ("v3", 16, YARN, True),
    "v3-yarn-rotate-half": ("v3", 16, YARN, False),
    "v3-default-rotate-half": ("v3", 16, DEFAULT, False),
    "v3-no-q-lora": ("v3", None, YARN, True),
    "v2-lite": ("v2", None, DEFAULT, None),
    "v2-q-lora-yarn": ("v2", 16, YARN, None),
}


def _case(name):
    cfg = _config(*CASES[name])
    attn, rotary = _build(cfg)
    return cfg, attn, rotary, mla.mla_shape_from_hf(cfg.to_dict())


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers_attention(name):
    cfg, attn, rotary, shape = _case(name)
    x, positions = _inputs()
    ref = _torch_attention(attn, rotary, x, positions)
    p = _params(attn)
    assert {k: v.shape for k, v in p.items()} == mla.mla_param_shapes(shape, D)
    ours = _ours(p, jnp.asarray(x[0].numpy()), jnp.asarray(positions.numpy(), jnp.int32), shape)
    assert _rel(ours, ref) <= TOL
    # The scale and rotary constants are transformers' own.
    assert mla.softmax_scale(shape) == pytest.approx(attn.scaling, rel=1e-12)
    inv_freq, factor = mla.rope_inv_freq_and_scale(shape)
    np.testing.assert_allclose(inv_freq, rotary.inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(rotary.attention_scaling, rel=1e-12)


def test_shape_from_hf_mapping():
    shape = mla.mla_shape_from_hf(_config("v3", 16, YARN, False).to_dict())
    assert shape == mla.MLAShape(
        n_heads=HEADS, q_lora_rank=16, kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE, v_head_dim=V_DIM, rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_interleave=False,
        yarn=mla.YarnScaling(factor=4.0, original_max_position_embeddings=8, mscale=1.0,
                             mscale_all_dim=0.8))
    assert shape.yarn is not None and mla.softmax_scale(shape) > shape.qk_head_dim ** -0.5
    # A released checkpoint's config.json (4.x keys): rope_theta + rope_scaling {type: yarn}.
    legacy = dict(model_type="deepseek_v3", num_attention_heads=HEADS, q_lora_rank=16,
                  kv_lora_rank=KV_RANK, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE,
                  v_head_dim=V_DIM, rms_norm_eps=1e-6, rope_theta=10000,
                  max_position_embeddings=32,
                  rope_scaling=dict(type="yarn", factor=4, original_max_position_embeddings=8,
                                    beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=0.8))
    assert mla.mla_shape_from_hf(legacy) == dataclasses.replace(shape, rope_interleave=True)
    v2 = mla.mla_shape_from_hf(_config("v2", None, DEFAULT).to_dict())
    assert v2.rope_interleave and v2.yarn is None and v2.q_lora_rank is None
    assert set(mla.mla_param_shapes(v2, D)) == {"wq", "wkv_a", "kv_a_norm", "wkv_b", "wo"}


@pytest.mark.parametrize("rope", [DEFAULT, YARN], ids=["default", "yarn"])
def test_rope_matches_transformers_layouts(rope):
    """V3 interleave exactly; V2's complex form up to the de-interleaving permutation."""
    x = torch.randn(N, 2, ROPE, generator=torch.Generator().manual_seed(2))
    positions = torch.arange(N) + OFFSET
    v3 = mla.mla_shape_from_hf(_config("v3", 16, rope, True).to_dict())
    ours = np.asarray(apply_rope(jnp.asarray(x.numpy()), jnp.asarray(positions.numpy()), v3))
    cos, sin = _build(_config("v3", 16, rope, True))[1](x, positions[None])
    theirs, _ = hf_v3.apply_rotary_pos_emb_interleave(x[None].transpose(1, 2), x[None].transpose(1, 2),
                                                      cos, sin)
    np.testing.assert_allclose(ours, theirs[0].transpose(0, 1).numpy(), rtol=1e-6, atol=1e-6)
    freqs_cis = _build(_config("v2", 16, rope))[1](x, positions[None])
    v2_out, _ = hf_v2.apply_rotary_emb(x[None].transpose(1, 2), x[None].transpose(1, 2), freqs_cis)
    deinterleave = np.r_[0:ROPE:2, 1:ROPE:2]
    np.testing.assert_allclose(ours, v2_out[0].transpose(0, 1).numpy()[..., deinterleave],
                               rtol=1e-6, atol=1e-6)


def test_expansion_matches_direct_projection_and_absorption():
    cfg, attn, _, shape = _case("v3-yarn")
    p = _params(attn)
    x = jnp.asarray(_inputs()[0][0].numpy())
    positions = jnp.arange(N, dtype=jnp.int32) + OFFSET
    latent, k_rope = mla_latent(p, x, positions, shape)
    keys, values = mla_expand(p, latent, k_rope, shape)
    # Direct per-head projection from the hidden state.
    kv = x @ p["wkv_a"]
    c = kv[:, :KV_RANK] * jax.lax.rsqrt(jnp.mean(kv[:, :KV_RANK] ** 2, -1, keepdims=True) + 1e-6)
    w = p["wkv_b"].reshape(KV_RANK, HEADS, NOPE + V_DIM)
    direct = jnp.einsum("mr,rhe->mhe", c * p["kv_a_norm"], w)
    np.testing.assert_allclose(keys[..., :NOPE], direct[..., :NOPE], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(values, direct[..., NOPE:], rtol=1e-5, atol=1e-5)
    assert np.array_equal(keys[..., NOPE:], jnp.broadcast_to(k_rope, (N, HEADS, ROPE)))
    # Rows are independent (what a cache relies on): expanding a subset gives its rows.
    idx = jnp.array([6, 1, 3])
    sub_k, sub_v = mla_expand(p, latent[idx], k_rope[idx], shape)
    np.testing.assert_allclose(sub_k, keys[idx], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sub_v, values[idx], rtol=1e-6, atol=1e-6)
    # Absorbed scores (q_nope·W_uk against the latent) equal the expanded ones.
    q = mla_queries(p, x, positions, shape)
    q_absorbed = jnp.einsum("qhd,rhd->qhr", q[..., :NOPE], w[..., :NOPE])   # [n, H, r]
    absorbed = (jnp.einsum("qhr,kr->hqk", q_absorbed, latent[:, 0])
                + jnp.einsum("qhd,kd->hqk", q[..., NOPE:], k_rope[:, 0]))
    expanded = jnp.einsum("qhd,khd->hqk", q, keys)
    np.testing.assert_allclose(absorbed, expanded, rtol=1e-5, atol=1e-5)


def test_uniform_shift_is_invariant_and_mistakes_are_not():
    cfg, attn, rotary, shape = _case("v3-yarn")
    x, positions = _inputs()
    ref = _torch_attention(attn, rotary, x, positions)
    p = _params(attn)
    xj, pos = jnp.asarray(x[0].numpy()), jnp.asarray(positions.numpy(), jnp.int32)
    assert _rel(_ours(p, xj, pos + 11, shape), ref) <= TOL      # rope is relative
    wrong = {
        "positions x2": _ours(p, xj, pos * 2, shape),
        "reversed positions": _ours(p, xj, pos[::-1], shape),
        "rotate-half layout": _ours(p, xj, pos, dataclasses.replace(shape, rope_interleave=False)),
        "no yarn": _ours(p, xj, pos, dataclasses.replace(shape, yarn=None)),
        # Same rotary (cos/sin factor pinned), only the mscale_all_dim² logit scale dropped.
        "plain softmax scale": _ours(p, xj, pos, dataclasses.replace(shape, yarn=dataclasses.replace(
            shape.yarn, mscale_all_dim=None,
            attention_factor=mla.rope_inv_freq_and_scale(shape)[1]))),
    }
    for what, out in wrong.items():
        assert _rel(out, ref) > 100 * TOL, what

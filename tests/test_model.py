"""Model stages (rope, rms_norm, packed attention) against float64 NumPy, packing invariance
of the forward, the NNX module, and the config's FLOP accounting and HF parsing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from moejax import attention, layers, model, moe
from moejax.attention_kinds import PackedCausal
from moejax.dispatch import StackedExperts, local_dispatcher
from moejax.param_layout import split_experts
from moejax.config import ConfigError, ModelConfig, from_hf_dict
from moejax.ops import PrefillOp
from moejax.packing import BucketPolicy, pack

CFG = ModelConfig(model_type="qwen3_moe", vocab_size=96, hidden_size=32, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, num_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                  qk_norm=True, rms_norm_eps=1e-6, rope_theta=10000.0, max_context=256,
                  tie_word_embeddings=False)


def rel_err(got, ref) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


# ----------------------------------------------------------------------------- rope / norm
def np_rope(x, positions, theta):
    x = np.asarray(x, np.float64)
    h = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, h, 2, dtype=np.float64) / h)   # HF convention
    angles = np.asarray(positions, np.float64)[:, None] * inv_freq[None]
    cos = np.concatenate([np.cos(angles)] * 2, -1)[:, None, :]
    sin = np.concatenate([np.sin(angles)] * 2, -1)[:, None, :]
    rotated = np.concatenate([-x[..., h // 2:], x[..., :h // 2]], -1)      # rotate_half
    return x * cos + rotated * sin


@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_rope_vs_numpy(theta):
    rng = np.random.default_rng(0)
    positions = np.concatenate([np.arange(8), rng.integers(0, 300, 24)]).astype(np.int32)
    x = rng.standard_normal((32, 3, 16)).astype(np.float32)
    got = np.asarray(layers.rope(jnp.asarray(x), jnp.asarray(positions), theta))
    # float32 angles (as in HF) at positions < 300 lose ~1e-5 rad
    np.testing.assert_allclose(got, np_rope(x, positions, theta), rtol=0, atol=1e-4)
    np.testing.assert_array_equal(got[:1], x[:1])  # position 0 is the identity


def test_rope_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 1, 8)).astype(np.float32)
    k = rng.standard_normal((1, 1, 8)).astype(np.float32)

    def score(m, n):
        rq = layers.rope(jnp.asarray(q), jnp.asarray([m]), 10000.0)
        rk = layers.rope(jnp.asarray(k), jnp.asarray([n]), 10000.0)
        return float(jnp.sum(rq * rk))

    assert score(7, 3) == pytest.approx(score(24, 20), rel=1e-5)
    assert score(7, 3) != pytest.approx(score(7, 4), rel=1e-3)


def test_rms_norm_vs_numpy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 16)).astype(np.float32) * 3
    w = (1 + 0.1 * rng.standard_normal(16)).astype(np.float32)
    eps = 1e-6
    x64 = x.astype(np.float64)
    ref = x64 / np.sqrt(np.mean(x64 ** 2, -1, keepdims=True) + eps) * w
    got = layers.rms_norm(jnp.asarray(x), jnp.asarray(w), eps)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)
    bf16 = layers.rms_norm(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), eps)
    assert bf16.dtype == jnp.bfloat16
    assert rel_err(bf16, ref) < 1e-2
    # eps matters for a zero row (no NaN)
    zero = layers.rms_norm(jnp.zeros((1, 16)), jnp.asarray(w), eps)
    assert np.all(np.asarray(zero) == 0)


# ----------------------------------------------------------------------------- attention
# Hand-packed layout, T = 32 tokens in blocks of B = 8: (segment, length) per block.
LAYOUT = [[(0, 5), (1, 3)], [(2, 8)], [(3, 2), (-1, 6)], [(-1, 8)]]


def _layout_arrays():
    segment_ids, positions = [], []
    for block in LAYOUT:
        for seg, n in block:
            segment_ids += [seg] * n
            positions += list(range(n)) if seg >= 0 else [0] * n
    return np.asarray(segment_ids, np.int32), np.asarray(positions, np.int32)


def np_causal_gqa(q, k, v):
    """float64 causal attention of one sequence: q [n, n_q, h], k/v [n, n_kv, h]."""
    n, n_q, h = q.shape
    group = n_q // k.shape[1]
    out = np.zeros((n, n_q, h))
    mask = np.tril(np.ones((n, n), bool))
    for head in range(n_q):
        kv = head // group   # HF repeat_kv: kv head j serves q heads j·g .. j·g+g-1
        scores = q[:, head] @ k[:, kv].T / np.sqrt(h)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out[:, head] = probs @ v[:, kv]
    return out


def test_segment_bias_matches_layout():
    segment_ids, _ = _layout_arrays()
    bias = np.asarray(attention.segment_bias(jnp.asarray(segment_ids), 8))
    assert bias.shape == (4, 8, 8) and bias.dtype == np.float32
    seg = segment_ids.reshape(4, 8)
    for b in range(4):
        for i in range(8):
            for j in range(8):
                visible = seg[b, i] == seg[b, j] and j <= i
                assert bias[b, i, j] == (0.0 if visible else attention.MASK_VALUE)


TILINGS = [None, attention.AttentionTiling("triangular", 8), attention.AttentionTiling("triangular", 4),
           attention.AttentionTiling("triangular", 2), attention.AttentionTiling("flash", 4),
           attention.AttentionTiling("flash", 8), attention.AttentionTiling("flash", 2)]


@pytest.mark.parametrize("tiling", TILINGS, ids=str)
@pytest.mark.parametrize("n_q,n_kv", [(4, 2), (4, 1), (2, 2)])
def test_packed_attention_vs_numpy(n_q, n_kv, tiling):
    segment_ids, _ = _layout_arrays()
    rng = np.random.default_rng(n_q * 10 + n_kv)
    t, h = len(segment_ids), 8
    q = rng.standard_normal((t, n_q, h)).astype(np.float32) * 2
    k = rng.standard_normal((t, n_kv, h)).astype(np.float32) * 2
    v = rng.standard_normal((t, n_kv, h)).astype(np.float32)
    out = np.asarray(attention.packed_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                jnp.asarray(segment_ids), 8, tiling=tiling))
    assert out.shape == (t, n_q, h) and np.isfinite(out).all()
    for seg in range(4):
        rows = np.nonzero(segment_ids == seg)[0]
        ref = np_causal_gqa(q[rows].astype(np.float64), k[rows].astype(np.float64),
                            v[rows].astype(np.float64))
        np.testing.assert_allclose(out[rows], ref, rtol=1e-5, atol=1e-5, err_msg=f"segment {seg}")


# ----------------------------------------------------------------------------- whole forward
_full_logits = jax.jit(model.full_logits, static_argnums=(2, 3))
_forward = jax.jit(model.forward, static_argnums=(2, 3))


@pytest.fixture(scope="module")
def params():
    p = model.init_params(CFG, seed=0, scale=0.1)
    p["layers"]["router"] = p["layers"]["router"] * 10  # well separated top-k choices
    rng = np.random.default_rng(0)
    for name in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        p["layers"][name] = p["layers"][name] + 0.1 * rng.standard_normal(
            p["layers"][name].shape).astype(np.float32)
    return p


LENGTHS = (30, 17, 12, 9, 5, 3)


def _sequences():
    rng = np.random.default_rng(4)
    return [PrefillOp(key=f"s{i}", token_ids=rng.integers(0, CFG.vocab_size, n),
                      score_positions=(n - 1,), score_token_ids=((1, 2),), full_vocab=True)
            for i, n in enumerate(LENGTHS)]


def _logits_by_sequence(params, hosts) -> dict[str, np.ndarray]:
    out = {}
    for host in hosts:
        logits = np.asarray(_full_logits(params, host.batch, CFG, host.options))
        seg = np.asarray(host.batch.segment_ids)
        pos = np.asarray(host.batch.positions)
        for i, seq in enumerate(host.sequences):
            rows = np.nonzero(seg == i)[0]
            rows = rows[np.argsort(pos[rows])]
            out[seq.key] = logits[rows]
    return out


# Two policies giving disjoint shapes: three (T=32, B=32) batches vs one (T=128, B=64).
SMALL = BucketPolicy(max_batch_tokens=32, min_block=32)
LARGE = BucketPolicy(max_batch_tokens=256, min_block=64)


def test_packing_does_not_change_logits(params):
    seqs = _sequences()
    small, large = pack(seqs, SMALL), pack(seqs, LARGE)
    assert {h.shape_key[:2] for h in small} == {(32, 32)} and len(small) == 3
    assert [h.shape_key[:2] for h in large] == [(128, 64)]
    a = _logits_by_sequence(params, small)
    b = _logits_by_sequence(params, large)
    assert sorted(a) == sorted(b) == sorted(s.key for s in seqs)
    for key in a:
        assert a[key].shape == (LENGTHS[int(key[1:])], CFG.vocab_size)
        assert rel_err(a[key], b[key]) <= 1e-5, key
    # A sequence alone in a batch matches as well (no cross-sequence leakage).
    alone = pack([seqs[2]], SMALL)
    c = _logits_by_sequence(params, alone)
    assert rel_err(c["s2"], a["s2"]) <= 1e-5
    # ... and a different neighbour changes nothing either.
    assert [len(s.token_ids) for s in small[1].sequences] == [17, 12, 3]
    swapped = [seqs[1], seqs[2], dataclasses.replace(seqs[5], token_ids=seqs[5].token_ids[::-1])]
    d = _logits_by_sequence(params, pack(swapped, SMALL))
    assert rel_err(d["s1"], a["s1"]) <= 1e-6 and rel_err(d["s2"], a["s2"]) <= 1e-6


def test_nnx_module_matches_pure_forward(params):
    host = pack(_sequences(), SMALL)[1]
    module = model.MoEDecoder(CFG, params)
    opts = host.options

    @nnx.jit(static_argnums=2)
    def call(m, batch, opts):
        out = m.score(batch, opts)
        return out.readout.logits, out.readout.lse

    got_logits, got_lse = call(module, host.batch, opts)
    want_logits, want_lse = _forward(params, host.batch, CFG, opts)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(want_lse), rtol=1e-6, atol=1e-6)
    # params() round-trips the dict the pure forward takes
    round_trip = module.params()
    assert set(round_trip) == set(params) and set(round_trip["layers"]) == set(params["layers"])
    for name, value in params["layers"].items():
        np.testing.assert_array_equal(np.asarray(round_trip["layers"][name]), value)


def test_split_merge_round_trip_runs_the_same_model(params):
    """What jitted code does: nnx.split the module, hand its state in as a pytree, merge."""
    host = pack(_sequences(), SMALL)[1]
    graphdef, state = nnx.split(model.MoEDecoder(CFG, params))

    @jax.jit
    def call(state, batch):
        out = nnx.merge(graphdef, state).score(batch, host.options)
        return out.readout.logits

    want, _ = _forward(params, host.batch, CFG, host.options)
    np.testing.assert_array_equal(np.asarray(call(state, host.batch)), np.asarray(want))
    # The config's abstract graph takes the same state as a plain dict (model.decoder).
    pure = nnx.to_pure_dict(state)
    assert jax.tree.structure(pure) == jax.tree.structure(params)
    merged = nnx.merge(model.graph_def(CFG), pure)
    np.testing.assert_array_equal(np.asarray(merged.embed[...]), params["embed"])


def _packed_kind(host):
    return PackedCausal.of(host.batch.positions, host.batch.segment_ids, host.options.attn_block)


def test_single_layer_entry_equals_the_fused_driver(params):
    """Driving the layers one by one from the host (the offload and decode-side path)
    computes what the fused loop computes."""
    host = pack(_sequences(), SMALL)[1]
    module = model.MoEDecoder(CFG, params)
    dispatcher = module.local_dispatcher()
    x0 = module.embed_tokens(jnp.asarray(host.batch.tokens))
    fused, _, _, ids = jax.jit(lambda x: module.run_layers(
        x, _packed_kind(host), dispatcher, observe=lambda i, r, v, h: r.experts))(x0)
    step = jax.jit(lambda i, x: module.layer(i, x, _packed_kind(host), dispatcher))
    x = x0
    for i in range(CFG.num_layers):
        out = step(i, x)
        x = out.x
        np.testing.assert_array_equal(np.asarray(out.routing.experts), np.asarray(ids[i]))
    np.testing.assert_allclose(np.asarray(x), np.asarray(fused), rtol=1e-6, atol=1e-6)
    assert ids.shape == (CFG.num_layers, host.batch.tokens.shape[0], CFG.num_experts_per_tok)


def test_routing_override_replaces_the_router(params):
    """The single-layer entry accepts a routing (speculative decode's predicted experts):
    the router's own routing gives the same output, another one changes it."""
    host = pack(_sequences(), SMALL)[1]
    module = model.MoEDecoder(CFG, params)
    dispatcher = module.local_dispatcher()
    x = module.embed_tokens(jnp.asarray(host.batch.tokens))
    own = module.layer(0, x, _packed_kind(host), dispatcher)
    same = module.layer(0, x, _packed_kind(host), dispatcher, routing=own.routing)
    np.testing.assert_array_equal(np.asarray(same.x), np.asarray(own.x))
    other = moe.Routing(weights=own.routing.weights,
                        experts=(own.routing.experts + 1) % CFG.num_experts)
    moved = module.layer(0, x, _packed_kind(host), dispatcher, routing=other)
    assert np.abs(np.asarray(moved.x) - np.asarray(own.x)).max() > 1e-4
    np.testing.assert_array_equal(np.asarray(moved.routing.experts), np.asarray(other.experts))


def test_module_without_experts_takes_them_from_its_dispatcher(params):
    """A backend that keeps the experts elsewhere builds the module without them and
    passes a dispatcher whose source holds them: same scores."""
    host = pack(_sequences(), SMALL)[1]
    dense, experts = split_experts(jax.tree.map(jnp.asarray, params["layers"]))
    module = model.decoder(CFG, {**params, "layers": dense})
    assert not module.with_experts
    dispatcher = local_dispatcher(StackedExperts(experts), CFG.num_experts)
    got = jax.jit(lambda: module.score(host.batch, host.options, dispatcher=dispatcher).readout.logits)()
    want, _ = _forward(params, host.batch, CFG, host.options)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="expert weights in a module built without"):
        model.MoEDecoder(CFG, params, with_experts=False)
    with pytest.raises(ValueError, match="without expert weights"):
        module.local_dispatcher()      # nothing of its own to dispatch to


def test_nnx_random_and_check_params():
    module = model.MoEDecoder.random(CFG, seed=3)
    expected = model.init_params(CFG, seed=3)
    np.testing.assert_array_equal(np.asarray(module.params()["embed"]), expected["embed"])
    bad = model.init_params(CFG)
    bad["layers"]["wq"] = bad["layers"]["wq"][:, :, :-1]
    with pytest.raises(ValueError, match="layers.wq"):
        model.MoEDecoder(CFG, bad)
    missing = model.init_params(CFG)
    del missing["lm_head"]
    with pytest.raises(ValueError, match=r"(?i)lm_head.*missing|missing.*lm_head"):
        model.MoEDecoder(CFG, missing)
    tied = dataclasses.replace(CFG, tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"(?i)lm_head.*unexpected|unexpected.*lm_head"):
        model.MoEDecoder(tied, model.init_params(CFG))


# ----------------------------------------------------------------------------- FLOPs
# d=32, L=2, n_q=4, n_kv=2, h=8, E=8, k=2, f=16, V=96, by hand:
#   qkv 2·32·(4·8 + 2·2·8) = 4096; out 2·32·32 = 2048; router 2·32·8 = 512;
#   experts 2·6·32·16 = 6144  ->  F_lin per layer 12800, per token 25600.
#   F_att(c) = 2·4·4·8·c = 256·c.  F_head = 2·32·96 = 6144 (|C| = 5: 320).
F_LIN_LAYER, F_LIN, ATT, F_HEAD = 12800, 25600, 256, 6144


def test_flop_formulas_by_hand():
    assert CFG.linear_flops_per_layer == F_LIN_LAYER
    assert CFG.linear_flops_per_token == F_LIN
    assert CFG.attention_flops(10) == 2560
    assert CFG.attention_flops_range(5, 10) == 256 * 45
    assert CFG.attention_flops_range(3, 2) == 0
    assert CFG.head_flops() == F_HEAD and CFG.head_flops(5) == 320
    rng = np.random.default_rng(0)
    for first, last in rng.integers(0, 200, (20, 2)):
        assert CFG.attention_flops_range(int(first), int(last)) == sum(
            CFG.attention_flops(i) for i in range(first, last + 1))
    # ΔW(p=10, s=3, c=4) = 6·F_lin + Σ_{5..10} F_att + 3·F_lin + Σ_{11..13} F_att + F_head
    assert CFG.request_flops(10, 3, 4) == 6 * F_LIN + 256 * 45 + 3 * F_LIN + 256 * 36 + F_HEAD
    assert CFG.request_flops(10, 3, 4) == 257280  # the same, as a literal
    # 2 scoring positions with 5 candidates each
    assert CFG.request_flops(7, 0, 0, scoring_positions=2, num_candidates=5) == \
        7 * F_LIN + 256 * 28 + 2 * 320
    assert CFG.sequence_flops(7) == CFG.request_flops(7) == 7 * F_LIN + 256 * 28 + F_HEAD
    assert CFG.request_flops(10, 0, 10, scoring_positions=0) == 0
    with pytest.raises(ValueError):
        CFG.request_flops(5, 0, 6)
    with pytest.raises(ValueError):
        CFG.request_flops(5, -1, 0)


def test_flops_of_same_prefix_siblings():
    p, s, n = 40, 6, 10
    prefix = CFG.request_flops(p, 0, 0, scoring_positions=0)
    sibling = CFG.request_flops(p, s, cached=p)
    assert prefix == p * F_LIN + ATT * p * (p + 1) // 2
    suffix_by_hand = s * F_LIN + ATT * sum(p + j for j in range(1, s + 1)) + F_HEAD
    assert sibling == suffix_by_hand
    # the first request pays the prefix, the ten siblings (cached) only their suffixes
    total = CFG.request_flops(p, s, cached=0) + (n - 1) * sibling
    assert total == prefix + n * suffix_by_hand
    assert total < n * CFG.request_flops(p, s, cached=0)


# ----------------------------------------------------------------------------- HF config
def _hf(**overrides):
    base = {"model_type": "qwen3_moe", "vocab_size": 96, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
            "moe_intermediate_size": 16, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 256, "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    base.update(overrides)
    return {k: v for k, v in base.items() if v is not None}


def test_from_hf_dict_round_trip():
    assert from_hf_dict(_hf()) == CFG


def test_from_hf_dict_refuses_unsupported_model_type():
    with pytest.raises(ConfigError) as info:
        from_hf_dict(_hf(model_type="llama"))
    message = str(info.value)
    assert "llama" in message and "qwen3_moe" in message and "mixtral" in message
    assert isinstance(info.value, ValueError)


def test_from_hf_dict_rope_theta_spellings():
    assert from_hf_dict(_hf(rope_parameters={"rope_type": "default",
                                             "rope_theta": 1e6})).rope_theta == 1e6
    legacy = from_hf_dict(_hf(rope_parameters=None, rope_theta=500000.0))
    assert legacy.rope_theta == 500000.0
    with pytest.raises(ConfigError, match="rope_theta"):
        from_hf_dict(_hf(rope_parameters=None))


@pytest.mark.parametrize("overrides", [
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
    {"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2}},
    {"rope_parameters": None, "rope_theta": 1e6, "rope_scaling": {"rope_type": "llama3"}},
], ids=["yarn", "legacy-linear", "legacy-llama3"])
def test_from_hf_dict_refuses_non_default_rope(overrides):
    with pytest.raises(ConfigError, match="rope type .* is not supported"):
        from_hf_dict(_hf(**overrides))


def test_from_hf_dict_mixtral():
    cfg = from_hf_dict(_hf(model_type="mixtral", num_experts=None, num_local_experts=8,
                           moe_intermediate_size=None, intermediate_size=16,
                           norm_topk_prob=None, sliding_window=None))
    assert cfg.model_type == "mixtral" and cfg.num_experts == 8
    assert cfg.moe_intermediate_size == 16 and cfg.norm_topk_prob and not cfg.qk_norm


def test_attention_tiling_table():
    assert attention.tiling_for(32) == attention.AttentionTiling("triangular", 32)
    assert attention.tiling_for(512).mode == "triangular"
    assert 512 % attention.tiling_for(512).sub == 0
    big = attention.tiling_for(1 << 16)
    assert big.mode == "flash" and (1 << 16) % big.sub == 0
    assert attention.attention_bias(jnp.zeros(1 << 16, jnp.int32), 1 << 16) is None


@pytest.mark.parametrize("tiling", [attention.AttentionTiling("triangular", 16),
                                    attention.AttentionTiling("flash", 16)], ids=str)
def test_attention_tilings_do_not_change_logits(params, monkeypatch, tiling):
    """The whole forward with multi-tile attention (as long prompts get) equals the
    single-tile computation."""
    hosts = pack(_sequences(), LARGE)
    reference = _logits_by_sequence(params, hosts)
    calls = []
    monkeypatch.setattr(attention, "tiling_for", lambda block: calls.append(block) or tiling)
    tiled = {}
    for host in hosts:   # a new function object, so JAX traces it afresh with the patch
        logits = np.asarray(jax.jit(lambda p, b: model.full_logits(p, b, CFG, host.options))(
            params, host.batch))
        seg, pos = np.asarray(host.batch.segment_ids), np.asarray(host.batch.positions)
        for i, seq in enumerate(host.sequences):
            rows = np.nonzero(seg == i)[0]
            tiled[seq.key] = logits[rows[np.argsort(pos[rows])]]
    assert calls, "the tiled attention was not traced"
    for key, ref in reference.items():
        np.testing.assert_allclose(tiled[key], ref, rtol=1e-5, atol=1e-5, err_msg=key)


@pytest.mark.parametrize("positions_per_sequence", [1, 12])
def test_last_layer_at_scoring_rows_equals_full_stack(params, positions_per_sequence):
    """forward() runs the last layer only at the scoring rows when P <= T/4 and the whole
    stack otherwise; both must equal full_logits at those rows."""
    rng = np.random.default_rng(9)
    seqs = []
    for i, n in enumerate(LENGTHS):
        count = min(n, positions_per_sequence)
        positions = tuple(sorted(rng.choice(n, count, replace=False).tolist()))
        seqs.append(PrefillOp(key=i, token_ids=rng.integers(0, CFG.vocab_size, n),
                              score_positions=positions,
                              score_token_ids=tuple((1, 5, 7) for _ in positions),
                              full_vocab=True))
    host, = pack(seqs, LARGE)
    p_rows, t = host.batch.score_token_ids.shape[0], host.batch.tokens.shape[0]
    assert (4 * p_rows <= t) == (positions_per_sequence == 1)   # both branches are covered
    picked, lse = _forward(params, host.batch, CFG, host.options)
    full = np.asarray(_full_logits(params, host.batch, CFG, host.options))
    rows = np.asarray(host.batch.score_positions)
    expected = np.take_along_axis(full[rows], np.asarray(host.batch.score_token_ids), axis=1)
    np.testing.assert_allclose(np.asarray(picked), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), jax.nn.logsumexp(full[rows], axis=-1),
                               rtol=1e-5, atol=1e-5)

"""GPT-OSS (transformers ``GptOssForCausalLM``) against transformers itself.

A tiny random model with every GPT-OSS piece: YaRN rotate-half RoPE, q/k/v/o biases,
attention sinks, alternating sliding-window (window 4) and full layers, a biased router
(softmax over the top-k logits), interleaved gate/up experts with biases and the clamped
SwiGLU. Router weights are scaled ×20 (well-separated choices), q/k ×4 (sharp attention,
so mask/rope mistakes show), the experts ×2, the embeddings ×20 (so the tokens, not the
biases, drive greedy generation), and the sinks and biases are non-zero.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from moejax import checkpoint as ck  # noqa: E402
from moejax import model as mdl  # noqa: E402
from moejax import mxfp4  # noqa: E402
from moejax.config import ConfigError, from_hf_dict  # noqa: E402

V, D, HEADS, KV_HEADS, HEAD_DIM, E, K = 128, 32, 4, 2, 8, 8, 2
N = 20   # tokens scored (five windows of 4)


def hf_config(layers: int = 4, intermediate: int = 16, **overrides):
    return transformers.GptOssConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=layers, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=E,
        num_experts_per_tok=K, intermediate_size=intermediate, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        max_position_embeddings=2048,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                             beta_slow=1.0, original_max_position_embeddings=64,
                             truncate=False),
        swiglu_limit=0.3,     # small enough that the clamps bite in this tiny model
        **overrides)


def build(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    hf = transformers.GptOssForCausalLM(hf_config(**kwargs)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
            elif name.endswith("router.weight"):
                param.copy_(torch.randn_like(param) * 0.02 * 20.0)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(4.0)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.randn_like(param) * 0.02 * 2.0)
            elif name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
            elif name.endswith("router.bias"):
                param.copy_(torch.randn_like(param) * 0.5)
            elif name.endswith("bias"):
                param.copy_(torch.randn_like(param) * 0.1)
            elif name.endswith("embed_tokens.weight"):
                param.mul_(20.0)
    return hf


def write_tokenizer(path: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(os.path.join(path, "tokenizer.json"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = build()
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    hf.save_pretrained(path)
    write_tokenizer(path)
    return path, hf


def torch_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def our_logits(cfg, params, ids: list[int], attn_block: int | None = None) -> np.ndarray:
    n = len(ids)
    batch = mdl.PackedBatch(tokens=np.array(ids, np.int32), positions=np.arange(n, dtype=np.int32),
                            segment_ids=np.zeros(n, np.int32),
                            score_positions=np.zeros(1, np.int32),
                            score_token_ids=np.zeros((1, 1), np.int32))
    return np.asarray(mdl.full_logits(params, batch, cfg,
                                      mdl.ForwardOptions(attn_block=attn_block or n)))


def assert_close(ours: np.ndarray, want: np.ndarray, rtol: float = 1e-4) -> None:
    err = np.max(np.abs(ours - want)) / np.max(np.abs(want))
    assert err <= rtol, f"relative error {err:.2e}"


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(1, V, n)]


# ----------------------------------------------------------------------------- config
def test_config_reads_gpt_oss(tiny):
    path, _ = tiny
    cfg = ck.load_model_config(path)
    assert cfg.model_type == "gpt_oss" and cfg.num_experts == E and cfg.moe_intermediate_size == 16
    assert cfg.sliding_window == 4 and cfg.sliding_layers == (0, 2)
    assert cfg.attention_sinks and cfg.o_bias and cfg.qkv_bias and cfg.router_bias
    assert cfg.expert_bias and cfg.swiglu_limit == 0.3 and cfg.swiglu_alpha == 1.702
    assert cfg.rope_yarn is not None and cfg.rope_yarn.truncate is False
    assert cfg.max_context == 2048     # the window is computed, not a context cap


def test_config_refuses_what_is_not_implemented(tiny):
    path, _ = tiny
    with open(os.path.join(path, "config.json")) as fh:
        base = json.load(fh)
    defaults = {k: v for k, v in base.items() if k not in ("swiglu_limit", "swiglu_alpha")}
    assert from_hf_dict(defaults).swiglu_limit == 7.0
    assert from_hf_dict(defaults).swiglu_alpha == 1.702
    with pytest.raises(ConfigError, match="layer_types"):
        from_hf_dict({**base, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(ConfigError, match="rope type"):
        from_hf_dict({**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}})
    with pytest.raises(ConfigError, match="sliding_window"):
        from_hf_dict({**base, "sliding_window": None})
    with pytest.raises(ConfigError, match="hidden_act"):
        from_hf_dict({**base, "hidden_act": "gelu"})


# ----------------------------------------------------------------------------- scoring
def test_full_logits_equal_transformers(tiny):
    path, hf = tiny
    cfg, params, _ = ck.load_model_dir(path, "float32")
    ids = prompt(1, N)
    assert_close(our_logits(cfg, params, ids), torch_logits(hf, ids))


def test_packed_sequences_and_scoring_rows(tiny):
    """Two sequences packed in one block (the second at a position offset of 0 again), and
    the scoring forward, whose last layer runs at a few rows only: log-probabilities at
    the scored positions equal transformers' per sequence."""
    path, hf = tiny
    cfg, params, _ = ck.load_model_dir(path, "float32")
    first, second = prompt(2, 12), prompt(3, 10)
    n = len(first) + len(second)
    block = 32
    tokens = np.zeros(block, np.int32)
    tokens[:n] = first + second
    positions = np.zeros(block, np.int32)
    positions[:n] = list(range(len(first))) + list(range(len(second)))
    segments = np.full(block, -1, np.int32)
    segments[:n] = [0] * len(first) + [1] * len(second)
    rows = np.array([len(first) - 1, n - 1, 5], np.int32)      # P = 3 <= T / 4 = 8
    candidates = np.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)
    batch = mdl.PackedBatch(tokens=tokens, positions=positions, segment_ids=segments,
                            score_positions=rows, score_token_ids=candidates)
    assert mdl.last_layer_at_rows_only(batch)
    logits, lse = mdl.forward(params, batch, cfg, mdl.ForwardOptions(attn_block=block))
    ours = np.asarray(logits) - np.asarray(lse)[:, None]
    want_first = torch.log_softmax(torch.tensor(torch_logits(hf, first)), -1).numpy()
    want_second = torch.log_softmax(torch.tensor(torch_logits(hf, second)), -1).numpy()
    want = np.stack([want_first[len(first) - 1, candidates[0]],
                     want_second[len(second) - 1, candidates[1]],
                     want_first[5, candidates[2]]])
    assert_close(ours, want)


def test_backends_serve_or_refuse_gpt_oss_by_name(tiny):
    """offload scores as resident does; sync_ep and tp (and the non-resident decode
    runners) refuse GPT-OSS naming it."""
    from moejax.backends import BackendError, backend_class, make_backend
    from moejax.backends.base import check_expert_bias
    from moejax.decode.runners import OffloadRunner, ResidentRunner

    path, _ = tiny
    cfg, params, _ = ck.load_model_dir(path, "float32")
    for name in ("resident", "offload", "async_ep", "hybrid"):
        assert backend_class(name).serves_expert_bias, name
    for name in ("sync_ep", "tp"):
        assert not backend_class(name).serves_expert_bias
        with pytest.raises(BackendError, match="gpt_oss"):
            check_expert_bias(name, cfg, backend_class(name).serves_expert_bias)
    assert ResidentRunner.serves_expert_bias and not OffloadRunner.serves_expert_bias
    with pytest.raises(BackendError, match="gpt_oss"):
        make_backend("sync_ep", cfg, params, devices=2)

    ids = prompt(7, 16)
    batch = mdl.PackedBatch(tokens=np.array(ids, np.int32), positions=np.arange(16, dtype=np.int32),
                            segment_ids=np.zeros(16, np.int32),
                            score_positions=np.array([3, 9, 15], np.int32),
                            score_token_ids=np.array([[1, 2], [3, 4], [5, 6]], np.int32))
    opts = mdl.ForwardOptions(attn_block=16)
    want = make_backend("resident", cfg, params).step([batch], opts)
    got = make_backend("offload", cfg, params).step([batch], opts)
    np.testing.assert_allclose(np.asarray(got[0].logits), np.asarray(want[0].logits), rtol=1e-5,
                               atol=1e-5)


def test_expert_impls_refuse_or_agree(tiny):
    """gmm, ragged_dot and dense compute the biased experts alike; the fused kernels refuse."""
    import jax.numpy as jnp

    from moejax import moe

    path, _ = tiny
    cfg, params, _ = ck.load_model_dir(path, "float32")
    layers = params["layers"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, D)), jnp.float32)
    routing = moe.route_scored(x, jnp.asarray(layers["router"][0]), K, norm_topk_prob=True,
                               logit_bias=jnp.asarray(layers["router_bias"][0]))
    perm = moe.permute(x, routing, E, jnp.array([True] * 5 + [False]))
    act = moe.expert_activation_of(cfg)
    biases = {k: jnp.asarray(layers[k][0]) for k in ("b_gate", "b_up", "b_down")}
    weights = [jnp.asarray(layers[k][0]) for k in ("w_gate", "w_up", "w_down")]
    outs = {impl: np.asarray(moe.expert_compute(perm, *weights, impl=impl, biases=biases,
                                                activation=act))
            for impl in ("auto", "gmm", "ragged_dot", "dense")}
    for impl, out in outs.items():
        np.testing.assert_allclose(out, outs["dense"], rtol=1e-5, atol=1e-6, err_msg=impl)
        assert not np.any(out[-K:])          # the padding token's rows stay zero
    for impl in ("fused_tiles", "pallas", "blocks"):
        with pytest.raises(ValueError, match="expert biases"):
            moe.expert_compute(perm, *weights, impl=impl, biases=biases, activation=act)


# ----------------------------------------------------------------------------- MXFP4
def test_mxfp4_checkpoint(tmp_path):
    """Expert matrices stored as MXFP4 pairs load dequantized: equal to the dequantized
    weights, and the logits equal transformers' on those dequantized weights."""
    from safetensors.torch import load_file, save_file

    hf = build(seed=3, layers=2, intermediate=32)    # in-dims (32, 32) fill whole blocks
    path = str(tmp_path / "mxfp4")
    hf.save_pretrained(path)
    write_tokenizer(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    dequantized = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        kind = name.rsplit(".", 1)[1]
        w = tensors.pop(name).numpy()                         # [E, in, out]
        blocks, scales = mxfp4.quantize_mxfp4(np.swapaxes(w, 1, 2))   # [E, out, in/32, 16]
        tensors[f"{name}_blocks"] = torch.from_numpy(np.ascontiguousarray(blocks))
        tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(scales))
        dequantized[name] = mxfp4.dequantize_expert_tensor(kind, blocks, scales)
        assert np.max(np.abs(dequantized[name] - w)) > 0       # really quantized
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})

    cfg, params, _ = ck.load_model_dir(path, "float32")
    for i in range(cfg.num_layers):
        gate_up = dequantized[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        np.testing.assert_array_equal(params["layers"]["w_gate"][i], gate_up[..., ::2])
        np.testing.assert_array_equal(params["layers"]["w_up"][i], gate_up[..., 1::2])
        np.testing.assert_array_equal(params["layers"]["w_down"][i],
                                      dequantized[f"model.layers.{i}.mlp.experts.down_proj"])
    with torch.no_grad():
        for name, w in dequantized.items():
            hf.get_parameter(name).copy_(torch.from_numpy(w))
    ids = prompt(4, N)
    assert_close(our_logits(cfg, params, ids), torch_logits(hf, ids))


def test_mxfp4_pair_must_be_uint8(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = build(seed=3, layers=2, intermediate=32)
    path = str(tmp_path / "bad")
    hf.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    name = "model.layers.0.mlp.experts.down_proj"
    blocks, scales = mxfp4.quantize_mxfp4(np.swapaxes(tensors.pop(name).numpy(), 1, 2))
    tensors[f"{name}_blocks"] = torch.from_numpy(blocks.astype(np.float32))
    tensors[f"{name}_scales"] = torch.from_numpy(scales)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ck.CheckpointError, match="down_proj_blocks"):
        ck.load_hf_params(path, ck.load_model_config(path))


# ----------------------------------------------------------------------------- generation
@pytest.mark.parametrize("options", [{}, {"batching": "static"}, {"step": "layerwise"}],
                         ids=["continuous", "static", "layerwise"])
def test_greedy_generation_equals_transformers(tiny, options):
    """Paged continuous batching (fused and layerwise steps) and the static baseline
    (prompt -> KV cache, then one slot per row): prompts longer than the window."""
    from serving import Generator

    path, hf = tiny
    prompts = [prompt(5, 9), prompt(6, 13)]
    gen = Generator(path, dtype="float32", compilation_cache="off", **options)
    results = gen.generate([{"id": i, "prompt_token_ids": p, "max_new_tokens": 6}
                            for i, p in enumerate(prompts)])
    for p, result in zip(prompts, results):
        assert result.error is None, result.error
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False,
                              pad_token_id=0)
        assert result.token_ids == [int(t) for t in out[0, len(p):]]
    assert len({t for r in results for t in r.token_ids}) > 3      # not a constant output


def test_offload_generation_refuses_gpt_oss(tiny):
    from moejax.backends import BackendError
    from serving import Generator

    path, _ = tiny
    with pytest.raises(BackendError, match="gpt_oss"):
        Generator(path, dtype="float32", compilation_cache="off", backend="offload")


# ----------------------------------------------------------------------------- prefix cache
def test_prefix_cache_scores_equal_without_it(tiny):
    """Shared prefixes (longer than the window) read from the pool: the sliding layers
    mask pooled keys by their positions. Scores equal the cache-less engine's, over
    repeated runs (cache hits) and KV-cache-free in-run sharing."""
    from moejax.backends import make_backend
    from moejax.ops import PrefillOp
    from moejax.packing import BucketPolicy
    from moejax.core.scoring_engine import Engine

    path, _ = tiny
    cfg, params, _ = ck.load_model_dir(path, "float32")
    resident = make_backend("resident", cfg, params)
    policy = BucketPolicy(max_batch_tokens=128, min_block=32)

    def sequences(seed: int) -> list[PrefillOp]:
        rng = np.random.default_rng(seed)
        system = rng.integers(2, V, 21)
        out = []
        for prompt in (np.concatenate([system, rng.integers(2, V, 7)]),
                       np.concatenate([system, rng.integers(2, V, 18)]), rng.integers(2, V, 19)):
            for _ in range(2):
                cand = rng.integers(2, V, int(rng.integers(1, 4)))
                tokens = np.concatenate([prompt, cand])
                out.append(PrefillOp(key=len(out), token_ids=np.asarray(tokens, np.int32),
                                     score_positions=tuple(range(len(prompt) - 1, len(tokens) - 1)),
                                     score_token_ids=tuple((1, 2, 3) for _ in cand),
                                     full_vocab=True, prefix_len=len(prompt)))
        return out

    plain = Engine(cfg, resident, policy=policy)
    cached = Engine(cfg, resident, policy=policy, prefix_cache_blocks=64)
    free = Engine(cfg, resident, policy=policy, prefix_cache_blocks=64, kv_cache_free=True)
    for seed in (1, 1):
        seqs = sequences(seed)
        want = plain.run(seqs)
        for engine in (cached, free):
            got = engine.run(seqs)
            for key in want:
                for a, b in zip(got[key].logits, want[key].logits):
                    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    assert cached.stats.prefix_tokens_cached > 0 and cached.prefix_cache.hits > 0
    assert free.stats.prefix_tokens_shared > 0

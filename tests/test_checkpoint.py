"""moejax.checkpoint against real transformers checkpoints (tiny random Qwen3-MoE / Mixtral)."""

from __future__ import annotations

import json
import os
import re
import shutil

import ml_dtypes
import numpy as np
import pytest

from moejax import checkpoint as ck
from moejax.config import load_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

V, D, L, HEADS, KV_HEADS, HEAD_DIM, E, K, F = 64, 32, 2, 4, 2, 8, 4, 2, 16


# ----------------------------------------------------------------------------- fixtures
def _qwen3_config(**overrides):
    kwargs = dict(vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_experts=E,
                  num_experts_per_tok=K, moe_intermediate_size=F, intermediate_size=2 * F,
                  max_position_embeddings=128, norm_topk_prob=True)
    kwargs.update(overrides)
    return transformers.Qwen3MoeConfig(**kwargs)


def _mixtral_config():
    return transformers.MixtralConfig(
        vocab_size=V, hidden_size=D, num_hidden_layers=L, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, num_local_experts=E,
        num_experts_per_tok=K, intermediate_size=F, max_position_embeddings=128)


def _random_model(model_cls, config, seed: int):
    """A model whose every parameter (norms included) is distinct random, so mix-ups show."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_()
    return model


def _save(model, path, **kwargs) -> str:
    model.save_pretrained(path, **kwargs)
    return os.fspath(path)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    model = _random_model(transformers.Qwen3MoeForCausalLM, _qwen3_config(), seed=0)
    return _save(model, tmp_path_factory.mktemp("qwen3")), model


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    model = _random_model(transformers.MixtralForCausalLM, _mixtral_config(), seed=1)
    return _save(model, tmp_path_factory.mktemp("mixtral")), model


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().float().numpy()


def _expected_from_torch(model, qk_norm: bool, tied: bool = False) -> dict:
    """The moejax layout built from the *in-memory* torch params (fused experts).

    transformers 5 holds experts as ``gate_up_proj [E, 2f, d]`` (gate rows first) and
    ``down_proj [E, d, f]``, applied with ``F.linear`` (x @ W.T).
    """
    sd = {name: _numpy(p) for name, p in model.named_parameters()}

    def stack(suffix: str, transform=lambda a: a) -> np.ndarray:
        return np.stack([transform(sd[f"model.layers.{i}.{suffix}"]) for i in range(L)])

    layers = {
        "attn_norm": stack("input_layernorm.weight"),
        "mlp_norm": stack("post_attention_layernorm.weight"),
        "wq": stack("self_attn.q_proj.weight", np.transpose),
        "wk": stack("self_attn.k_proj.weight", np.transpose),
        "wv": stack("self_attn.v_proj.weight", np.transpose),
        "wo": stack("self_attn.o_proj.weight", np.transpose),
        "router": stack("mlp.gate.weight", np.transpose),
        "w_gate": stack("mlp.experts.gate_up_proj", lambda a: a[:, :F].transpose(0, 2, 1)),
        "w_up": stack("mlp.experts.gate_up_proj", lambda a: a[:, F:].transpose(0, 2, 1)),
        "w_down": stack("mlp.experts.down_proj", lambda a: a.transpose(0, 2, 1)),
    }
    if qk_norm:
        layers["q_norm"] = stack("self_attn.q_norm.weight")
        layers["k_norm"] = stack("self_attn.k_norm.weight")
    expected = {"embed": sd["model.embed_tokens.weight"], "layers": layers,
                "final_norm": sd["model.norm.weight"]}
    if not tied:
        expected["lm_head"] = sd["lm_head.weight"].T
    return expected


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(_flat(value, f"{prefix}/{key}" if prefix else key))
        return out
    return {prefix: tree}


def _assert_tree_equal(actual, expected):
    actual, expected = _flat(actual), _flat(expected)
    assert sorted(actual) == sorted(expected)
    for key in expected:
        a, e = np.asarray(actual[key]), np.asarray(expected[key])
        assert a.shape == e.shape, key
        np.testing.assert_array_equal(a.astype(np.float32), e.astype(np.float32), err_msg=key)


def _rewrite(src: str, dst, edit) -> str:
    """Copy a single-file HF dir to ``dst`` with ``edit(tensors)`` applied to its weights."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    shutil.copyfile(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return os.fspath(dst)


def _write_tokenizer(model_dir) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(V - 1)} | {"<unk>": V - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(
        os.path.join(model_dir, "tokenizer.json"))


# ----------------------------------------------------------------------------- HF loading
def test_qwen3_f32_params_equal_torch_weights(qwen3):
    path, model = qwen3
    cfg = load_config(path)
    params = ck.load_hf_params(path, cfg)
    assert _flat(ck.expected_param_shapes(cfg)) == {k: v.shape for k, v in _flat(params).items()}
    assert all(v.dtype == np.float32 for v in _flat(params).values())
    _assert_tree_equal(params, _expected_from_torch(model, qk_norm=True))


def test_mixtral_f32_params_equal_torch_weights(mixtral):
    path, model = mixtral
    cfg = load_config(path)
    assert cfg.model_type == "mixtral" and not cfg.qk_norm
    params = ck.load_hf_params(path, cfg)
    _assert_tree_equal(params, _expected_from_torch(model, qk_norm=False))


@pytest.mark.parametrize("which", ["qwen3", "mixtral"])
def test_params_reproduce_torch_modules(which, request):
    """Orientation check through the torch modules themselves, not through weight names."""
    path, model = request.getfixturevalue(which)
    params = ck.load_hf_params(path, load_config(path))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, D)).astype(np.float32)
    xt = torch.from_numpy(x)
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        with torch.no_grad():
            for key, module in (("wq", attn.q_proj), ("wk", attn.k_proj), ("wv", attn.v_proj)):
                np.testing.assert_allclose(x @ params["layers"][key][i], _numpy(module(xt)),
                                           rtol=1e-5, atol=1e-5)
            for e in range(E):
                # route every token to expert e alone, with weight 1
                out = layer.mlp.experts(xt, torch.full((3, 1), e), torch.ones(3, 1))
                gate = x @ params["layers"]["w_gate"][i, e]
                hidden = gate / (1 + np.exp(-gate)) * (x @ params["layers"]["w_up"][i, e])
                np.testing.assert_allclose(hidden @ params["layers"]["w_down"][i, e],
                                           _numpy(out), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        np.testing.assert_allclose(x @ params["lm_head"], _numpy(model.lm_head(xt)),
                                   rtol=1e-5, atol=1e-5)


def test_bf16_checkpoint(tmp_path):
    model = _random_model(transformers.Qwen3MoeForCausalLM, _qwen3_config(), seed=2)
    model = model.to(torch.bfloat16)
    path = _save(model, tmp_path / "bf16")
    header = ck.read_safetensors_header(os.path.join(path, "model.safetensors"))
    assert {info.dtype for info in header.tensors.values()} == {"BF16"}
    cfg = load_config(path)
    expected = _expected_from_torch(model, qk_norm=True)  # bf16 values, exactly in float32
    _assert_tree_equal(ck.load_hf_params(path, cfg, "float32"), expected)
    as_bf16 = ck.load_hf_params(path, cfg, "bfloat16")
    assert all(v.dtype == ml_dtypes.bfloat16 for v in _flat(as_bf16).values())
    _assert_tree_equal(as_bf16, expected)
    as_f16 = ck.load_hf_params(path, cfg, "float16")
    np.testing.assert_allclose(as_f16["layers"]["w_up"].astype(np.float32),
                               expected["layers"]["w_up"], rtol=1e-2)


def test_sharded_checkpoint(qwen3, tmp_path):
    path, model = qwen3
    sharded = _save(model, tmp_path / "sharded", max_shard_size="20KB")
    assert os.path.isfile(os.path.join(sharded, ck.INDEX_FILE))
    assert not os.path.exists(os.path.join(sharded, ck.SINGLE_FILE))
    with open(os.path.join(sharded, ck.INDEX_FILE)) as fh:
        assert len(set(json.load(fh)["weight_map"].values())) > 1
    cfg = load_config(sharded)
    _assert_tree_equal(ck.load_hf_params(sharded, cfg), ck.load_hf_params(path, cfg))


def test_tied_embeddings(tmp_path):
    model = _random_model(transformers.Qwen3MoeForCausalLM,
                          _qwen3_config(tie_word_embeddings=True), seed=3)
    path = _save(model, tmp_path / "tied")
    cfg = load_config(path)
    assert cfg.tie_word_embeddings
    params = ck.load_hf_params(path, cfg)
    assert "lm_head" not in params
    _assert_tree_equal(params, _expected_from_torch(model, qk_norm=True, tied=True))

    # Some exporters write the tied head anyway: it is ignored, not an error.
    def add_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    with_head = _rewrite(path, tmp_path / "tied_with_head", add_head)
    _assert_tree_equal(ck.load_hf_params(with_head, cfg), params)


@pytest.mark.parametrize("which", ["qwen3", "mixtral"])
def test_fused_expert_tensors_on_disk(which, request, tmp_path):
    """Checkpoints holding the fused ``experts.gate_up_proj``/``down_proj`` (and, for Mixtral,
    the ``mlp.`` prefix) load to the same params as the per-expert form."""
    from safetensors.torch import save_file

    path, model = request.getfixturevalue(which)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    shutil.copyfile(os.path.join(path, "config.json"), fused_dir / "config.json")
    state = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, os.fspath(fused_dir / "model.safetensors"))
    cfg = load_config(path)
    _assert_tree_equal(ck.load_hf_params(fused_dir, cfg), ck.load_hf_params(path, cfg))


# ----------------------------------------------------------------------------- errors
def test_wrong_shape_names_tensor_and_shapes(qwen3, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:, :-1].copy()

    bad = _rewrite(qwen3[0], tmp_path / "bad", shrink)
    with pytest.raises(ck.CheckpointError,
                       match=re.escape(f"{name}: expected shape (16, 32), found (16, 31)")):
        ck.load_hf_params(bad, load_config(bad))


def test_missing_tensor_is_named(qwen3, tmp_path):
    name = "model.layers.0.self_attn.k_norm.weight"
    bad = _rewrite(qwen3[0], tmp_path / "bad", lambda tensors: tensors.pop(name))
    with pytest.raises(ck.CheckpointError,
                       match=re.escape(f"missing {name} (expected shape (8,))")):
        ck.load_hf_params(bad, load_config(bad))


def test_unexpected_tensor_is_an_error_unless_lenient(qwen3, tmp_path):
    path = qwen3[0]
    extra = "model.layers.0.mlp.shared_expert.up_proj.weight"

    def add(tensors):
        tensors[extra] = np.zeros((F, D), np.float32)
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)

    bad = _rewrite(path, tmp_path / "bad", add)
    cfg = load_config(bad)
    with pytest.raises(ck.CheckpointError, match=re.escape(extra)) as info:
        ck.load_hf_params(bad, cfg)
    assert "inv_freq" not in str(info.value)  # rotary buffers are ignorable
    with pytest.warns(UserWarning, match=re.escape(extra)):
        params = ck.load_hf_params(bad, cfg, strict=False)
    _assert_tree_equal(params, ck.load_hf_params(path, cfg))


def test_non_float_weights_are_refused(qwen3, tmp_path):
    name = "model.layers.0.mlp.gate.weight"

    def quantize(tensors):
        tensors[name] = tensors[name].astype(np.int8)

    bad = _rewrite(qwen3[0], tmp_path / "bad", quantize)
    with pytest.raises(ck.CheckpointError, match=re.escape(f"{name} (I8)")):
        ck.load_hf_params(bad, load_config(bad))


def test_no_weights_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        ck.CheckpointReader(tmp_path)


def test_bad_dtype_name():
    with pytest.raises(ValueError, match="float64"):
        ck.resolve_dtype("float64")


# ----------------------------------------------------------------------------- safetensors
def test_reader_matches_safetensors_library(tmp_path):
    from safetensors.torch import save_file

    rng = np.random.default_rng(0)
    tensors = {"f32": torch.from_numpy(rng.standard_normal((3, 5)).astype(np.float32)),
               "f16": torch.from_numpy(rng.standard_normal((7,)).astype(np.float16)),
               "bf16": torch.randn(2, 3, 4).to(torch.bfloat16),
               "f64": torch.from_numpy(rng.standard_normal((2, 2))),
               "i64": torch.arange(6).reshape(2, 3),
               "empty": torch.zeros(0, 4)}
    path = tmp_path / "lib.safetensors"
    save_file(tensors, os.fspath(path), metadata={"k": "v"})
    with ck.SafetensorsFile(path) as fh:
        assert fh.header.metadata == {"k": "v"}
        assert sorted(fh.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            array = fh.get(name)
            assert array.shape == tuple(tensor.shape)
            assert not array.flags.writeable  # a view of the read-only mapping
            np.testing.assert_array_equal(array.astype(np.float64), tensor.double().numpy())
        assert fh.get("bf16").dtype == ml_dtypes.bfloat16


def test_writer_is_read_by_safetensors_library(tmp_path):
    from safetensors.numpy import load_file

    rng = np.random.default_rng(1)
    tensors = {"b": rng.standard_normal((4, 3)).astype(np.float32),
               "a": rng.standard_normal(5).astype(np.float16),
               "c": np.arange(3, dtype=np.int64)}
    path = tmp_path / "ours.safetensors"
    ck.write_safetensors(path, tensors, metadata={"format": "pt"})
    loaded = load_file(os.fspath(path))
    assert sorted(loaded) == sorted(tensors)
    for name, array in tensors.items():
        assert loaded[name].dtype == array.dtype
        np.testing.assert_array_equal(loaded[name], array)
    second = tmp_path / "again.safetensors"
    ck.write_safetensors(second, dict(reversed(list(tensors.items()))), {"format": "pt"})
    assert path.read_bytes() == second.read_bytes()


@pytest.mark.parametrize("corrupt", [
    lambda raw: raw[:4],                                          # truncated length prefix
    lambda raw: (10**9).to_bytes(8, "little") + raw[8:],          # header past end of file
    lambda raw: raw[:8] + b"x" + raw[9:],                         # broken JSON
    lambda raw: raw[:-4],                                         # data section too short
])
def test_corrupt_files_raise_checkpoint_error(tmp_path, corrupt):
    path = tmp_path / "x.safetensors"
    ck.write_safetensors(path, {"w": np.ones((4, 4), np.float32)})
    path.write_bytes(corrupt(path.read_bytes()))
    with pytest.raises(ck.CheckpointError):
        ck.SafetensorsFile(path)


# ----------------------------------------------------------------------------- orbax & dirs
def test_orbax_round_trip(qwen3, tmp_path):
    path = qwen3[0]
    cfg = load_config(path)
    for dtype in ("float32", "bfloat16"):
        params = ck.load_hf_params(path, cfg, dtype)
        ck.save_params(params, tmp_path / dtype)  # relative-or-not, made absolute inside
        restored = ck.restore_params(tmp_path / dtype)
        for key, value in _flat(params).items():
            got = _flat(restored)[key]
            assert isinstance(got, np.ndarray) and got.dtype == value.dtype, key
            np.testing.assert_array_equal(got.astype(np.float32), value.astype(np.float32))
    cast = ck.restore_params(tmp_path / "float32", "bfloat16")
    assert all(v.dtype == ml_dtypes.bfloat16 for v in _flat(cast).values())
    _assert_tree_equal(cast, ck.load_hf_params(path, cfg, "bfloat16"))


def test_convert_then_load_model_dir(qwen3, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(qwen3[0], hf_dir)
    _write_tokenizer(hf_dir)
    out = tmp_path / "converted"
    assert not ck.is_converted_dir(hf_dir)
    assert ck.convert_checkpoint(hf_dir, out, "bfloat16") == os.fspath(out)
    assert ck.is_converted_dir(out)
    assert {"config.json", "tokenizer.json", "params", ck.CONVERTED_MARKER} <= set(os.listdir(out))
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # temporary dir cleaned up

    cfg_hf, params_hf, tok_hf = ck.load_model_dir(hf_dir, "bfloat16")
    cfg_cv, params_cv, tok_cv = ck.load_model_dir(out, "bfloat16")
    assert cfg_cv == cfg_hf
    assert tok_cv.get_vocab() == tok_hf.get_vocab()
    _assert_tree_equal(params_cv, params_hf)
    assert all(v.dtype == ml_dtypes.bfloat16 for v in _flat(params_cv).values())
    _, params_f32, _ = ck.load_model_dir(out, "float32")  # bf16 on disk, cast on restore
    assert all(v.dtype == np.float32 for v in _flat(params_f32).values())
    _assert_tree_equal(params_f32, params_hf)

    with pytest.raises(FileExistsError):
        ck.convert_checkpoint(hf_dir, out, "bfloat16")
    ck.convert_checkpoint(hf_dir, out, "float32", overwrite=True)
    _, params_again, _ = ck.load_model_dir(out, "float32")
    _assert_tree_equal(params_again, ck.load_hf_params(hf_dir, cfg_hf))


def test_convert_needs_tokenizer(qwen3, tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(os.path.join(qwen3[0],
                                                                       "tokenizer.json"))):
        ck.convert_checkpoint(qwen3[0], tmp_path / "out", "float32")
    assert not os.path.exists(tmp_path / "out")


def test_load_tokenizer_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "tokenizer.json"))):
        ck.load_tokenizer(tmp_path)


def test_converted_dir_with_wrong_config_is_refused(qwen3, tmp_path):
    hf_dir = tmp_path / "hf"
    shutil.copytree(qwen3[0], hf_dir)
    _write_tokenizer(hf_dir)
    out = ck.convert_checkpoint(hf_dir, tmp_path / "converted", "float32")
    with open(os.path.join(out, "config.json")) as fh:
        config = json.load(fh)
    config["moe_intermediate_size"] = F * 2
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(config, fh)
    with pytest.raises(ck.CheckpointError, match="layers.w_up: expected shape"):
        ck.load_model_dir(out)

"""The built-in demo model: shipped trained files, a reproducible tokenizer, loads like any model."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from hf_parity import assert_transformers_agrees
from moejax import checkpoint as ck
from moejax import demo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return demo.ensure_demo_model(tmp_path_factory.mktemp("cache"))


def _file_digests(path: str) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


def test_notice_says_trained_toy():
    assert "trained" in demo.DEMO_NOTICE and "toy" in demo.DEMO_NOTICE
    assert "untrained" not in demo.DEMO_NOTICE
    assert "toy" in demo.__doc__ and "trained here" in demo.__doc__


def test_tokenizer_is_deterministic():
    first = demo.build_demo_tokenizer(examples=1500).to_str()
    assert demo.build_demo_tokenizer(examples=1500).to_str() == first
    # A fresh interpreter with another hash seed (Python and Rust hash maps differ) agrees.
    script = ("import sys; from moejax import demo; "
              "sys.stdout.write(demo.build_demo_tokenizer(examples=1500).to_str())")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    assert out == first


def test_shipped_tokenizer_is_rebuilt_exactly():
    """The tokenizer in moejax/demo/weights is what the training script builds."""
    shipped = (demo.WEIGHTS_DIR / "tokenizer.json").read_text(encoding="utf-8")
    rebuilt = demo.build_demo_tokenizer(demo.demo_config().vocab_size, demo.DEMO_SEED)
    assert json.loads(rebuilt.to_str()) == json.loads(shipped)


def test_tokenizer_vocab_and_single_token_words(demo_dir):
    tokenizer = ck.load_tokenizer(demo_dir)
    cfg = demo.demo_config()
    assert tokenizer.get_vocab_size() == cfg.vocab_size == 1024
    for word in (" yes", " no", " A", " B", " code", " data", " 40", " 45") + tuple(
            " " + w for w in demo.ANSWER_WORDS):
        assert len(tokenizer.encode(word).ids) == 1, word
    for i, token in enumerate(demo.SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == i
    text = "Any text, even ünïcödé 🙂, round-trips."
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_config_matches_brief():
    cfg = demo.demo_config()
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size, cfg.num_experts,
            cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.num_heads,
            cfg.num_kv_heads, cfg.head_dim, cfg.max_context, cfg.rope_theta) == (
        "qwen3_moe", 4, 128, 8, 2, 128, 4, 2, 32, 2048, 10000.0)
    assert cfg.norm_topk_prob and cfg.qk_norm and not cfg.tie_word_embeddings


def test_demo_dir_loads(demo_dir):
    assert sorted(os.listdir(demo_dir)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert _file_digests(demo_dir) == {name: digest for name, digest in
                                       _file_digests(demo.WEIGHTS_DIR).items()
                                       if name in os.listdir(demo_dir)}
    assert not ck.is_converted_dir(demo_dir)
    cfg, params, tokenizer = ck.load_model_dir(demo_dir, "float32")
    assert cfg == demo.demo_config()
    shapes = ck.expected_param_shapes(cfg)
    assert params.keys() == shapes.keys() and params["layers"].keys() == shapes["layers"].keys()
    for key in ("embed", "final_norm", "lm_head"):
        assert params[key].shape == shapes[key]
    for key, shape in shapes["layers"].items():
        assert params["layers"][key].shape == shape, key
    assert params["layers"]["w_gate"].shape == (4, 8, 128, 128)
    for key, value in [("final_norm", params["final_norm"])] + list(params["layers"].items()):
        assert np.all(np.isfinite(value)), key
    # Trained, not the seeded init: norms moved away from 1, and the router is not N(0, 0.02²).
    assert not np.allclose(params["layers"]["mlp_norm"], 1.0)
    assert params["layers"]["router"].std() > 0.03
    assert tokenizer.get_vocab_size() == cfg.vocab_size


def test_shipped_weights_are_bfloat16_and_small():
    header = ck.read_safetensors_header(demo.WEIGHTS_DIR / "model.safetensors")
    assert header.tensors and {info.dtype for info in header.tensors.values()} == {"BF16"}
    assert (demo.WEIGHTS_DIR / "model.safetensors").stat().st_size < 8 << 20
    assert "trained" in header.metadata["notice"]


def test_missing_shipped_weights_are_reported(tmp_path, monkeypatch):
    monkeypatch.setitem(demo.MODELS, "demo", dataclasses.replace(
        demo.MODELS["demo"], weights_dir=tmp_path / "nothing"))
    with pytest.raises(FileNotFoundError, match="python -m moejax.demo.train"):
        demo.ensure_demo_model(tmp_path / "cache")
    assert os.listdir(tmp_path / "cache") == []   # the temporary copy is cleaned up


def test_second_call_reuses_files(demo_dir):
    before = {name: os.stat(os.path.join(demo_dir, name)).st_mtime_ns
              for name in os.listdir(demo_dir)}
    assert demo.ensure_demo_model(os.path.dirname(demo_dir)) == demo_dir
    after = {name: os.stat(os.path.join(demo_dir, name)).st_mtime_ns
             for name in os.listdir(demo_dir)}
    assert after == before


def test_concurrent_first_use_via_env(demo_dir, tmp_path, monkeypatch):
    """Racing first uses all get one complete directory, byte-identical to another build."""
    monkeypatch.setenv("MOEJAX_CACHE", os.fspath(tmp_path))
    assert demo.default_cache_root() == os.fspath(tmp_path)
    results: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            results.append(demo.ensure_demo_model())
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert results == [os.path.join(tmp_path, demo.DEMO_NAME)] * 2
    assert os.listdir(tmp_path) == [demo.DEMO_NAME]  # the loser's temporary dir is gone
    assert _file_digests(results[0]) == _file_digests(demo_dir)


def test_incomplete_cache_dir_is_reported(tmp_path):
    (tmp_path / demo.DEMO_NAME).mkdir()
    (tmp_path / demo.DEMO_NAME / "config.json").write_text("{}")
    with pytest.raises(RuntimeError, match="not a complete demo model"):
        demo.ensure_demo_model(tmp_path)


def test_transformers_loads_demo_and_agrees(demo_dir):
    """Hugging Face's own Qwen3-MoE reads the trained files and computes the same logits."""
    assert_transformers_agrees(demo_dir, "Is 3 + 4 = 7? Answer: yes")

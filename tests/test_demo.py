"""The built-in demo model: deterministic files, a usable tokenizer, loads like any model."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from moejax import checkpoint as ck
from moejax import demo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return demo.ensure_demo_model(tmp_path_factory.mktemp("cache"))


def _file_digests(path: str) -> dict[str, str]:
    return {name: hashlib.sha256(open(os.path.join(path, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(path))}


def test_notice_says_untrained():
    assert "untrained" in demo.DEMO_NOTICE and "meaningless" in demo.DEMO_NOTICE
    assert "untrained" in demo.__doc__.lower() or "not trained" in demo.__doc__.lower()


def test_tokenizer_is_deterministic():
    first = demo.build_demo_tokenizer().to_str()
    assert demo.build_demo_tokenizer().to_str() == first
    # A fresh interpreter with another hash seed (Python and Rust hash maps differ) agrees.
    script = ("import sys; from moejax import demo; "
              "sys.stdout.write(demo.build_demo_tokenizer().to_str())")
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=REPO)
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    assert out == first


def test_tokenizer_vocab_and_single_token_words(demo_dir):
    tokenizer = ck.load_tokenizer(demo_dir)
    cfg = demo.demo_config()
    assert tokenizer.get_vocab_size() == cfg.vocab_size == 1024
    for word in (" yes", " no", " A", " B", " positive", " negative") + tuple(
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
        "qwen3_moe", 4, 256, 16, 4, 128, 4, 2, 64, 2048, 10000.0)
    assert cfg.norm_topk_prob and cfg.qk_norm and not cfg.tie_word_embeddings


def test_demo_dir_loads(demo_dir):
    assert sorted(os.listdir(demo_dir)) == ["config.json", "model.safetensors", "tokenizer.json"]
    assert not ck.is_converted_dir(demo_dir)
    cfg, params, tokenizer = ck.load_model_dir(demo_dir, "float32")
    assert cfg == demo.demo_config()
    shapes = ck.expected_param_shapes(cfg)
    assert params.keys() == shapes.keys() and params["layers"].keys() == shapes["layers"].keys()
    for key in ("embed", "final_norm", "lm_head"):
        assert params[key].shape == shapes[key]
    for key, shape in shapes["layers"].items():
        assert params["layers"][key].shape == shape, key
    assert params["layers"]["w_gate"].shape == (4, 16, 256, 128)
    for norm in ("attn_norm", "mlp_norm", "q_norm", "k_norm"):
        np.testing.assert_array_equal(params["layers"][norm], 1.0)
    np.testing.assert_array_equal(params["final_norm"], 1.0)
    for key in ("wq", "w_up", "w_down", "router"):
        assert 0.018 < params["layers"][key].std() < 0.022, key
    assert tokenizer.get_vocab_size() == cfg.vocab_size


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


def test_transformers_loads_demo(demo_dir):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        demo_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.shape == (1, 4, 1024) and torch.isfinite(logits).all()

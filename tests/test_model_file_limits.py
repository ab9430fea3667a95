"""Model files that are absurd, hostile or not files at all (issue 37, items 4, 8, 9b, 9d
and the ``convert demo`` papercut): each is refused promptly with an error naming the
file and what is wrong, instead of growing memory for minutes, reading outside the model
directory, blocking for ever, or ending in a traceback.

The model directories are built here from transformers' own classes (the tiny Qwen3-MoE
of ``hf_tiny_models``). Calls that once hung or ran for minutes run in a daemon thread or
a subprocess with an explicit time limit, so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest

from moejax import checkpoint as ck
from moejax import model_dirs
from moejax.config import ConfigError, load_config
from moejax.prefetch import defaults as defaults_lib
from moejax.prefetch import files as prefetch_files
from moejax.prefetch.defaults import PrefetchFileError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_tiny_models import E, L, V, build_torch_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
CALL_LIMIT_S = 20      # an in-process call that once ran for minutes (or for ever)
CLI_LIMIT_S = 120      # a `moejax` subprocess: JAX's import and start, then the refusal


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3-MoE directory as transformers saves it (per-expert tensors, one
    model.safetensors), with a word-level tokenizer.json."""
    from tokenizers import Tokenizer, models

    path = tmp_path_factory.mktemp("tiny")
    build_torch_model("qwen3_moe", {}, seed=0).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(V - 1)} | {"<unk>": V - 1}
    Tokenizer(models.WordLevel(vocab, unk_token="<unk>")).save(str(path / "tokenizer.json"))
    return path


def _copy(source: Path, dest: Path, **config_changes: Any) -> Path:
    """A copy of the model directory ``source`` with config.json fields replaced."""
    shutil.copytree(source, dest)
    config = json.loads((dest / "config.json").read_text())
    config.update(config_changes)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def _within(seconds: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a daemon thread: its result, or its exception raised here; a
    failure when it has not returned within ``seconds``."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"{fn.__name__}{args} did not return within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


def _moejax(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "serving.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=CLI_LIMIT_S)


_OPENED: list[str] | None = None   # paths opened while a test records them (audit hook)


def _record_opens(event: str, args: tuple) -> None:
    if event == "open" and _OPENED is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_record_opens)


# ----------------------------------------------------------------------------- item 4: sizes
ABSURD = [
    ("num_experts", 1_000_000_000, "must be an integer in [1, 4096], got 1000000000"),
    ("num_experts", 1e9, "must be an integer, got 1000000000.0 (float"),
    ("num_hidden_layers", 1e9, "must be an integer, got 1000000000.0 (float"),
    ("num_hidden_layers", 1_000_000_000, "must be an integer in [1, 1024], got 1000000000"),
    ("hidden_size", 1e9, "must be an integer, got 1000000000.0 (float"),
    ("hidden_size", 128.5, "must be an integer, got 128.5 (float"),
    ("vocab_size", 10**12, "must be an integer in [1, 4194304], got 1000000000000"),
    ("max_position_embeddings", 10**12,
     "must be an integer in [1, 16777216], got 1000000000000"),
    ("max_position_embeddings", 1e12, "must be an integer, got 1000000000000.0 (float"),
    ("num_experts", True, "must be an integer, got True (bool)"),
    ("moe_intermediate_size", "16", "must be an integer, got '16' (str)"),
    ("head_dim", 8.0, "must be an integer, got 8.0 (float"),
    ("num_attention_heads", 0, "must be an integer in [1, 1024], got 0"),
]


@pytest.mark.parametrize("field, value, words", ABSURD,
                         ids=[f"{f}={v!r}" for f, v, _ in ABSURD])
def test_an_absurd_size_is_refused_naming_file_field_and_value(tiny_dir, tmp_path, field,
                                                               value, words):
    """Before: num_experts / num_hidden_layers of 1e9 grew memory for minutes (the tensor
    plan, a layer list); hidden_size 128.5 became 128 and max_position_embeddings 1e12 was
    served, silently."""
    model = _copy(tiny_dir, tmp_path / "model", **{field: value})
    config = str(model / "config.json")
    expected = f"{config}: field {field!r} {words}"
    with pytest.raises(ConfigError, match="^" + re.escape(expected)):
        _within(CALL_LIMIT_S, ck.load_model_dir, str(model))
    with pytest.raises(ConfigError, match="^" + re.escape(expected)):
        _within(CALL_LIMIT_S, ck.convert_checkpoint, str(model), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field, value, words", [
    ("num_experts", 4096, "the config has 4096 experts per MoE layer, but the checkpoint in "
                          "{dir} holds {E} (from model.layers."),
    ("num_experts", E + 1, "the config has {E1} experts per MoE layer, but the checkpoint in "
                           "{dir} holds {E} (from model.layers."),
    ("num_hidden_layers", 1024, "num_hidden_layers is 1024, but the checkpoint in {dir} holds "
                                "tensors for {L} layer(s) (model.layers.0 to model.layers.{L1})"),
], ids=["num_experts=4096", "num_experts=E+1", "num_hidden_layers=1024"])
def test_counts_beyond_the_checkpoint_are_refused_before_planning(tiny_dir, tmp_path, field,
                                                                  value, words):
    """Sizes within the bounds must still agree with the tensors that exist: a config
    asking for more layers or experts than the checkpoint holds is refused from the
    tensor names alone (before: a per-expert plan of every missing tensor, then a list of
    thousands of missing names)."""
    model = _copy(tiny_dir, tmp_path / "model", **{field: value})
    expected = f"{model / 'config.json'}: " + words.format(dir=model, E=E, E1=E + 1, L=L,
                                                             L1=L - 1)
    with pytest.raises(ck.CheckpointError, match="^" + re.escape(expected)):
        _within(CALL_LIMIT_S, ck.load_model_dir, str(model))


def test_the_sizes_of_a_good_config_are_unchanged(tiny_dir):
    cfg = load_config(tiny_dir)
    assert (cfg.num_experts, cfg.num_layers, cfg.hidden_size, cfg.max_context) == (E, L, 32, 128)
    params = ck.load_hf_params(str(tiny_dir), cfg)
    assert params["layers"]["w_gate"].shape == (L, E, 32, 16)


def test_moejax_info_refuses_a_billion_experts_promptly(tiny_dir, tmp_path):
    """Before: `moejax info` of this directory was at 7.3 GB of memory after 60 s and
    still running. Now: exit 2 with one line naming the file, the field and the value."""
    model = _copy(tiny_dir, tmp_path / "model", num_experts=1_000_000_000)
    done = _moejax("info", "--model", str(model))
    assert done.returncode == 2, done.stderr
    assert done.stdout == ""
    assert done.stderr == (f"moejax: error: {model / 'config.json'}: field 'num_experts' must "
                           f"be an integer in [1, 4096], got 1000000000 (moejax's bound, well "
                           f"above the largest open models: a corrupt config?)\n")


# ----------------------------------------------------------------------------- item 8: shards
def _sharded(tiny_dir: Path, dest: Path, shard_of: Callable[[str], str]) -> Path:
    """``dest``: the tiny model with an index whose weight_map sends each tensor to
    ``shard_of(name)`` (the real weights stay in ``outside/`` next to ``dest``)."""
    dest.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copyfile(tiny_dir / name, dest / name)
    outside = dest.parent / "outside"
    outside.mkdir(exist_ok=True)
    shutil.copyfile(tiny_dir / "model.safetensors", outside / "model.safetensors")
    names = ck.read_safetensors_header(outside / "model.safetensors").tensors
    index = {"metadata": {}, "weight_map": {name: shard_of(name) for name in sorted(names)}}
    (dest / ck.INDEX_FILE).write_text(json.dumps(index))
    return dest


@pytest.mark.parametrize("entry", ["../outside/model.safetensors", "/etc/passwd", "OUTSIDE",
                                   "sub/model.safetensors", "..", "sub\\model.safetensors", ""])
def test_an_index_shard_outside_the_model_directory_is_refused_unopened(tiny_dir, tmp_path,
                                                                        entry):
    """Before: such entries were opened, and the error told the file's size ("header
    length ... does not fit in a 1234-byte file")."""
    global _OPENED
    outside = str(tmp_path / "outside" / "model.safetensors")
    entry = outside if entry == "OUTSIDE" else entry
    model = _sharded(tiny_dir, tmp_path / "model", lambda name: entry)
    _OPENED = []
    try:
        with pytest.raises(ck.CheckpointError) as info:
            ck.CheckpointReader(model)
        opened = list(_OPENED)
    finally:
        _OPENED = None
    message = str(info.value)
    assert message.startswith(f"{model / ck.INDEX_FILE}: weight_map entry 'lm_head.weight': "
                              f"shard {entry!r} must be ")
    assert "byte" not in message and "size" not in message
    assert [p for p in opened if "passwd" in p or p.endswith("safetensors")] == [], opened


def test_a_shard_symlink_leading_out_of_the_directory_is_refused(tiny_dir, tmp_path):
    model = _sharded(tiny_dir, tmp_path / "model", lambda name: "model-00001.safetensors")
    (model / "model-00001.safetensors").symlink_to(tmp_path / "outside" / "model.safetensors")
    with pytest.raises(ck.CheckpointError, match=re.escape(
            "shard 'model-00001.safetensors' is a symlink that leads out of the model "
            "directory")):
        ck.load_hf_params(str(model), load_config(model))


def test_shards_in_the_directory_and_in_a_hub_snapshot_still_load(tiny_dir, tmp_path):
    """Plain shards load; so does a Hugging Face hub snapshot, whose files are symlinks to
    ``../../blobs/HASH`` of the same repository."""
    cfg = load_config(tiny_dir)
    expected = ck.load_hf_params(str(tiny_dir), cfg)
    plain = _sharded(tiny_dir, tmp_path / "plain", lambda name: "model-00001-of-00001.safetensors")
    shutil.copyfile(tmp_path / "outside" / "model.safetensors",
                    plain / "model-00001-of-00001.safetensors")
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "snapshots").mkdir(parents=True)
    (repo / "blobs").mkdir()
    snapshot = _sharded(tiny_dir, repo / "snapshots" / "0123abc",
                        lambda name: "model-00001-of-00001.safetensors")
    shutil.copyfile(tiny_dir / "model.safetensors", repo / "blobs" / "9f8e7d")
    (snapshot / "model-00001-of-00001.safetensors").symlink_to("../../blobs/9f8e7d")
    for model in (plain, snapshot):
        params = ck.load_hf_params(str(model), cfg)
        assert all(np.array_equal(params["layers"][k], expected["layers"][k])
                   for k in expected["layers"])
        assert np.array_equal(params["embed"], expected["embed"])


# ----------------------------------------------------------------------------- item 9b: FIFOs
@pytest.mark.parametrize("fifo", ["config.json", "tokenizer.json", "model.safetensors",
                                  ck.INDEX_FILE, "shard.safetensors"])
def test_a_model_file_that_is_a_fifo_is_refused_without_blocking(tiny_dir, tmp_path, fifo):
    """Before: a config.json that is a FIFO blocked `open` for ever (the others were
    reported as missing, or blocked too)."""
    if fifo == "shard.safetensors":
        model = _sharded(tiny_dir, tmp_path / "model", lambda name: fifo)
    else:
        model = _copy(tiny_dir, tmp_path / "model")
        if fifo == ck.INDEX_FILE:
            os.remove(model / "model.safetensors")
        else:
            os.remove(model / fifo)
    os.mkfifo(model / fifo)
    with pytest.raises(ValueError, match="^" + re.escape(
            f"{model / fifo}: is a FIFO (named pipe), not a regular file")):
        _within(CALL_LIMIT_S, ck.load_model_dir, str(model))


def test_a_config_that_is_a_directory_is_named(tmp_path):
    (tmp_path / "config.json").mkdir()
    with pytest.raises(ConfigError, match=re.escape(
            f"{tmp_path / 'config.json'}: is a directory, not a regular file")):
        load_config(tmp_path)


# ----------------------------------------------------------------------------- item 9d: .npz
def _truncated_defaults(tmp_path: Path) -> Path:
    """A default-vector file written by the real writer, then cut to half its bytes (its
    zip directory, at the end, is gone)."""
    layers, experts, hidden = 4, 8, 128     # the demo model's [L, E, d]
    vectors = defaults_lib.DefaultVectors(
        defaults=np.ones((layers, experts, hidden), np.float32),
        counts=np.ones((layers, experts), np.int64), model="demo", fingerprint="0" * 64,
        calibration_requests=1, calibration_tokens=8)
    path = tmp_path / "defaults.npz"
    defaults_lib.save(path, vectors)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def test_a_truncated_prefetch_file_is_named(tmp_path):
    """Before: zipfile.BadZipFile escaped (the CLI ended with a traceback and exit 1)."""
    path = _truncated_defaults(tmp_path)
    expected = f"{path}: not a readable .npz, truncated or damaged? (BadZipFile: "
    with pytest.raises(PrefetchFileError, match="^" + re.escape(expected)):
        prefetch_files.load_files([str(path)], None, None)
    with pytest.raises(PrefetchFileError, match="^" + re.escape(expected)):
        defaults_lib.load(path)
    os.mkfifo(tmp_path / "fifo.npz")
    with pytest.raises(PrefetchFileError, match=re.escape("not a regular file")):
        _within(CALL_LIMIT_S, prefetch_files.load_files, [str(tmp_path / "fifo.npz")], None,
                None)


def test_moejax_generate_with_a_truncated_prefetch_file_exits_2(tmp_path, capsys):
    """As for a damaged ELDR fit file: one line naming the file, exit 2 (before: the
    BadZipFile's traceback, exit 1)."""
    from serving import cli

    path = _truncated_defaults(tmp_path)
    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"prompt": "a", "max_new_tokens": 2}) + "\n")
    status = cli.main(["generate", str(requests), "-o", str(tmp_path / "out.jsonl"),
                       "--model", "demo", "--backend", "offload", "--prefetch", "quasi",
                       "--prefetch-file", str(path)])
    err = capsys.readouterr().err
    assert status == 2, err
    assert err.startswith(f"moejax: error: {path}: not a readable .npz, truncated or "
                          f"damaged? (BadZipFile: "), err
    assert err.count("\n") == 1, err


# ----------------------------------------------------------------------------- convert demo
def test_convert_takes_a_built_in_model_name(tmp_path, capsys):
    """Before: `moejax convert demo OUT` said "no model config at demo", though every
    other command takes `demo`."""
    from serving import cli

    out = tmp_path / "demo-converted"
    assert cli.main(["convert", "demo", str(out), "--dtype", "float32"]) == 0, \
        capsys.readouterr().err
    assert ck.is_converted_dir(out)
    demo_dir, is_demo = model_dirs.resolve_model_dir("demo")
    assert is_demo
    cfg, params, _ = ck.load_model_dir(out)
    demo_cfg, demo_params, _ = ck.load_model_dir(demo_dir)
    assert cfg == demo_cfg
    assert np.array_equal(params["layers"]["router"], demo_params["layers"]["router"])

"""Hugging Face hub ids as model names (``moejax.hub``, through ``resolve_model_dir``).

The hub cannot be reached here, so each test lays out a real Hugging Face cache (the
format ``snapshot_download`` writes: ``hub/models--ORG--NAME/{blobs,refs,snapshots}``)
under a temporary ``HF_HOME`` holding the demo model's files, and resolves names in a
subprocess started with ``HF_HOME`` and ``HF_HUB_OFFLINE=1`` in its environment: the real
``huggingface_hub`` reads both when it is imported, as in a user's process.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
DEMO_WEIGHTS = ROOT / "moejax" / "demo" / "weights"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "org/tiny-moe"
REQUEST = {"id": "r1", "prompt": "Review: great food.\nSentiment:",
           "candidates": [" positive", " negative"]}

# Resolves each name of argv[1] (a JSON list), printing one JSON record per name.
RESOLVE = """
import json, sys
from moejax.model_dirs import model_display_name, resolve_model_dir
out = {}
for name in json.loads(sys.argv[1]):
    try:
        path, is_demo = resolve_model_dir(name)
        out[name] = {"path": path, "name": model_display_name(name, path, is_demo)}
    except Exception as exc:
        out[name] = {"error": type(exc).__name__, "message": str(exc),
                     "file_not_found": isinstance(exc, FileNotFoundError)}
print(json.dumps(out))
"""
# Scores REQUEST with a Scorer of the model argv[1].
SCORE = """
import json, sys
from serving import Scorer
scorer = Scorer(sys.argv[1], dtype="float32", max_batch_tokens=2048, calibrate=False)
(result,) = scorer.score([json.loads(sys.argv[2])])
print(json.dumps({"model_name": scorer.model_name, "logprobs": result.logprobs,
                  "label": result.label, "error": result.error}))
"""


def add_to_cache(hub: Path, repo: str, commit: str, files: dict[str, bytes]) -> Path:
    """Lay ``files`` out as ``snapshot_download`` does: each one a blob named by its hash,
    linked from ``snapshots/COMMIT/``, and ``refs/main`` naming the commit. Returns the
    snapshot directory."""
    storage = hub / ("models--" + repo.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for name, data in files.items():
        blob = hashlib.sha256(data).hexdigest()
        (storage / "blobs" / blob).write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """An HF_HOME whose cache holds the demo model as ``org/tiny-moe`` and a repository
    without a config.json as ``org/no-config``."""
    home = tmp_path_factory.mktemp("hf-home")
    demo = {name: (DEMO_WEIGHTS / name).read_bytes()
            for name in ("config.json", "model.safetensors", "tokenizer.json")}
    add_to_cache(home / "hub", REPO, COMMIT, demo)
    add_to_cache(home / "hub", "org/no-config", "f" * 40,
                 {"tokenizer.json": demo["tokenizer.json"]})
    return home


def offline_env(hf_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN")}
    return dict(env, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT),
                HF_HUB_DISABLE_TELEMETRY="1")


def run_offline(hf_home: Path, code: str, *args: str, cwd: Path = ROOT) -> dict:
    """The JSON that ``python -c code args`` prints, run offline with ``hf_home``."""
    done = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300, env=offline_env(hf_home))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def resolved(hf_home, tmp_path_factory) -> dict[str, dict]:
    """Every name the tests below ask about, resolved in one offline process whose working
    directory holds a local directory ``local/model`` (a hub id's spelling)."""
    cwd = tmp_path_factory.mktemp("cwd")
    (cwd / "local" / "model").mkdir(parents=True)
    names = [REPO, f"{REPO}@{COMMIT}", f"{REPO}@main", "org/absent", f"{REPO}@nope",
             f"{REPO}@{'a' * 40}", "org/no-config", "local/model", "no/such/dir/x",
             "missing-dir", "demo"]
    return run_offline(hf_home, RESOLVE, json.dumps(names), cwd=cwd)


def test_a_cached_hub_id_resolves_to_its_snapshot(resolved, hf_home):
    snapshot = str(hf_home / "hub" / "models--org--tiny-moe" / "snapshots" / COMMIT)
    for name in (REPO, f"{REPO}@{COMMIT}", f"{REPO}@main"):
        assert resolved[name] == {"path": snapshot, "name": REPO}, name
    assert resolved["demo"]["name"] == "demo"


def test_an_id_missing_from_the_cache_fails_offline_in_one_line(resolved, hf_home):
    record = resolved["org/absent"]
    assert record["error"] == "HubModelNotCached" and record["file_not_found"]
    message = record["message"]
    assert "\n" not in message
    assert message.startswith("model 'org/absent': not a local directory, not in the "
                              "Hugging Face cache")
    assert str(hf_home / "hub") in message and "HF_HUB_OFFLINE=1" in message
    assert "`hf download org/absent`" in message


@pytest.mark.parametrize("revision", ["nope", "a" * 40])
def test_a_revision_missing_from_the_cache_is_named(resolved, revision):
    record = resolved[f"{REPO}@{revision}"]
    assert record["error"] == "HubModelNotCached" and "\n" not in record["message"]
    assert record["message"].startswith(f"model '{REPO}@{revision}': not a local directory, "
                                        f"revision '{revision}' not in the Hugging Face cache")
    assert f"`hf download {REPO} --revision {revision}`" in record["message"]


def test_a_snapshot_without_config_is_refused(resolved):
    record = resolved["org/no-config"]
    assert record["error"] == "HubModelIncomplete" and record["file_not_found"]
    assert record["message"].startswith("model 'org/no-config': its Hugging Face snapshot ")
    assert "has no config.json" in record["message"] and "\n" not in record["message"]


def test_a_local_directory_wins_over_a_hub_id(resolved):
    assert resolved["local/model"] == {"path": "local/model", "name": "model"}


@pytest.mark.parametrize("name", ["no/such/dir/x", "missing-dir"])
def test_a_name_that_is_neither_names_the_path(resolved, name):
    record = resolved[name]
    assert record["error"] == "FileNotFoundError"
    assert record["message"].startswith(f"model directory '{name}' does not exist")
    assert "hub id ORG/NAME[@REVISION]" in record["message"]


def test_a_path_object_is_never_a_hub_id(hf_home):
    from moejax.model_dirs import resolve_model_dir

    with pytest.raises(FileNotFoundError, match="model directory 'org/absent' does not"):
        resolve_model_dir(Path("org/absent"))


def test_a_hub_scorer_scores_as_the_demo_and_is_named_by_its_id(hf_home, demo_scorer):
    """Same weights, same scores; served as the id, not as the snapshot's commit."""
    hub = run_offline(hf_home, SCORE, REPO, json.dumps(REQUEST))
    (expected,) = demo_scorer.score([REQUEST])
    assert hub["model_name"] == REPO and hub["error"] is None and expected.error is None
    assert hub["label"] == expected.label
    np.testing.assert_allclose(hub["logprobs"], expected.logprobs, rtol=1e-5, atol=1e-6)


def test_the_command_reports_an_uncached_id_as_a_bad_model(hf_home):
    done = subprocess.run([sys.executable, "-m", "serving.cli", "info", "--model",
                           "org/absent"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=offline_env(hf_home))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(
        "moejax: error: model 'org/absent': not a local directory, not in the Hugging Face "
        "cache")

"""Scorer and CLI over the execution backends: same results as resident, options,
deployment configs, calibration record."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moejax.backends import BackendError
from serving import Scorer, cli
from serving.options import load_options

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = [
    {"id": "a", "prompt": "Review: lovely food and kind staff.\nSentiment:",
     "candidates": [" positive", " negative"]},
    {"id": "b", "prompt": "Claim: 2 + 2 = 5. True or false?", "candidates": [" true", " false"],
     "normalize": "vocab"},
    {"id": "c", "kind": "choice", "prompt": "Which is a colour?", "candidates": ["red", "table"]},
    {"id": "d", "prompt": "A much longer prompt " * 12 + "Answer:", "candidates": [" yes", " no"]},
    {"id": "bad", "prompt": "", "candidates": [" yes", " no"]},
]


@pytest.fixture(scope="module")
def resident_results():
    return Scorer("demo", dtype="float32", max_batch_tokens=128).score(REQUESTS)


def _same(results, reference) -> None:
    for got, want in zip(results, reference):
        assert got.id == want.id and got.error == want.error
        if want.error is None:
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
            assert got.label == want.label


def test_async_ep_scorer_equals_resident(resident_results):
    scorer = Scorer("demo", dtype="float32", max_batch_tokens=128, backend="async_ep",
                    devices=4)
    _same(scorer.score(REQUESTS), resident_results)
    info = scorer.info
    assert info["backend"] == "async_ep" and info["devices"] == 4 and info["ranks"] == 4
    assert scorer.calibration.source == "measured" and info["theta_flops"] > 0
    assert info["memory"]["expert_weight_bytes"] < info["memory"]["expert_bytes_all_layers"] * 2


def test_deployment_file_then_keywords(resident_results):
    scorer = Scorer("demo", dtype="float32", max_batch_tokens=128,
                    deployment=ROOT / "serving/configs/deployments/offload.yaml", calibrate=False)
    assert scorer.engine.backend.name == "offload" and scorer.engine.backend.window == 2
    assert scorer.calibration.source == "fallback"
    _same(scorer.score(REQUESTS), resident_results)


def test_offload_with_the_prefix_cache_equals_resident(resident_results):
    scorer = Scorer("demo", dtype="float32", max_batch_tokens=128, backend="offload",
                    prefix_cache_blocks=64, calibrate=False)
    for _ in range(2):                 # the second call reads the prompts' cached blocks
        _same(scorer.score(REQUESTS), resident_results)
    assert scorer.engine.prefix_cache.hits > 0


def test_a_backend_without_a_prefix_pool_is_refused_by_name():
    with pytest.raises(BackendError, match="backend 'tp' cannot hold a prefix KV pool: its"):
        Scorer("demo", backend="tp", devices=2, prefix_cache_blocks=8, calibrate=False)


def test_every_deployment_file_is_valid():
    files = sorted((ROOT / "serving/configs/deployments").glob("*.yaml"))
    assert {f.stem for f in files} >= {"offload", "async_ep", "hybrid", "sync_ep", "tp"}
    for path in files:
        options = load_options({}, deployment=path)
        assert options.backend == path.stem
        assert load_options({}, deployment=path.stem) == options   # shipped: by name too


def test_backend_options_are_validated():
    with pytest.raises(ValueError, match="backend must be one of"):
        load_options({"backend": "nccl"})
    with pytest.raises(ValueError, match="devices must be a positive integer"):
        load_options({"devices": 0})
    with pytest.raises(ValueError, match="theta must be None or >= 0"):
        load_options({"theta": -1.0})
    with pytest.raises(FileNotFoundError, match="deployment config"):
        load_options({}, deployment="no/such.yaml")
    merged = load_options({"backend_options": {"window": 3}},
                          deployment=ROOT / "serving/configs/deployments/sync_ep.yaml")
    assert merged.backend_options == {"capacity_factor": 2.0, "window": 3}
    with pytest.raises(ValueError, match="asks for 64 devices"):
        Scorer("demo", backend="async_ep", devices=64)


def test_cli_backend_flags(tmp_path, capsys):
    requests = tmp_path / "in.jsonl"
    requests.write_text("\n".join(json.dumps(r) for r in REQUESTS[:2]) + "\n")
    out = tmp_path / "out.jsonl"
    rc = cli.main(["score", str(requests), "-o", str(out), "--dtype", "float32",
                   "--backend", "offload", "--window", "1", "--theta", "1e9"])
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == ["a", "b"] and all(r["error"] is None for r in lines)
    rc = cli.main(["score", str(requests), "--backend", "tp", "--devices", "3"])
    assert rc == 2 and "divisible" in capsys.readouterr().err


def test_configure_xla_asks_for_host_devices():
    from moejax import configure_xla

    overlap = "--xla_gpu_enable_latency_hiding_scheduler=true"
    env = {"XLA_FLAGS": "--foo=1"}
    added = configure_xla(host_devices=4, environ=env)
    assert added == [overlap, "--xla_force_host_platform_device_count=4"]
    assert env["XLA_FLAGS"] == f"--foo=1 {overlap} --xla_force_host_platform_device_count=4"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    configure_xla(host_devices=8, environ=env)          # the user's own setting wins
    assert env["XLA_FLAGS"] == f"--xla_force_host_platform_device_count=2 {overlap}"
    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    assert configure_xla(host_devices=1, environ=env) == []   # so does an explicit false
    assert env == {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}


@pytest.mark.parametrize("backend,devices", [("tp_ep", 2), ("dp_tp", 2), ("pp", 2)])
def test_the_papers_other_baselines_score_like_resident(resident_results, backend, devices):
    """TP+EP, DP+TP and PP+PP behind the Scorer: the same results as resident (the
    prompt-sharing pool is not theirs: share_prompts 'auto' runs without it)."""
    scorer = Scorer("demo", dtype="float32", max_batch_tokens=128, backend=backend,
                    devices=devices, calibrate=False)
    assert scorer.engine.backend.name == backend and scorer.engine.kv_store is None
    _same(scorer.score(REQUESTS), resident_results)

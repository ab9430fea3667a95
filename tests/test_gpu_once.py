"""benchmarks/gpu_once.py, the prepared device call, rehearsed on CPU: the order its steps
run in, the commands it gives each benchmark (parsed by that benchmark's own parser), and
what a run cut short by its budget leaves behind (every file valid JSON, the summary
naming each missing figure's reason)."""

from __future__ import annotations

import importlib
import json
import os
import sys

from benchmarks import gpu_once, gpu_summary

# The priority order: environment, resident MFU and breakdown, grouped GEMM,
# offload against resident, METRO, FP8, the 48-layer model.
PRIORITY = ("env", "breakdown_32k", "breakdown_131k", "gmm_qwen3", "gmm_mixtral", "offload",
            "metro", "fp8", "full_model")
RATE = 712.5          # a measured bf16 rate (TFLOP/s) the later steps must divide by


def step(name: str) -> gpu_once.Step:
    return next(s for s in gpu_once.STEPS if s.name == name)


def test_steps_run_in_priority_order_inside_eight_minutes():
    assert gpu_once.STEP_NAMES == PRIORITY
    assert gpu_once.DEFAULT_BUDGET_S <= 8 * 60
    assert [s.name for s in gpu_once.select_steps("metro,env")] == ["env", "metro"]


def test_every_device_command_parses_with_its_benchmark_and_uses_the_measured_rate(tmp_path):
    ctx = {"matmul_bf16_tflops": RATE}
    parsed = {}
    for s in gpu_once.STEPS:
        argv = s.argv(ctx, tmp_path, dry_run=False)
        assert argv[:3] == [sys.executable, "-m", s.module] and "--quick" not in argv
        if s.needs() is not None:           # fp8: no benchmark yet, so no parser to ask
            continue
        args = importlib.import_module(s.module).build_parser().parse_args(argv[3:])
        assert args.json_path == str(tmp_path / f"{s.name}.json")
        parsed[s.name] = args
    for name in ("breakdown_32k", "breakdown_131k", "offload", "full_model"):
        assert parsed[name].peak_tflops == RATE, name
    assert parsed["gmm_qwen3"].matmul_tflops == parsed["gmm_mixtral"].matmul_tflops == RATE
    assert (parsed["breakdown_32k"].tokens, parsed["breakdown_131k"].tokens) == (32768, 131072)
    assert (parsed["gmm_qwen3"].models, parsed["gmm_mixtral"].models) == ("qwen3", "mixtral")
    assert parsed["gmm_qwen3"].tokens == "16384" and not parsed["gmm_qwen3"].sweep_tiles
    assert parsed["offload"].backends == "resident,offload"
    assert parsed["offload"].batch_tokens == 131072
    assert parsed["metro"].timing and parsed["full_model"].tokens == "32768"
    # the rehearsal: the same flags at the quick sizes; without a rate, no rate flag
    quick = step("offload").argv({}, tmp_path, dry_run=True)
    assert "--quick" in quick and "--batch-tokens" not in quick and "--peak-tflops" not in quick
    assert "--backends" in quick


def test_a_run_cut_by_its_budget_keeps_valid_partial_output(tmp_path, monkeypatch):
    # A benchmark that never finishes, and never writes its JSON.
    (tmp_path / "hanging_bench.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    out = tmp_path / "out"
    out.mkdir()
    hanging = gpu_once.Step("hanging", "hanging_bench", 600, 0, gpu_once.no_flags)
    steps = [step("env"), hanging, step("metro"), step("fp8")]
    # 7 s of the budget are left after its 5 s reserve: the env step takes under 2 s here.
    record = gpu_once.run_steps(steps, out, budget_s=12, dry_run=True)

    assert json.loads((out / gpu_once.RECORD).read_text()) == json.loads(json.dumps(record))
    assert record["order"] == ["env", "hanging", "metro", "fp8"]
    status = {e["name"]: e for e in record["steps"]}
    assert status["env"]["status"] == "ok" and status["env"]["json"] == "env.json"
    assert status["hanging"]["status"] == "timed_out" and status["hanging"]["json"] is None
    assert status["hanging"]["seconds"] < 12
    assert status["metro"]["status"] == "skipped" and "left of the budget" in \
        status["metro"]["reason"]
    assert status["fp8"]["status"] == "skipped" and "FP8" in status["fp8"]["reason"]
    assert all(e["status"] in gpu_once.STATUSES for e in record["steps"])
    assert not (out / "hanging.json").exists() and not (out / "metro.json").exists()

    env = json.loads((out / "env.json").read_text())
    assert env["matmul_bf16_tflops"] > 0 and env["platform"] == "cpu"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["matmul_bf16_tflops"] == env["matmul_bf16_tflops"]
    assert summary["copy_tbps"] == env["copy_tbps"] > 0
    assert set(summary["missing"]) == set(gpu_summary.KEYS) - {"matmul_bf16_tflops", "copy_tbps"}
    assert all(isinstance(why, str) and why for why in summary["missing"].values())
    log = (out / gpu_once.LOG).read_text()
    assert "=== hanging: timed_out" in log and "measured bf16 matmul" in log


def test_without_a_gpu_the_device_run_stops_after_the_environment(tmp_path):
    record = gpu_once.main([str(tmp_path), "--only", "env,metro"])
    assert [e["name"] for e in record["steps"]] == ["env"]
    assert "no GPU" in record["aborted"] and "--dry-run" in record["aborted"]
    saved = json.loads((tmp_path / gpu_once.RECORD).read_text())
    assert saved["aborted"] == record["aborted"]
    assert json.loads((tmp_path / "summary.json").read_text())["matmul_bf16_tflops"] > 0

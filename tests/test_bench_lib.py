"""benchmarks.lib, the benchmarks' shared library: timing statistics against NumPy, the
compile counter on a real jit, trace attribution on a hand-made Chrome trace, the run
metadata, the common command line and the JSON every benchmark writes."""

from __future__ import annotations

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.lib import cli, compiles, meta, tables, timing, trace
from chrome_trace_events import meta as trace_meta, op as trace_op


# ----------------------------------------------------------------------------- timing
def test_median_and_percentile_match_numpy():
    rng = np.random.default_rng(0)
    values = list(rng.exponential(size=101))
    assert timing.median(values) == pytest.approx(float(np.median(values)))
    for q in (0, 50, 90, 99, 100):
        assert timing.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    evenly = list(range(1, 101))
    assert timing.percentile(evenly, 50) == pytest.approx(50.5)
    assert timing.percentile(evenly, 99) == pytest.approx(99.01)
    assert timing.percentile([4.0], 99) == 4.0
    assert math.isnan(timing.percentile([], 50)) and math.isnan(timing.median([]))


def test_sample_seconds_times_each_repeat_after_the_warm_up():
    calls = []
    seconds = timing.sample_seconds(lambda: calls.append(1), 4, label="noop", warmup=2)
    assert len(seconds) == 4 and len(calls) == 6 and all(s >= 0 for s in seconds)
    taken, result = timing.timed_call(lambda: 7, label=None)     # a warm-up: not counted
    assert result == 7 and taken >= 0


# ----------------------------------------------------------------------------- compiles
def test_counter_sees_a_compile_of_a_new_shape_and_none_for_a_cached_call():
    double = jax.jit(lambda x: 2 * x + 1)
    small, large = jnp.ones(3), jnp.ones(5)     # made before counting (they compile too)
    jax.block_until_ready(double(small))
    with compiles.counting() as cached:
        jax.block_until_ready(double(small))
    assert cached.count == 0
    with compiles.counting() as fresh:
        jax.block_until_ready(double(large))
    assert fresh.count == 1 and fresh.seconds > 0


def test_timed_passes_are_tallied_and_a_compiling_pass_is_flagged(capsys):
    triple = jax.jit(lambda x: 3 * x)
    x = jnp.arange(7.0)
    compiles.start_run()
    with compiles.timed_pass("cold"):
        jax.block_until_ready(triple(x))
    with compiles.timed_pass("warm"):
        jax.block_until_ready(triple(x))
    assert "WARNING: timed pass 'cold' compiled 1 program(s)" in capsys.readouterr().out
    figures = compiles.run_figures()
    assert figures == {"compiles_in_timed_passes": 1, "timed_passes": 2,
                       "compiles_in_timed_pass_cold": 1}
    compiles.start_run()
    assert compiles.run_figures()["timed_passes"] == 0


# ----------------------------------------------------------------------------- trace
def test_attribution_of_a_tiny_gpu_trace():
    """One GPU: compute 0-100 µs, an all-gather 50-150 µs (50 µs of it exposed), a marker
    and an "XLA Modules" span (neither is device work), a host thread (ignored)."""
    chrome = {"traceEvents": [
        trace_meta(1, "/device:GPU:0"), trace_meta(1, "Stream #7(Compute)", 7),
        trace_meta(1, "Stream #20(Communication)", 20), trace_meta(1, "XLA Modules", 99),
        trace_meta(2, "/host:CPU"), trace_meta(2, "python", 1),
        trace_op(1, 7, "fusion.3", 0, 100), trace_op(1, 20, "all-gather-start.1", 50, 100),
        trace_op(1, 7, "end: fusion.3", 100, 0), trace_op(1, 99, "jit_step(1)", 0, 200),
        trace_op(2, 1, "PjitFunction(step)", 0, 300)]}
    summary = trace.summarize_trace(chrome)
    assert summary.lanes == 1 and summary.device_lanes
    assert summary.compute_s == pytest.approx(100e-6)
    assert summary.transfer_s == pytest.approx(100e-6)
    assert summary.exposed_s == pytest.approx(50e-6)
    device_lanes, work = trace.device_work(chrome)
    assert device_lanes and sorted(ev["name"] for _, ev in work) == [
        "all-gather-start.1", "fusion.3"]
    shares = trace.split_time([(0.0, 4.0, "a"), (2.0, 6.0, "b")])
    assert shares == pytest.approx({"a": 3.0, "b": 3.0})     # 2-4 is split between both


# ----------------------------------------------------------------------------- tables
def test_print_table_aligns_and_writes_markdown(capsys):
    columns = [("name", -6, lambda r: r[0]), ("value", 7, lambda r: tables.fmt(r[1], ".2f"))]
    tables.print_table(columns, [("a", 1.0), ("bb", None)])
    assert capsys.readouterr().out.splitlines() == [
        "name    value", "-------------", "a        1.00", "bb          -"]
    tables.print_table(columns, [("a", 1.0)], markdown=True)
    assert capsys.readouterr().out.splitlines() == [
        "| name | value |", "| --- | ---: |", "| a | 1.00 |"]


# ----------------------------------------------------------------------------- meta, cli
def test_metadata_and_the_json_a_benchmark_writes(tmp_path):
    info = meta.run_metadata()
    for key in ("hostname", "machine", "cpu_count", "system", "python", "date_utc",
                "git_commit", "jax_version", "jaxlib_version", "jax_platform", "device_kind"):
        assert key in info, key
    assert info["jax_version"] == jax.__version__ and info["cpu_count"] == os.cpu_count()
    path = tmp_path / "out" / "figures.json"
    compiles.start_run()
    figures = meta.finish_run({"tokens_per_s": 12.5}, path)
    written = json.loads(path.read_text())
    assert written == figures     # what a benchmark's main returns is what it wrote
    assert written["tokens_per_s"] == 12.5 and written["compiles_in_timed_passes"] == 0
    assert written["meta_jax_version"] == jax.__version__
    assert all(not isinstance(v, (dict, list)) for v in written.values())     # flat


def test_common_command_line_and_the_host_device_flag(monkeypatch):
    parser = cli.bench_parser("A benchmark.\n\nMore.", quick_help="small", model="demo",
                              repeats=3, repeats_help="timed passes",
                              devices_help="devices")
    args = parser.parse_args(["--quick", "--json", "out.json", "--devices", "4"])
    assert (args.quick, args.json_path, args.model, args.repeats, args.devices) == (
        True, "out.json", "demo", 3, 4)
    assert parser.description == "A benchmark."
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_use_thunk_runtime=true")
    monkeypatch.setattr(cli, "jax_started", lambda: False)     # as before JAX starts
    cli.force_host_devices(8)
    assert os.environ["XLA_FLAGS"].split() == [
        "--xla_cpu_use_thunk_runtime=true", "--xla_force_host_platform_device_count=8"]
    cli.force_host_devices(2)             # a count already named is the user's: kept
    assert "--xla_force_host_platform_device_count=8" in os.environ["XLA_FLAGS"]

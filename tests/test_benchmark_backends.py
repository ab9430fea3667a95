"""The trace arithmetic of ``benchmarks/backends.py`` on hand-written Chrome traces
(a unit test of the parser, not a timing test), and one quick run of the benchmark."""

from __future__ import annotations

import json

import pytest

from benchmarks import backends as bench
from benchmarks.lib import trace as bench_trace
from chrome_trace_events import meta, op


def gpu_trace():
    """Device 0: compute 0–100 µs and 120–130 µs on the compute stream; an all-gather
    50–150 µs and a host copy 200–210 µs on other streams. Device 1: a transfer wholly
    under compute. Lines that only summarize (XLA Modules) and the host are ignored."""
    return {"traceEvents": [
        meta(1, "/device:GPU:0"), meta(1, "Stream #7(Compute)", 7),
        meta(1, "Stream #20(Communication)", 20), meta(1, "Stream #30(MemcpyH2D)", 30),
        meta(1, "XLA Modules", 99),
        meta(2, "/device:GPU:1"), meta(2, "Stream #7(Compute)", 7),
        meta(2, "Stream #20(Communication)", 20),
        meta(3, "/host:CPU"), meta(3, "python", 1),
        op(1, 7, "fusion.12", 0, 100),
        op(1, 7, "loop_add_fusion", 120, 10),
        op(1, 20, "ncclDevKernel_AllGather_RING_LL", 50, 100),
        op(1, 30, "MemcpyH2D", 200, 10),
        op(1, 99, "jit_step(1)", 0, 300),                 # whole-program span: skipped
        op(2, 7, "sm90_xmma_gemm_bf16bf16", 0, 100),
        op(2, 20, "all-gather-start.3", 10, 30),
        op(3, 1, "MemcpyH2D", 400, 50),                    # host plane on a GPU run: skipped
        {"ph": "i", "pid": 1, "tid": 7, "name": "marker", "ts": 5},
    ]}


def test_exposed_transfer_is_transfer_minus_its_overlap_with_compute():
    s = bench_trace.summarize_trace(gpu_trace())
    assert s.device_lanes and s.lanes == 2
    # device 0: transfers 50–150 ∪ 200–210 = 110 µs; compute 0–100 ∪ 120–130 = 110 µs;
    # overlap 50–100 and 120–130 = 60 µs -> exposed 50 µs. device 1: 30 µs all hidden.
    assert s.transfer_s == pytest.approx(140e-6, abs=1e-12)
    assert s.compute_s == pytest.approx(210e-6, abs=1e-12)
    assert s.exposed_s == pytest.approx(50e-6, abs=1e-12)
    assert set(s.names["transfer"]) == {"ncclDevKernel_AllGather_RING_LL", "MemcpyH2D",
                                        "all-gather-start"}
    assert "jit_step(1)" not in s.names["compute"]


def test_cpu_lanes_are_threads_and_host_copies_meet_any_compute():
    trace = {"traceEvents": [
        meta(9, "/host:CPU"), meta(9, "python", 1), meta(9, "tf_XLAPjRtCpuClient/1", 2),
        meta(9, "tf_XLAEigen/5", 3),
        op(9, 2, "ynn_fusion", 0, 40),
        op(9, 2, "all_gather.3", 40, 20),                 # synchronous: exposed on its thread
        op(9, 2, "end: all_gather.3", 60, 0),
        op(9, 2, "Rendezvous", 45, 10),
        op(9, 3, "dot_fusion", 50, 30),                   # other thread: does not hide it
        op(9, 1, "DevicePutWithSharding", 70, 20),        # host copy: hidden 70–80 by thread 3
        op(9, 1, "PjitFunction(step)", 0, 100),
    ]}
    s = bench_trace.summarize_trace(trace)
    assert not s.device_lanes and s.lanes == 3
    assert s.exposed_s == pytest.approx(20e-6 + 10e-6, abs=1e-12)
    assert s.transfer_s == pytest.approx(40e-6, abs=1e-12)
    assert s.compute_s == pytest.approx(70e-6, abs=1e-12)
    assert "all_gather" in s.names["transfer"] and "Rendezvous" in s.names["other"]


def test_interval_helpers():
    merged = bench_trace.merge([(5, 7), (0, 2), (1, 3), (7, 8), (9, 9)])
    assert merged == [(0, 3), (5, 8)]
    assert bench_trace.length(merged) == 6
    assert bench_trace.overlap(merged, [(2, 6), (7.5, 20)]) == pytest.approx(2.5)
    assert bench_trace.classify("all-reduce-start.1") == "transfer"
    assert bench_trace.classify("psum") == "transfer"
    assert bench_trace.classify("recv-done.2") == "transfer"
    assert bench_trace.classify("while.4") == "other"
    assert bench_trace.classify("end: all_gather.3") == "other"
    assert bench_trace.classify("transpose_copy_fusion") == "compute"


def test_quick_run_writes_the_json_keys(tmp_path):
    out = tmp_path / "backends.json"
    bench.main(["--quick", "--backends", "resident,offload,offload_waiting", "--json", str(out)])
    figures = json.loads(out.read_text())
    for name in ("resident", "offload", "offload_waiting"):
        for key in ("tokens_per_s", "mfu", "exposed_transfer_fraction", "over_resident",
                    "expert_bytes_per_device", "expert_saving", "theta_flops"):
            assert f"{name}_{key}" in figures
    assert figures["offload_expert_saving"] == pytest.approx(1.5)   # 3 layers, window 2
    # The streamed backends' split of exposed transfer adds up to the whole.
    assert (figures["offload_sync_lag"], figures["offload_waiting_sync_lag"]) == (1, 0)
    for name in ("offload", "offload_waiting"):
        parts = [figures[f"{name}_exposed_{part}_fraction"]
                 for part in ("first_layer", "between_layers", "other")]
        assert sum(parts) == pytest.approx(figures[f"{name}_exposed_transfer_fraction"])
        assert 0 < figures[f"{name}_device_idle_fraction"] < 1
    assert "resident_exposed_first_layer_fraction" not in figures
    assert figures["offload_lagged_over_waiting"] == pytest.approx(
        figures["offload_tokens_per_s"] / figures["offload_waiting_tokens_per_s"])
    assert {"platform", "peak_tflops", "devices", "tokens"} <= set(figures)

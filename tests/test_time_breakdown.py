"""benchmarks/time_breakdown.py: the stage attribution (pure functions on synthetic HLO
text and traces, with hand-computed shares) and one real CPU run of a tiny model."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from benchmarks import time_breakdown as tb
from benchmarks.lib import trace as bench_trace

HLO = """HloModule jit_forward, entry_computation_layout={()->f32[4]}

%fused_computation.1 (param_0: f32[4]) -> f32[4] {
  %param_0 = f32[4]{0} parameter(0)
  %multiply.2 = f32[4]{0} multiply(%param_0, %param_0), metadata={op_name="jit(forward)/while/body/route/mul"}
  ROOT %add.3 = f32[4]{0} add(%multiply.2, %param_0), metadata={op_name="jit(forward)/while/body/route/add"}
}

ENTRY %main.9 (Arg_0.1: f32[4]) -> f32[4] {
  %Arg_0.1 = f32[4]{0} parameter(0)
  %loop_fusion.4 = f32[4]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused_computation.1
  %dot.5 = f32[4]{0} multiply(%loop_fusion.4, %Arg_0.1), metadata={op_name="jit(forward)/while/body/attention/norm/mul"}
  %gemm.6 = f32[4]{0} custom-call(%dot.5), metadata={op_name="jit(forward)/while/body/experts/dot_general"}
  %while.7 = (s32[], f32[4]{0}) while(%tuple.1), condition=%cond, body=%body, metadata={op_name="jit(forward)/while"}
  ROOT %copy.8 = f32[4]{0} copy(%gemm.6)
}
"""


def test_scope_of_takes_the_innermost_stage_and_ignores_jitted_functions():
    assert tb.scope_of("jit(f)/while/body/attention/norm/mul") == "norm"
    assert tb.scope_of("jit(f)/transpose(jvp(experts))/dot_general") == "experts"
    assert tb.scope_of("jit(f)/attention/jit(norm)/sqrt") == "attention"
    assert tb.scope_of("jit(f)/while/body/closed_call/jit(dynamic_index_in_dim)") is None
    assert tb.scope_of(None) is None


def test_instruction_categories_from_hlo_text():
    table = tb.instruction_categories(HLO)
    assert tb.module_name(HLO) == "jit_forward"
    assert table["loop_fusion.4"] == "route"      # no metadata: its fused computation's scope
    assert table["loop_fusion_4"] == "route"      # the GPU kernel spelling
    assert table["dot.5"] == "norm"
    assert table["gemm.6"] == "experts"
    assert table["copy.8"] == "other"
    assert table["while.7"] == tb.CONTROL


def test_split_time_shares_overlaps_equally():
    split = bench_trace.split_time([(0.0, 4.0, "a"), (2.0, 6.0, "b"), (8.0, 10.0, "a"),
                           (9.0, 10.0, "a")])
    # a: [0,2) alone 2, [2,4) half 1, [8,10) alone 2 (a second 'a' adds nothing); b: 1 + 2
    assert split == pytest.approx({"a": 5.0, "b": 3.0})


def _event(start: float, end: float, category: str, attributed: bool = True) -> tb.OpEvent:
    return tb.OpEvent(lane=0, start=start, end=end, category=category, attributed=attributed)


def test_attribute_shares_of_wall_and_busy():
    events = [_event(0.0, 2.0, "attention"), _event(1.0, 3.0, "experts"),
              _event(5.0, 6.0, "norm"), _event(6.0, 10.0, "other", attributed=False)]
    result = tb.attribute(events)
    assert result.wall_s == pytest.approx(10.0)
    assert result.busy_s == pytest.approx(8.0)               # idle [3, 5)
    assert result.seconds["attention"] == pytest.approx(1.5)
    assert result.seconds["experts"] == pytest.approx(1.5)
    assert result.seconds["norm"] == pytest.approx(1.0)
    assert result.seconds["other"] == pytest.approx(4.0)
    assert result.unattributed_s == pytest.approx(4.0)
    figures = tb.breakdown_figures(result)
    assert figures["breakdown_attention_fraction"] == pytest.approx(0.15)
    assert figures["breakdown_attention_busy_fraction"] == pytest.approx(1.5 / 8)
    assert figures["breakdown_route_fraction"] == 0.0
    assert figures["breakdown_unattributed_fraction"] == pytest.approx(0.5)
    assert sum(figures[f"breakdown_{c}_fraction"] for c in tb.CATEGORIES) == pytest.approx(0.8)


def test_attribute_of_no_events_is_empty():
    result = tb.attribute([])
    assert result.wall_s == 0.0 and tb.breakdown_figures(result)["breakdown_norm_fraction"] == 0


def _meta(pid: int, tid: int | None, name: str) -> dict:
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def _x(pid: int, tid: int, ts: float, dur: float, name: str, **args) -> dict:
    return {"ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def test_op_events_of_a_cpu_trace():
    table = tb.instruction_categories(HLO)
    trace = {"traceEvents": [
        _meta(1, None, "/host:CPU"), _meta(1, 7, "tf_XLAEigen/1"), _meta(1, 8, "python"),
        _x(1, 7, 0, 10, "gemm.6", hlo_op="gemm.6", hlo_module="jit_forward"),
        _x(1, 7, 10, 1, "end: gemm.6"),
        _x(1, 7, 0, 40, "while.7", hlo_op="while.7", hlo_module="jit_forward"),
        _x(1, 7, 20, 5, "dot.5", hlo_op="dot.5", hlo_module="jit_forward"),
        _x(1, 7, 30, 5, "add.1", hlo_op="add.1", hlo_module="jit_other"),
        _x(1, 7, 30, 5, "ThunkExecutor::Execute"),
        _x(1, 8, 0, 50, "gemm.6", hlo_op="gemm.6", hlo_module="jit_forward")]}
    events = tb.op_events(trace, table, "jit_forward")
    assert [e.category for e in events] == ["experts", "norm"]
    assert [e.start for e in events] == pytest.approx([0.0, 2e-5])
    assert [e.end for e in events] == pytest.approx([1e-5, 2.5e-5])


def test_op_events_of_a_gpu_trace():
    table = tb.instruction_categories(HLO)
    trace = {"traceEvents": [
        _meta(2, None, "/device:GPU:0"), _meta(2, 1, "Stream #13(Compute)"),
        _meta(2, 2, "XLA Modules"), _meta(3, None, "/host:CPU"), _meta(3, 1, "python"),
        _x(2, 1, 0, 4, "loop_fusion_4"),                                  # kernel name
        _x(2, 1, 4, 4, "sm90_xmma_gemm_bf16", hlo_op="gemm.6", hlo_module="jit_forward"),
        _x(2, 1, 8, 2, "cutlass_kernel", long_name="%dot.5 = f32[4] multiply(...)"),
        _x(2, 1, 10, 2, "Memcpy DtoD"),
        _x(2, 2, 0, 12, "jit_forward"),                                   # a summary line
        _x(3, 1, 0, 12, "PjitFunction(forward)")]}
    events = tb.op_events(trace, table, "jit_forward")
    assert [(e.category, e.attributed) for e in events] == [
        ("route", True), ("experts", True), ("norm", True), ("other", False)]
    result = tb.attribute(events)
    assert result.wall_s == pytest.approx(12e-6)
    assert result.unattributed_s == pytest.approx(2e-6)


def test_named_scopes_reach_the_compiled_metadata():
    from benchmarks.lib import models
    import argparse

    cfg, dtype = models.model_shape(argparse.Namespace(quick=True, layers=2, dtype=None))
    host = models.make_workload(cfg, 1, 32, 128)[0]
    params = models.device_params(cfg, dtype, jax.devices()[0])
    hlo = tb.compile_forward(params, jax.device_put(host.batch), cfg, host.options).as_text()
    scopes = {tb.scope_of(ins.op_name) for ins in tb.parse_instructions(hlo).values()}
    assert set(tb.SCOPES) <= scopes


def test_real_cpu_run_covers_every_stage(tmp_path):
    path = tmp_path / "breakdown.json"
    figures = tb.main(["--quick", "--repeats", "1", "--json", str(path)])
    stored = json.loads(path.read_text())
    assert stored["breakdown_attention_fraction"] == figures["breakdown_attention_fraction"]
    for category in ("attention", "experts", "route", "permute", "norm", "lm_head", "other"):
        assert stored[f"breakdown_{category}_fraction"] > 0, category
    total = sum(stored[f"breakdown_{c}_fraction"] for c in tb.CATEGORIES)
    assert 0 < total <= 1 + 1e-6
    busy = sum(stored[f"breakdown_{c}_busy_fraction"] for c in tb.CATEGORIES)
    assert math.isclose(busy, 1.0, rel_tol=1e-6)
    assert stored["breakdown_tokens"] > 0 and stored["breakdown_wall_s"] > 0
    assert np.isfinite(stored["breakdown_mfu"])

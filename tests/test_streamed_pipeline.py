"""The streamed backends' lagged synchronization (``sync_lag``): the host dispatches the
next layer before it waits for the previous one. Same logits as waiting (``sync_lag=0``)
and as resident, the same window bound, recovery from a failure while a layer program is
still in flight; and the benchmark's split of exposed transfer on hand-written traces.

hybrid runs with ``sync_lag=0`` on CPU host devices (two collective programs in flight can
deadlock XLA:CPU); :class:`LaggedHybrid` lifts that for 2 devices so that its lagged path
runs here too: every program of a step reads the previous one's output, so the devices
run them in the same order and no two rendezvous interleave.

On CPU the lagged and waiting runs are compared bit for bit. On a GPU (the suite runs this
file there, where the copies have their own engine) the same program may sum in another
order from one run to the next (atomic adds), so there they agree to f32 tolerance; the
hybrid tests need two devices of the platform.
"""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest

from backend_fixtures import (CFG, F32_TOL, make_params, max_rel_err, run_backend,
                              small_workload)
from moejax.backends import BackendError, make_backend
from moejax.backends.streamed import HybridBackend
from moejax.core.scoring_engine import Engine
from test_recovery import POLICY, check_recovery, failing_on_call, failing_program, make_ops

from benchmarks import backends as bench
from benchmarks.lib import trace as bench_trace


ON_CPU = jax.default_backend() == "cpu"
needs_two_devices = pytest.mark.skipif(len(jax.devices()) < 2,
                                       reason="hybrid needs two devices of this platform")


class LaggedHybrid(HybridBackend):
    """hybrid whose layer loop runs lagged on CPU host devices too (see the docstring)."""

    @property
    def serialize_steps(self) -> bool:
        return False


@pytest.fixture(scope="module")
def work():
    return small_workload(shapes=1)


@pytest.fixture(autouse=True)
def no_dying_backends():
    """Collect the backends earlier tests left (jitted closures hold them in cycles):
    ``live_window_bytes`` leaves out the arrays alive when a backend was built by their
    ids, and an id freed later may come back as one of the new backend's arrays."""
    gc.collect()


def per_layer_bytes(backend) -> int:
    return backend.memory_report().expert_bytes_all_layers // CFG.num_layers


def assert_same_array(got, want) -> None:
    """Bit for bit on CPU; to f32 tolerance on a GPU (see the module docstring)."""
    if ON_CPU:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=F32_TOL, atol=F32_TOL)


def assert_identical(got: list, want: list) -> None:
    """Step readouts equal field by field."""
    for g, w in zip(got, want):
        assert_same_array(g.logits, w.logits)
        assert (g.lse is None) == (w.lse is None)
        if w.lse is not None:
            assert_same_array(g.lse, w.lse)


# ------------------------------------------------------------------ same logits, same bound
def run_offload_within_its_window(work, window: int, sync_lag: int) -> list[tuple]:
    """Two passes of offload (the window cycles on): its outputs, the window's bound held."""
    gc.collect()                     # (the previous backend: see no_dying_backends)
    backend = make_backend("offload", work.cfg, work.params, window=window,
                           sync_lag=sync_lag, track_memory=True)
    assert backend.sync_lag == sync_lag
    run_backend(backend, work.hosts)
    outputs = run_backend(backend, work.hosts)
    # Lagged or not, the device holds W layers of experts at most (live arrays).
    assert backend.peak_window_bytes == window * per_layer_bytes(backend)
    assert backend.memory_report().expert_weight_bytes == window * per_layer_bytes(backend)
    assert backend.live_window_bytes() == window * per_layer_bytes(backend)
    return outputs


def test_offload_lagged_equals_waiting_and_resident_within_its_window(work):
    outputs = {lag: run_offload_within_its_window(work, 3, lag) for lag in (0, 1, 2)}
    assert_identical(outputs[1], outputs[0])
    assert_identical(outputs[2], outputs[0])
    assert max_rel_err(outputs[1], work.reference, work.hosts) <= F32_TOL


def test_the_lag_is_capped_by_the_window_and_refused_when_negative(work):
    # A layer dispatched ahead needs its experts in the window already: lag <= W - 1.
    assert make_backend("offload", work.cfg, work.params, window=1).sync_lag == 0
    assert make_backend("offload", work.cfg, work.params, window=2, sync_lag=5).sync_lag == 1
    with pytest.raises(BackendError, match="sync_lag must be an integer >= 0"):
        make_backend("offload", work.cfg, work.params, sync_lag=-1)


@pytest.mark.skipif(not ON_CPU, reason="the CPU host devices' rule")
def test_hybrid_waits_for_each_layer_on_cpu_devices(work):
    backend = make_backend("hybrid", work.cfg, work.params, devices=2, window=2)
    assert backend.serialize_steps and backend.requested_sync_lag == 1
    assert backend.sync_lag == 0
    assert backend.memory_report().detail["gathered"] == 2 * per_layer_bytes(backend)


@needs_two_devices
def test_hybrid_lagged_equals_waiting_with_one_more_gathered_layer(work):
    lagged = LaggedHybrid(work.cfg, work.params, devices=2, window=2, track_memory=True)
    assert lagged.sync_lag == 1
    got = run_backend(lagged, work.hosts)
    # W shard-layers and three gathered layers: the one a program runs, the one it
    # gathers, and the one of the program the host has not yet seen finish. (Measured
    # before another backend makes arrays of the same shapes.)
    report = lagged.memory_report()
    shards = report.detail["window"]
    assert shards == 2 * per_layer_bytes(lagged) // 2
    assert report.detail["gathered"] == 3 * per_layer_bytes(lagged)
    assert lagged.peak_window_bytes == shards + 3 * per_layer_bytes(lagged)
    assert lagged.live_window_bytes() == shards               # the step left nothing else
    waiting = make_backend("hybrid", work.cfg, work.params, devices=2, window=2)
    assert_identical(got, run_backend(waiting, work.hosts))
    assert max_rel_err(got, work.reference, work.hosts) <= F32_TOL


def test_offload_lagged_with_the_prefix_pool_equals_waiting():
    """The pool is donated from layer program to layer program, now while the host is a
    layer behind. (Lagged offload against resident with the pool: test_prefix_cache.)"""
    params = make_params()
    prompt = np.random.default_rng(5).integers(2, CFG.vocab_size, 34).astype(np.int32)
    ops = make_ops(count=3, prompt=prompt)
    results = {}
    for sync_lag in (0, 1):
        engine = Engine(CFG, make_backend("offload", CFG, params, sync_lag=sync_lag),
                        policy=POLICY, prefix_cache_blocks=16)
        # The first run stores the prompt's blocks (its siblings share them), the
        # second reads them from the pool.
        results[sync_lag] = [engine.run(ops), engine.run(ops)]
        assert engine.stats.prefix_tokens_shared > 0 and engine.prefix_cache.hits > 0
    for lagged, waiting in zip(results[1], results[0]):
        assert lagged.keys() == waiting.keys()
        for key in waiting:
            for got, want in zip(lagged[key].logits, waiting[key].logits):
                assert_same_array(got, want)


# ------------------------------------------------------------------ failures mid-step
def test_offload_lagged_recovers_when_a_layer_fails_with_the_previous_in_flight(monkeypatch):
    backend = make_backend("offload", CFG, make_params(),
                           window=2, sync_lag=1)
    engine = Engine(CFG, backend, policy=POLICY)
    # L-1 layer programs a step: call L+1 is the second step's layer 1, dispatched while
    # its layer 0 is still unwaited.
    n = CFG.num_layers - 1 + 2
    check_recovery(engine, make_ops(), lambda patch: patch.setattr(
        backend, "_program", failing_program(backend, "layer", n)), monkeypatch)
    assert backend.live_window_bytes() == backend.memory_report().detail["window"]


def test_offload_lagged_recovers_when_a_wait_fails(monkeypatch):
    """A program's failure surfaces where the host waits for it: here the second step's
    wait for layer 0, with layer 1 dispatched and running."""
    backend = make_backend("offload", CFG, make_params(),
                           window=2, sync_lag=1)
    engine = Engine(CFG, backend, policy=POLICY)
    engine.run(make_ops())                    # compiles (the engine then waits per shape)
    # The waits of a step: layer 0 (after layer 1 is dispatched), layer 1 and the last.
    waits = CFG.num_layers
    check_recovery(engine, make_ops(), lambda patch: patch.setattr(
        jax, "block_until_ready", failing_on_call(jax.block_until_ready, waits + 1)),
        monkeypatch)
    assert backend.live_window_bytes() == backend.memory_report().detail["window"]


@needs_two_devices
def test_hybrid_lagged_recovers_from_a_failed_layer_program(monkeypatch):
    backend = LaggedHybrid(CFG, make_params(), devices=2,
                           window=2)
    engine = Engine(CFG, backend, policy=POLICY)
    n = CFG.num_layers - 1 + 2         # the second step's layer 1, its layer 0 in flight
    check_recovery(engine, make_ops(), lambda patch: patch.setattr(
        backend, "_program", failing_program(backend, "layer", n)), monkeypatch)
    assert backend.live_window_bytes() == backend.memory_report().detail["window"]


# ------------------------------------------------------------------ the benchmark's split
def meta(pid, name, tid=None):
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def op(pid, tid, name, ts, dur, **args):
    event = {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
    if args:
        event["args"] = args
    return event


def gpu_trace():
    """One GPU, two steps of offload (µs). Programs on the XLA Modules line: embed
    10–20, layer 30–100, layer 110–180, last 200–260, an output slice 270–275, then
    embed 300–310, layer 320–390. Kernels cover the programs, except 150–160 inside the
    second layer. Copies: 0–25, 95–130, 150–160, 180–205, 255–300, 340–350 and
    400–410."""
    modules = [("jit_streamed_embed(1)", 10, 10), ("jit_streamed_layer(2)", 30, 70),
               ("jit_streamed_layer(2)", 110, 70), ("jit_streamed_last(3)", 200, 60),
               ("jit_squeeze(4)", 270, 5), ("jit_streamed_embed(1)", 300, 10),
               ("jit_streamed_layer(2)", 320, 70)]
    kernels = [(10, 10), (30, 70), (110, 40), (160, 20), (200, 60), (270, 5), (300, 10),
               (320, 70)]
    copies = [(0, 25), (95, 35), (150, 10), (180, 25), (255, 45), (340, 10), (400, 10)]
    return {"traceEvents": [
        meta(1, "/device:GPU:0"), meta(1, "Stream #7(Compute)", 7),
        meta(1, "Stream #30(MemcpyH2D)", 30), meta(1, "XLA Modules", 99),
        *(op(1, 99, name, ts, dur) for name, ts, dur in modules),
        *(op(1, 7, f"fusion.{i}", ts, dur) for i, (ts, dur) in enumerate(kernels)),
        *(op(1, 30, "MemcpyH2D", ts, dur) for ts, dur in copies)]}


def test_gpu_split_of_exposed_transfer_by_where_it_falls():
    summary = bench_trace.summarize_trace(gpu_trace())
    # Exposed: 0–10, 20–25 (before the first layer: step start, 15); 100–110 and
    # 180–200 (waits between layers, 30); 150–160 (inside a layer) and 400–410 (after
    # the last program), other 20; 260–270 and 275–300 (after a step's last program,
    # before the next step's: step start, 35).
    assert summary.exposed_s == pytest.approx(100e-6, abs=1e-12)
    split = bench_trace.split_exposed(summary)
    assert split.step_start_s == pytest.approx(50e-6, abs=1e-12)
    assert split.between_layers_s == pytest.approx(30e-6, abs=1e-12)
    assert split.other_s == pytest.approx(20e-6, abs=1e-12)
    # Idle between programs: 20–30, 100–110, 180–200, 260–270, 275–300, 310–320 (the
    # 0–10 before the first program is not between programs); between layers: 30.
    assert split.idle_s == pytest.approx(85e-6, abs=1e-12)
    assert split.idle_between_layers_s == pytest.approx(30e-6, abs=1e-12)
    figures = bench.split_figures("offload", split, wall_devices_s=500e-6, sync_lag=1)
    assert figures == pytest.approx({
        "offload_sync_lag": 1, "offload_exposed_first_layer_fraction": 0.10,
        "offload_exposed_between_layers_fraction": 0.06,
        "offload_exposed_other_fraction": 0.04, "offload_device_idle_fraction": 0.17,
        "offload_idle_between_layers_fraction": 0.06})


def test_cpu_split_reads_programs_from_their_ops_run_ids():
    """CPU: a program is the ops sharing a run_id (embed 0–5; layer 10–20 and 25–40;
    layer 50–70; last 75–90); copies on the Python thread 5–8, 20–25, 40–52."""
    def kernel(module, run, ts, dur):
        return op(9, 2, "ynn_fusion", ts, dur, hlo_module=module, run_id=str(run))

    trace = {"traceEvents": [
        meta(9, "/host:CPU"), meta(9, "python", 1), meta(9, "tf_XLAPjRtCpuClient/1", 2),
        kernel("jit_streamed_embed", 1, 0, 5), kernel("jit_streamed_layer", 2, 10, 10),
        kernel("jit_streamed_layer", 2, 25, 15), kernel("jit_streamed_layer", 3, 50, 20),
        kernel("jit_streamed_last", 4, 75, 15),
        op(9, 1, "DevicePutWithSharding", 5, 3), op(9, 1, "DevicePutWithSharding", 20, 5),
        op(9, 1, "DevicePutWithSharding", 40, 12)]}
    summary = bench_trace.summarize_trace(trace)
    programs = summary.programs[bench_trace.CPU_TIMELINE]
    assert [p.kind for p in programs] == ["embed", "layer", "layer", "last"]
    assert [t for p in programs for t in (p.start, p.end)] == pytest.approx(
        [0.0, 5e-6, 10e-6, 40e-6, 50e-6, 70e-6, 75e-6, 90e-6], abs=1e-12)
    split = bench_trace.split_exposed(summary)
    # 5–8: before the first layer; 20–25: inside the first layer's program; 40–50:
    # between the layers (50–52 runs beside the second layer's kernel).
    assert summary.exposed_s == pytest.approx(18e-6, abs=1e-12)
    assert split.step_start_s == pytest.approx(3e-6, abs=1e-12)
    assert split.between_layers_s == pytest.approx(10e-6, abs=1e-12)
    assert split.other_s == pytest.approx(5e-6, abs=1e-12)
    assert split.idle_s == pytest.approx(20e-6, abs=1e-12)         # 5–10, 40–50, 70–75
    assert split.idle_between_layers_s == pytest.approx(15e-6, abs=1e-12)  # 40–50, 70–75


def test_split_helpers():
    assert bench_trace.subtract([(0, 10), (20, 30)], [(2, 3), (5, 22), (29, 40)]) == [
        (0, 2), (3, 5), (22, 29)]
    assert bench_trace.subtract([(0, 5)], []) == [(0, 5)]
    assert bench_trace.program_kind("jit_streamed_layer(17)") == "layer"
    assert bench_trace.program_kind("jit_squeeze") == "other"
    assert bench_trace.gap_label("layer", "last") == bench_trace.BETWEEN_LAYERS
    assert bench_trace.gap_label("last", "embed") == bench_trace.STEP_START
    assert bench_trace.gap_label("gather", "layer") == bench_trace.STEP_START
    assert bench_trace.gap_label("last", None) is None
    assert bench_trace.split_exposed(bench_trace.summarize_trace({"traceEvents": []})) is None
    assert bench.base_backend("offload_waiting") == "offload"
    assert bench.base_backend("resident_waiting") == "resident_waiting"

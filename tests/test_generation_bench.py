"""``benchmarks/generation_serving.py``: its workload builder, metrics and replay drivers on
hand-made inputs (deterministic checks, nothing timed), and one short end-to-end run."""

from __future__ import annotations

import json
import math
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import generation_serving as bench  # noqa: E402
from benchmarks.generation_serving import Timing  # noqa: E402


# ----------------------------------------------------------------------------- workload
def test_workload_is_seeded_and_within_its_ranges():
    trace = bench.build_workload(300, seed=7, prompt_min=16, prompt_max=512, max_new=128,
                                 vocab=1024)
    assert trace == bench.build_workload(300, seed=7, prompt_min=16, prompt_max=512,
                                         max_new=128, vocab=1024)
    assert trace != bench.build_workload(300, seed=8, prompt_min=16, prompt_max=512,
                                         max_new=128, vocab=1024)
    assert [r.index for r in trace] == list(range(300))
    lengths = [len(r.prompt_token_ids) for r in trace]
    assert min(lengths) >= 16 and max(lengths) <= 512
    assert all(3 <= t < 1024 for r in trace for t in r.prompt_token_ids)
    news = [r.max_new_tokens for r in trace]
    assert min(news) >= 1 and max(news) <= 128
    request = trace[5].as_request()
    assert request == {"id": 5, "prompt_token_ids": trace[5].prompt_token_ids,
                       "max_new_tokens": trace[5].max_new_tokens, "stop_token_ids": []}


def test_poisson_arrivals_increase_from_zero_with_unit_mean_gap():
    arrivals = bench.poisson_unit_arrivals(np.random.default_rng(0), 20_000)
    assert arrivals[0] == 0.0
    gaps = np.diff(arrivals)
    assert (gaps > 0).all()
    assert abs(gaps.mean() - 1.0) < 0.03            # rate 1: mean gap 1 s
    assert abs(gaps.std() - 1.0) < 0.05             # exponential: std = mean
    # In the trace, the arrival at rate r is unit_arrival / r.
    trace = bench.build_workload(2000, seed=3, prompt_min=16, prompt_max=32, max_new=8)
    unit = np.array([r.unit_arrival for r in trace])
    assert (np.diff(unit) > 0).all() and unit[0] == 0.0
    assert abs(np.diff(unit / 50.0).mean() - 1 / 50.0) < 0.002


def test_max_new_tokens_are_log_uniform():
    draws = bench.long_tailed_max_new(np.random.default_rng(1), 50_000, 128)
    assert draws.min() == 1 and draws.max() == 128
    # P(k) = ln((k+1)/k) / ln(129): P(1) ≈ 0.143, P(k <= 11) = ln(12)/ln(129) ≈ 0.511.
    assert abs((draws == 1).mean() - math.log(2) / math.log(129)) < 0.01
    assert abs((draws <= 11).mean() - math.log(12) / math.log(129)) < 0.01
    assert abs(draws.mean() - sum(k * math.log((k + 1) / k) for k in range(1, 129))
               / math.log(129)) < 0.6
    # The largest value is reachable and a one-token cap gives only ones.
    assert (bench.long_tailed_max_new(np.random.default_rng(2), 100, 1) == 1).all()


def test_fresh_tokens_keep_the_shape_of_the_trace():
    trace = bench.build_workload(20, seed=0, prompt_min=16, prompt_max=64, max_new=16)
    warm = bench.fresh_tokens(trace, seed=99, vocab=1024)
    for a, b in zip(trace, warm):
        assert (len(a.prompt_token_ids), a.max_new_tokens, a.unit_arrival) == \
            (len(b.prompt_token_ids), b.max_new_tokens, b.unit_arrival)
        assert a.prompt_token_ids != b.prompt_token_ids


# ----------------------------------------------------------------------------- metrics
def test_timing_metrics_and_throughput_formula():
    # Arrivals at 10, 11, 12; one request of one token, one of 5, one of 3.
    a = Timing(arrival=10.0)
    a.got(1, 10.5)
    b = Timing(arrival=11.0)
    for now in (11.2, 11.3, 11.4, 11.5, 11.6):
        b.got(1, now)
    c = Timing(arrival=12.0)
    c.got(2, 12.4)      # two tokens in one delivery, then one more
    c.got(1, 13.0)
    assert (b.first, b.last, b.tokens, b.events) == (11.2, 11.6, 5, 5)
    c.got(0, 99.0)      # an empty delivery changes nothing
    assert (c.first, c.last, c.tokens, c.events) == (12.4, 13.0, 3, 2)
    timings = [a, b, c]
    assert bench.ttfts(timings) == pytest.approx([0.5, 0.2, 0.4])
    # TPOT: (last - first) / (tokens - 1), only for >= 2 tokens: b 0.4/4, c 0.6/2.
    assert bench.tpots(timings) == pytest.approx([0.1, 0.3])
    # 9 tokens from the first arrival (10) to the last token (13).
    assert bench.throughput(timings) == pytest.approx(9 / 3.0)
    summary = bench.summarize(timings)
    assert summary["tokens_per_s"] == pytest.approx(3.0)
    assert summary["output_tokens"] == 9 and summary["seconds"] == pytest.approx(3.0)
    assert summary["ttft_p50_ms"] == pytest.approx(400.0)
    # p99 of 3 sorted values sits at position 0.99 · 2 = 1.98: 0.4 + 0.98 · 0.1.
    assert summary["ttft_p99_ms"] == pytest.approx(1000 * (0.4 + 0.98 * 0.1))
    assert summary["tpot_p50_ms"] == pytest.approx(200.0)
    assert summary["tpot_p99_ms"] == pytest.approx(1000 * (0.1 + 0.99 * 0.2))


def test_tokens_delivered_at_once_have_no_tpot():
    t = Timing(arrival=0.0)
    t.got(8, 2.0)               # a whole batch's tokens at its return
    assert bench.tpots([t]) == [] and bench.ttfts([t]) == [2.0]
    assert math.isnan(bench.summarize([t])["tpot_p50_ms"])


def test_ratio_needs_both_figures():
    figures = {"a": 6.0, "b": 2.0, "c": float("nan"), "z": 0.0}
    assert bench.ratio(figures, "a", "b") == 3.0
    assert bench.ratio(figures, "a", "missing") is None
    assert bench.ratio(figures, "a", "c") is None
    assert bench.ratio(figures, "a", "z") is None


def test_report_ratios_names_the_issue_keys():
    figures = {"continuous_tokens_per_s": 900.0, "static_tokens_per_s": 300.0,
               "transformers_padded_tokens_per_s": 100.0,
               "transformers_continuous_tokens_per_s": 150.0,
               "fused_tpot_p50_ms": 4.0, "layerwise_tpot_p50_ms": 5.0,
               "continuous_tpot_p50_ms": 4.0, "offload_tpot_p50_ms": 8.0}
    bench.report_ratios(figures)
    assert figures["continuous_over_static_throughput"] == pytest.approx(3.0)
    assert figures["continuous_over_transformers_throughput"] == pytest.approx(6.0)  # faster
    assert figures["continuous_over_transformers_padded_throughput"] == pytest.approx(9.0)
    assert figures["layerwise_over_fused_tpot"] == pytest.approx(1.25)
    assert figures["offload_over_resident_tpot"] == pytest.approx(2.0)
    partial = {"static_tokens_per_s": 1.0}
    bench.report_ratios(partial)
    assert partial == {"static_tokens_per_s": 1.0}


# ----------------------------------------------------------------------------- replay drivers
def _trace(n: int = 10):
    return bench.build_workload(n, seed=5, prompt_min=16, prompt_max=32, max_new=6)


def test_replay_batches_serves_arrived_requests_in_order_up_to_the_batch_size():
    trace = _trace(10)
    batches: list[list[int]] = []

    def serve(batch):
        batches.append([r.index for r in batch])
        out = []
        for r in batch:
            t = Timing(arrival=0.0)
            for _ in range(r.max_new_tokens):
                t.got(1, bench.time.perf_counter())
            out.append(t)
        return out

    timings = bench.replay_batches(serve, trace, rate=1e6, max_batch=4)
    assert [i for b in batches for i in b] == list(range(10))
    assert all(1 <= len(b) <= 4 for b in batches)
    assert [t.tokens for t in timings] == [r.max_new_tokens for r in trace]
    assert all(t.done and t.first >= t.arrival for t in timings)
    arrivals = [t.arrival for t in timings]
    assert arrivals == sorted(arrivals)
    bench.check_counts(trace, timings, "fake")


class _FakeLoop:
    """A stand-in for moejax.core.continuous.GenerationLoop: each submitted request's tokens
    come one per event from a worker thread, the last event carrying the result."""

    class Event:
        def __init__(self, index, token_ids, result):
            self.index, self.token_ids, self.result = index, token_ids, result

    class Result:
        def __init__(self, token_ids, error=None):
            self.token_ids, self.error = token_ids, error

    class Handle:
        cancelled = False

        def cancel(self):
            self.cancelled = True

    def __init__(self, short_by: int = 0):
        self.short_by = short_by
        self.threads: list[threading.Thread] = []
        self.closed = False

    def submit(self, request, on_event):
        def run():
            n = request["max_new_tokens"] - self.short_by
            for k in range(n):
                last = k == n - 1
                on_event(self.Event(0, [7], self.Result([7] * n) if last else None))

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)
        return self.Handle()

    def close(self):
        for thread in self.threads:
            thread.join()
        self.closed = True


def test_replay_loop_records_every_event():
    trace = _trace(8)
    loop = _FakeLoop()
    timings = bench.replay_loop(loop, trace, rate=1e6, timeout=30)
    loop.close()
    assert [t.tokens for t in timings] == [r.max_new_tokens for r in trace]
    assert [t.events for t in timings] == [r.max_new_tokens for r in trace]
    assert all(t.done and t.error is None and t.arrival <= t.first <= t.last for t in timings)
    bench.check_counts(trace, timings, "fake")
    short = bench.replay_loop(_FakeLoop(short_by=1), [r for r in trace if r.max_new_tokens > 1],
                              rate=1e6, timeout=30)
    with pytest.raises(RuntimeError, match="asked for exactly"):
        bench.check_counts([r for r in trace if r.max_new_tokens > 1], short, "fake")


def test_unknown_config_is_refused():
    with pytest.raises(SystemExit):
        bench.parse_args(["--configs", "static,nonsense"])
    assert bench.parse_args(["--configs", "static, transformers_padded"]).configs == \
        ["static", "transformers_padded"]


# ----------------------------------------------------------------------------- end to end
def test_quick_run_writes_the_figures(tmp_path):
    """A few requests through moejax static batching and transformers' padded generate
    (a fixed rate: no calibration); keys present and positive. Nothing is timed."""
    out = tmp_path / "figures.json"
    figures = bench.main(["--quick", "--requests", "6", "--rate", "1000", "--configs",
                          "static,transformers_padded", "--torch-threads", "1",
                          "--warmup-passes", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == figures
    assert figures["requests"] == 6 and figures["rate"] == 1000 and figures["seed"] == 0
    total = figures["output_tokens"]
    for config in ("static", "transformers_padded"):
        assert figures[f"{config}_output_tokens"] == total
        for key in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "seconds"):
            assert figures[f"{config}_{key}"] > 0
    for key in ("tpot_p50_ms", "tpot_p99_ms"):
        assert figures[f"transformers_padded_{key}"] > 0
    assert figures["static_compiles_in_replay"] >= 0
    assert figures["skipped_configs"] == ""
    for key in ("machine", "date", "command", "versions"):
        assert figures[key]

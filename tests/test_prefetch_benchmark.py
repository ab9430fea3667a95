"""The pieces of ``benchmarks/expert_prefetch.py`` its figures rest on: the modelled
H100 TPOT (the seed's Eq. 1 overlap, by hand), the H100 compute per layer read from the
committed cost file, the cue-cut task accuracy and the token agreement."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import expert_prefetch as bench
from moejax.asyncmoe import costs
from moejax.model_shape import QWEN3_30B_A3B


def test_modelled_tpot_by_hand():
    # top-8 of 128 experts
    copy = 8 * 9_437_184 * costs.H100_H2D_SECONDS_PER_QWEN3_LAYER / 1_207_959_552
    recall = {kind: np.array([1.0, 0.5, 0.75]) for kind in bench.COMPUTED}
    recall["oracle"] = np.ones(3)
    for compute in (0.2 * copy, 3.0 * copy):     # copy-bound, then compute-bound
        got = bench.modelled_tpot(recall, 3, compute)
        spill = max(0.0, copy - compute)
        ondemand = 3 * (compute + copy)
        speculative = compute + copy + 2 * (compute + spill)
        exact = speculative + (0.5 + 0.25) * copy
        assert got["ondemand"] == pytest.approx(1000 * ondemand)
        assert got["speculative_quasi"] == pytest.approx(1000 * speculative)
        assert got["oracle"] == pytest.approx(1000 * speculative)
        assert got["exact_estimator"] == pytest.approx(1000 * exact)
        assert got["copy_ms_per_layer"] == pytest.approx(1000 * copy)
    # Copy-bound: the overlap hides compute's worth of each later layer's copy.
    assert got["speculative_quasi"] < got["ondemand"]


def test_h100_compute_per_layer_reads_the_cost_file(tmp_path):
    fit = json.loads(bench.GPU_COST.read_text())["by_batch"]["8"]
    assert bench.h100_compute_per_layer(bench.GPU_COST, "expert") == pytest.approx(
        QWEN3_30B_A3B.top_k * fit["a_s"])
    assert bench.h100_compute_per_layer(bench.GPU_COST, "layer") == pytest.approx(
        QWEN3_30B_A3B.top_k * fit["a_s"] + fit["t0_s"])


class _Tokenizer:
    def decode(self, ids):
        return "".join(f" w{i}" for i in ids)


class _Item:
    def __init__(self, answer):
        self.answer = answer


def test_accuracy_needs_the_cue_then_the_answer():
    tok = _Tokenizer()
    items = [_Item(" w5"), _Item(" w5"), _Item(" w7"), _Item(" w7")]
    cues = [[1, 2]] * 4
    tokens = [[1, 2, 5, 9], [1, 3, 5], [1, 2, 7], [1, 2, 8]]
    assert bench.accuracy(tokens, items, cues, tok) == 0.5
    assert bench.accuracy([[5], [7]], items[:2], [[], []], tok) == 0.5
    assert bench.agreement([[1, 2, 3], [4, 5]], [[1, 0, 3], [4, 5]]) == pytest.approx(
        (2 / 3 + 1) / 2)
    assert bench.common_prefix([[1, 2, 3], [4, 5], [7]], [[1, 0, 3], [4, 5], [8]]) == \
        pytest.approx((1 + 2 + 0) / 3)

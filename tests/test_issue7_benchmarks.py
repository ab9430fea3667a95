"""The pure functions of benchmarks/reformulation_accuracy.py and
benchmarks/expert_specialization.py on hand-made inputs, and one quick end-to-end run of
each on a tiny untrained model."""

from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest

from benchmarks import expert_specialization as es
from benchmarks.lib import reference_traces as expert_traces
from benchmarks import reformulation_accuracy as ra
from serving.requests import NormalizeOptions, OpKey, PrefillOp, normalize_requests


# ------------------------------------------------------------------- reformulation_accuracy
def test_first_word():
    assert ra.first_word("  yes\nno") == "yes"
    assert ra.first_word(" B.") == "B"
    assert ra.first_word(" 56\n7 *") == "56"
    assert ra.first_word(" \n ") == ""


def test_parse_answer():
    assert ra.parse_answer(" yes", [" yes", " no"]) == 0
    assert ra.parse_answer(" No.\nmore", [" yes", " no"]) == 1
    assert ra.parse_answer(" maybe", [" yes", " no"]) is None
    assert ra.parse_answer("", [" yes", " no"]) is None
    # a product: the generated number must be one of the candidates
    assert ra.parse_answer(" 56\n7 * 8", [" 48", " 56", " 63"]) == 1
    assert ra.parse_answer(" 55", [" 48", " 56", " 63"]) is None
    # choice: identifiers first, then an option's own text
    labels, options = ["A", "B", "C", "D"], ["19", "21", "23", "24"]
    assert ra.parse_answer(" c", labels, options) == 2
    assert ra.parse_answer(" 21", labels, options) == 1
    assert ra.parse_answer(" 22", labels, options) is None
    # an ambiguous word is unparsed
    assert ra.parse_answer(" x", ["x", "X"]) is None


def test_generated_answer():
    assert ra.generated_answer("classify", [2]) == 2
    assert ra.generated_answer("choice", [None]) is None
    assert ra.generated_answer("multi", [0, 1, 0, 1]) == (0, 2)
    assert ra.generated_answer("multi", [1, 1]) == ()
    assert ra.generated_answer("multi", [0, None]) is None
    with pytest.raises(ValueError):
        ra.generated_answer("classify", [0, 1])


def test_accuracy_figures():
    expected = [0, 1, 1, (0, 2)]
    prefill = [0, 1, 0, (0, 2)]
    generated = [0, None, 0, (2,)]
    f = ra.accuracy_figures(expected, prefill, generated)
    assert f["accuracy_prefill"] == 0.75
    assert f["accuracy_generate"] == 0.25
    assert f["agreement"] == 0.5          # items 0 and 2 agree; unparsed item 1 does not
    assert f["unparsed"] == 0.25
    assert f["majority"] == 0.5           # label 1 is expected twice
    assert f["items"] == 4
    with pytest.raises(ValueError):
        ra.accuracy_figures([0], [0, 1], [0])


class WordTokenizer:
    """Each word with its leading space is one token (ids assigned on first sight)."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        return [self.vocab.setdefault(piece, len(self.vocab))
                for piece in re.findall(r"\s*\S+|\s+", text)]


def test_generation_prompts_are_what_the_scorer_reads_after():
    tok = WordTokenizer()
    opts = NormalizeOptions()
    requests = [
        {"prompt": "Is 1 + 1 = 2? Answer:", "candidates": [" yes", " no"]},
        {"prompt": "2 * 3 =", "candidates": [" 6 x", " 5 y"]},          # multi-token
        {"kind": "choice", "prompt": "What is 1 + 2?", "candidates": ["3", "4"]},
        {"kind": "multi", "prompt": "Text: a = 1", "candidates": ["code", "math"]},
    ]
    ops, errors, _ = normalize_requests(requests, tok, vocab_size=1000, max_context=512,
                                        options=opts)
    assert not errors
    prompts = ra.generation_prompts(ops)
    enc = lambda text: tuple(tok.encode(text))
    assert prompts[0] == [enc("Is 1 + 1 = 2? Answer:")]
    assert prompts[1] == [enc("2 * 3 =")]                  # one prompt for both candidates
    assert prompts[2] == [enc("What is 1 + 2?\nA. 3\nB. 4\nAnswer:")]
    assert prompts[3] == [enc("Text: a = 1") + enc("\nCandidate: code\nRelevant (yes/no):"),
                          enc("Text: a = 1") + enc("\nCandidate: math\nRelevant (yes/no):")]
    assert ra.answer_table(requests[2], opts) == (["A", "B"], ["3", "4"])
    assert ra.answer_table(requests[3], opts) == ([" yes", " no"], [])
    assert ra.answer_table(requests[0], opts) == ([" yes", " no"], [])


def test_generation_prompts_on_hand_made_ops():
    ops = [PrefillOp(OpKey(0, -1), (5, 6, 7), (2,), ((1, 2),), False, prefix_len=3),
           PrefillOp(OpKey(1, 0), (5, 6, 9, 4), (1, 2, 3), ((9,), (4,), (3,)), True, prefix_len=2),
           PrefillOp(OpKey(1, 1), (5, 6, 8), (1, 2), ((8,), (2,)), True, prefix_len=2)]
    assert ra.generation_prompts(ops) == {0: [(5, 6, 7)], 1: [(5, 6)]}


# ------------------------------------------------------------------- expert_specialization
def test_distinct_per_layer():
    ids = np.array([[[0, 1], [1, 2], [0, 2]],        # layer 0: {0, 1, 2}
                    [[3, 4], [3, 4], [3, 4]]])       # layer 1: {3, 4}
    assert es.distinct_per_layer(ids, 8).tolist() == [3, 2]
    batched = np.stack([ids, np.zeros_like(ids)])    # leading batch axis
    assert es.distinct_per_layer(batched, 8).tolist() == [[3, 2], [1, 1]]


def test_batch_step_distinct_and_union():
    # R=3 requests, L=1 layer, S=2 steps, k=1
    traces = np.array([[[[0], [1]]], [[[0], [2]]], [[[3], [1]]]])
    batches = np.array([[0, 1], [0, 2], [1, 2]])
    # [0,1]: step0 {0}, step1 {1,2} -> 1.5; [0,2]: {0,3}, {1} -> 1.5; [1,2]: {0,3}, {2,1} -> 2
    assert es.batch_step_distinct(traces, batches, 4).tolist() == [1.5, 1.5, 2.0]
    # whole-sequence union: {0,1,2}, {0,1,3}, {0,1,2,3}
    assert es.union_distinct(traces, batches, 4).tolist() == [3.0, 3.0, 4.0]


def test_reduction():
    assert es.reduction(4.0, 5.0) == pytest.approx(0.2)
    assert es.reduction(5.0, 5.0) == 0.0
    assert es.reduction(6.0, 5.0) == pytest.approx(-0.2)


def test_batch_drawing():
    rng = np.random.default_rng(0)
    same = es.same_domain_batches([3, 4, 5, 6], 3, 50, rng)
    assert same.shape == (50, 3)
    assert all(len(set(row)) == 3 and set(row) <= {3, 4, 5, 6} for row in same.tolist())
    with pytest.raises(ValueError):
        es.same_domain_batches([1, 2], 3, 1, rng)
    groups = [[0, 1, 2], [10, 11, 12]]
    mixed = es.mixed_batches(groups, 4, 50, rng)
    assert all(sum(x < 10 for x in row) == 2 and len(set(row)) == 4 for row in mixed.tolist())
    odd = es.mixed_batches(groups, 3, 50, rng)
    assert {sum(x < 10 for x in row) for row in odd.tolist()} <= {1, 2}
    a, b = es.halves(np.arange(7), rng)
    assert len(a) == 3 and len(b) == 4 and sorted(np.concatenate([a, b]).tolist()) == list(range(7))


def test_pearson():
    assert es.pearson([1, 2, 3], [1, 3, 2]) == pytest.approx(0.5)
    assert es.pearson([[1, 2], [3, 4]], [2, 4, 6, 8]) == pytest.approx(1.0)
    assert es.pearson([1, 2, 3, 4], [8, 6, 4, 2]) == pytest.approx(-1.0)
    assert math.isnan(es.pearson([1, 1, 1], [1, 2, 3]))


def test_pairings_and_correlations():
    rng = np.random.default_rng(0)
    domains = [0, 0, 1, 1]
    assert es.other_pairing(domains, rng, same_domain=True).tolist() == [1, 0, 3, 2]
    other = es.other_pairing(domains, rng, same_domain=False)
    assert [domains[j] for j in other] == [1, 1, 0, 0]
    with pytest.raises(ValueError):
        es.other_pairing([0, 1, 1], rng, same_domain=True)
    prefill = np.array([[[1, 2, 3]], [[3, 1, 2]]])
    decode = np.array([[[2, 4, 6]], [[1, 3, 2]]])
    r = es.paired_correlations(prefill, decode, [0, 1])
    assert r.tolist() == pytest.approx([1.0, -1.0])        # [3,1,2] vs [1,3,2]
    # [1,2,3] vs [1,3,2]: 0.5; [3,1,2] vs [2,4,6]: -0.5
    assert es.paired_correlations(prefill, decode, [1, 0]).tolist() == pytest.approx([0.5, -0.5])


def test_usage_and_tv():
    usage = es.usage_fractions(np.array([[3, 1], [0, 2]]))
    assert usage.tolist() == [[0.75, 0.25], [0.0, 1.0]]
    tv = es.tv_distance([[1.0, 0.0], [0.5, 0.5]], [[0.0, 1.0], [0.5, 0.5]])
    assert tv.tolist() == [1.0, 0.0]


def test_first_stop():
    assert es.first_stop([5, 0, 7, 0], {0}) == 1
    assert es.first_stop([5, 6], {0}) == 2
    assert es.first_stop([0], frozenset({0})) == 0


def test_locality_on_perfectly_specialized_traces():
    # domain 0 always routes to expert 0, domain 1 to expert 1 (k=1, L=1, 3 steps)
    domains = np.array([0] * 4 + [1] * 4)
    traces = np.where(domains == 0, 0, 1)[:, None, None, None] * np.ones((1, 1, 3, 1), int)
    rng = np.random.default_rng(0)
    split = [es.halves(np.flatnonzero(domains == d), rng) for d in range(2)]
    f = es.locality_figures(traces, domains, 2, 2, 30, 2, rng, split)
    assert f["same"] == [1.0, 1.0] and f["mixed"] == 2.0
    assert f["reduction"] == 0.5 and f["reduction_by_domain"] == [0.5, 0.5]
    assert f["noise_floor"] == 0.0


def test_analyse_on_disjoint_domain_experts():
    # domain d routes every token to experts {2d, 2d+1} (L=2, k=2); decode repeats prefill
    domains = np.repeat(np.arange(4), 8)
    prefill = [np.broadcast_to(np.array([2 * d, 2 * d + 1]), (2, 6, 2)).copy() for d in domains]
    decode = np.stack(prefill)                                            # [R, L, S=6, k]
    first_eos = np.array([7] * 31 + [3])            # the last request stops after 3 steps
    out = es.analyse(prefill, decode, domains, 4, 8, [2, 4], 20, 0, first_eos=first_eos)
    assert out["correlation"] == pytest.approx(1.0)
    assert out["correlation_before_eos"] == pytest.approx(1.0)
    assert out["correlation_centered"] == pytest.approx(1.0)
    # two disjoint 4-of-16 supports: r = -1/3
    assert out["correlation_noise_floor"] == pytest.approx(-1 / 3)
    assert out["correlation_other_same_domain"] == pytest.approx(1.0)
    assert out["eos_fraction"] == 1 / 32 and out["answered_fraction"] == 1.0
    # N=2: same 2 experts, mixed (two domains) 4; N=4: same 2, mixed (all domains) 8
    assert out["decode"][2]["reduction"] == 0.5 and out["decode"][4]["reduction"] == 0.75
    assert out["decode"][4]["noise_floor"] == 0.0
    assert out["prefill_union_same"] == 2.0 and out["prefill_union_mixed"] == 8.0
    assert out["tv_between_domains_prefill"].tolist() == [1.0, 1.0]
    assert out["tv_between_halves_decode"].tolist() == [0.0, 0.0]
    flat = es.flat_figures(out, ["a", "b", "c", "d"], 4, "_x")
    assert flat["prefill_decode_correlation_x"] == out["correlation"]
    assert flat["same_domain_expert_reduction_x"] == 0.75
    assert flat["same_domain_expert_reduction_b2_x"] == 0.5
    assert flat["distinct_experts_same_domain_x"] == 2.0 and flat["distinct_experts_mixed_x"] == 8.0
    assert flat["usage_tv_between_domains_decode_x"] == 1.0
    assert {k for k in flat if k.startswith("usage_tv_between_halves_prefill_layer")} == {
        "usage_tv_between_halves_prefill_layer0_x", "usage_tv_between_halves_prefill_layer1_x"}


def test_next_layer_recall_by_hand_and_against_float64():
    # L=2 layers, E=4 experts, k=2, d=2; layer 1's router picks experts from the input's sign
    router_w = np.zeros((2, 2, 4))
    router_w[1] = [[1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 1.0, -1.0]]
    inputs = np.zeros((2, 3, 2))
    inputs[0] = [[1.0, 2.0], [-1.0, -2.0], [2.0, -1.0]]   # predicted {0,2}, {1,3}, {0,3}
    chosen = np.zeros((2, 3, 2), np.int64)
    chosen[1] = [[2, 0], [1, 0], [1, 2]]                   # hits 2, 1, 0 of 2 each
    recall = es.next_layer_recall(inputs, chosen, router_w, 2)
    assert recall.shape == (1,) and recall[0] == pytest.approx((2 + 1 + 0) / 6)
    # random data: the same as a float64 top-k by brute force
    rng = np.random.default_rng(0)
    router_w = rng.standard_normal((3, 5, 8))
    inputs = rng.standard_normal((3, 40, 5)).astype(np.float32)
    chosen = np.stack([np.argsort(-rng.random((40, 8)), axis=1)[:, :3] for _ in range(3)])
    want = []
    for layer in range(2):
        top = np.argsort(-(inputs[layer].astype(np.float64) @ router_w[layer + 1]), axis=1)[:, :3]
        want.append(np.mean([len(set(top[t]) & set(chosen[layer + 1, t])) / 3 for t in range(40)]))
    np.testing.assert_allclose(es.next_layer_recall(inputs, chosen, router_w, 3), want)


def test_domain_aggregate_correlation_and_sampling_ceiling():
    rng = np.random.default_rng(0)
    # two domains with opposite usage; decode follows prefill exactly
    prefill = np.array([[[9, 1, 0]], [[8, 2, 0]], [[0, 1, 9]], [[0, 2, 8]]], np.float64)
    domains = np.array([0, 0, 1, 1])
    own, other = es.domain_aggregate_correlation(prefill, prefill, domains, 2)
    assert own == pytest.approx(1.0) and other < 0
    # many decode slots: the ceiling approaches 1; a handful: well below
    many = es.sampling_ceiling(prefill, prefill * 1000, rng)
    few = es.sampling_ceiling(prefill, np.ones_like(prefill), rng)
    assert many > 0.99 and few < many


def test_usage_divergence_by_domain():
    # R=3 requests, L=1, E=2: domain 0 uses expert 0 only, domain 1 expert 1 only
    counts = np.array([[[4, 0]], [[2, 0]], [[0, 5]]])
    domains = np.array([0, 0, 1])
    out = es.usage_divergence_by_domain(counts, domains, 2)
    assert out.shape == (2, 1) and out.tolist() == [[1.0], [1.0]]
    same = es.usage_divergence_by_domain(np.array([[[1, 1]], [[2, 2]]]), np.array([0, 1]), 2)
    assert same.tolist() == [[0.0], [0.0]]


# ------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """An untrained 2-layer demo-shaped model with a small demo tokenizer."""
    from moejax import demo

    base = tmp_path_factory.mktemp("tiny-base")
    tokenizer = demo.build_demo_tokenizer(1024, examples=300)
    tokenizer.save(str(base / "tokenizer.json"))
    config = {**demo.demo_config_dict(), "num_hidden_layers": 2}
    (base / "config.json").write_text(json.dumps(config))
    out = tmp_path_factory.mktemp("tiny")
    assert expert_traces.untrained_model_dir(str(base), str(out)) == 0   # no train_log: seed 0
    return str(out)


def test_expert_specialization_end_to_end(tiny_model, tmp_path):
    path = tmp_path / "es.json"
    figures = es.main(["--quick", "--model", tiny_model, "--json", str(path), "--per-domain",
                       "8", "--prompt-tokens", "16", "--new-tokens", "6", "--batch", "2",
                       "--batch-sizes", "2,4", "--batches", "20"])
    saved = json.loads(path.read_text())
    assert saved["same_domain_expert_reduction"] == figures["same_domain_expert_reduction"]
    for key in ("same_domain_expert_reduction", "prefill_decode_correlation"):
        for suffix in ("", "_untrained", "_noise_floor", "_noise_floor_untrained"):
            assert -1.0 <= saved[key + suffix] <= 1.0
    # the model IS an untrained init with the default seed, so its untrained twin is itself
    assert saved["same_domain_expert_reduction"] == saved["same_domain_expert_reduction_untrained"]
    assert saved["prefill_decode_correlation"] == saved["prefill_decode_correlation_untrained"]
    assert 1.0 <= saved["distinct_experts_same_domain"] <= saved["distinct_experts_mixed"] + 1
    assert saved["prefill_union_distinct_mixed"] <= 8
    # the twin's router on the same traced inputs: the same recall per layer (L=2: one)
    assert 0.0 <= saved["next_layer_recall_router_baseline_layer0"] <= 1.0
    assert saved["next_layer_recall_router_baseline"] == saved[
        "next_layer_recall_router_baseline_layer0"] == saved[
        "next_layer_recall_router_baseline_untrained"]
    assert saved["next_layer_recall_chance"] == 2 / 8
    for domain in ("code", "prose", "math", "data"):
        assert 0.0 <= saved[f"usage_divergence_{domain}_layer1"] <= 1.0


def test_expert_traces_are_deterministic_and_feed_expert_specialization(tiny_model, tmp_path):
    """Writing the reference traces twice gives the same arrays; the specialization
    benchmark reads them instead of generating (the same figures as generating)."""
    from moejax import traces

    shape = dict(per_domain=4, prompt_tokens=12, new_tokens=4, router_inputs=True)
    first = expert_traces.write_reference_traces(tiny_model, str(tmp_path / "a"), **shape)
    expert_traces.write_reference_traces(tiny_model, str(tmp_path / "b"), **shape)
    base = os.path.basename(tiny_model)
    for name in (f"{base}.npz", f"{base}-init.npz"):
        a, b = traces.load(tmp_path / "a" / name), traces.load(tmp_path / "b" / name)
        assert sorted(a.arrays) == sorted(b.arrays)
        for key in a.arrays:
            np.testing.assert_array_equal(a.arrays[key], b.arrays[key], err_msg=key)
        assert a.domains == [d for d in ("code", "prose", "math", "data") for _ in range(4)]
        assert a.num_decode_tokens == 16 * 3 and a.has_router_inputs
    assert first["requests"] == 16
    args = ["--batch", "2", "--batch-sizes", "2", "--batches", "10"]
    read = es.main(["--model", tiny_model, "--traces", str(tmp_path / "a")] + args)
    made = es.main(["--model", tiny_model, "--per-domain", "4", "--prompt-tokens", "12",
                    "--new-tokens", "4"] + args)
    for key in ("same_domain_expert_reduction", "prefill_decode_correlation",
                "next_layer_recall_router_baseline_untrained", "usage_divergence_math_layer0"):
        assert read[key] == made[key], key


@pytest.mark.slow      # ~8 s with a cold compilation cache (the decode-step compile)
def test_reformulation_accuracy_end_to_end(tiny_model, tmp_path):
    path = tmp_path / "ra.json"
    figures = ra.main(["--quick", "--model", tiny_model, "--json", str(path), "--per-task", "1",
                       "--max-new-tokens", "2", "--gen-batch", "4", "--tasks", "multi_selection"])
    saved = json.loads(path.read_text())
    assert saved["items"] == 1 == figures["items"] == saved["items_multi_selection"]
    assert saved["tasks"] == ["multi_selection"]
    for key in ("accuracy_prefill", "accuracy_generate", "agreement", "unparsed"):
        assert saved[key] in (0.0, 1.0)                     # one item: right or wrong
    assert saved["agreement"] + saved["unparsed"] <= 1.0
    assert saved["speedup_prefill_over_generate"] == pytest.approx(
        saved["prefill_items_per_s"] / saved["generate_items_per_s"])
    # one generation per candidate, each from exactly the tokens of its prefill op
    assert saved["generate_sequences"] == saved["prefill_ops"] == 4
    assert saved["generate_prompt_tokens"] == saved["prefill_tokens"]
    assert 4 <= saved["generate_new_tokens"] <= 8

"""Kind "prompt_logprobs": each prompt token's log-probability after the tokens before it,
and the most likely tokens at each position, read by the scoring engine's top-k readout
(``ForwardOptions.top_k``) and held to the single-device model's full logits in float64."""

from __future__ import annotations

import numpy as np
import pytest

from moejax import checkpoint
from moejax import model as mdl
from serving import Scorer
from serving.grpc.convert import (request_from_proto, request_to_proto, result_from_proto,
                                  result_to_proto)
from serving.requests import MAX_TOP_LOGPROBS, ScoreResult, parse_request

PROMPTS = ["The capital of France is Paris", "def add(a, b):\n    return a + b",
           "12 + 30 = 42"]


@pytest.fixture(scope="module")
def reference():
    """(params, config) of the demo model in float32, for the single-device forward."""
    from serving.api import resolve_model_dir

    model_dir, _ = resolve_model_dir("demo")
    cfg, params, _ = checkpoint.load_model_dir(model_dir, "float32")
    return cfg, params


def expected(reference, tokens: list[int], k: int):
    """float64 log-softmax of the single-device model's logits at every position ->
    (log P(token i+1), top-k ids, their log-probabilities) for i < n - 1."""
    cfg, params = reference
    n = len(tokens)
    block = 1 << (n - 1).bit_length()
    batch = mdl.PackedBatch(tokens=np.pad(np.array(tokens, np.int32), (0, block - n)),
                            positions=np.arange(block, dtype=np.int32),
                            segment_ids=np.where(np.arange(block) < n, 0, -1).astype(np.int32),
                            score_positions=np.zeros(1, np.int32),
                            score_token_ids=np.zeros((1, 1), np.int32))
    logits = np.asarray(mdl.full_logits(params, batch, cfg, mdl.ForwardOptions(
        attn_block=block)), np.float64)[:n - 1]
    shift = logits.max(-1, keepdims=True)
    logp = logits - (shift + np.log(np.exp(logits - shift).sum(-1, keepdims=True)))
    picked = logp[np.arange(n - 1), tokens[1:]]
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    return picked, top, np.take_along_axis(logp, top, axis=-1)


def check_against_reference(result, reference, k: int) -> None:
    assert result.error is None, result.error
    tokens = result.token_ids
    assert result.prompt_tokens == len(tokens) and result.label is None
    picked, top, top_logp = expected(reference, tokens, k)
    np.testing.assert_allclose(result.logprobs, picked, rtol=1e-4, atol=1e-4)
    if k:
        np.testing.assert_array_equal(np.array(result.top_token_ids), top)
        np.testing.assert_allclose(np.array(result.top_logprobs), top_logp, rtol=1e-4,
                                   atol=1e-4)
        # Best first, and never above the token that was there when it is the best.
        assert all(row == sorted(row, reverse=True) for row in result.top_logprobs)
    else:
        assert result.top_token_ids is None and result.top_logprobs is None


def test_prompt_logprobs_equal_the_single_device_model(demo_scorer, reference):
    requests = [{"kind": "prompt_logprobs", "prompt": p, "top_logprobs": k, "id": i}
                for i, (p, k) in enumerate(zip(PROMPTS, (3, 0, MAX_TOP_LOGPROBS)))]
    requests.append({"kind": "prompt_logprobs", "prompt_token_ids": [5, 6, 7, 8]})
    results = demo_scorer.score(requests)
    for result, k in zip(results, (3, 0, MAX_TOP_LOGPROBS, 0)):
        check_against_reference(result, reference, k)
    assert results[3].token_ids == [5, 6, 7, 8] and len(results[3].logprobs) == 3
    tokens = demo_scorer.tokenizer.encode(PROMPTS[0])
    assert results[0].token_ids == tokens
    # A continuation's log-likelihood is the sum of its tokens' (lm-eval's loglikelihood):
    # the same number the "classify" kind gives a multi-token candidate over the vocabulary.
    (whole,) = demo_scorer.score([{"prompt_token_ids": tokens[:3],
                                   "candidate_token_ids": [tokens[3:]], "normalize": "vocab"}])
    assert whole.logprobs[0] == pytest.approx(sum(results[0].logprobs[2:]), abs=1e-4)


def test_the_top_k_readout_is_the_same_on_an_expert_parallel_group(reference):
    scorer = Scorer("demo", backend="async_ep", devices=2, calibrate=False)
    (result,) = scorer.score([{"kind": "prompt_logprobs", "prompt": PROMPTS[1],
                               "top_logprobs": 5}])
    check_against_reference(result, reference, 5)


def test_bad_prompt_logprobs_requests_name_the_field(demo_scorer):
    results = demo_scorer.score([
        {"kind": "prompt_logprobs", "prompt": "a", "id": "short"},
        {"kind": "prompt_logprobs", "prompt": "xy", "candidates": [" a"]},
        {"kind": "classify", "prompt": "xy", "candidates": [" a", " b"], "top_logprobs": 2},
        {"kind": "prompt_logprobs", "prompt": "xy", "top_logprobs": MAX_TOP_LOGPROBS + 1},
        {"kind": "prompt_logprobs", "prompt": "xy", "top_logprobs": 1.5},
        {"kind": "prompt_logprobs", "prompt": "The capital", "id": "fine"}])
    errors = [r.error for r in results]
    assert errors[0] == ("request 'short': prompt: has 1 token: prompt log-probabilities "
                         "need at least 2 (the first token has none)")
    assert "candidates: kind 'prompt_logprobs' scores the prompt's own tokens" in errors[1]
    assert errors[2] == "request #2: top_logprobs: only kind 'prompt_logprobs' reads it"
    assert errors[3] == (f"request #3: top_logprobs: must be in [0, {MAX_TOP_LOGPROBS + 1}), "
                         f"got {MAX_TOP_LOGPROBS + 1}")
    assert "top_logprobs: must be an integer, got float" in errors[4]
    assert errors[5] is None and results[5].id == "fine"      # the others' errors cost it nothing


def test_prompt_logprobs_travel_over_grpc_protos():
    request = parse_request({"kind": "prompt_logprobs", "prompt": "abc", "top_logprobs": 2,
                             "id": 7}, 0)
    assert request_from_proto(request_to_proto(request)) == request
    sent = ScoreResult(id=7, logprobs=[-1.5, -0.25], prompt_tokens=3, token_ids=[4, 5, 6],
                       top_token_ids=[[5, 9], [6, 1]], top_logprobs=[[-1.5, -2.0],
                                                                     [-0.25, -3.0]])
    assert result_from_proto(result_to_proto(sent)) == sent
    plain = ScoreResult(id="a", logprobs=[-0.1, -2.4], label=0, prompt_tokens=4)
    assert result_from_proto(result_to_proto(plain)) == plain

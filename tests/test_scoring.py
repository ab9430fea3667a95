"""End-to-end scoring through serving.Scorer and the CLI, on the built-in demo model."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from serving import Scorer, ScoreRequest


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    return Scorer("demo", dtype="float32", max_batch_tokens=512)


REQUESTS = [
    {"id": "a", "prompt": "Review: lovely food and kind staff.\nSentiment:",
     "candidates": [" positive", " negative"]},
    {"id": "b", "prompt": "Claim: 2 + 2 = 5. True or false?", "candidates": [" true", " false"],
     "normalize": "vocab"},
    {"id": "c", "kind": "choice", "prompt": "Which is a colour?",
     "candidates": ["red", "table", "seven"]},
    {"id": "d", "kind": "multi", "prompt": "Article: the team won the final.",
     "candidates": ["sports", "music", "politics"]},
    {"id": "e", "prompt": "The capital of France is", "candidates": [" Paris", " the city of Lyon"]},
    {"id": "f", "prompt": "A much longer prompt " * 20 + "Answer:", "candidates": [" yes", " no"]},
    {"id": "g", "prompt_token_ids": [5, 6, 7, 8, 9], "candidate_token_ids": [[10], [11, 12]],
     "normalize": "vocab"},
]


def _close(a, b, tol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    return np.max(np.abs(a - b) / np.maximum(1.0, np.abs(b))) <= tol


def test_packed_batch_equals_each_request_alone(scorer):
    together = scorer.score(REQUESTS)
    for request, joint in zip(REQUESTS, together):
        alone = scorer.score([request])[0]
        assert joint.error is None and alone.error is None, (joint.error, alone.error)
        assert joint.id == request["id"]
        assert _close(joint.logprobs, alone.logprobs), (request["id"], joint.logprobs, alone.logprobs)
        assert joint.label == alone.label


def test_candidate_normalisation_sums_to_one(scorer):
    for result, request in zip(scorer.score(REQUESTS), REQUESTS):
        probs = np.exp(result.logprobs)
        if request.get("normalize", "candidates") == "candidates" and request.get("kind") != "multi":
            assert math.isclose(probs.sum(), 1.0, rel_tol=1e-6)
        else:
            assert np.all(probs <= 1.0 + 1e-9)
        assert result.label == int(np.argmax(result.logprobs))


def test_vocab_normalisation_matches_full_softmax(scorer):
    """normalize='vocab' on single tokens is the log-softmax over the whole vocabulary,
    which is consistent with the candidate normalisation of the same logits."""
    prompt = "Review: lovely food and kind staff.\nSentiment:"
    cands = [" positive", " negative"]
    by_vocab = scorer.score([{"prompt": prompt, "candidates": cands, "normalize": "vocab"}])[0]
    by_cand = scorer.score([{"prompt": prompt, "candidates": cands}])[0]
    renorm = np.array(by_vocab.logprobs) - np.logaddexp.reduce(by_vocab.logprobs)
    assert _close(renorm, by_cand.logprobs)
    assert all(lp < 0 for lp in by_vocab.logprobs)


def test_multi_selection_siblings_equal_binary_requests(scorer):
    request = REQUESTS[3]
    multi = scorer.score([request])[0]
    prompt_ids = scorer.tokenizer.encode(request["prompt"])
    singles = []
    for candidate in request["candidates"]:
        suffix = scorer.tokenizer.encode(f"\nCandidate: {candidate}\nRelevant (yes/no):")
        singles.append({"prompt_token_ids": prompt_ids + suffix, "candidates": [" yes", " no"]})
    binary = scorer.score(singles)
    assert _close(multi.logprobs, [b.logprobs[0] for b in binary])
    assert multi.selected == [k for k, b in enumerate(binary) if b.logprobs[0] > b.logprobs[1]]


def test_multi_token_candidates_are_sums_of_token_logprobs(scorer):
    """A two-token candidate's vocab log-prob is log p(t1 | prompt) + log p(t2 | prompt, t1)."""
    prompt_ids = [5, 6, 7, 8, 9]
    seq = scorer.score([{"prompt_token_ids": prompt_ids, "candidate_token_ids": [[11, 12], [10]],
                         "normalize": "vocab"}])[0]
    first = scorer.score([{"prompt_token_ids": prompt_ids, "candidate_token_ids": [[11], [10]],
                           "normalize": "vocab"}])[0]
    second = scorer.score([{"prompt_token_ids": prompt_ids + [11],
                            "candidate_token_ids": [[12], [10]], "normalize": "vocab"}])[0]
    assert _close(seq.logprobs[0], first.logprobs[0] + second.logprobs[0])
    assert _close(seq.logprobs[1], first.logprobs[1])


@pytest.mark.parametrize("bad, fragment", [
    ({"prompt": "", "candidates": [" yes"]}, "prompt"),
    ({"prompt": "x " * 5000, "candidates": [" yes", " no"]}, "context"),
    ({"prompt": "Is it?", "candidates": []}, "candidates"),
    ({"prompt": "Is it?", "candidates": [" yes", " yes"]}, "duplicate"),
    ({"prompt": "Is it?", "candidates": [" yes", ""]}, "candidate"),
    ({"prompt": "Is it?", "candidates": [" yes"], "kind": "rank"}, "kind"),
    ({"prompt": "Is it?", "candidates": [" yes"], "normalize": "softmax"}, "normalize"),
    ({"prompt_token_ids": [1, 99999], "candidates": [" yes"]}, "prompt_token_ids"),
    ({"prompt": "Is it?", "candidates": [" yes"], "colour": "blue"}, "colour"),
])
def test_bad_request_gets_error_result_and_others_are_scored(scorer, bad, fragment):
    good = REQUESTS[0]
    results = scorer.score([good, dict(bad, id="bad"), good])
    assert results[1].error is not None and fragment in results[1].error, results[1].error
    assert "bad" in results[1].error and results[1].logprobs is None
    reference = scorer.score([good])[0]
    for r in (results[0], results[2]):
        assert r.error is None and _close(r.logprobs, reference.logprobs)


def test_typed_requests_and_input_checks(scorer):
    typed = ScoreRequest(id=7, prompt="The capital of France is", candidates=[" Paris", " Rome"])
    assert scorer.score([typed])[0].id == 7
    with pytest.raises(TypeError):
        scorer.score({"prompt": "x", "candidates": [" a"]})
    with pytest.raises(TypeError, match="unknown Scorer option"):
        Scorer("demo", batch_size=3)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Scorer("/nonexistent/model/dir")


def test_bucketed_compiles_stay_bounded(scorer):
    rng = np.random.default_rng(0)
    requests = [{"prompt_token_ids": rng.integers(0, 1000, int(n)).tolist(),
                 "candidate_token_ids": [[1], [2]]} for n in rng.integers(1, 400, 60)]
    before = scorer.engine.stats.compiles
    scorer.score(requests)
    scorer.score(requests[::-1])
    new = scorer.engine.stats.compiles - before
    policy = scorer.engine.policy
    assert new <= len(policy.token_buckets(400)) ** 2, new
    assert all(t & (t - 1) == 0 for t, *_ in scorer.engine.stats.shapes)


def test_cli_score_jsonl(tmp_path, capsys):
    from serving.cli import main

    lines = [json.dumps(r) for r in REQUESTS[:2]] + ["{not json", json.dumps([1, 2]),
                                                     json.dumps({"prompt": "", "candidates": ["x"]})]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert main(["score", str(src), "-o", str(out), "--max-batch-tokens", "512"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 5
    assert [r["id"] for r in rows[:2]] == ["a", "b"]
    assert rows[0]["error"] is None and len(rows[0]["logprobs"]) == 2
    assert "line 3" in rows[2]["error"] and "invalid JSON" in rows[2]["error"]
    assert "line 4" in rows[3]["error"]
    assert "prompt" in rows[4]["error"]
    assert "scored 2 of 5 requests" in capsys.readouterr().err
    expected = Scorer("demo", max_batch_tokens=512).score(REQUESTS[:1])[0]
    assert _close(rows[0]["logprobs"], expected.logprobs)


def test_cli_reports_missing_model(tmp_path, capsys):
    from serving.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(REQUESTS[0]) + "\n")
    assert main(["score", str(src), "--model", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_chunks_give_the_same_results(tmp_path):
    from serving.cli import main

    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in REQUESTS) + "\n{bad\n", encoding="utf-8")
    outputs = []
    for chunk in ("1000", "2"):
        out = tmp_path / f"out{chunk}.jsonl"
        # float32: the GPU default is bfloat16, whose rounding depends on the batch mix.
        assert main(["score", str(src), "-o", str(out), "--chunk-size", chunk,
                     "--max-batch-tokens", "512", "--dtype", "float32"]) == 0
        outputs.append([json.loads(line) for line in out.read_text().splitlines()])
    assert len(outputs[0]) == len(REQUESTS) + 1
    for a, b in zip(*outputs):
        assert a["id"] == b["id"] and a["error"] == b["error"] and a["label"] == b["label"]
        if a["logprobs"] is not None:
            assert _close(a["logprobs"], b["logprobs"])


def test_bfloat16_scores_track_float32(scorer):
    bf16 = Scorer("demo", dtype="bfloat16", max_batch_tokens=512)
    assert bf16.info["dtype"] == "bfloat16"
    requests = REQUESTS[:3] + REQUESTS[4:]
    for a, b in zip(bf16.score(requests), scorer.score(requests)):
        assert a.error is None
        # Compare log-probs, not argmax: near ties would make an argmax check fragile.
        assert np.max(np.abs(np.array(a.logprobs) - np.array(b.logprobs))) < 0.1


def test_cli_convert_then_score_converted_dir(tmp_path, scorer, capsys):
    """`moejax convert` writes orbax params once; a Scorer on the converted directory
    gives the same scores as on the original checkpoint."""
    from serving.cli import main

    out = tmp_path / "converted"
    assert main(["convert", scorer.model_dir, str(out), "--dtype", "float32"]) == 0
    assert "converted" in capsys.readouterr().err
    converted = Scorer(str(out), dtype="float32", max_batch_tokens=512)
    for a, b in zip(converted.score(REQUESTS), scorer.score(REQUESTS)):
        assert a.error is None and _close(a.logprobs, b.logprobs)
    assert main(["convert", scorer.model_dir, str(out)]) == 2      # exists: refused
    assert "exists" in capsys.readouterr().err


def test_cli_info_lists_buckets(capsys):
    from serving.cli import main

    assert main(["info", "--max-batch-tokens", "512"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model_type"] == "qwen3_moe" and info["demo"] is True
    assert info["token_buckets"][0] == 32 and info["linear_flops_per_token"] > 0


def test_scorer_options_defaults_and_validation(monkeypatch, tmp_path):
    from serving.options import load_options

    opts = load_options()
    assert opts.min_block == 32 and opts.expert_impl == "auto"
    assert opts.resolved_dtype().name == "float32"          # CPU default
    assert opts.resolved_batch_tokens() == 4096
    monkeypatch.setenv("MOEJAX_CACHE", str(tmp_path))
    assert opts.compilation_cache is None and opts.resolved_compilation_cache() is None
    auto = load_options({"compilation_cache": "auto"})
    assert auto.resolved_compilation_cache() == str(tmp_path / "jax-cache")
    assert load_options({"compilation_cache": "off"}).resolved_compilation_cache() is None
    for bad in ({"dtype": "float8"}, {"expert_impl": "magic"}, {"max_batch_tokens": 0},
                {"tile_rows": -1}, {"compilation_cache": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            load_options(bad)


def test_empty_and_all_bad_inputs(scorer):
    assert scorer.score([]) == []
    results = scorer.score([{"prompt": ""}, {"candidates": [" a"]}])
    assert [r.logprobs for r in results] == [None, None]
    assert "request #0" in results[0].error and "request #1" in results[1].error


def test_new_shapes_are_logged_once(caplog):
    import logging

    fresh = Scorer("demo", max_batch_tokens=512)   # an engine that has compiled nothing yet
    request = {"prompt_token_ids": list(range(3, 300)), "candidate_token_ids": [[1], [2]]}
    with caplog.at_level(logging.INFO, logger="moejax.engine"):
        fresh.score([request])
        fresh.score([request])
    compiled = [r.getMessage() for r in caplog.records if "compiled forward" in r.getMessage()]
    assert len(compiled) == 1, compiled           # the second call reuses the program
    assert "T=512 block=512" in compiled[0], compiled
    assert fresh.engine.stats.compiles == 1 and fresh.engine.stats.batches == 2

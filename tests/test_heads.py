"""Sequence classifiers and reward models (``*ForSequenceClassification`` checkpoints):
their ``score`` head and ``id2label`` load, and a request of kind "head" answers with the
head's outputs at the last prompt token, held to ``transformers`` on tiny random models,
through the Scorer, the CLI, gRPC and HTTP's ``/classify``."""

from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="head parity needs torch (the 'parity' extra)")
pytest.importorskip("transformers", reason="head parity needs transformers")

from hf_tiny_models import build_torch_model, word_tokenizer  # noqa: E402
from moejax.checkpoint import CheckpointError  # noqa: E402
from serving import Scorer  # noqa: E402
from serving import cli  # noqa: E402

PROMPTS = ["t5 t9 t17 t3", "t40 t2 t99 t7 t7 t12", "t100"]
LABELS = {"0": "negative", "1": "neutral", "2": "positive"}
TOL = 1e-4


def save_classifier(path, seed: int, family: str = "qwen3_moe", **overrides):
    """A tiny sequence classifier of ``family`` saved as transformers saves it, beside a
    word tokenizer; returns the torch model."""
    hf = build_torch_model(family, {"pad_token_id": 0, **overrides}, seed, head="classifier")
    with torch.no_grad():        # a head that is not near zero: its mistakes show
        hf.score.weight.mul_(20.0)
    hf.save_pretrained(path)
    word_tokenizer().save(str(path / "tokenizer.json"))
    return hf


def torch_outputs(hf, prompt: str) -> np.ndarray:
    ids = [int(w[1:]) for w in prompt.split()]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double().numpy()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    hf = save_classifier(path, 3, num_labels=3, id2label=LABELS,
                         label2id={v: int(k) for k, v in LABELS.items()})
    return path, hf, Scorer(str(path), calibrate=False)


def test_the_head_answers_as_transformers(classifier):
    path, hf, scorer = classifier
    assert scorer.head.labels == ("negative", "neutral", "positive")
    assert scorer.info["labels"] == ["negative", "neutral", "positive"]
    results = scorer.score([{"kind": "head", "prompt": p, "id": i}
                            for i, p in enumerate(PROMPTS)])
    for result, prompt in zip(results, PROMPTS):
        want = torch_outputs(hf, prompt)
        assert result.error is None, result.error
        np.testing.assert_allclose(result.scores, want, rtol=TOL, atol=TOL)
        log_softmax = want - np.log(np.exp(want - want.max()).sum()) - want.max()
        np.testing.assert_allclose(result.logprobs, log_softmax, rtol=TOL, atol=TOL)
        assert result.label == int(np.argmax(want))
        assert result.prompt_tokens == len(prompt.split())


def test_a_mixtral_classifier_too(tmp_path):
    hf = save_classifier(tmp_path, 4, "mixtral", num_labels=2)
    scorer = Scorer(str(tmp_path), calibrate=False)
    assert scorer.head.labels == ("LABEL_0", "LABEL_1")
    (result,) = scorer.score([{"kind": "head", "prompt": PROMPTS[1]}])
    np.testing.assert_allclose(result.scores, torch_outputs(hf, PROMPTS[1]), rtol=TOL,
                               atol=TOL)


def test_a_classifier_refuses_the_language_model_kinds_and_back(classifier):
    _, _, scorer = classifier
    wrong, no_kind = scorer.score([{"prompt": "t5", "candidates": [" t1", " t2"]},
                                   {"prompt": "t5"}])
    for result in (wrong, no_kind):
        assert "kind: 'classify' needs a language-model head; this model is a sequence " \
               "classifier (3 labels" in result.error and "use kind 'head'" in result.error
    (lm,) = Scorer("demo", calibrate=False).score([{"kind": "head", "prompt": "hi"}])
    assert "kind: 'head' needs a classification head" in lm.error
    with pytest.raises(ValueError, match="sequence classifier .* cannot generate"):
        from serving import Generator
        Generator(str(classifier[0]))


def test_a_reward_model_returns_its_score_and_a_multi_label_head_its_sigmoids(tmp_path):
    reward_dir, multi_dir = tmp_path / "reward", tmp_path / "multi"
    reward = save_classifier(reward_dir, 5, num_labels=1)
    multi = save_classifier(multi_dir, 6, num_labels=3, id2label=LABELS,
                            problem_type="multi_label_classification")
    (score,) = Scorer(str(reward_dir), calibrate=False).score(
        [{"kind": "head", "prompt": PROMPTS[1]}])
    np.testing.assert_allclose(score.scores, torch_outputs(reward, PROMPTS[1]), rtol=TOL,
                               atol=TOL)
    assert score.logprobs is None and score.label is None and len(score.scores) == 1
    (tagged,) = Scorer(str(multi_dir), calibrate=False).score(
        [{"kind": "head", "prompt": PROMPTS[0]}])
    want = torch_outputs(multi, PROMPTS[0])
    np.testing.assert_allclose(tagged.logprobs, -np.log1p(np.exp(-want)), rtol=TOL, atol=TOL)
    assert tagged.selected == [i for i, v in enumerate(want) if v > 0]


def test_a_checkpoint_without_either_head_is_refused_naming_both(tmp_path, classifier):
    from safetensors.numpy import load_file, save_file

    path = tmp_path / "headless"
    path.mkdir()
    source = classifier[0]
    for name in ("config.json", "tokenizer.json"):
        (path / name).write_bytes((source / name).read_bytes())
    tensors = {k: v for k, v in load_file(str(source / "model.safetensors")).items()
               if k != "score.weight"}
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="score.weight") as refused:
        Scorer(str(path), calibrate=False)
    assert "lm_head.weight" in str(refused.value)


def test_the_cli_grpc_and_http_classify_give_the_same_numbers(classifier, tmp_path):
    import urllib.request

    from serving.grpc.client import Client
    from serving.grpc.server import ScoringServer, ServerOptions
    from serving.http import HttpOptions, HttpServer

    path, hf, scorer = classifier
    want = [torch_outputs(hf, p) for p in PROMPTS]
    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"kind": "head", "prompt": p}) + "\n"
                                for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    assert cli.main(["score", str(requests), "-o", str(out), "--model", str(path)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    for line, expected in zip(lines, want):
        np.testing.assert_allclose(line["scores"], expected, rtol=TOL, atol=TOL)
    server = ScoringServer(ServerOptions(port=0))
    port = server.start()
    http = HttpServer(server, HttpOptions(port=0))
    http.start()
    server.attach(scorer)
    try:
        got = Client(f"127.0.0.1:{port}").score([{"kind": "head", "prompt": p}
                                                  for p in PROMPTS])
        for result, expected in zip(got, want):
            np.testing.assert_allclose(result.scores, expected, rtol=TOL, atol=TOL)
            assert result.label == int(np.argmax(expected))
        body = json.dumps({"input": PROMPTS}).encode()
        call = urllib.request.Request(f"http://127.0.0.1:{http.port}/classify", body,
                                      {"Content-Type": "application/json"})
        with urllib.request.urlopen(call, timeout=60) as answer:
            data = json.loads(answer.read())["data"]
        for item, expected in zip(data, want):
            probs = np.exp(expected - expected.max())
            np.testing.assert_allclose(item["probs"], probs / probs.sum(), rtol=TOL,
                                       atol=TOL)
            assert item["label"] == LABELS[str(int(np.argmax(expected)))]
            assert item["num_classes"] == 3
    finally:
        server.stop(2)
        http.stop(5)


@pytest.mark.parametrize("family, cls", [("qwen2_moe", "Qwen2MoeForSequenceClassification"),
                                         ("deepseek_v3", "DeepseekV3ForSequenceClassification")])
def test_other_families_classifiers(tmp_path, family, cls):
    """The head is family-blind: a Qwen2-MoE (shared expert, QKV bias) and a DeepSeek-V3
    (MLA, sigmoid routing) classifier over the robust tiny models of the family tests."""
    import transformers

    from hf_family_models import build_family_model, family_config

    base = build_family_model(family, seed=8)
    torch.manual_seed(9)
    hf = getattr(transformers, cls)(family_config(family, num_labels=2, pad_token_id=0))
    hf = hf.to(torch.float32).eval()
    hf.model.load_state_dict(base.model.state_dict())
    with torch.no_grad():
        hf.score.weight.mul_(20.0)
    hf.save_pretrained(tmp_path)
    word_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (result,) = Scorer(str(tmp_path), calibrate=False).score(
        [{"kind": "head", "prompt": PROMPTS[1]}])
    np.testing.assert_allclose(result.scores, torch_outputs(hf, PROMPTS[1]), rtol=TOL,
                               atol=TOL)

"""The prompt templates of kinds "choice" and "multi" (serving.requests.NormalizeOptions),
per server (``Scorer(templates=...)``, serving/configs/scoring.yaml's ``templates``) and per
request (a request's ``templates``)."""

from __future__ import annotations

import numpy as np
import pytest

from serving import Scorer

CHOICE = {"choice_template": "Q: {prompt}\n{options}\nA:", "choice_labels": ["1", "2"],
          "choice_option_template": "({label}) {option}"}
MULTI = {"multi_template": "\nTopic {candidate}? Answer:"}


@pytest.fixture(scope="module")
def scorer():
    return Scorer("demo", calibrate=False, max_batch_tokens=256)


def close(a, b):
    assert a.error is None and b.error is None, (a.error, b.error)
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-6)


def test_a_request_s_templates_render_its_prompt(scorer):
    choice, classify = scorer.score([
        {"kind": "choice", "prompt": "Which is a number?", "candidates": ["seven", "table"],
         "templates": CHOICE},
        # What that choice request is by definition: classify over the identifiers.
        {"prompt": "Q: Which is a number?\n(1) seven\n(2) table\nA:",
         "candidates": [" 1", " 2"]}])
    close(choice, classify)
    default = scorer.score([{"kind": "choice", "prompt": "Which is a number?",
                             "candidates": ["seven", "table"]}])[0]
    assert not np.allclose(default.logprobs, choice.logprobs)


def test_the_server_s_templates_equal_the_request_s(scorer):
    requests = [{"kind": "choice", "prompt": "Which is a number?",
                 "candidates": ["seven", "table"]},
                {"kind": "multi", "prompt": "Article: the team won.",
                 "candidates": ["sports", "music"]}]
    served = Scorer("demo", calibrate=False, max_batch_tokens=256,
                    templates={**CHOICE, **MULTI}).score(requests)
    per_request = scorer.score([{**r, "templates": {**CHOICE, **MULTI}} for r in requests])
    for a, b in zip(served, per_request):
        close(a, b)


def test_bad_templates_are_refused_by_name(scorer):
    bad = scorer.score([
        {"kind": "multi", "prompt": "x", "candidates": ["a"], "templates": {"multi_tmpl": "y"}},
        {"kind": "multi", "prompt": "x", "candidates": ["a"],
         "templates": {"multi_template": "no placeholder"}},
        {"kind": "choice", "prompt": "x", "candidates": ["a", "b"],
         "templates": {"choice_labels": "AB"}}])
    assert "templates: unknown field 'multi_tmpl'" in bad[0].error
    assert "templates.multi_template: must contain '{candidate}'" in bad[1].error
    assert "templates.choice_labels: must be a list of strings" in bad[2].error
    with pytest.raises(ValueError, match=r"templates\.choice_template: must contain"):
        Scorer("demo", templates={"choice_template": "{prompt} only"})

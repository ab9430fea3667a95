"""Scorer with the prefix cache, KV-cache-free mode and several routed engines: results
identical to one plain engine; per-request timings; CLI flags; Ctrl-C."""

from __future__ import annotations

import json

import numpy as np
import pytest

from serving import cli
from serving import Scorer

SYSTEM = "You are a careful assistant. Answer with one word. " * 2
REQUESTS = (
    [{"id": f"c{i}", "prompt": SYSTEM + f"Question {i}: is it good?",
      "candidates": [" yes", " no"]} for i in range(4)]
    + [{"id": "m", "kind": "multi", "prompt": SYSTEM + "Article: the team won.",
        "candidates": ["sports", "music", "politics"]},
       {"id": "t", "prompt": SYSTEM + "Capital of France:",
        "candidates": [" Paris", " the city of Lyon", " Rome"], "normalize": "vocab"},
       {"id": "ch", "kind": "choice", "prompt": "Which is a colour?",
        "candidates": ["red", "table"]},
       {"id": "bad", "prompt": "", "candidates": [" a"]}])
OPTIONS = dict(dtype="float32", max_batch_tokens=256)


@pytest.fixture(scope="module")
def reference():
    return Scorer("demo", **OPTIONS).score(REQUESTS)


def same(results, reference):
    for got, want in zip(results, reference):
        assert got.id == want.id and got.error == want.error
        if want.error is None:
            np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
            assert got.label == want.label and got.selected == want.selected


@pytest.mark.parametrize("options", [{"prefix_cache_blocks": 64},
                                     {"kv_cache_free": True},
                                     {"engines": 2, "prefix_cache_blocks": 64},
                                     {"engines": 2, "routing": "round_robin"}],
                         ids=["cache", "kv_cache_free", "2_engines_prefix", "2_engines_rr"])
def test_results_identical_whatever_cache_and_routing(reference, options):
    scorer = Scorer("demo", **OPTIONS, **options)
    first, second = scorer.score(REQUESTS), scorer.score(REQUESTS)
    same(first, reference)
    same(second, reference)                       # second call: cross-call cache hits
    engines = scorer.engines
    assert len(engines) == options.get("engines", 1)
    if options.get("prefix_cache_blocks"):
        assert sum(e.stats.prefix_tokens_cached for e in engines) > 0
    for result in first:
        if result.error is None:
            assert result.timings["seconds"] > 0 and result.timings["engines"]
    assert scorer.info["engines"] == len(engines)


def test_prefix_routing_keeps_siblings_together():
    scorer = Scorer("demo", **OPTIONS, engines=2, prefix_cache_blocks=64)
    results = scorer.score(REQUESTS)
    by_id = {r.id: r for r in results}
    assert len(by_id["m"].timings["engines"]) == 1          # 3 siblings, one engine
    assert len(by_id["t"].timings["engines"]) == 1


def test_option_errors():
    with pytest.raises(ValueError, match="routing must be one of"):
        Scorer("demo", routing="fastest")
    with pytest.raises(ValueError, match="with backend 'resident' runs one engine per device"):
        Scorer("demo", engines=2, backend="resident", devices=2)
    with pytest.raises(ValueError, match="prefix_cache_blocks must be"):
        Scorer("demo", prefix_cache_blocks=-3)


def test_cli_frontend_flags_and_ctrl_c(tmp_path, monkeypatch, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in REQUESTS[:6]) + "\n")
    out = tmp_path / "out.jsonl"
    rc = cli.main(["score", str(src), "-o", str(out), "--dtype", "float32", "--engines", "2",
                   "--routing", "least_tokens", "--prefix-cache-blocks", "32"])
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in lines] == [r["id"] for r in REQUESTS[:6]]
    assert all("timings" in r for r in lines)
    # Ctrl-C during the second chunk: the first chunk's results are written, exit 130.
    real = cli.score_chunk
    calls = {"n": 0}

    def interrupting(scorer, chunk):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(scorer, chunk)

    monkeypatch.setattr(cli, "score_chunk", interrupting)
    rc = cli.main(["score", str(src), "-o", str(out), "--chunk-size", "2"])
    assert rc == 130 and "interrupted" in capsys.readouterr().err
    assert len(out.read_text().splitlines()) == 2
    with pytest.raises(SystemExit):
        cli.main(["score", str(src), "--prefix-cache-blocks", "many"])

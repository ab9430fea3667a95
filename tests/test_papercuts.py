"""Issue 37's papercuts: the -v compile log, the examples, --decoders on CPU and candidate
tokenization boundaries."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from serving import Scorer
from moejax.core.scoring_steps import SHAPE_KEY_FIELDS

REPO = Path(__file__).resolve().parents[1]
# Candidates of several tokens and a "multi" request: ops that continue a shared prompt.
REQUESTS = [{"id": "product", "prompt": "7 * 8 =", "candidates": [" 54", " 56", " 63"]},
            {"id": "tags", "kind": "multi", "prompt": "Text: def area(w, h):\nWhich domains "
             "does it contain?", "candidates": ["code", "prose"]}]


@pytest.mark.parametrize("share_prompts", [True, False], ids=["prefix-pool", "plain"])
def test_compile_log_names_every_shape_field(caplog, share_prompts):
    """`moejax -v` logs each compiled shape; with the prefix pool on (the default) its key
    has seven fields, which the log line once formatted with five placeholders ("--- Logging
    error --- TypeError: not all arguments converted")."""
    scorer = Scorer("demo", share_prompts=share_prompts)
    with caplog.at_level(logging.INFO, logger="moejax.engine"):
        results = scorer.score(REQUESTS)
    assert [r.error for r in results] == [None] * len(REQUESTS)
    compiled = [r for r in caplog.records if r.name == "moejax.engine"
                and r.msg.startswith("compiled forward")]
    assert compiled, "no compile was logged"
    messages = [record.getMessage() for record in compiled]   # raised TypeError before
    for message in messages:
        for name in SHAPE_KEY_FIELDS[:6]:
            assert f" {name}=" in message, message
    pool_steps = [m for m in messages if " context_slots=" in m and " stored_rows=" in m]
    assert bool(pool_steps) == share_prompts, messages


# ----------------------------------------------------------------------------- boundaries
@pytest.fixture(scope="module")
def scorer(demo_scorer) -> Scorer:
    return demo_scorer            # the session's (conftest.py)


@pytest.mark.parametrize("prompt", ["Answer:", "Answer: ", "Is 3 + 4 = 7? Answer: ", "x = 1"])
@pytest.mark.parametrize("candidate", ["yes", " yes", "2"])
def test_a_candidate_boundary_mismatch_is_warned_without_changing_the_score(
        scorer, prompt, candidate):
    """A candidate that tokenizes differently after the prompt than apart (with the demo
    tokenizer: "Answer: " + "yes" reads " yes" together) gets a warning naming it; the
    score is that of the candidate tokenized apart, as without the check."""
    encode = scorer.tokenizer.encode
    differs = encode(prompt + candidate) != encode(prompt) + encode(candidate)
    other = "no" if candidate.strip() != "no" else "maybe"
    request = {"id": "q", "prompt": prompt, "candidates": [candidate, other]}
    [result] = scorer.score([request])
    assert result.error is None
    warned = [w for w in result.warnings or [] if "candidates[0]" in w]
    assert bool(warned) == differs, (encode(prompt + candidate), result.warnings)
    if differs:
        assert warned[0].startswith(f"request 'q': candidates[0] ({candidate!r})")
        assert result.to_dict()["warnings"] == result.warnings
    else:
        assert "warnings" not in result.to_dict() or all("candidates[0]" not in w
                                                         for w in result.to_dict()["warnings"])
    # The score is unchanged: the same request as token ids (no text, no check) agrees.
    [by_ids] = scorer.score([{"prompt_token_ids": encode(prompt),
                              "candidate_token_ids": [encode(candidate), encode(other)]}])
    assert by_ids.warnings is None
    assert result.logprobs == pytest.approx(by_ids.logprobs, abs=1e-6)


def test_the_warning_says_where_the_tokenizations_part(scorer):
    """With the demo tokenizer "Answer:" + "yes" tokenizes alike together and apart (no
    warning: the text scored is "Answer:yes"), while "Answer: " + "yes" reads " yes"
    together: a warning with the ids from the boundary on and the fix."""
    [plain, spaced] = scorer.score([
        {"prompt": "Answer:", "candidates": ["yes", "no"]},
        {"prompt": "Answer: ", "candidates": ["yes", "no"]}])
    assert plain.warnings is None
    encode = scorer.tokenizer.encode
    assert len(spaced.warnings) == 2          # "no" parts the same way
    assert spaced.warnings[0] == (
        f"request #1: candidates[0] ('yes'): tokenizes differently after the prompt: "
        f"together {encode(' yes')}, apart {encode(' ') + encode('yes')} (from the boundary "
        f"on); scored as tokenized apart; end the prompt without its trailing whitespace and "
        f"start the candidate with it (e.g. ' yes')")


# ----------------------------------------------------------------------------- examples
def _run_main(argv: list[str]) -> int:
    from serving.cli import main

    return main(argv)


def test_the_generation_example_runs_without_errors(tmp_path, capsys):
    """`moejax generate examples/generate.jsonl` answers every request (it once had no
    generation example: examples/requests.jsonl gave 12 errors and exit 0), and the demo
    answers the sums and checks as trained."""
    out = tmp_path / "out.jsonl"
    status = _run_main(["generate", str(REPO / "examples" / "generate.jsonl"), "-o", str(out)])
    assert status == 0, capsys.readouterr().err
    results = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert [r["error"] for r in results.values()] == [None] * 8
    assert results["sum"]["text"].split("\n")[0] == " 21"
    assert results["sum-2"]["text"].split("\n")[0] == " 15"
    assert results["yes-no"]["text"] == " yes"
    assert results["claim"]["text"] == " false"
    assert results["domain"]["text"] == " data"
    assert "(0 with errors)" in capsys.readouterr().err


def test_generate_exits_non_zero_when_every_request_fails(tmp_path, capsys):
    """Scoring requests are not generation requests: every line fails (12 errors), and
    the command says so by its exit status (3) instead of 0."""
    out = tmp_path / "out.jsonl"
    status = _run_main(["generate", str(REPO / "examples" / "requests.jsonl"), "-o", str(out)])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12 and all(r["error"] for r in lines)
    assert status == 3
    assert "(12 with errors)" in capsys.readouterr().err


def test_generate_help_names_the_exit_codes(capsys):
    with pytest.raises(SystemExit):
        _run_main(["generate", "--help"])
    text = capsys.readouterr().out
    assert "exit codes:" in text and "every result is an error" in text
    assert "host devices" in " ".join(text.split())     # --decoders's help


def test_the_calibration_example_is_what_trace_reads(tmp_path):
    """examples/calibration.jsonl (the input of `moejax trace`, whose traces eldr-fit and
    prefetch-calibrate read) parses line by line as `moejax trace` parses it: every
    line a valid generation request for demo-e32, with a domain label of its eight."""
    from moejax import checkpoint, model_dirs
    from moejax.demo.corpus import DOMAINS_E32
    from serving.generate import parse_generation_request
    from serving.jsonl import open_jsonl
    from serving.requests import TokenizerAdapter
    from serving.cli.trace import prepare_line

    model_dir, _ = model_dirs.resolve_model_dir("demo-e32")
    cfg = checkpoint.load_model_config(model_dir)
    tokenizer = TokenizerAdapter(checkpoint.load_tokenizer(model_dir))
    domains = []
    with open_jsonl(str(REPO / "examples" / "calibration.jsonl"), str(tmp_path / "o.npz"),
                    1) as files:
        for number, line in enumerate(files.lines()):
            assert line.error is None, line.error
            request, domain = prepare_line(line, max_new_tokens=4)
            assert request.error is None, request.error
            spec = parse_generation_request(request.request, number, tokenizer,
                                            vocab_size=cfg.vocab_size,
                                            max_context=cfg.max_context,
                                            default_stop=frozenset())
            assert spec.max_new_tokens == 4 and spec.prompt
            domains.append(domain)
    assert sorted(set(domains)) == sorted(DOMAINS_E32)


# ----------------------------------------------------------------------------- --decoders
def test_decoders_sets_the_cpu_host_devices(tmp_path):
    """`moejax generate --decoders 2` on CPU asks XLA for two host devices itself, as
    --devices and --engines do (it once failed: "decoders=2 needs one device per
    decoder, but only 1 cpu device(s) exist"). Run as a command, without the suite's
    8-device XLA flag, so the command's own setting is what counts."""
    import os
    import subprocess
    import sys

    requests = tmp_path / "in.jsonl"
    requests.write_text(json.dumps({"id": "a", "prompt": "12 + 9 =", "max_new_tokens": 3})
                        + "\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split()
                                if not flag.startswith("--xla_force_host_platform_device"))
    out = tmp_path / "out.jsonl"
    done = subprocess.run([sys.executable, "-m", "serving.cli", "generate", str(requests),
                           "--decoders", "2", "-o", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    [result] = [json.loads(line) for line in out.read_text().splitlines()]
    assert result["error"] is None and result["text"].startswith(" 21")


def test_host_devices_cover_the_decoders_the_devices_and_the_engines():
    import argparse

    from serving.cli.distributed import host_devices_per_process

    def count(**flags):
        return host_devices_per_process(argparse.Namespace(**flags))

    assert count(devices=2, decoders=4) == 4           # --devices 2 --decoders 4: four
    assert count(devices=8, decoders=2) == 8 and count(engines=3) == 3
    assert count(decoders=4, num_processes=2) == 2


def test_eldr_fit_and_prefetch_calibrate_read_the_trace_of_the_calibration_example(
        tmp_path, capsys):
    """The documented pipeline on examples/calibration.jsonl: `moejax trace` (two tokens a
    request: eldr-fit needs decode tokens), then `moejax eldr-fit` fits K=2 from it, and
    prefetch-calibrate's loader reads every request of it with its domain."""
    from moejax import checkpoint, model_dirs
    from moejax.prefetch import train

    trace = tmp_path / "calib.npz"
    assert _run_main(["trace", str(REPO / "examples" / "calibration.jsonl"), "-o", str(trace),
                      "--model", "demo-e32", "--max-new-tokens", "2",
                      "--max-batch-size", "16"]) == 0
    assert "traced 16 of 16 requests (0 with errors)" in capsys.readouterr().err
    fit = tmp_path / "eldr-2.npz"
    assert _run_main(["eldr-fit", str(trace), "-o", str(fit), "--decoders", "2"]) == 0
    assert "16 requests" in capsys.readouterr().err and fit.stat().st_size > 0
    cfg = checkpoint.load_model_config(model_dirs.resolve_model_dir("demo-e32")[0])
    requests = train.load_requests([str(trace)], cfg)
    assert len(requests) == 16 and all(r.ok for r in requests)
    from moejax.demo.corpus import DOMAINS_E32

    assert sorted({r.domain for r in requests}) == sorted(DOMAINS_E32)


def test_boundary_warnings_cross_the_grpc_wire():
    """A result's warnings survive the proto round trip that servers, the router and
    `moejax score --target` use; a result without any has none after it either."""
    from serving.grpc import convert
    from serving.requests import ScoreResult

    warned = ScoreResult(id="a", logprobs=[-0.5, -1.5], label=0, prompt_tokens=4,
                         warnings=["candidate 1 ' yes' tokenizes differently"])
    back = convert.result_from_proto(convert.result_to_proto(warned))
    assert back.warnings == warned.warnings and back.logprobs == warned.logprobs
    plain = dataclasses.replace(warned, warnings=None)
    assert convert.result_from_proto(convert.result_to_proto(plain)).warnings is None

"""Tests of serving/requests.py: request validation, op expansion and result combination.

A real ``tokenizers`` WordLevel tokenizer and a fake deterministic "model" (a
float64 function of the whole token prefix, built from a fixed random table)
stand in for the engine, so every logprob can be checked against a reference
computed independently here.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

# Run from anywhere (plain `pytest` puts tests/ on sys.path, not the repo root).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.requests import (  # noqa: E402
    NormalizeOptions, OpKey, OpOutput, PrefillOp, RequestError, ScoreRequest, ScoreResult,
    TokenizerAdapter, normalize_requests, parse_request)
from serving.results import combine_results  # noqa: E402

WORDS = ("[UNK] <s> the capital of france is paris london rome new york what ? "
         "which city : . ( ) ): / yes no please Candidate Relevant Answer option "
         "big small red blue").split() + list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
TOKENIZER_VOCAB = len(WORDS)
VOCAB = TOKENIZER_VOCAB + 5  # model vocab padded past the tokenizer's, as real models do
MAX_CONTEXT = 64


def _build_tokenizer() -> TokenizerAdapter:
    """Whitespace WordLevel tokenizer whose post-processor adds a BOS (that must not appear)."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", WORDS.index("<s>"))])
    return TokenizerAdapter(tok)


TOK = _build_tokenizer()


class FakeModel:
    """Next-token logits as a deterministic function of the whole prefix (float64)."""

    def __init__(self, vocab: int, dim: int = 16, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.embed = rng.normal(size=(vocab, dim))
        self.unembed = rng.normal(size=(dim, vocab))

    def logits(self, prefix) -> np.ndarray:
        """A leaky sum of embeddings, so every earlier token matters."""
        h = np.zeros(self.embed.shape[1])
        for t in prefix:
            h = 0.7 * h + self.embed[t]
        return h @ self.unembed

    def logprobs(self, prefix) -> np.ndarray:
        """Full-vocabulary log-softmax (the reference)."""
        x = self.logits(prefix)
        return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()

    def forward(self, op: PrefillOp, *, always_lse: bool = False) -> OpOutput:
        """What the engine would return for ``op`` (logsumexp only when asked for)."""
        rows, lses = [], []
        for pos, ids in zip(op.score_positions, op.score_token_ids):
            full = self.logits(op.token_ids[:pos + 1])
            rows.append(full[list(ids)])
            lses.append(np.log(np.sum(np.exp(full - full.max()))) + full.max())
        lse = np.array(lses) if (op.full_vocab or always_lse) else None
        return OpOutput(logits=rows, logsumexp=lse)


MODEL = FakeModel(VOCAB)


def log_softmax(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x - np.log(np.sum(np.exp(x - x.max()))) - x.max()


def seq_logprob(prompt, cand) -> float:
    """Reference log P(cand | prompt) by teacher forcing."""
    return sum(MODEL.logprobs(list(prompt) + list(cand[:j]))[cand[j]] for j in range(len(cand)))


def enc(text: str) -> list[int]:
    return TOK.encode(text)


def run(requests, *, max_context=MAX_CONTEXT, options=NormalizeOptions(), always_lse=False):
    """normalize -> fake model -> combine; returns (results, ops, errors)."""
    ops, errors, prompt_tokens = normalize_requests(
        requests, TOK, vocab_size=VOCAB, max_context=max_context, options=options)
    outputs = [MODEL.forward(op, always_lse=always_lse) for op in ops]
    return combine_results(requests, ops, outputs, errors, prompt_tokens), ops, errors


PROMPT = "the capital of france is"
GOOD = {"id": "good", "prompt": PROMPT, "candidates": [" paris", " london", " rome"]}


# ----------------------------------------------------------------------------- tokenizer
def test_adapter_encodes_without_special_tokens_and_checks_text():
    bos = WORDS.index("<s>")
    assert TOK.tokenizer.encode("paris").ids[0] == bos  # the raw tokenizer adds BOS
    assert TOK.encode("paris") == [WORDS.index("paris")]
    assert TOK.vocab_size == TOKENIZER_VOCAB
    with pytest.raises(TypeError, match="bytes"):
        TOK.encode(b"paris")
    with pytest.raises(ValueError, match="lone surrogate"):
        TOK.encode("paris \udc80")


# ----------------------------------------------------------------------------- classify
@pytest.mark.parametrize("always_lse", [False, True])
def test_single_token_classify_normalized_over_candidates(always_lse):
    results, ops, errors = run([GOOD], always_lse=always_lse)
    prompt, ids = enc(PROMPT), [enc(c)[0] for c in GOOD["candidates"]]
    assert errors == {}
    assert ops == [PrefillOp(key=OpKey(0, -1), token_ids=tuple(prompt),
                             prefix_len=len(prompt), score_positions=(len(prompt) - 1,),
                             score_token_ids=(tuple(ids),), full_vocab=False)]
    expected = log_softmax(MODEL.logits(prompt)[ids])
    (result,) = results
    np.testing.assert_allclose(result.logprobs, expected, rtol=0, atol=1e-12)
    assert np.isclose(np.exp(result.logprobs).sum(), 1.0)
    assert result.label == int(np.argmax(expected))
    assert result.prompt_tokens == len(prompt) and result.error is None
    assert result.selected is None and result.id == "good"


def test_single_token_classify_normalized_over_vocab():
    results, ops, _ = run([{**GOOD, "normalize": "vocab"}])
    assert len(ops) == 1 and ops[0].full_vocab
    ids = [enc(c)[0] for c in GOOD["candidates"]]
    expected = MODEL.logprobs(enc(PROMPT))[ids]
    np.testing.assert_allclose(results[0].logprobs, expected, rtol=0, atol=1e-12)
    assert np.exp(results[0].logprobs).sum() < 1.0


@pytest.mark.parametrize("normalize", ["candidates", "vocab"])
def test_multi_token_candidates_are_sequence_sums(normalize):
    cands = [" paris", " new york", " rome"]
    results, ops, _ = run([{"prompt": PROMPT, "candidates": cands, "normalize": normalize}])
    prompt = enc(PROMPT)
    assert [op.candidate_index for op in ops] == [0, 1, 2]  # single-token ones too: uniform
    new_york = ops[1]
    assert new_york.token_ids.tolist() == prompt + enc(" new")
    assert new_york.prefix_len == len(prompt)
    assert new_york.score_positions == (len(prompt) - 1, len(prompt))
    assert new_york.score_token_ids == ((enc(" new")[0],), (enc(" york")[0],))
    assert all(op.full_vocab for op in ops)
    seq = np.array([seq_logprob(prompt, enc(c)) for c in cands])
    expected = seq if normalize == "vocab" else log_softmax(seq)
    np.testing.assert_allclose(results[0].logprobs, expected, rtol=0, atol=1e-12)
    assert results[0].label == int(np.argmax(seq))


def test_token_id_input_with_ids_beyond_the_tokenizer():
    # Ids the tokenizer never produces but the (padded) model vocab has are fine.
    prompt, cands = [2, 3, VOCAB - 1], [[VOCAB - 2], [7, 8]]
    results, ops, errors = run([{"prompt_token_ids": [np.int64(t) for t in prompt],
                                 "candidate_token_ids": cands}])
    assert errors == {} and ops[0].token_ids.tolist() == prompt
    seq = np.array([seq_logprob(prompt, c) for c in cands])
    np.testing.assert_allclose(results[0].logprobs, log_softmax(seq), rtol=0, atol=1e-12)


def test_score_request_objects_are_accepted():
    results, _, errors = run([ScoreRequest(**GOOD)])
    assert errors == {} and results[0].id == "good" and results[0].logprobs is not None


# ----------------------------------------------------------------------------- choice
def test_choice_formats_the_prompt_and_scores_identifiers():
    req = {"id": 7, "kind": "choice", "prompt": "which city is big ?",
           "candidates": ["paris", "new york", "rome"]}
    results, ops, _ = run([req])
    text = "which city is big ?\nA. paris\nB. new york\nC. rome\nAnswer:"
    prompt = enc(text)
    ids = [enc(" A")[0], enc(" B")[0], enc(" C")[0]]
    assert len(ops) == 1
    assert ops[0].token_ids.tolist() == prompt and ops[0].score_token_ids == (tuple(ids),)
    np.testing.assert_allclose(results[0].logprobs, log_softmax(MODEL.logits(prompt)[ids]),
                               rtol=0, atol=1e-12)
    assert results[0].prompt_tokens == len(prompt) and results[0].id == 7


def test_choice_falls_back_to_sequences_for_multi_token_identifiers():
    options = NormalizeOptions(choice_identifier_template=" option {label}")
    req = {"kind": "choice", "prompt": "which city is big ?", "candidates": ["paris", "rome"]}
    results, ops, _ = run([req], options=options)
    prompt = enc("which city is big ?\nA. paris\nB. rome\nAnswer:")
    idents = [enc(" option A"), enc(" option B")]
    assert [op.candidate_index for op in ops] == [0, 1]
    assert all(len(i) == 2 for i in idents)
    seq = np.array([seq_logprob(prompt, i) for i in idents])
    np.testing.assert_allclose(results[0].logprobs, log_softmax(seq), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------- multi
@pytest.mark.parametrize("normalize", ["candidates", "vocab"])
def test_multi_equals_separate_binary_classify_requests(normalize):
    cands = ["paris", "big red rome", "london"]
    multi = {"id": "m", "kind": "multi", "prompt": PROMPT, "candidates": cands,
             "normalize": normalize}
    results, ops, _ = run([multi])
    prompt = enc(PROMPT)
    template = NormalizeOptions().multi_template
    assert [op.candidate_index for op in ops] == [0, 1, 2]
    for op, cand in zip(ops, cands):
        assert op.token_ids.tolist() == prompt + enc(template.format(candidate=cand))
        assert op.prefix_len == len(prompt) and op.full_vocab == (normalize == "vocab")
        assert op.score_token_ids == ((enc(" yes")[0], enc(" no")[0]),)

    binary = [{"prompt_token_ids": list(op.token_ids), "candidates": [" yes", " no"],
               "normalize": normalize} for op in ops]
    separate, _, _ = run(binary)
    expected = [r.logprobs[0] for r in separate]
    (result,) = results
    np.testing.assert_allclose(result.logprobs, expected, rtol=0, atol=1e-12)
    assert result.label == int(np.argmax(expected))
    # selected always uses the binary yes/no normalisation.
    p_yes = [np.exp(log_softmax(MODEL.logits(op.token_ids)[list(op.score_token_ids[0])])[0])
             for op in ops]
    assert result.selected == [k for k, p in enumerate(p_yes) if p > 0.5]
    assert result.to_dict()["selected"] == result.selected


def test_multi_with_token_ids_inserts_candidate_ids_into_the_template():
    prompt, cands = enc(PROMPT), [[WORDS.index("paris")], [VOCAB - 1, 5]]
    _, ops, errors = run([{"kind": "multi", "prompt_token_ids": prompt,
                           "candidate_token_ids": cands}])
    assert errors == {}
    before, after = enc("\nCandidate: "), enc("\nRelevant (yes/no):")
    assert [op.token_ids.tolist() for op in ops] == [prompt + before + c + after for c in cands]


def test_multi_needs_single_token_answers():
    options = NormalizeOptions(multi_answers=(" yes please", " no"))
    results, ops, errors = run([{"kind": "multi", "prompt": PROMPT, "candidates": ["rome"]},
                                GOOD], options=options)
    assert "single-token answers" in errors[0] and "' yes please' is 2 tokens" in errors[0]
    assert results[1].error is None and [op.request_index for op in ops] == [1]


# ----------------------------------------------------------------------------- errors
_LONG = " ".join(["paris"] * (MAX_CONTEXT + 1))
BAD_REQUESTS = [
    ({"id": "x", "candidates": [" paris"]}, ["request 'x'", "prompt", "neither"]),
    ({"prompt": PROMPT, "prompt_token_ids": [1], "candidates": [" paris"]},
     ["request #1", "prompt", "got both"]),
    ({"prompt": "", "candidates": [" paris"]}, ["prompt: is empty"]),
    ({"prompt_token_ids": [], "candidates": [" paris"]}, ["prompt_token_ids: is empty"]),
    ({"prompt_token_ids": [3, "4"], "candidates": [" paris"]},
     ["prompt_token_ids[1]", "must be an integer, got str"]),
    ({"prompt_token_ids": [3, True], "candidates": [" paris"]},
     ["prompt_token_ids[1]", "must be an integer, got bool"]),
    ({"prompt_token_ids": [3, VOCAB], "candidates": [" paris"]},
     ["prompt_token_ids", f"token id {VOCAB} (position 1)", f"[0, {VOCAB})"]),
    ({"prompt_token_ids": [-1], "candidates": [" paris"]}, ["prompt_token_ids", "token id -1"]),
    ({"prompt": _LONG, "candidates": [" paris"]},
     [f"prompt: has {MAX_CONTEXT + 1} tokens", f"max_context ({MAX_CONTEXT})"]),
    ({"prompt": " ".join(["paris"] * MAX_CONTEXT), "candidates": [" paris", " new york"]},
     [f"prompt ({MAX_CONTEXT} tokens)", "candidate 1", f"{MAX_CONTEXT + 1} tokens"]),
    ({"prompt": PROMPT}, ["candidates", "no candidates"]),
    ({"prompt": PROMPT, "candidates": [" paris"], "candidate_token_ids": [[1]]},
     ["candidates", "got both"]),
    ({"prompt": PROMPT, "candidates": []}, ["candidates: is empty"]),
    ({"prompt": PROMPT, "candidates": " paris"}, ["candidates: must be a list, got str"]),
    ({"prompt": PROMPT, "candidates": [" paris", " rome", " paris"]},
     ["candidates 0 and 2 are duplicates"]),
    ({"prompt": PROMPT, "candidate_token_ids": [[4], [4]]},
     ["candidate_token_ids", "candidates 0 and 1 are duplicates"]),
    ({"prompt": PROMPT, "candidates": ["paris", " paris"]}, ["tokenize identically"]),
    ({"prompt": PROMPT, "candidates": [" paris", "  "]},
     ["candidates[1]", "'  ' tokenizes to no tokens"]),
    ({"prompt": PROMPT, "candidate_token_ids": [[4], []]}, ["candidate_token_ids[1]: is empty"]),
    ({"prompt": PROMPT, "candidate_token_ids": [[4], [VOCAB + 3]]},
     ["candidate_token_ids[1]", f"token id {VOCAB + 3}"]),
    ({"prompt": PROMPT, "candidates": [" paris"], "kind": "rank"},
     ["kind: 'rank' is not one of 'classify', 'choice', 'multi'"]),
    ({"prompt": PROMPT, "candidates": [" paris"], "normalize": "softmax"},
     ["normalize: 'softmax' is not one of 'candidates', 'vocab'"]),
    ({"prompt": 42, "candidates": [" paris"]}, ["prompt: must be a str, got int"]),
    ({"prompt": PROMPT, "candidates": [" paris", 3]}, ["candidates[1]: must be a str, got int"]),
    ({"prompt": b"paris", "candidates": [" paris"]}, ["prompt: must be a str, got bytes"]),
    ({"prompt": b"\xffparis", "candidates": [" paris"]},
     ["prompt: is not valid UTF-8 (bytes, invalid at byte 0)"]),
    ({"prompt": "paris \udc80", "candidates": [" paris"]},
     ["prompt: is not valid UTF-8 text", "lone surrogate", "index 6"]),
    ({"prompt": PROMPT, "candidates": [" paris", "rome\ud800"]},
     ["candidates[1]: is not valid UTF-8 text"]),
    ({"kind": "choice", "prompt_token_ids": [1, 2], "candidates": ["paris"]},
     ["prompt_token_ids: kind 'choice' needs text"]),
    ({"kind": "choice", "prompt": PROMPT, "candidate_token_ids": [[1]]},
     ["candidate_token_ids: kind 'choice' needs text"]),
    ({"kind": "choice", "prompt": PROMPT, "candidates": [f"paris {i}" for i in range(27)]},
     ["at most 26 options, got 27"]),
    ({"kind": "choice", "prompt": PROMPT, "candidates": ["paris", " "]},
     ["candidates[1]: is blank"]),
    ({"kind": "multi", "prompt_token_ids": [1, 2], "candidates": ["paris"]},
     ["candidate_token_ids too"]),
    ({"kind": "multi", "prompt": PROMPT, "candidates": ["paris", ""]},
     ["candidates[1]", "'' tokenizes to no tokens"]),
    ({"id": [1], "prompt": PROMPT, "candidates": [" paris"]},
     ["request #1", "id: must be a string, an integer or null, got list"]),
    ({"id": "typo", "promt": PROMPT, "candidates": [" paris"]},
     ["request 'typo'", "unknown field(s) 'promt'", "accepted: id, prompt"]),
    ("the capital", ["request #1", "expected an object (dict), got str"]),
    # NumPy arrays where a str is expected: refused, never compared element-wise
    ({"prompt": PROMPT, "candidates": [" paris"], "kind": np.array(["classify", "multi"])},
     ["request #1", "kind: array(['classify', 'multi']", "is not one of"]),
    ({"prompt": PROMPT, "candidates": [" paris"], "normalize": np.array([])},
     ["normalize: array([]"]),
    ({"prompt": PROMPT, "candidates": [" paris"], "kind": np.array(["choice"])},
     ["kind: array(['choice']"]),
    ({"prompt": np.array(["paris"]), "candidates": [" paris"]},
     ["prompt: must be a str, got ndarray"]),
    ({"prompt": PROMPT, "candidates": np.array([" paris"])},
     ["candidates: must be a list, got ndarray"]),
    # ids that could not be written as UTF-8 JSON
    ({"id": "\udc80", "prompt": PROMPT, "candidates": [" paris"]},
     ["request #1: id: is not valid UTF-8 text (lone surrogate '\\udc80' at index 0)"]),
    ({"id": 10**5000, "prompt": PROMPT, "candidates": [" paris"]},
     ["request #1: id: <integer of 16610 bits> has too many digits"]),
    ({"id": np.int64(3), "prompt": PROMPT, "candidates": [" paris"]},
     ["request #1: id: must be a string, an integer or null, got int64"]),
    # token ids: floats and out-of-range integers, however large
    ({"prompt_token_ids": [3, 4.0], "candidates": [" paris"]},
     ["prompt_token_ids[1]", "must be an integer, got float"]),
    ({"prompt_token_ids": [3, np.float32(4)], "candidates": [" paris"]},
     ["prompt_token_ids[1]", "must be an integer, got float32"]),
    ({"prompt_token_ids": [3, 10**5000], "candidates": [" paris"]},
     ["prompt_token_ids", "token id <integer of 16610 bits> (position 1)"]),
    ({"prompt": PROMPT, "candidate_token_ids": [[4], [2**64]]},
     ["candidate_token_ids[1]", f"token id {2**64} (position 0)"]),
    ({"prompt": PROMPT, "candidate_token_ids": [[4], [np.uint64(2**64 - 1)]]},
     ["candidate_token_ids[1]", f"token id {2**64 - 1} (position 0)"]),
    # keys that are not field names, whatever their type
    ({"id": "k", 1: "x", None: 2, "prompt": PROMPT, "candidates": [" paris"]},
     ["request 'k': unknown field(s) '1', 'None'"]),
    (ScoreRequest(prompt=["paris"], candidates=[" paris"]), ["prompt: must be a str, got list"]),
]


@pytest.mark.parametrize("bad,fragments", BAD_REQUESTS,
                         ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_request_is_reported_and_isolated(bad, fragments):
    other = {"id": 3, "kind": "multi", "prompt": PROMPT, "candidates": ["rome", "paris"]}
    requests = [GOOD, bad, other]
    results, ops, errors = run(requests)
    assert list(errors) == [1]
    for fragment in fragments:
        assert fragment in errors[1], (fragment, errors[1])
    assert {op.request_index for op in ops} == {0, 2}
    assert [r.error is None for r in results] == [True, False, True]
    bad_result = results[1]
    assert bad_result.error == errors[1] and bad_result.logprobs is None
    assert bad_result.label is None and bad_result.prompt_tokens == 0
    # The good neighbours are scored exactly as they would be alone.
    assert results[0] == run([GOOD])[0][0]
    assert results[2].logprobs == run([other])[0][0].logprobs and results[2].id == 3


def test_error_messages_are_distinct():
    messages = [run([bad])[2][0] for bad, _ in BAD_REQUESTS]
    assert len(set(messages)) == len(messages)


def test_parse_request_raises_request_error_naming_field():
    with pytest.raises(RequestError, match=r"request #4: normalize") as info:
        parse_request({"prompt": "x", "candidates": ["y"], "normalize": "z"}, 4)
    assert info.value.index == 4 and info.value.field == "normalize"
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("request_id", ["\udc80", "ok\ud800!", "a\udfff"])
def test_id_with_a_lone_surrogate_is_refused_naming_the_id(request_id):
    with pytest.raises(RequestError, match=r"^request #2: id: is not valid UTF-8 text") as info:
        parse_request({"id": request_id, "prompt": PROMPT, "candidates": [" paris"]}, 2)
    assert info.value.field == "id" and info.value.index == 2
    # Its error result carries no id, so the whole result can be written as UTF-8 JSON.
    [result] = run([{"id": request_id, "prompt": PROMPT, "candidates": [" paris"]}])[0]
    assert result.id is None and result.error.startswith("request #0: id: ")
    json.dumps(result.to_dict(), ensure_ascii=False).encode("utf-8")


def test_numpy_array_kind_is_a_request_error_naming_kind():
    for value in (np.array(["classify"]), np.array(["classify", "multi"]), np.array([])):
        with pytest.raises(RequestError, match=r"^request 'n': kind: array\(") as info:
            parse_request({"id": "n", "prompt": PROMPT, "candidates": [" paris"],
                           "kind": value}, 0)
        assert info.value.field == "kind"


def test_odd_but_valid_forms_score_like_plain_ones():
    """NumPy strs and integers, tuples, other mappings and ScoreRequest objects are read as
    the plain JSON values they stand for."""
    import types

    class DictSubclass(dict):
        pass

    plain = [{"id": "t", "prompt": PROMPT, "candidates": [" paris", " rome"], "kind": "classify"},
             {"id": 2**70, "prompt_token_ids": [4, 5, 6], "candidate_token_ids": [[7], [8, 9]],
              "normalize": "vocab"},
             {"kind": "multi", "prompt": PROMPT, "candidates": ["rome", "paris"]}]
    odd = [DictSubclass(id=np.str_("t"), prompt=np.str_(PROMPT),
                        candidates=(np.str_(" paris"), " rome"), kind=np.str_("classify")),
           types.MappingProxyType({"id": 2**70, "prompt_token_ids": (np.int64(4), np.int32(5), 6),
                                   "candidate_token_ids": [(np.uint8(7),), [np.int16(8), 9]],
                                   "normalize": np.str_("vocab")}),
           ScoreRequest(kind=np.str_("multi"), prompt=PROMPT, candidates=("rome", "paris"))]
    assert run(odd)[0] == run(plain)[0]
    parsed = parse_request(odd[0], 0)
    assert type(parsed.kind) is str and type(parsed.prompt) is str
    assert all(type(c) is str for c in parsed.candidates)
    assert all(type(t) is int for t in parse_request(odd[1], 1).prompt_token_ids)
    assert json.dumps([r.to_dict() for r in run(odd)[0]])


def test_an_unexpected_exception_fails_only_its_request():
    """A mapping that breaks its own protocol (a value it lists but will not give) gets an
    error result naming it; its neighbours are scored as usual."""
    from test_request_fuzz import BrokenMapping

    broken = BrokenMapping({"id": "b", "prompt": PROMPT, "candidates": [" paris"]},
                           broken_key="candidates", message="no candidates today\nsecond line")
    results, ops, errors = run([GOOD, broken])
    assert list(errors) == [1] and {op.request_index for op in ops} == {0}
    assert results[1].id == "b"
    assert results[1].error == ("request 'b': request: could not be validated "
                                "(RuntimeError: no candidates today)")
    assert results[0] == run([GOOD])[0][0]


def test_unknown_keys_are_rejected_by_from_dict():
    with pytest.raises(RequestError, match=r"unknown field\(s\) 'foo', 'kinds'") as info:
        ScoreRequest.from_dict({"prompt": "x", "candidates": ["y"], "kinds": 1, "foo": 2})
    assert info.value.field == "foo"
    assert ScoreRequest.from_dict({"prompt": "x", "candidates": ["y"]}).kind == "classify"


# ----------------------------------------------------------------------------- combine
def test_results_follow_request_order_whatever_the_op_order():
    requests = [
        {"id": "a", "kind": "multi", "prompt": PROMPT, "candidates": ["rome", "paris", "blue"]},
        {"id": "b", "prompt": PROMPT, "candidates": [" paris", " new york"]},
        {"id": "c", "prompt": ""},
        {"id": 4, "kind": "choice", "prompt": "which city ?", "candidates": ["rome", "paris"]},
        {"prompt": PROMPT, "candidates": [" rome", " small"], "normalize": "vocab"},
    ]
    ops, errors, prompt_tokens = normalize_requests(requests, TOK, vocab_size=VOCAB,
                                                    max_context=MAX_CONTEXT)
    pairs = [(op, MODEL.forward(op)) for op in ops]
    in_order = combine_results(requests, *zip(*pairs), errors, prompt_tokens)
    random.Random(0).shuffle(pairs)  # a packer may run ops in any order
    shuffled = combine_results(requests, [p[0] for p in pairs], [p[1] for p in pairs],
                               errors, prompt_tokens)
    assert shuffled == in_order
    assert [r.id for r in in_order] == ["a", "b", "c", 4, None]
    assert [r.error is None for r in in_order] == [True, True, False, True, True]
    assert [sorted(r.to_dict()) for r in in_order][1] == [
        "error", "id", "label", "logprobs", "prompt_tokens"]
    json.dumps([r.to_dict() for r in in_order])  # JSONL-ready


def test_combine_rejects_outputs_that_do_not_match_their_ops():
    requests = [{**GOOD, "normalize": "vocab"}]
    ops, errors, prompt_tokens = normalize_requests(requests, TOK, vocab_size=VOCAB,
                                                    max_context=MAX_CONTEXT)
    out = MODEL.forward(ops[0])
    with pytest.raises(ValueError, match="needs logsumexp"):
        combine_results(requests, ops, [OpOutput(out.logits, None)], errors, prompt_tokens)
    with pytest.raises(ValueError, match="shape"):
        combine_results(requests, ops, [OpOutput([out.logits[0][:2]], out.logsumexp)],
                        errors, prompt_tokens)
    with pytest.raises(ValueError, match="1 ops but 0 outputs"):
        combine_results(requests, ops, [], errors, prompt_tokens)
    siblings = [{"prompt": PROMPT, "candidates": [" paris", " new york"]}]
    ops, errors, prompt_tokens = normalize_requests(siblings, TOK, vocab_size=VOCAB,
                                                    max_context=MAX_CONTEXT)
    with pytest.raises(ValueError, match="expected one op per candidate"):
        combine_results(siblings, ops[:1], [MODEL.forward(ops[0])], errors, prompt_tokens)


def test_nan_logits_fail_only_their_request():
    requests = [GOOD, {**GOOD, "id": "nan"}]
    ops, errors, prompt_tokens = normalize_requests(requests, TOK, vocab_size=VOCAB,
                                                    max_context=MAX_CONTEXT)
    outputs = [MODEL.forward(op) for op in ops]
    outputs[1].logits[0][1] = np.nan
    results = combine_results(requests, ops, outputs, errors, prompt_tokens)
    assert results[0].error is None
    assert "NaN" in results[1].error and results[1].logprobs is None


def test_score_result_to_dict_round_trips_through_json():
    result = ScoreResult(id="q", logprobs=[-0.1, -2.3], label=0, prompt_tokens=5)
    assert json.loads(json.dumps(result.to_dict())) == {
        "id": "q", "logprobs": [-0.1, -2.3], "label": 0, "prompt_tokens": 5, "error": None}


def test_byte_level_bpe_tokenizer_end_to_end():
    """A trained byte-level BPE: leading spaces matter and identifiers may split."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = ["the capital of france is paris", "the capital of italy is rome",
              "Answer: A", "Answer: B", "Candidate: paris Relevant (yes/no): yes",
              "Candidate: rome Relevant (yes/no): no"] * 5
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    adapter = TokenizerAdapter(tok)
    requests = [{"prompt": "the capital of italy is", "candidates": [" rome", " paris", " é"]},
                {"kind": "choice", "prompt": "capital of france?", "candidates": ["paris", "rome"]},
                {"kind": "multi", "prompt": "the capital", "candidates": ["paris", "rome"]}]
    vocab = adapter.vocab_size
    model = FakeModel(vocab, seed=1)
    ops, errors, prompt_tokens = normalize_requests(requests, adapter, vocab_size=vocab,
                                                    max_context=128)
    assert errors == {}
    results = combine_results(requests, ops, [model.forward(op) for op in ops], errors,
                              prompt_tokens)
    for result in results[:2]:
        assert np.isclose(np.exp(result.logprobs).sum(), 1.0)
    assert all(0.0 < np.exp(lp) < 1.0 for lp in results[2].logprobs)

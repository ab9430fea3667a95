"""Seeded fuzz of the request parsers: malformed requests never fail a whole batch.

Scoring: ``Scorer("demo").score`` gets several hundred requests, every malformed one of a
fixed catalogue (wrong types, NumPy scalars and arrays, None, nested lists, bools and
floats as token ids, ids past the vocabulary and past int64, lone surrogates, dict
subclasses, mappings with non-str keys, tuples, very long lists, ``ScoreRequest`` s built
with wrong field types) plus random extra ones, shuffled among valid requests (some in odd
but accepted forms: NumPy strs and ints, tuples, mapping types, ``ScoreRequest``
objects). Every call must return exactly one result per request, in order; each malformed
one an error naming the request and the field; each valid one what scoring it without the
others gives. Every result must be writable as UTF-8 JSON. A mapping that breaks its own
protocol gets a test of its own.

Generation: the same kind of fuzz of ``parse_generation_request`` (the whole of
``Generator``'s request handling before the model runs), without running the model.
"""

from __future__ import annotations

import collections
import json
import random
import types
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from serving import Scorer, ScoreRequest
from serving.api import resolve_model_dir
from serving.generate import GenerationRequest, parse_generation_request
from serving.requests import request_id_of as _generation_error_id  # what the generator uses
from serving.requests import RequestError, TokenizerAdapter

SEED = 14
EXTRA_BAD = 180        # random malformed requests on top of the catalogue
VALID = 130            # valid requests mixed in
VOCAB = 1024           # the demo model's
MAX_CONTEXT = 2048

PROMPTS = ("The capital of France is", "Review: lovely food and kind staff.\nSentiment:",
           "2 + 3 =", "héllo 🙂 \u200b wörld \U0010FFFF\nAnswer:", "def f(x):\n    return",
           "Claim: 2 + 2 = 5. True or false?")
SINGLE = (" a", " b", " c", " yes", " no", " true", " false", " positive", " negative",
          " the", " of", " 1", " 2", " 3")
SEVERAL = (" sum", " Paris", " x", " the city of Lyon")   # several tokens each
OPTIONS = ("red", "table", "seven", "blue", "a sum")
TOPICS = ("sports", "music", "politics", "code")


class DictSubclass(dict):
    pass


class BrokenMapping(Mapping):
    """A mapping that lists keys it then refuses to give (``broken_key``, raising
    RuntimeError(``message``)): its own request must fail."""

    def __init__(self, data, broken_key="prompt", message="broken mapping"):
        self.data, self.broken_key, self.message = data, broken_key, message

    def __iter__(self):
        return iter(self.data)

    def __len__(self):
        return len(self.data)

    def __getitem__(self, key):
        if key == self.broken_key:
            raise RuntimeError(self.message)
        return self.data[key]


def usable_id(request_id):
    """The id a result must carry: the request's id when it is usable, else None."""
    if isinstance(request_id, str):
        try:
            request_id.encode("utf-8")
        except UnicodeEncodeError:
            return None
        return request_id
    if isinstance(request_id, int) and not isinstance(request_id, bool):
        return request_id if abs(request_id) < 10**4000 else None   # json.dumps can write it
    return None


def label(request_id, index: int) -> str:
    """How an error message must start: the usable id, else the index."""
    usable = usable_id(request_id)
    if usable is None:
        return f"request #{index}:"
    return f"request {str.__str__(usable) if isinstance(usable, str) else str(int(usable))!r}:"


def n_candidates(req) -> int:
    get = req.get if isinstance(req, Mapping) else lambda name: getattr(req, name)
    candidates = get("candidates")
    return len(candidates if candidates is not None else get("candidate_token_ids"))


# ----------------------------------------------------------------------------- valid ones
def random_ids(rng: random.Random, low: int = 1, high: int = 12) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randint(low, high))]


def distinct_id_lists(rng: random.Random, n: int) -> list[list[int]]:
    out: list[list[int]] = []
    while len(out) < n:
        ids = random_ids(rng, 1, 2)
        if ids not in out:
            out.append(ids)
    return out


def valid_base(rng: random.Random) -> dict:
    """A valid request as a plain dict (no id)."""
    shape = rng.choice(("text", "text", "text", "ids", "choice", "multi", "multi_ids"))
    normalize = rng.choice(("candidates", "vocab"))
    if shape == "text":
        candidates = rng.sample(SINGLE, rng.randint(2, 4))
        if rng.random() < 0.2:
            candidates.append(rng.choice(SEVERAL))
        return {"prompt": rng.choice(PROMPTS), "candidates": candidates, "normalize": normalize}
    if shape == "ids":
        return {"prompt_token_ids": random_ids(rng),
                "candidate_token_ids": distinct_id_lists(rng, rng.randint(1, 3)),
                "normalize": normalize}
    if shape == "choice":
        return {"kind": "choice", "prompt": rng.choice(PROMPTS),
                "candidates": rng.sample(OPTIONS, rng.randint(2, 4)), "normalize": normalize}
    if shape == "multi":
        return {"kind": "multi", "prompt": rng.choice(PROMPTS),
                "candidates": rng.sample(TOPICS, rng.randint(1, 3)), "normalize": normalize}
    return {"kind": "multi", "prompt_token_ids": random_ids(rng),
            "candidate_token_ids": distinct_id_lists(rng, rng.randint(1, 3)),
            "normalize": normalize}


def oddly_typed(rng: random.Random, d: dict) -> dict:
    """The same request in accepted but unusual forms (NumPy strs and ints, tuples)."""
    d = dict(d)
    if rng.random() < 0.3:
        d["kind"] = np.str_(d.get("kind", "classify"))
        d["normalize"] = np.str_(d["normalize"])
    if "prompt" in d and rng.random() < 0.3:
        d["prompt"] = np.str_(d["prompt"])
    if "candidates" in d and rng.random() < 0.3:
        d["candidates"] = tuple(np.str_(c) if rng.random() < 0.5 else c
                                for c in d["candidates"])
    if "prompt_token_ids" in d and rng.random() < 0.5:
        kind = rng.choice((np.int64, np.int32, np.uint16, int))
        d["prompt_token_ids"] = tuple(kind(t) for t in d["prompt_token_ids"])
    if "candidate_token_ids" in d and rng.random() < 0.5:
        d["candidate_token_ids"] = [tuple(np.int64(t) for t in c)
                                    for c in d["candidate_token_ids"]]
    return d


VALID_IDS = ("a", "ïd-🙂", "", np.str_("numpy-str"), 7, -3, 2**100, 10**300)


def as_container(rng: random.Random, d: dict):
    """A dict, a dict subclass, another mapping type or a ScoreRequest."""
    form = rng.choice(("dict", "dict", "subclass", "ordered", "proxy", "dataclass"))
    if form == "subclass":
        return DictSubclass(d)
    if form == "ordered":
        return collections.OrderedDict(d)
    if form == "proxy":
        return types.MappingProxyType(d)
    if form == "dataclass":
        return ScoreRequest(**d)
    return d


def valid_request(rng: random.Random):
    d = valid_base(rng)
    if rng.random() < 0.7:
        d["id"] = rng.choice(VALID_IDS) if rng.random() < 0.3 else f"ok-{rng.randrange(10**6)}"
    return as_container(rng, oddly_typed(rng, d))


# ----------------------------------------------------------------------------- malformed ones
def _text(d: dict) -> dict:
    return {k: v for k, v in d.items() if k not in ("prompt_token_ids", "candidate_token_ids")}


BAD_CHOICES = (np.array(["classify"]), np.array(["classify", "multi"]), np.array([]),
               "Classify", None, 1, ["multi"], b"classify", np.str_("classifyy"),
               float("nan"), {"classify": 1}, True)
BAD_IDS = (1.5, True, np.int64(3), [1], {"a": 1}, b"x", "\udc80", "ok\ud800!",
           np.array([1, 2]), 10**5000, float("nan"), ("a",))
BAD_PROMPTS = (5, b"x", ["x"], np.array(["x"]), np.array(["a", "b"]), "", "\udc80",
               "a\udfffb", ("x",), 2.5)
# (value, field named in the error)
BAD_PROMPT_IDS = (([], "prompt_token_ids"), ([1.0], "prompt_token_ids[0]"),
                  ([3, True], "prompt_token_ids[1]"), ([np.bool_(True)], "prompt_token_ids[0]"),
                  ([10**30], "prompt_token_ids"), ([-1], "prompt_token_ids"),
                  ([VOCAB], "prompt_token_ids"), ([2**63], "prompt_token_ids"),
                  ([2**64 + 5], "prompt_token_ids"), ([10**5000], "prompt_token_ids"),
                  ([np.float32(1)], "prompt_token_ids[0]"), ("abc", "prompt_token_ids"),
                  (np.array([1, 2]), "prompt_token_ids"), ([[1]], "prompt_token_ids[0]"),
                  ([None], "prompt_token_ids[0]"), ([1, "2"], "prompt_token_ids[1]"),
                  ([5] * (MAX_CONTEXT + 50), "prompt"),
                  ([np.uint64(2**64 - 1)], "prompt_token_ids"))
BAD_CANDIDATES = (([], "candidates"), (" a", "candidates"), ([" a", " a"], "candidates"),
                  ([" a", None], "candidates[1]"), ([" a", ["b"]], "candidates[1]"),
                  ([" a", np.array([" b"])], "candidates[1]"),
                  ([" a", "\udc80"], "candidates[1]"), ([" a", ""], "candidates[1]"),
                  (np.array([" a", " b"]), "candidates"), ([" a", 3], "candidates[1]"),
                  ([" a", b" b"], "candidates[1]"), ({" a": 1}, "candidates"),
                  ([" a"] + [f" w{i}" for i in range(3000)] + [None], "candidates[3001]"))
BAD_CANDIDATE_IDS = (([[1], [1]], "candidate_token_ids"), ([[]], "candidate_token_ids[0]"),
                     ([[1.5]], "candidate_token_ids[0][0]"),
                     ([[True]], "candidate_token_ids[0][0]"), ([1, 2], "candidate_token_ids[0]"),
                     ([[10**40]], "candidate_token_ids[0]"), ([[-3]], "candidate_token_ids[0]"),
                     ([[VOCAB]], "candidate_token_ids[0]"),
                     (np.array([[1], [2]]), "candidate_token_ids"),
                     ([np.array([1])], "candidate_token_ids[0]"),
                     ([[np.int64(1)], [2**70]], "candidate_token_ids[1]"),
                     ([], "candidate_token_ids"), (None, "candidates"),
                     ([[i] for i in range(1, 2000)] + [[1]], "candidate_token_ids"))


def catalogue(rng: random.Random) -> list[tuple[object, str]]:
    """Every malformed request of the catalogue, each over a random valid base:
    (request, a fragment its error must contain)."""
    out: list[tuple[object, str]] = []

    def text_base() -> dict:
        while "prompt" not in (d := valid_base(rng)):
            pass
        return _text(d)

    def ids_base() -> dict:
        while "prompt_token_ids" not in (d := valid_base(rng)):
            pass
        return d

    def add(d: dict, fragment: str) -> None:
        out.append((d, fragment))

    for value in BAD_CHOICES:
        add({**text_base(), "id": "bad-kind", "kind": value}, ": kind: ")
        add({**ids_base(), "normalize": value}, ": normalize: ")
    for value in BAD_IDS:
        add({**text_base(), "id": value}, ": id: ")
    for value in BAD_PROMPTS:
        add({**text_base(), "id": f"p{len(out)}", "prompt": value}, ": prompt: ")
    add({**text_base(), "prompt": None}, ": prompt: give exactly one")
    for value, field in BAD_PROMPT_IDS:
        add({**ids_base(), "id": len(out), "prompt_token_ids": value}, f": {field}: ")
    for value, field in BAD_CANDIDATES:
        add({**text_base(), "candidates": value}, f": {field}: ")
    for value, field in BAD_CANDIDATE_IDS:
        add({**ids_base(), "id": f"c{len(out)}", "candidate_token_ids": value}, f": {field}: ")
    # forms a kind cannot use, and both forms at once
    add({**text_base(), "prompt_token_ids": [1, 2]}, ": prompt: give exactly one")
    add({**ids_base(), "candidates": [" a"]}, ": candidates: give only one")
    add({"kind": "choice", "prompt_token_ids": [1, 2], "candidates": ["x", "y"]},
        ": prompt_token_ids: kind 'choice'")
    add({"kind": "choice", "prompt": "Pick", "candidate_token_ids": [[1], [2]]},
        ": candidate_token_ids: kind 'choice'")
    add({"kind": "choice", "prompt": "Pick", "candidates": [f"o{i}" for i in range(27)]},
        ": candidates: kind 'choice' takes at most 26")
    add({"kind": "choice", "prompt": "Pick", "candidates": ["x", "  "]}, ": candidates[1]: ")
    add({"kind": "multi", "prompt_token_ids": [1, 2], "candidates": ["x"]},
        ": candidates: kind 'multi'")
    # unknown and non-str keys
    for key in ("promt", 1, None, ("a",), b"prompt", 2.5):
        add({**text_base(), "id": f"k{len(out)}", key: "x"}, "unknown field(s)")
    # not a mapping at all
    for obj in (None, "a string", 42, [1, 2], np.array([1]), ("prompt", "x"), b"{}",
                {"prompt", "candidates"}):
        out.append((obj, "expected an object"))
    # ScoreRequests built with wrong field types
    for kwargs, fragment in (
            ({"prompt": ["x"], "candidates": [" a"]}, ": prompt: "),
            ({"prompt": "x", "candidates": " ab"}, ": candidates: "),
            ({"prompt": "x", "candidates": [" a"], "kind": np.array(["classify", "multi"])},
             ": kind: "),
            ({"prompt": "x", "candidates": [" a"], "normalize": None}, ": normalize: "),
            ({"prompt": "x", "candidates": [" a"], "id": object()}, ": id: "),
            ({"prompt_token_ids": np.array([1, 2]), "candidate_token_ids": [[1]]},
             ": prompt_token_ids: "),
            ({"prompt": "x", "candidates": {" a": 1}}, ": candidates: "),
            ({"id": "sr", "prompt": "x", "candidate_token_ids": [[1.0]]},
             ": candidate_token_ids[0][0]: ")):
        out.append((ScoreRequest(**kwargs), fragment))
    return out


def in_other_mapping(rng: random.Random, obj):
    """A plain dict as a dict subclass, an OrderedDict or a read-only mapping, at random."""
    if type(obj) is not dict:
        return obj
    form = rng.choice((dict, DictSubclass, collections.OrderedDict, types.MappingProxyType))
    return form(obj)


def fuzz_batch(seed: int):
    """(requests, expected) with expected[i] = None for a valid request, else the fragment
    its error must contain: the whole catalogue, EXTRA_BAD random picks from three more
    catalogues (other random bases, random mapping types) and VALID valid requests,
    shuffled."""
    rng = random.Random(seed)
    more = [item for _ in range(3) for item in catalogue(rng)]
    extra = [(in_other_mapping(rng, req), frag)
             for req, frag in (rng.choice(more) for _ in range(EXTRA_BAD))]
    items = (catalogue(rng) + extra
             + [(valid_request(rng), None) for _ in range(VALID)])
    rng.shuffle(items)
    return [req for req, _ in items], [frag for _, frag in items]


def request_id(obj):
    """The id a request carries (a mapping's "id", a request object's ``id``)."""
    if isinstance(obj, Mapping):
        return obj.get("id")
    return obj.id if isinstance(obj, (ScoreRequest, GenerationRequest)) else None


def assert_writable(result) -> None:
    """Every result goes out as JSON in UTF-8."""
    json.dumps(result.to_dict(), ensure_ascii=False).encode("utf-8")


def assert_same_score(got, want, where: str) -> None:
    assert got.error is None and want.error is None, (where, got.error, want.error)
    assert got.id == want.id and got.prompt_tokens == want.prompt_tokens, where
    assert got.selected == want.selected, where
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5, err_msg=where)
    if got.label != want.label:   # only a near tie may flip the label
        assert abs(got.logprobs[got.label] - got.logprobs[want.label]) < 1e-5, where


# ----------------------------------------------------------------------------- scoring
@pytest.fixture(scope="module")
def scorer() -> Scorer:
    return Scorer("demo", dtype="float32", max_batch_tokens=512)


def test_fuzzed_batch_fails_only_its_malformed_requests(scorer):
    assert (scorer.config.vocab_size, scorer.config.max_context) == (VOCAB, MAX_CONTEXT)
    requests, expected = fuzz_batch(SEED)
    assert sum(e is not None for e in expected) >= 300 and expected.count(None) == VALID
    results = scorer.score(requests)
    assert len(results) == len(requests)
    for index, (req, want, result) in enumerate(zip(requests, expected, results)):
        assert_writable(result)
        rid = request_id(req)
        assert result.id == usable_id(rid), index
        if want is None:
            assert result.error is None, (index, result.error)
            assert len(result.logprobs) == n_candidates(req)
            continue
        assert result.error is not None, (index, req)
        assert result.logprobs is None and result.label is None and result.prompt_tokens == 0
        assert result.error.startswith(label(rid, index)), (index, result.error)
        assert want in result.error, (index, want, result.error)

    # The valid requests scored without the malformed ones: the same answers.
    valid = [i for i, e in enumerate(expected) if e is None]
    alone = scorer.score([requests[i] for i in valid])
    for i, want in zip(valid, alone):
        assert_same_score(results[i], want, f"request #{i}")
    # A few truly alone.
    for i in random.Random(SEED).sample(valid, 4):
        [want] = scorer.score([requests[i]])
        assert_same_score(results[i], want, f"request #{i} alone")


def test_a_mapping_that_breaks_its_protocol_fails_only_its_request(scorer):
    good = {"id": "g", "prompt": "x", "candidates": [" a", " b"]}
    broken = BrokenMapping({"id": "broken", "prompt": "x", "candidates": [" a"]})
    results = scorer.score([broken, good])
    assert results[0].id == "broken" and results[0].error.startswith(
        "request 'broken': request: could not be validated (RuntimeError: broken mapping)")
    assert_same_score(results[1], scorer.score([good])[0], "good")


def test_numpy_array_kind_fails_only_its_request(scorer):
    good = {"id": "g", "prompt": "x", "candidates": [" a", " b"]}
    requests = [{"prompt": "x", "candidates": [" a", " b"], "kind": np.array(["classify"])},
                {"id": "n", "prompt": "x", "candidates": [" a", " b"],
                 "normalize": np.array(["vocab", "candidates"])},
                good]
    results = scorer.score(requests)
    assert results[0].error.startswith("request #0: kind: array(['classify']")
    assert results[1].error.startswith("request 'n': normalize: array(")
    assert_same_score(results[2], scorer.score([good])[0], "good")


# ----------------------------------------------------------------------------- generation
@pytest.fixture(scope="module")
def tokenizer() -> TokenizerAdapter:
    model_dir, _ = resolve_model_dir("demo")
    return TokenizerAdapter.from_file(str(Path(model_dir) / "tokenizer.json"))


GEN_BAD = {  # field -> values it refuses (the error names the field)
    "max_new_tokens": (0, -1, 1.5, True, "3", 10**30, np.float64(4), MAX_CONTEXT + 1),
    "temperature": (-1, float("nan"), float("inf"), -float("inf"), 1e300, 10**400, "1",
                    True, np.float64(1e39), 3.5e38, 1e-40, [1.0], np.complex128(1)),
    "top_p": (0, -0.1, 1.5, float("nan"), 1e-50, "0.9", True, np.array([0.5]), 1e300, 10**400),
    "seed": (-1, 2**64, 1.0, True, "1", 10**5000, np.float32(3)),
    "stop_token_ids": ([VOCAB], [-1], [1.0], "1", [True], np.array([1]), 5, [10**5000]),
    "id": BAD_IDS,
    "prompt": BAD_PROMPTS,
}
GEN_GOOD = {
    "max_new_tokens": (None, 1, 7, np.int64(4), np.uint8(3)),
    "temperature": (None, 0, 0.0, 0.7, 2, np.float32(0.5), np.float16(1.0), 3.4e38, 1.2e-38),
    "top_p": (None, 1, 0.9, np.float64(0.5), 1e-30, 1e-40),
    "seed": (None, 0, 2**64 - 1, np.uint64(2**64 - 1), np.int64(7)),
    "stop_token_ids": (None, [], [1, 2], (3,), [np.int64(5)]),
    "id": (None, "g", "ïd-🙂", 5, 2**100),
}


def parse_gen(obj, index: int, tokenizer: TokenizerAdapter):
    return parse_generation_request(obj, index, tokenizer, vocab_size=VOCAB,
                                    max_context=MAX_CONTEXT, default_stop=frozenset({0}))


def gen_valid(rng: random.Random) -> dict:
    d = ({"prompt": rng.choice(PROMPTS)} if rng.random() < 0.5
         else {"prompt_token_ids": random_ids(rng)})
    for field, values in GEN_GOOD.items():
        value = rng.choice(values)
        if value is not None:
            d[field] = value
    return d


def as_gen_container(rng: random.Random, d: dict):
    form = rng.choice(("dict", "subclass", "proxy", "dataclass"))
    return (d if form == "dict" else DictSubclass(d) if form == "subclass"
            else types.MappingProxyType(d) if form == "proxy" else GenerationRequest(**d))


def check_spec(spec, d: Mapping, tokenizer: TokenizerAdapter) -> None:
    """A valid request's spec holds exactly what it asked for (defaults where absent)."""
    prompt = (tokenizer.encode(d["prompt"]) if d.get("prompt") is not None
              else [int(t) for t in d["prompt_token_ids"]])
    assert spec.prompt == tuple(prompt)
    get = lambda name, default: default if d.get(name) is None else d[name]  # noqa: E731
    assert spec.max_new_tokens == int(get("max_new_tokens", 16))
    assert spec.temperature == float(get("temperature", 0.0))
    assert np.isfinite(np.float32(spec.temperature))
    assert spec.top_p == float(get("top_p", 1.0)) and np.float32(spec.top_p) > 0
    assert spec.seed == int(get("seed", 0))
    stop = get("stop_token_ids", None)
    assert spec.stop_token_ids == (frozenset({0}) if stop is None
                                   else frozenset(int(t) for t in stop))


def test_generation_parser_fuzz(tokenizer):
    """Every request gives a SequenceSpec holding what it asked for, or a RequestError
    naming it and the field (never another exception: Generator.generate would fail the
    whole batch); the id its error result carries can be written as UTF-8 JSON."""
    rng = random.Random(SEED)
    cases: list[tuple[object, str | None]] = []
    for field, values in GEN_BAD.items():
        for value in values:
            cases.append(({**gen_valid(rng), field: value}, f": {field}"))
    for _ in range(60):
        field = rng.choice(list(GEN_BAD))
        cases.append(({**gen_valid(rng), field: rng.choice(GEN_BAD[field])}, f": {field}"))
    for value, field in BAD_PROMPT_IDS:
        if field == "prompt":   # too long: for generation, prompt + max_new_tokens
            field = "max_new_tokens"
        d = {k: v for k, v in gen_valid(rng).items() if k != "prompt"}
        cases.append(({**d, "prompt_token_ids": value}, f": {field.split('[')[0]}"))
    cases += [({"prompt": "x", "prompt_token_ids": [1]}, ": prompt: give exactly one"),
              ({"max_new_tokens": 3}, ": prompt: give exactly one"),
              ({"prompt": "x", "temprature": 1}, "unknown field(s) 'temprature'"),
              ({"prompt": "x", 1: 2}, "unknown field(s) '1'"),
              (None, "expected an object"), ([("prompt", "x")], "expected an object"),
              (np.array([1]), "expected an object"),
              (GenerationRequest(prompt=["x"]), ": prompt: "),
              (GenerationRequest(prompt="x", temperature=np.array([0.5, 1])), ": temperature: "),
              (BrokenMapping({"id": 3, "prompt": "x"}), "could not be validated (RuntimeError")]
    cases += [(as_gen_container(rng, gen_valid(rng)), None) for _ in range(80)]
    rng.shuffle(cases)
    assert len(cases) >= 200
    for index, (obj, fragment) in enumerate(cases):
        if fragment is None:
            spec = parse_gen(obj, index, tokenizer)
            check_spec(spec, obj if isinstance(obj, Mapping) else dict(vars(obj)), tokenizer)
            continue
        with pytest.raises(RequestError) as info:
            parse_gen(obj, index, tokenizer)
        message = str(info.value)
        assert message.startswith(label(request_id(obj), index)), (index, message)
        assert _generation_error_id(obj) == usable_id(request_id(obj))
        json.dumps({"id": _generation_error_id(obj), "error": message},
                   ensure_ascii=False).encode("utf-8")
        assert fragment in message, (index, fragment, message)


@pytest.mark.parametrize("field, value, fragment", [
    ("temperature", 1e300, "must fit in float32"),
    ("temperature", 10**400, "must fit in float32"),
    ("temperature", float("inf"), "must be finite"),
    ("temperature", float("nan"), "must be finite"),
    ("temperature", 1e-40, "smallest normal float32"),
    ("top_p", float("nan"), "must be finite"),
    ("top_p", 1e-50, "must not round to 0 in float32"),
    ("top_p", 1e300, "must fit in float32"),
], ids=["1e300", "10**400", "inf", "nan", "1e-40", "top_p-nan", "top_p-1e-50", "top_p-1e300"])
def test_generation_refuses_sampling_values_float32_cannot_hold(tokenizer, field, value,
                                                                 fragment):
    with pytest.raises(RequestError, match=f"^request 'r': {field}: .*{fragment}") as info:
        parse_gen({"id": "r", "prompt": "x", field: value}, 0, tokenizer)
    assert info.value.field == field

"""The scoring request shapes other servers speak, each mapped onto moejax's own request
kinds (``serving.requests``), and their results rendered back in that server's shape.

* SGLang ``POST /v1/score`` (:class:`SGLangScore`): for each item, the text (or token ids)
  ``query + item`` (``item + query`` with ``item_first``) is a "classify" request over the
  single-token candidates ``label_token_ids``: ``scores[i][j]`` is the probability of
  label token j after it, normalized over the vocabulary, or over the label tokens with
  ``apply_softmax``.
* vLLM ``POST /score`` (:class:`VllmScore`) and ``POST /rerank`` (:class:`Rerank`,
  Cohere/Jina style): relevance of a document to a query is the "multi" kind's binary
  judgment, P(yes) over {yes, no} after the prompt with the document in the server's
  ``multi_template`` (``"\\nCandidate: {candidate}\\nRelevant (yes/no):"`` by default), the
  way LLM rerankers score. The documents of one query are one request: the query is
  computed once for all.
* ``POST /classify`` (:class:`Classify`): each input is a "classify" request over the
  label candidates (text, scored whole, multi-token ones too); ``probs`` are normalized
  over the labels, ``label`` is the most probable.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Shape(BaseModel):
    # Unknown fields are refused by name (a typo must not pass silently); ``model`` is
    # accepted and ignored (one model per server), as the other servers take it.
    model_config = ConfigDict(extra="forbid")
    model: str | None = None


class SGLangScore(_Shape):
    query: str | list[int]
    items: list[str] | list[list[int]] = Field(min_length=1)
    label_token_ids: list[int] = Field(min_length=1)
    apply_softmax: bool = False
    item_first: bool = False

    @model_validator(mode="after")
    def _same_form(self) -> "SGLangScore":
        text = isinstance(self.query, str)
        if any(isinstance(item, str) != text for item in self.items):
            raise ValueError("query and items must both be text or both be token ids")
        return self


class VllmScore(_Shape):
    text_1: str | list[str]
    text_2: str | list[str]

    @model_validator(mode="after")
    def _pairs(self) -> "VllmScore":
        if isinstance(self.text_1, list):
            if not self.text_1:
                raise ValueError("text_1 must not be empty")
            if isinstance(self.text_2, list) and len(self.text_2) != len(self.text_1):
                raise ValueError(f"text_1 and text_2 are lists of {len(self.text_1)} and "
                                 f"{len(self.text_2)} texts: pairs need equal lengths")
            if not isinstance(self.text_2, list):
                raise ValueError("text_1 is a list: text_2 must be a list of as many texts")
        elif isinstance(self.text_2, list) and not self.text_2:
            raise ValueError("text_2 must not be empty")
        return self


class Document(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str


class Rerank(_Shape):
    query: str
    documents: list[str | Document] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True


class Classify(_Shape):
    """``labels``: the label candidates a language model scores; absent, the model's own
    classification head answers (a ``*ForSequenceClassification`` checkpoint)."""

    input: str | list[str]
    labels: list[str] | None = Field(default=None, min_length=2)

    @model_validator(mode="after")
    def _inputs(self) -> "Classify":
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        return self


# ----------------------------------------------------------------------------- requests
def sglang_requests(body: SGLangScore) -> list[dict[str, Any]]:
    out = []
    for item in body.items:
        first, second = (item, body.query) if body.item_first else (body.query, item)
        request: dict[str, Any] = {"kind": "classify",
                                   "candidate_token_ids": [[t] for t in body.label_token_ids],
                                   "normalize": "candidates" if body.apply_softmax else "vocab"}
        if isinstance(first, str):
            request["prompt"] = first + second
        else:
            request["prompt_token_ids"] = list(first) + list(second)
        out.append(request)
    return out


def relevance_requests(query: str, documents: Sequence[str]) -> list[dict[str, Any]]:
    """One "multi" request: the documents of one query."""
    return [{"kind": "multi", "prompt": query, "candidates": list(documents)}]


def vllm_score_pairs(body: VllmScore) -> list[tuple[str, str]]:
    if isinstance(body.text_1, list):
        return list(zip(body.text_1, body.text_2))
    seconds = body.text_2 if isinstance(body.text_2, list) else [body.text_2]
    return [(body.text_1, text) for text in seconds]


def pair_requests(pairs: Sequence[tuple[str, str]]) -> tuple[list[dict[str, Any]],
                                                             list[tuple[int, int]]]:
    """Pairs grouped by query (one "multi" request per distinct query, in first-seen
    order) -> (requests, (request, candidate) of each pair)."""
    requests: list[dict[str, Any]] = []
    where: dict[str, int] = {}
    places = []
    for query, document in pairs:
        if query not in where:
            where[query] = len(requests)
            requests.append({"kind": "multi", "prompt": query, "candidates": []})
        candidates = requests[where[query]]["candidates"]
        places.append((where[query], len(candidates)))
        candidates.append(document)
    return requests, places


def classify_requests(body: Classify) -> list[dict[str, Any]]:
    inputs = body.input if isinstance(body.input, list) else [body.input]
    if body.labels is None:
        return [{"kind": "head", "prompt": text} for text in inputs]
    return [{"kind": "classify", "prompt": text, "candidates": list(body.labels),
             "normalize": "candidates"} for text in inputs]


# ----------------------------------------------------------------------------- responses
def _usage(results: Sequence[Any]) -> dict[str, int]:
    tokens = sum(r.prompt_tokens for r in results)
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def sglang_response(results: Sequence[Any], model: str) -> dict[str, Any]:
    return {"scores": [[math.exp(x) for x in r.logprobs] for r in results], "model": model,
            "usage": _usage(results), "object": "scoring"}


def vllm_score_response(results: Sequence[Any], places: Sequence[tuple[int, int]],
                        model: str) -> dict[str, Any]:
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": model, "usage": _usage(results),
            "data": [{"index": i, "object": "score",
                      "score": math.exp(results[r].logprobs[c])}
                     for i, (r, c) in enumerate(places)]}


def rerank_response(body: Rerank, result: Any, model: str) -> dict[str, Any]:
    texts = document_texts(body)
    ranked = sorted(range(len(texts)), key=lambda i: (-result.logprobs[i], i))
    out = []
    for i in ranked[:body.top_n or len(ranked)]:
        entry: dict[str, Any] = {"index": i, "relevance_score": math.exp(result.logprobs[i])}
        if body.return_documents:
            entry["document"] = {"text": texts[i]}
        out.append(entry)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": _usage([result]),
            "results": out}


def classify_response(body: Classify, results: Sequence[Any], model: str,
                      head_labels: Sequence[str] = ()) -> dict[str, Any]:
    """vLLM's classify response: per input the best label and the probabilities over the
    labels (a head's raw outputs too, as ``scores``; a reward model's score alone: label and
    probs null)."""
    labels = body.labels if body.labels is not None else head_labels

    def item(i: int, r: Any) -> dict[str, Any]:
        out = {"index": i, "label": None if r.label is None else labels[r.label],
               "probs": None if r.logprobs is None else [math.exp(x) for x in r.logprobs],
               "num_classes": len(labels)}
        if r.scores is not None:
            out["scores"] = r.scores
        return out

    return {"id": f"classify-{uuid.uuid4().hex}", "object": "list",
            "created": int(time.time()), "model": model, "usage": _usage(results),
            "data": [item(i, r) for i, r in enumerate(results)]}


def document_texts(body: Rerank) -> list[str]:
    return [d if isinstance(d, str) else d.text for d in body.documents]


__all__ = ("Classify", "Rerank", "SGLangScore", "VllmScore", "classify_requests",
           "classify_response", "document_texts", "pair_requests", "relevance_requests",
           "rerank_response", "sglang_requests", "sglang_response", "vllm_score_pairs",
           "vllm_score_response")

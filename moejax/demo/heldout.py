"""Held-out scoring requests for the demo model, their expected answers, and accuracy.

Every request is built from the evaluation split of :mod:`moejax.demo.corpus` (held-out
source files and licences, held-out operand pairs for the sum tasks, seeds the training
stream never uses), in the scoring API's own request kinds:

* ``domain_question``   -- "classify" over the domain names (`` code``/`` prose``/`` math``/
  `` data`` for the demo, the eight of :data:`moejax.demo.corpus.DOMAINS_E32` for demo-e32);
* ``arithmetic_yes_no`` -- "classify" over `` yes``/`` no``;
* ``arithmetic_claim``  -- "classify" over `` true``/`` false``;
* ``multiple_choice``   -- "choice" (the API renders ``A. ...`` lines and ``Answer:``);
* ``multi_selection``   -- "multi" over the domain names (``selected`` is scored);
* ``product``           -- "classify" with multi-token candidates: products of one-digit
  numbers from 54 up (`` 56``) are two tokens, so the sequence log-probabilities decide.
  (The 81 products are not held out, only these items are new.)

``python -m moejax.demo.heldout OUT_DIR`` writes the request files of ``examples/``.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from moejax.demo import corpus

TASKS = ("domain_question", "arithmetic_yes_no", "arithmetic_claim", "multiple_choice",
         "multi_selection", "product")
HELDOUT_SEED = 1000      # training streams use seeds 0 (train split) and 1 (held-out loss)


@dataclass(frozen=True)
class Item:
    """One request and its expected answer: ``label`` (candidate index) or, for kind
    "multi", the expected ``selected`` indices."""

    task: str
    request: dict[str, Any]
    label: int | None = None
    selected: tuple[int, ...] | None = None


def _product_item(rng: np.random.Generator, rid: str) -> Item:
    """``a * b =`` with a, b in 6..9, so most candidates (54 and up) are two tokens."""
    a, b = (int(x) for x in rng.integers(6, 10, 2))
    options = {a * b}
    while len(options) < 4:   # near misses: nearby rows and columns of the table (+-2,
        da, db = (int(x) for x in rng.integers(-2, 3, 2))   # since 9 * 9 has 3 at +-1)
        if 1 <= a + da <= 9 and 1 <= b + db <= 9:
            options.add((a + da) * (b + db))
    values = sorted(options)
    values = [values[i] for i in rng.permutation(len(values))]
    request = {"id": rid, "prompt": f"{a} * {b} =", "candidates": [f" {v}" for v in values]}
    return Item("product", request, label=values.index(a * b))


def _from_example(task: str, ex: corpus.Example, rid: str) -> Item:
    if task == "multiple_choice":
        question, rest = ex.prompt.split("\n", 1)
        options = [line.split(". ", 1)[1] for line in rest.split("\n")[:-1]]
        request = {"id": rid, "kind": "choice", "prompt": question, "candidates": options}
        return Item(task, request, label=corpus.LETTERS.index(ex.answer.strip()))
    request = {"id": rid, "prompt": ex.prompt, "candidates": list(ex.candidates)}
    return Item(task, request, label=list(ex.candidates).index(ex.answer))


def _multi_item(src: corpus.Sources, rng: np.random.Generator, rid: str) -> Item:
    """A whole "multi" request: a text of one or two domains, every domain a candidate."""
    domains = src.domains
    present, body = corpus.mixed_domain_text(src, rng)
    request = {"id": rid, "kind": "multi", "prompt": f"Text: {body}{corpus.MULTI_QUESTION}",
               "candidates": list(domains)}
    return Item("multi_selection", request,
                selected=tuple(sorted(domains.index(d) for d in present)))


def heldout_items(task: str, count: int, seed: int = HELDOUT_SEED,
                  src: corpus.Sources | None = None,
                  domains: tuple[str, ...] = corpus.DOMAINS) -> list[Item]:
    """``count`` held-out items of ``task`` (deterministic for a seed) over ``domains``
    (the held-out split of those domains unless ``src`` is given)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    rng = np.random.default_rng(seed + TASKS.index(task))
    if task == "product":
        return [_product_item(rng, f"product-{i}") for i in range(count)]
    src = src or corpus.sources("eval", tuple(domains))
    if task == "multi_selection":
        return [_multi_item(src, rng, f"multi-{i}") for i in range(count)]
    return [_from_example(task, corpus.TASKS[task](src, rng), f"{task}-{i}")
            for i in range(count)]


def accuracy(scorer, items: Sequence[Item]) -> float:
    """Fraction of items the scorer answers as expected (kind "multi": the exact set)."""
    results = scorer.score([item.request for item in items])
    right = 0
    for item, result in zip(items, results):
        if result.error is not None:
            raise RuntimeError(f"{item.request.get('id')}: {result.error}")
        if item.selected is not None:
            right += tuple(result.selected) == item.selected
        else:
            right += result.label == item.label
    return right / max(len(items), 1)


def write_examples(out_dir: str, per_task: int = 4) -> dict[str, str]:
    """Write one request file per request kind into ``out_dir`` and the expected answers
    into ``demo_expected.json``; returns {file name: what it shows}."""
    src = corpus.sources("eval")
    items = {task: heldout_items(task, per_task, src=src) for task in TASKS}
    files = {
        "demo_classify.jsonl": ("classify with single-token candidates",
                                items["domain_question"] + items["arithmetic_yes_no"]
                                + items["arithmetic_claim"]),
        "demo_choice.jsonl": ("multiple choice (kind choice)", items["multiple_choice"]),
        "demo_multi.jsonl": ("multi-selection (kind multi)", items["multi_selection"]),
        "demo_multitoken.jsonl": ("classify with multi-token candidates", items["product"]),
        "demo_vocab_normalize.jsonl": ("normalize=vocab: probabilities over the vocabulary",
                                       [Item(i.task, {**i.request, "id": i.request["id"] + "-vocab",
                                                      "normalize": "vocab"}, i.label, i.selected)
                                        for i in items["arithmetic_yes_no"][:2]
                                        + items["domain_question"][:2]]),
    }
    expected: dict[str, Any] = {}
    os.makedirs(out_dir, exist_ok=True)
    for name, (_, chosen) in files.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as fh:
            for item in chosen:
                fh.write(json.dumps(item.request) + "\n")
                expected[item.request["id"]] = (
                    {"selected": list(item.selected)} if item.selected is not None
                    else {"label": item.label})
    with open(os.path.join(out_dir, "demo_expected.json"), "w", encoding="utf-8") as fh:
        json.dump(expected, fh, indent=1, sort_keys=True)
        fh.write("\n")
    return {name: what for name, (what, _) in files.items()}


if __name__ == "__main__":
    for name, what in write_examples(sys.argv[1] if len(sys.argv) > 1 else "examples").items():
        print(f"{name}: {what}")

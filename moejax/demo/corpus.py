"""The demo models' training data: a four- or eight-domain corpus plus labelled task text.

The small demo's domains (:data:`DOMAINS`), all taken from what ships with Python and
Debian or generated here:

* ``code``  -- windows of lines from the Python standard library's top-level ``*.py`` files;
* ``prose`` -- English docstrings of those files (via ``ast``) and the licence texts in
  ``/usr/share/common-licenses``;
* ``math``  -- generated arithmetic (``12 + 9 = 21``);
* ``data``  -- generated JSON records and CSV tables.

demo-e32's eight domains (:data:`DOMAINS_E32`): ``python`` (the ``code`` texts), ``c``,
``shell``, ``prose``, ``config``, ``debian`` (read from the system by
:mod:`moejax.demo.system_texts`), ``math`` and ``data``. A :class:`Sources` holds one
split of one domain set; the tasks ask about the domains of their ``Sources``.

Tasks, each with a fixed answer format that matches the scoring API's templates
(``serving.requests.NormalizeOptions``), so "classify", "choice" and "multi" requests
work on the demo as they were trained:

* domain question: ``Text: ...\\nQuestion: Which domain is this? Answer: code``;
* arithmetic yes/no: ``Is 12 + 9 = 21? Answer: yes``;
* arithmetic claim: ``Claim: 12 + 9 = 20.\\nTrue or false? false``;
* multiple choice: ``What is 12 + 9?\\nA. 19\\nB. 21\\n...\\nAnswer: B``;
* multi-selection: ``Text: ...\\nWhich domains does it contain?\\nCandidate: math\\n
  Relevant (yes/no): yes`` (the text may mix two domains).

Splits: source files and licences are split by name (every ``HELD_OUT_EVERY``-th file of
the sorted list is held out); generated items use separate seeds, and the arithmetic
tasks hold out a fixed set of operand pairs (:func:`pair_split`), whose sums the model
only ever sees as plain equations in the math corpus.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Literal

import numpy as np

Split = Literal["train", "eval"]
DOMAINS = ("code", "prose", "math", "data")
DOMAINS_E32 = ("python", "c", "shell", "prose", "config", "debian", "math", "data")
HELD_OUT_EVERY = 7
LICENCE_DIR = Path("/usr/share/common-licenses")
MAX_OPERAND = 15          # a + b with 0 <= a, b <= MAX_OPERAND: a table a tiny model can learn
DOMAIN_QUESTION = "\nQuestion: Which domain is this? Answer:"
MULTI_QUESTION = "\nWhich domains does it contain?"
LETTERS = ("A", "B", "C", "D")

_NAMES = ("Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Anna", "Tom",
          "Olga", "Ravi", "Mei", "Jonas", "Lena", "Omar")
_CITIES = ("Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Berlin", "Madrid", "Delhi", "Quito",
           "Dakar", "Seoul", "Rome")
_ITEMS = ("apple", "bread", "lamp", "chair", "pen", "cable", "book", "cup", "shirt", "tyre")


@dataclass(frozen=True)
class Example:
    """One training or evaluation text; ``answer`` is the labelled answer of a task item
    (with its leading space), ``candidates`` the answers it was chosen from."""

    kind: str                       # a domain name for plain text, else the task name
    domain: str                     # the domain of the text (tasks: their topic's domain)
    text: str
    prompt: str = ""
    answer: str = ""
    candidates: tuple[str, ...] = ()


# ====================================================================== source texts
def stdlib_dir() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _split_files(paths: list[Path], split: Split) -> list[Path]:
    held = [p for i, p in enumerate(sorted(paths)) if i % HELD_OUT_EVERY == 3]
    return held if split == "eval" else [p for p in sorted(paths) if p not in held]


def _read_ascii(path: Path) -> str:
    """File text with non-ASCII characters dropped (they would waste the tiny vocabulary)."""
    return path.read_bytes().decode("utf-8", "ignore").encode("ascii", "ignore").decode()


def code_files(split: Split) -> list[Path]:
    return _split_files([p for p in stdlib_dir().glob("*.py") if p.is_file()], split)


def code_chunks(split: Split) -> list[str]:
    """Windows of 4-10 consecutive non-blank lines, every source file of the split."""
    out = []
    for path in code_files(split):
        lines = [ln.rstrip() for ln in _read_ascii(path).splitlines()]
        lines = [ln for ln in lines if ln.strip() and len(ln) < 100]
        step = 7
        for start in range(0, max(0, len(lines) - 4), step):
            chunk = "\n".join(lines[start:start + 4 + (start // step) % 7])
            if re.search(r"[A-Za-z]", chunk):
                out.append(chunk)
    return out


def _paragraphs(text: str) -> Iterator[str]:
    """Blank-line separated paragraphs, whitespace collapsed, mostly letters."""
    for para in re.split(r"\n\s*\n", text):
        flat = " ".join(para.split())
        letters = sum(c.isalpha() or c == " " for c in flat)
        if len(flat) >= 60 and letters >= 0.85 * len(flat) and ">>>" not in flat:
            yield flat


def _sentence_windows(para: str, max_chars: int = 400) -> Iterator[str]:
    """A long paragraph cut at sentence ends into pieces of at most ``max_chars``."""
    piece = ""
    for sentence in re.split(r"(?<=[.!?]) ", para):
        if piece and len(piece) + len(sentence) > max_chars:
            yield piece
            piece = ""
        piece = f"{piece} {sentence}".strip()
    if len(piece) >= 60:
        yield piece[:max_chars]


def prose_chunks(split: Split) -> list[str]:
    """Docstring paragraphs of the split's source files, then its licence paragraphs."""
    out = []
    for path in code_files(split):
        try:
            tree = ast.parse(_read_ascii(path))
        except SyntaxError:
            continue
        nodes = [tree] + [n for n in ast.walk(tree)
                          if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        for node in nodes:
            doc = ast.get_docstring(node)
            if doc:
                for para in _paragraphs(doc):
                    out.extend(_sentence_windows(para))
    if LICENCE_DIR.is_dir():
        licences = [p for p in LICENCE_DIR.iterdir() if p.is_file()]
        for path in _split_files(licences, split):
            for para in _paragraphs(_read_ascii(path)):
                out.extend(_sentence_windows(para))
    return out


# ====================================================================== generated texts
def pair_split(a: int, b: int) -> Split:
    """Operand pairs whose arithmetic *tasks* are held out (about one in seven)."""
    return "eval" if (3 * a + 5 * b) % HELD_OUT_EVERY == 2 else "train"


def _pick(rng: np.random.Generator, options: tuple[str, ...]) -> str:
    return options[int(rng.integers(len(options)))]


def math_chunk(rng: np.random.Generator) -> str:
    """2-6 lines of arithmetic: sums (the tasks' facts), differences, and the one-digit
    multiplication table (whose products of 50 and more are two tokens)."""
    lines = []
    for _ in range(int(rng.integers(2, 7))):
        a, b = (int(x) for x in rng.integers(0, MAX_OPERAND + 1, 2))
        op = int(rng.integers(20))
        if op < 10:
            lines.append(f"{a} + {b} = {a + b}")
        elif op < 13:
            hi, lo = max(a, b), min(a, b)
            lines.append(f"{hi} - {lo} = {hi - lo}")
        else:
            a, b = (int(x) for x in rng.integers(1, 10, 2))
            lines.append(f"{a} * {b} = {a * b}")
    return "\n".join(lines)


def data_chunk(rng: np.random.Generator) -> str:
    """A JSON record or a small CSV table of made-up people, places and prices."""
    def record() -> dict[str, object]:
        return {"id": int(rng.integers(1, 1000)), "name": _pick(rng, _NAMES),
                "city": _pick(rng, _CITIES), "item": _pick(rng, _ITEMS),
                "price": round(float(rng.uniform(0.5, 99.0)), 2),
                "active": bool(rng.integers(2))}

    if rng.integers(2):
        rows = [record() for _ in range(int(rng.integers(1, 3)))]
        return json.dumps(rows if len(rows) > 1 else rows[0])
    cols = ["id", "name", "city", "item", "price"]
    rows = [record() for _ in range(int(rng.integers(2, 5)))]
    return "\n".join([",".join(cols)] + [",".join(str(r[c]) for c in cols) for r in rows])


# ====================================================================== tasks
GENERATED = {"math": math_chunk, "data": data_chunk}


class Sources:
    """One split's texts of the ``domains``; ``snippet`` draws one short text of a domain."""

    def __init__(self, split: Split, domains: tuple[str, ...] = DOMAINS):
        from moejax.demo import system_texts

        self.split, self.domains = split, tuple(domains)
        self.chunks: dict[str, list[str]] = {}
        for domain in self.domains:
            if domain in ("code", "python"):
                self.chunks[domain] = code_chunks(split)
            elif domain == "prose":
                self.chunks[domain] = prose_chunks(split)
            elif domain in system_texts.FINDERS:
                self.chunks[domain] = system_texts.domain_chunks(domain, split)
            elif domain not in GENERATED:
                raise ValueError(f"unknown demo corpus domain {domain!r}")
        empty = [d for d, chunks in self.chunks.items() if not chunks]
        if empty:
            raise RuntimeError(f"no {split} texts found for the demo corpus domains {empty} "
                               f"(read from {stdlib_dir()}, {LICENCE_DIR} and the system)")

    def text(self, domain: str, rng: np.random.Generator) -> str:
        if domain in GENERATED:
            return GENERATED[domain](rng)
        if domain not in self.chunks:
            raise ValueError(f"domain {domain!r} is not one of these sources' {self.domains}")
        chunks = self.chunks[domain]
        return chunks[int(rng.integers(len(chunks)))]

    def snippet(self, domain: str, rng: np.random.Generator, max_chars: int = 180) -> str:
        """A text of ``domain`` cut to ``max_chars`` at a line or word boundary."""
        text = self.text(domain, rng)
        if len(text) <= max_chars:
            return text
        cut = text[:max_chars]
        boundary = max(cut.rfind("\n"), cut.rfind(" "))
        return cut[:boundary] if boundary > max_chars // 2 else cut


def _operands(rng: np.random.Generator, split: Split) -> tuple[int, int]:
    while True:
        a, b = (int(x) for x in rng.integers(0, MAX_OPERAND + 1, 2))
        if pair_split(a, b) == split:
            return a, b


def _wrong_sum(rng: np.random.Generator, total: int) -> int:
    """A nearby wrong sum (within 5, never negative), so the check needs the real sum."""
    while True:
        wrong = total + int(rng.integers(-5, 6))
        if wrong != total and wrong >= 0:
            return wrong


def domain_task(src: Sources, rng: np.random.Generator) -> Example:
    domain = _pick(rng, src.domains)
    prompt = f"Text: {src.snippet(domain, rng)}{DOMAIN_QUESTION}"
    answer = " " + domain
    return Example("domain_question", domain, prompt + answer, prompt, answer,
                   tuple(" " + d for d in src.domains))


def yes_no_task(src: Sources, rng: np.random.Generator) -> Example:
    a, b = _operands(rng, src.split)
    correct = bool(rng.integers(2))
    c = a + b if correct else _wrong_sum(rng, a + b)
    prompt = f"Is {a} + {b} = {c}? Answer:"
    answer = " yes" if correct else " no"
    return Example("arithmetic_yes_no", "math", prompt + answer, prompt, answer, (" yes", " no"))


def claim_task(src: Sources, rng: np.random.Generator) -> Example:
    a, b = _operands(rng, src.split)
    correct = bool(rng.integers(2))
    c = a + b if correct else _wrong_sum(rng, a + b)
    prompt = f"Claim: {a} + {b} = {c}.\nTrue or false?"
    answer = " true" if correct else " false"
    return Example("arithmetic_claim", "math", prompt + answer, prompt, answer,
                   (" true", " false"))


def choice_options(rng: np.random.Generator, total: int) -> list[int]:
    """The sum and three distinct nearby wrong sums, shuffled."""
    options = {total}
    while len(options) < 4:
        options.add(_wrong_sum(rng, total))
    ordered = sorted(options)
    return [ordered[i] for i in rng.permutation(4)]


def choice_task(src: Sources, rng: np.random.Generator) -> Example:
    """The exact rendering of a kind "choice" request (``{label}. {option}`` lines)."""
    a, b = _operands(rng, src.split)
    options = choice_options(rng, a + b)
    question = f"What is {a} + {b}?"
    lines = "\n".join(f"{letter}. {value}" for letter, value in zip(LETTERS, options))
    prompt = f"{question}\n{lines}\nAnswer:"
    answer = " " + LETTERS[options.index(a + b)]
    return Example("multiple_choice", "math", prompt + answer, prompt, answer,
                   tuple(" " + x for x in LETTERS))


def option_lookup_task(src: Sources, rng: np.random.Generator) -> Example:
    """A kind "choice" request that names the option's value: ``Which option is 21?``.

    It isolates the step a multiple-choice answer needs besides the sum (find the line
    holding a value, answer its letter), which the model did not learn from choice items
    alone (stage 4 left them at chance)."""
    a, b = _operands(rng, src.split)
    options = choice_options(rng, a + b)
    target = options[int(rng.integers(4))]
    lines = "\n".join(f"{letter}. {value}" for letter, value in zip(LETTERS, options))
    prompt = f"Which option is {target}?\n{lines}\nAnswer:"
    answer = " " + LETTERS[options.index(target)]
    return Example("option_lookup", "math", prompt + answer, prompt, answer,
                   tuple(" " + x for x in LETTERS))


def lookup_drill_task(src: Sources, rng: np.random.Generator) -> Example:
    """Plain text: an option list, then every option's value asked back in a random order
    (``21 is B``) -- four value-to-letter lookups per item instead of one answer token."""
    a, b = _operands(rng, src.split)
    options = choice_options(rng, a + b)
    lines = "\n".join(f"{letter}. {value}" for letter, value in zip(LETTERS, options))
    asks = "\n".join(f"{options[i]} is {LETTERS[i]}" for i in rng.permutation(4))
    return Example("lookup_drill", "math", f"Options:\n{lines}\n{asks}")


def mixed_domain_text(src: Sources, rng: np.random.Generator) -> tuple[list[str], str]:
    """The domains present (one, or two distinct) and a text joining a snippet of each:
    the text of every "multi" item (training, drills and held-out requests)."""
    present = [_pick(rng, src.domains)]
    if rng.integers(2):
        present.append(_pick(rng, tuple(d for d in src.domains if d != present[0])))
    return present, "\n".join(src.snippet(d, rng, 180 // len(present)) for d in present)


def multi_task(src: Sources, rng: np.random.Generator) -> Example:
    """One binary sibling of a kind "multi" request: is ``candidate`` among the domains
    of a text that joins one or two domains' snippets?"""
    present, body = mixed_domain_text(src, rng)
    # Ask about a present domain half the time, so "yes" and "no" are balanced.
    candidate = _pick(rng, tuple(present)) if rng.integers(2) else _pick(rng, src.domains)
    prompt = f"Text: {body}{MULTI_QUESTION}\nCandidate: {candidate}\nRelevant (yes/no):"
    answer = " yes" if candidate in present else " no"
    return Example("multi_selection", "+".join(present), prompt + answer, prompt, answer,
                   (" yes", " no"))


def multi_drill_task(src: Sources, rng: np.random.Generator) -> Example:
    """Plain text: a text of one or two domains, then every domain answered in a random
    order (``shell: yes``) -- one item supervises the decision for every candidate of a
    "multi" request, instead of the one a multi_selection item asks."""
    present, body = mixed_domain_text(src, rng)
    answers = "\n".join(f"{src.domains[i]}: {'yes' if src.domains[i] in present else 'no'}"
                        for i in rng.permutation(len(src.domains)))
    return Example("multi_drill", "+".join(present), f"Text: {body}{MULTI_QUESTION}\n{answers}")


TASKS: dict[str, Callable[[Sources, np.random.Generator], Example]] = {
    "domain_question": domain_task, "arithmetic_yes_no": yes_no_task,
    "arithmetic_claim": claim_task, "multiple_choice": choice_task,
    "multi_selection": multi_task, "option_lookup": option_lookup_task,
    "lookup_drill": lookup_drill_task, "multi_drill": multi_drill_task}

# Mixture of the training stream: plain text of each domain, then each task.
MIXTURE: dict[str, float] = {"code": 0.08, "prose": 0.08, "math": 0.10, "data": 0.04,
                             "domain_question": 0.16, "arithmetic_yes_no": 0.14,
                             "arithmetic_claim": 0.12, "multiple_choice": 0.16,
                             "multi_selection": 0.12}


# Stage 2 of training: mostly tasks, with some plain text so the language model stays.
TASK_MIXTURE: dict[str, float] = {"code": 0.03, "prose": 0.03, "math": 0.06, "data": 0.02,
                                  "domain_question": 0.08, "arithmetic_yes_no": 0.22,
                                  "arithmetic_claim": 0.18, "multiple_choice": 0.26,
                                  "multi_selection": 0.12}



# Stages 3 and 4 ("checks"): checking a claimed sum needs a far larger share than stage 2
# gave it before the model compares the claim with the sum it can already complete —
# first mostly yes/no checks (stage 3), then mostly true/false claims and choices (stage 4).
CHECK_MIXTURE: dict[str, float] = {"code": 0.02, "prose": 0.02, "math": 0.08, "data": 0.02,
                                   "domain_question": 0.04, "arithmetic_yes_no": 0.30,
                                   "arithmetic_claim": 0.24, "multiple_choice": 0.24,
                                   "multi_selection": 0.04}
CHOICE_MIXTURE: dict[str, float] = {"code": 0.02, "prose": 0.02, "math": 0.06, "data": 0.02,
                                    "domain_question": 0.04, "arithmetic_yes_no": 0.12,
                                    "arithmetic_claim": 0.32, "multiple_choice": 0.36,
                                    "multi_selection": 0.04}


# Stages 5 and 6: multiple choice needs the value -> letter lookup as well as the sum.
# Stage 5 adds lookup requests (option_lookup); stage 6 adds lookup drills (four lookups per
# item). The key order is part of the stream (the seeded draw indexes this list).
LOOKUP_MIXTURE: dict[str, float] = {"code": 0.02, "prose": 0.02, "math": 0.06, "data": 0.02,
                                    "domain_question": 0.04, "arithmetic_yes_no": 0.08,
                                    "arithmetic_claim": 0.08, "multiple_choice": 0.44,
                                    "option_lookup": 0.2, "multi_selection": 0.04}
DRILL_MIXTURE: dict[str, float] = {"code": 0.02, "prose": 0.02, "math": 0.04, "data": 0.02,
                                   "domain_question": 0.03, "arithmetic_yes_no": 0.05,
                                   "arithmetic_claim": 0.05, "multiple_choice": 0.3,
                                   "option_lookup": 0.14, "lookup_drill": 0.3,
                                   "multi_selection": 0.03}


def for_domains(mixture: dict[str, float], domains: tuple[str, ...],
                text_share: float | None = None) -> dict[str, float]:
    """``mixture`` (written for :data:`DOMAINS`) over another domain set: its plain-text
    share other than math (or ``text_share``) spread evenly over the non-math domains,
    math and every task kept. Key order: the domains, then the tasks (the seeded draw
    indexes it)."""
    tasks = {k: v for k, v in mixture.items() if k in TASKS}
    text = sum(v for k, v in mixture.items() if k not in TASKS and k != "math")
    text = text if text_share is None else text_share
    others = [d for d in domains if d != "math"]
    out = {d: round(text / len(others), 6) for d in others}
    if "math" in domains:
        out["math"] = mixture.get("math", 0.0)
    return {**out, **tasks}


# Stage 7 (demo-e32 only): the multi-selection set over eight domains is right only when
# all eight yes/no siblings are, which stages 1-6 (a few percent of multi items) left at
# 6 %; this stage gives it the largest share while keeping every other task in the mix.
MULTI_MIXTURE: dict[str, float] = {"code": 0.03, "prose": 0.03, "math": 0.04, "data": 0.02,
                                   "domain_question": 0.12, "arithmetic_yes_no": 0.04,
                                   "arithmetic_claim": 0.04, "multiple_choice": 0.14,
                                   "option_lookup": 0.06, "lookup_drill": 0.08,
                                   "multi_selection": 0.40}


# Stage 8 (demo-e32 only): multi drills (every candidate of a text answered, as the
# lookup drills did for multiple choice) beside multi-selection items; stage 7 took the
# exact set over eight domains from 25 % to 58 %.
MULTI_DRILL_MIXTURE: dict[str, float] = {"code": 0.03, "prose": 0.03, "math": 0.04, "data": 0.02,
                                         "domain_question": 0.10, "arithmetic_yes_no": 0.04,
                                         "arithmetic_claim": 0.04, "multiple_choice": 0.12,
                                         "option_lookup": 0.04, "lookup_drill": 0.06,
                                         "multi_selection": 0.24, "multi_drill": 0.24}


@functools.lru_cache(maxsize=4)
def sources(split: Split, domains: tuple[str, ...] = DOMAINS) -> Sources:
    """The split's :class:`Sources`, read once per process (parsing takes seconds)."""
    return Sources(split, tuple(domains))


def plain_example(src: Sources, domain: str, rng: np.random.Generator) -> Example:
    return Example(domain, domain, src.text(domain, rng))


def stream(src: Sources, seed: int, mixture: dict[str, float] | None = None
           ) -> Iterator[Example]:
    """An endless, seeded mixture of plain texts and task items (default :data:`MIXTURE`)."""
    rng = np.random.default_rng(seed)
    mixture = mixture or MIXTURE
    kinds = list(mixture)
    weights = np.array([mixture[k] for k in kinds])
    weights = weights / weights.sum()
    while True:
        kind = kinds[int(rng.choice(len(kinds), p=weights))]
        if kind in TASKS:
            yield TASKS[kind](src, rng)
        else:
            yield plain_example(src, kind, rng)


def task_items(src: Sources, task: str, count: int, seed: int) -> list[Example]:
    """``count`` items of one task (evaluation sets: pass an eval-split ``src``)."""
    rng = np.random.default_rng(seed)
    return [TASKS[task](src, rng) for _ in range(count)]


def corpus_fingerprint(domains: tuple[str, ...] = DOMAINS) -> dict[str, object]:
    """What the corpus was built from (recorded in the training log): for the small demo
    the standard library and licence names; for system-text domains also every file read
    and each split's chunk count."""
    from moejax.demo import system_texts

    out: dict[str, object] = {
        "stdlib": os.fspath(stdlib_dir()),
        "code_files": {s: len(code_files(s)) for s in ("train", "eval")},
        "licences": sorted(p.name for p in LICENCE_DIR.iterdir()) if LICENCE_DIR.is_dir()
        else []}
    system = [d for d in domains if d in system_texts.FINDERS]
    if system:
        out["domains"] = list(domains)
        out["files"] = {d: list(system_texts.domain_files(d)) for d in system}
        out["chunks"] = {d: {s: len(sources(s, domains).chunks[d]) for s in ("train", "eval")}
                         for d in domains if d not in GENERATED}
    return out

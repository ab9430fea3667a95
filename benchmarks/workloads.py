"""Seeded synthetic prefill-only workloads shaped like the seed's Table 2 (token ids, no text).

The seed paper (MoE-Prefill, §8.1 Table 2) evaluates on six public data sets mixed into one
"aggregated" workload, plus (§8.4) a sweep of uniformly random prompts with no prefix sharing.
Downloading those data sets is not needed to exercise the serving stack: what matters to a
prefill-only server is each data set's *shape* -- context lengths, how much of the prompt is
shared between requests (the prefix-share level), and what gets scored (single-token labels,
multi-token candidates, multi-selection siblings). This module generates that shape.

Prompt model
------------
Every prompt is ``shared prefix + request-specific suffix``:

* the **shared prefix** is one of a pool of distinct prefixes -- a system prompt / profile
  (MoralStories), a subject header (MMLU), an article that many questions are asked about
  (QuALITY), a paper scored with several label sets (ArXiv). Requests are spread evenly over
  the pool, so the pool size fixes the share level;
* the **suffix** is unique to the request (the story, question, review, ...);
* data sets whose documents are independent (BoolQ, IMDB) have no shared prefix: the whole
  prompt is unique.

Designed sharing is the *only* sharing: every root segment (shared prefix, or whole prompt
when there is none) starts with a first token that no other root in the workload has, and
the suffixes over one shared prefix start with first tokens distinct from each other. Random
token ids therefore add no accidental overlap, and a prefix-cache benchmark sees exactly the
reuse the spec describes (e.g. share ratio exactly 0 for the no-sharing sweep). This holds
while ``vocab_size - 2`` ids suffice (at most that many roots, and that many requests per
shared prefix); past it, heads grow to two or more tokens and distinct segments may share
up to ``head_length - 1`` leading tokens (pigeonhole), a tiny overlap.

Request kinds (``WorkloadSpec.kind_mix``, in the order of :data:`REQUEST_KINDS`):

* ``classify``: ``kind="classify"`` with K single-token labels -> one prefill op (the prompt);
* ``multi``: ``kind="multi"`` with K candidates -> K sibling ops, ``prompt + template(c_k)``;
* ``multi_token``: ``kind="classify"`` with K multi-token candidates -> K sibling ops,
  ``prompt + c_k[:-1]``.

Each data set has one fixed label set (K single-token ids) and one fixed set of K candidate
phrases (distinct first tokens), as a real classification endpoint would.

Prefixes, share ratio, ideal work
---------------------------------
What counts as the *prefix* of a request:

* for ``multi`` and ``multi_token`` requests (siblings), the whole prompt: it is computed once
  for the K sibling ops (``PrefillOp.prefix_len``);
* across requests, the part of a prompt that other prompts start with as well: the shared
  system prompt / profile / document. Formally the set of distinct prefixes of all prompts,
  i.e. the nodes of the prompts' token trie: ``distinct_prefix_tokens`` counts them.

``share_ratio = 1 - distinct prefix tokens / total prompt tokens`` (cross-request sharing, the
seed's "prefix share"). ``ideal_prefill_tokens`` = distinct prefix tokens (each distinct
prefix once) + every sibling suffix (``len(c_k) - 1`` tokens for multi-token candidates,
``len(c_k)`` + the template's tokens for multi). ``prefill_tokens`` is the work with no reuse
at all (every op in full).

    python -m benchmarks.workloads [--quick] [--json PATH]

prints :func:`prefix_stats` of a sample of every spec, the aggregated mix and the no-sharing
sweep; ``--json`` writes them as flat keys ``{name}_{stat}`` (e.g. ``quality_share_ratio``).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.tables import print_table

FIRST_TOKEN_ID = 2          # ids 0 and 1 are left to specials (pad / BOS) in small vocabularies
REQUEST_KINDS = ("classify", "multi", "multi_token")
SHARE_LEVELS = ("high", "medium", "low")
# Tokens the serving layer's multi template ("\nCandidate: {candidate}\nRelevant (yes/no):")
# adds around a candidate; tokenizer-dependent, so reserved generously when clipping.
MULTI_TEMPLATE_RESERVE = 32
# A sample smaller than the Table's data set keeps its requests-per-prefix, but gets at
# least this many distinct prefixes, so prefix-aware routing still has a choice to make.
MIN_PREFIX_POOL = 4
# Seed §8.4: "10M tokens per regime". Its regime lengths were lost from the text; only the
# ultra-long one (128K, "TP+TP at 128K", §8.5) survives, so short/medium/long are our picks.
SWEEP_TOKENS_PER_REGIME = 10_000_000
SWEEP_LENGTHS = (2_048, 8_192, 32_768, 131_072)


# ----------------------------------------------------------------------------- specs
@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Shape of one data set's traffic.

    Table 2 columns (copied from the seed): ``task``, ``context_len`` (Req Context),
    ``table_requests`` (# Request), ``table_tokens`` (Total) and ``share_level``.
    Our modelling choices: ``num_prefixes`` (distinct shared prefixes at the Table's request
    count; 0 = none, every prompt unique), ``prefix_len`` / ``suffix_len`` (token ranges;
    ``prefix_len + suffix_len`` stays inside ``context_len``), ``kind_mix`` (fractions of
    :data:`REQUEST_KINDS`), ``num_candidates`` (K) and ``candidate_len`` (tokens per
    candidate phrase, for the multi and multi_token kinds).
    """

    name: str
    task: str
    share_level: str
    context_len: tuple[int, int]
    table_requests: int
    table_tokens: int
    num_prefixes: int
    prefix_len: tuple[int, int]
    suffix_len: tuple[int, int]
    kind_mix: tuple[float, float, float]
    num_candidates: int
    candidate_len: tuple[int, int] = (1, 1)

    def __post_init__(self) -> None:
        if self.share_level not in SHARE_LEVELS:
            raise ValueError(f"{self.name}: share_level must be one of {SHARE_LEVELS}")
        for field in ("context_len", "prefix_len", "suffix_len", "candidate_len"):
            lo, hi = getattr(self, field)
            if not 0 <= lo <= hi:
                raise ValueError(f"{self.name}: {field} must be 0 <= lo <= hi, got {(lo, hi)}")
        if (self.num_prefixes == 0) != (self.prefix_len == (0, 0)):
            raise ValueError(f"{self.name}: prefix_len must be (0, 0) exactly when "
                             "num_prefixes == 0")
        if self.suffix_len[0] < 1 or self.num_candidates < 1 or self.candidate_len[0] < 1:
            raise ValueError(f"{self.name}: suffixes, candidates and candidate phrases need "
                             "at least one token")
        if (self.prefix_len[0] + self.suffix_len[0] < self.context_len[0]
                or self.prefix_len[1] + self.suffix_len[1] > self.context_len[1]):
            raise ValueError(f"{self.name}: prefix_len + suffix_len must lie inside "
                             f"context_len {self.context_len}")
        if (len(self.kind_mix) != len(REQUEST_KINDS) or min(self.kind_mix) < 0
                or not math.isclose(sum(self.kind_mix), 1.0)):
            raise ValueError(f"{self.name}: kind_mix must be {len(REQUEST_KINDS)} "
                             "non-negative fractions summing to 1")
        if self.kind_mix[2] > 0 and self.candidate_len[0] < 2:
            raise ValueError(f"{self.name}: multi_token requests need candidate_len >= 2")

    @property
    def mean_context(self) -> float:
        """Mean prompt length implied by Table 2 (total tokens / requests)."""
        return self.table_tokens / self.table_requests


# Table 2 of the seed ("Datasets ... Req Context (tokens) | # Request | Total (tokens) |
# Prefix Share"):
#   MoralStories  Moral reasoning           100-200    24K   3.3M   High
#   MMLU          Multiple-choice QA        50-500     24K   5.8M   Low
#   BoolQ         Binary QA                 200-600    12K   2.7M   Low
#   IMDB          Sentiment classification  300-2K     12K   5.5M   Low
#   QuALITY       Long-document QA          4K-12K     1.2K  10.5M  High
#   ArXiv Class.  Document classification   6K-128K    600   10.1M  Medium
#   Aggregated    Prefill-only              50-128K    73.8K 37.9M  Mixed
# Prefix pools, length splits, kinds and candidates are ours (the Table gives none of them).
SPECS: dict[str, WorkloadSpec] = {s.name: s for s in (
    # High: a few system prompts (instructions + norm) ahead of a short story.
    WorkloadSpec("moralstories", "Moral reasoning", "high", (100, 200), 24_000, 3_300_000,
                 num_prefixes=8, prefix_len=(80, 120), suffix_len=(20, 80),
                 kind_mix=(0.8, 0.0, 0.2), num_candidates=2, candidate_len=(2, 3)),
    # Low: a short header per subject (MMLU has 57) ahead of a unique question + options.
    WorkloadSpec("mmlu", "Multiple-choice QA", "low", (50, 500), 24_000, 5_800_000,
                 num_prefixes=57, prefix_len=(8, 16), suffix_len=(42, 484),
                 kind_mix=(1.0, 0.0, 0.0), num_candidates=4),
    # Low: unique passage + question, yes/no.
    WorkloadSpec("boolq", "Binary QA", "low", (200, 600), 12_000, 2_700_000,
                 num_prefixes=0, prefix_len=(0, 0), suffix_len=(200, 600),
                 kind_mix=(1.0, 0.0, 0.0), num_candidates=2),
    # Low: unique reviews; some label sets are multi-token phrases.
    WorkloadSpec("imdb", "Sentiment classification", "low", (300, 2_000), 12_000, 5_500_000,
                 num_prefixes=0, prefix_len=(0, 0), suffix_len=(300, 2_000),
                 kind_mix=(0.7, 0.0, 0.3), num_candidates=2, candidate_len=(2, 4)),
    # High: ~20 questions per article (60 articles for 1.2K requests); 4 options scored as
    # letters (single tokens) or as option texts (multi-token).
    WorkloadSpec("quality", "Long-document QA", "high", (4_000, 12_000), 1_200, 10_500_000,
                 num_prefixes=60, prefix_len=(3_800, 11_500), suffix_len=(200, 500),
                 kind_mix=(0.5, 0.0, 0.5), num_candidates=4, candidate_len=(3, 12)),
    # Medium: each paper is scored by 1.6 requests on average (375 papers for 600 requests)
    # with different label sets; 11 subject classes, single-label or multi-selection.
    WorkloadSpec("arxiv", "Document classification", "medium", (6_000, 128_000), 600,
                 10_100_000, num_prefixes=375, prefix_len=(5_900, 127_500),
                 suffix_len=(100, 500), kind_mix=(0.5, 0.5, 0.0), num_candidates=11,
                 candidate_len=(1, 4)),
)}

# The aggregated workload mixes the data sets in Table 2's request proportions
# (24K + 24K + 12K + 12K + 1.2K + 0.6K = 73.8K requests, 37.9M tokens).
AGGREGATED_MIX: dict[str, int] = {name: spec.table_requests for name, spec in SPECS.items()}


# ----------------------------------------------------------------------------- sampling
class _HeadAllocator:
    """Hands out distinct heads (equal-length token runs) that start segments.

    Equal lengths and distinct values make heads prefix-free: two segments starting with
    different heads share no leading token run beyond their first differing head token.
    """

    def __init__(self, rng: np.random.Generator, vocab_size: int, capacity: int):
        self.rng = rng
        self.span = vocab_size - FIRST_TOKEN_ID
        self.length = head_length(capacity, vocab_size)
        self.seen: set[int] = set()
        # One-token heads: deal from a shuffled deck, exact up to the last free id.
        self.deck = rng.permutation(self.span).tolist() if self.length == 1 else []

    def take(self, count: int) -> list[list[int]]:
        """``count`` new heads, each ``self.length`` tokens."""
        if self.length == 1:
            if count > len(self.deck):
                raise ValueError("head allocator exhausted (capacity exceeded)")
            dealt, self.deck = self.deck[:count], self.deck[count:]
            return [[FIRST_TOKEN_ID + code] for code in dealt]
        codes: list[int] = []
        space = self.span ** self.length
        while len(codes) < count:   # rejection sampling: space >= 2 * capacity, so it is quick
            for code in self.rng.integers(0, space, size=count - len(codes)).tolist():
                if code not in self.seen:
                    self.seen.add(code)
                    codes.append(code)
        return [self._decode(code) for code in codes]

    def _decode(self, code: int) -> list[int]:
        digits = []
        for _ in range(self.length):
            code, digit = divmod(code, self.span)
            digits.append(FIRST_TOKEN_ID + digit)
        return digits


def head_length(count: int, vocab_size: int) -> int:
    """Head length for ``count`` distinct heads: 1 while the vocabulary has enough ids.

    Longer heads (2x slack, for quick rejection sampling) only when ``count`` exceeds the
    ``vocab_size - 2`` usable ids; such heads can share up to ``length - 1`` leading tokens,
    which no choice of random ids could avoid.
    """
    span = vocab_size - FIRST_TOKEN_ID
    if span < 2:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID + 1}, got {vocab_size}")
    if count <= span:
        return 1
    length = 2
    while span ** length < 2 * count:
        length += 1
    return length


def _skewed_lengths(rng: np.random.Generator, n: int, lo: int, hi: int,
                    mean: float) -> np.ndarray:
    """``n`` integer lengths in [lo, hi] with expected value ~``mean``.

    ``lo + (hi - lo) * Beta(a, b)`` with one shape parameter 1: the density falls
    monotonically from the end nearer the mean, giving the long tail of document lengths
    (BoolQ, IMDB and ArXiv have means far below the middle of their Table 2 range).
    """
    if hi <= lo:
        return np.full(n, lo, dtype=np.int64)
    mu = float(np.clip((mean - lo) / (hi - lo), 0.02, 0.98))
    a, b = (1.0, (1 - mu) / mu) if mu <= 0.5 else (mu / (1 - mu), 1.0)
    return np.clip(np.rint(lo + rng.beta(a, b, n) * (hi - lo)), lo, hi).astype(np.int64)


def _mean_targets(spec: WorkloadSpec) -> tuple[float, float]:
    """(prefix, suffix) mean lengths whose sum is Table 2's mean context, where the ranges allow."""
    if spec.num_prefixes == 0:
        return 0.0, float(np.clip(spec.mean_context, *spec.suffix_len))
    suffix_mid = sum(spec.suffix_len) / 2
    prefix_mean = float(np.clip(spec.mean_context - suffix_mid, *spec.prefix_len))
    return prefix_mean, float(np.clip(spec.mean_context - prefix_mean, *spec.suffix_len))


def _scaled(lengths: np.ndarray, scale: float, floor: int) -> np.ndarray:
    """Lengths shrunk by ``scale`` (CPU-sized runs), never below ``floor`` tokens."""
    return np.maximum(np.rint(lengths * scale).astype(np.int64), floor)


def _segment(rng: np.random.Generator, head: list[int], length: int, vocab_size: int
             ) -> list[int]:
    """``length`` tokens starting with ``head``, the rest uniform in [FIRST_TOKEN_ID, vocab)."""
    tail = rng.integers(FIRST_TOKEN_ID, vocab_size, size=length - len(head)).tolist()
    return head + tail


def prefix_pool_size(spec: WorkloadSpec, num_requests: int) -> int:
    """Distinct shared prefixes in a sample of ``num_requests`` (see :data:`MIN_PREFIX_POOL`)."""
    if spec.num_prefixes == 0 or num_requests == 0:
        return 0
    scaled = round(num_requests * spec.num_prefixes / spec.table_requests)
    return min(num_requests, spec.num_prefixes, max(MIN_PREFIX_POOL, scaled))


def _root_count(spec: WorkloadSpec, num_requests: int) -> int:
    """Segments that start a prompt: the shared prefixes, or every prompt when none."""
    return prefix_pool_size(spec, num_requests) if spec.num_prefixes else num_requests


@dataclasses.dataclass(frozen=True)
class _Labels:
    """One data set's fixed answer sets: K single-token labels and K candidate phrases."""

    single: tuple[tuple[int], ...]
    phrases: tuple[tuple[int, ...], ...]

    @classmethod
    def sample(cls, spec: WorkloadSpec, rng: np.random.Generator, vocab_size: int) -> _Labels:
        k = spec.num_candidates
        single = rng.choice(vocab_size - FIRST_TOKEN_ID, k, replace=False) + FIRST_TOKEN_ID
        # Distinct first tokens: sibling ops then share exactly the prompt, nothing more.
        firsts = rng.choice(vocab_size - FIRST_TOKEN_ID, k, replace=False) + FIRST_TOKEN_ID
        lengths = rng.integers(spec.candidate_len[0], spec.candidate_len[1] + 1, size=k)
        phrases = tuple((int(f), *rng.integers(FIRST_TOKEN_ID, vocab_size, n - 1).tolist())
                        for f, n in zip(firsts, lengths))
        return cls(tuple((int(t),) for t in single), phrases)

    def room(self, kind: str) -> int:
        """Tokens an op of ``kind`` appends to the prompt (multi: with the template reserve)."""
        longest = max(len(p) for p in self.phrases)
        return {"classify": 0, "multi_token": longest - 1,
                "multi": longest + MULTI_TEMPLATE_RESERVE}[kind]

    def request(self, request_id: str, prompt: list[int], kind: str) -> dict[str, Any]:
        """The scoring-API request dict (``serving.requests``) of one prompt."""
        candidates = self.single if kind == "classify" else self.phrases
        return {"id": request_id, "kind": "multi" if kind == "multi" else "classify",
                "prompt_token_ids": prompt,
                "candidate_token_ids": [list(c) for c in candidates]}


def _check_sizes(vocab_size: int, max_context: int, scale: float) -> None:
    if vocab_size < 16:
        raise ValueError(f"vocab_size must be >= 16, got {vocab_size}")
    if max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")


def _dataset_requests(spec: WorkloadSpec, n: int, rng: np.random.Generator,
                      roots: _HeadAllocator, vocab_size: int, max_context: int,
                      scale: float) -> list[dict[str, Any]]:
    """``n`` requests of one data set (not yet shuffled); root heads come from ``roots``."""
    if n == 0:
        return []
    if spec.num_candidates > vocab_size - FIRST_TOKEN_ID:
        raise ValueError(f"{spec.name}: vocab_size {vocab_size} is too small for "
                         f"{spec.num_candidates} distinct labels")
    labels = _Labels.sample(spec, rng, vocab_size)
    kinds = [REQUEST_KINDS[i] for i in rng.choice(len(REQUEST_KINDS), n, p=spec.kind_mix)]
    limits = [max_context - labels.room(kind) for kind in kinds]   # longest prompt per request
    prefix_mean, suffix_mean = _mean_targets(spec)
    suffix_lens = _skewed_lengths(rng, n, *spec.suffix_len, suffix_mean)
    ids = [f"{spec.name}-{i}" for i in range(n)]
    if spec.num_prefixes == 0:   # independent documents: every prompt is a root
        heads = roots.take(n)
        lengths = _scaled(suffix_lens, scale, roots.length)
        if min(limits) < roots.length:
            raise ValueError(f"{spec.name}: max_context {max_context} leaves no room for "
                             "a prompt after the candidates")
        return [labels.request(ids[i], _segment(rng, heads[i], min(int(lengths[i]), limits[i]),
                                                vocab_size), kinds[i]) for i in range(n)]
    pool = prefix_pool_size(spec, n)
    group = rng.permutation(np.arange(n) % pool)   # even spread: every prefix gets n/pool
    suffix_heads = {g: _HeadAllocator(rng, vocab_size, int(np.sum(group == g))).take(
        int(np.sum(group == g))) for g in range(pool)}
    suffix_floor = max(len(h[0]) for h in suffix_heads.values())
    # Cap shared prefixes so every request on them still fits a suffix head: truncating a
    # shared prefix per request would break the sharing.
    prefix_cap = min(limits) - suffix_floor
    if prefix_cap < roots.length:
        raise ValueError(f"{spec.name}: max_context {max_context} is too small for a shared "
                         "prefix, a suffix and the candidates")
    prefix_lens = np.minimum(_scaled(_skewed_lengths(rng, pool, *spec.prefix_len, prefix_mean),
                                     scale, roots.length), prefix_cap)
    prefixes = [_segment(rng, head, int(length), vocab_size)
                for head, length in zip(roots.take(pool), prefix_lens)]
    suffix_lens = _scaled(suffix_lens, scale, suffix_floor)
    used = {g: 0 for g in range(pool)}
    requests = []
    for i in range(n):
        g = int(group[i])
        head = suffix_heads[g][used[g]]
        used[g] += 1
        length = min(int(suffix_lens[i]), limits[i] - len(prefixes[g]))
        requests.append(labels.request(ids[i], prefixes[g] + _segment(rng, head, length,
                                                                        vocab_size), kinds[i]))
    return requests


def _mixed_requests(parts: Sequence[tuple[WorkloadSpec, int]], rng: np.random.Generator,
                    vocab_size: int, max_context: int, scale: float) -> list[dict[str, Any]]:
    """The requests of every (spec, count) part, shuffled together into arrival order."""
    _check_sizes(vocab_size, max_context, scale)
    roots = _HeadAllocator(rng, vocab_size, sum(_root_count(s, n) for s, n in parts))
    requests = [r for spec, n in parts
                for r in _dataset_requests(spec, n, rng, roots, vocab_size, max_context, scale)]
    return [requests[i] for i in rng.permutation(len(requests))]


def _rng(seed: int, name: str) -> np.random.Generator:
    """A generator per (seed, workload name); crc32, not hash(), so runs agree."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


# ----------------------------------------------------------------------------- public generators
def generate(name: str, num_requests: int, *, vocab_size: int, max_context: int,
             seed: int = 0, scale: float = 1.0) -> list[dict[str, Any]]:
    """``num_requests`` requests shaped like data set ``name`` (a key of :data:`SPECS`).

    Requests are in arrival order, shuffled (deterministically for ``seed``) so requests on
    the same shared prefix interleave. ``scale`` multiplies every prompt length (candidates
    keep theirs). Prompts are clipped so each request's longest op fits ``max_context``
    (multi requests also keep :data:`MULTI_TEMPLATE_RESERVE` tokens for the template).
    Token ids lie in ``[2, vocab_size)``.
    """
    if name not in SPECS:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(SPECS)})")
    return _mixed_requests([(SPECS[name], num_requests)], _rng(seed, name), vocab_size,
                           max_context, scale)


def apportion(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Split ``total`` in proportion to ``weights`` (largest remainders; ties by order)."""
    names = list(weights)
    w = np.array([weights[k] for k in names], dtype=np.float64)
    if total < 0 or len(w) == 0 or w.min() < 0 or w.sum() <= 0:
        raise ValueError("need total >= 0 and non-negative weights with a positive sum")
    exact = total * w / w.sum()
    counts = np.floor(exact).astype(np.int64)
    for i in np.argsort(-(exact - counts), kind="stable")[:total - int(counts.sum())]:
        counts[i] += 1
    return {k: int(c) for k, c in zip(names, counts)}


def aggregated(num_requests: int, *, vocab_size: int, max_context: int, seed: int = 0,
               scale: float = 1.0, mix: Mapping[str, float] | None = None
               ) -> list[dict[str, Any]]:
    """The seed's aggregated workload: all data sets interleaved in one arrival stream.

    ``mix`` (default :data:`AGGREGATED_MIX`, Table 2's request counts) gives each data set's
    share of the ``num_requests`` requests. Ids are ``"{dataset}-{i}"``.
    """
    mix = AGGREGATED_MIX if mix is None else mix
    unknown = sorted(set(mix) - set(SPECS))
    if unknown:
        raise ValueError(f"unknown workloads in mix: {unknown}")
    counts = apportion(num_requests, mix)
    return _mixed_requests([(SPECS[k], n) for k, n in counts.items()], _rng(seed, "aggregated"),
                           vocab_size, max_context, scale)


def requests_for_tokens(length: int, tokens: int = SWEEP_TOKENS_PER_REGIME) -> int:
    """Requests of ``length`` tokens that add up to ``tokens`` (the seed: 10M per regime)."""
    return max(1, math.ceil(tokens / length))


def no_sharing_sweep(lengths: Sequence[int], requests_per_length: int | Sequence[int], *,
                     vocab_size: int, max_context: int | None = None, seed: int = 0,
                     scale: float = 1.0, num_candidates: int = 2) -> list[dict[str, Any]]:
    """Seed §8.4: uniformly random, pairwise unshared prompts of each length in ``lengths``.

    ``requests_per_length``: one count for every length, or one per length (e.g.
    ``[requests_for_tokens(n) for n in lengths]`` for the seed's 10M tokens per regime).
    Every request is a single-token classify over ``num_candidates`` labels, so its one op
    is exactly its prompt. Requests of one length are contiguous, in the order of
    ``lengths`` (the regimes are run one at a time); ids are ``"sweep-{length}-{i}"``.
    """
    counts = ([int(requests_per_length)] * len(lengths) if np.ndim(requests_per_length) == 0
              else [int(c) for c in requests_per_length])
    if len(counts) != len(lengths):
        raise ValueError("requests_per_length needs one count per length")
    _check_sizes(vocab_size, max_context if max_context is not None else 1, scale)
    rng = _rng(seed, "no_sharing_sweep")
    heads = _HeadAllocator(rng, vocab_size, sum(counts))
    labels = [[int(t)] for t in rng.choice(vocab_size - FIRST_TOKEN_ID, num_candidates,
                                           replace=False) + FIRST_TOKEN_ID]
    requests = []
    for length, count in zip(lengths, counts):
        n_tokens = max(heads.length, round(length * scale))
        if max_context is not None and n_tokens > max_context:
            raise ValueError(f"sweep length {n_tokens} exceeds max_context {max_context}")
        for i, head in enumerate(heads.take(count)):
            requests.append({"id": f"sweep-{length}-{i}", "kind": "classify",
                             "prompt_token_ids": _segment(rng, head, n_tokens, vocab_size),
                             "candidate_token_ids": labels})
    return requests


# ----------------------------------------------------------------------------- statistics
def request_kind(request: Mapping[str, Any]) -> str:
    """Which of :data:`REQUEST_KINDS` a token-id request is."""
    kind = request.get("kind", "classify")
    token_ids = (request.get("prompt_token_ids") is not None
                 and request.get("candidate_token_ids") is not None)
    if kind not in ("classify", "multi") or not token_ids:
        raise ValueError(f"request {request.get('id')!r}: statistics need token-id "
                         "requests of kind 'classify' or 'multi'")
    if kind == "multi":
        return "multi"
    if all(len(c) == 1 for c in request["candidate_token_ids"]):
        return "classify"
    return "multi_token"


def sibling_suffix_lengths(request: Mapping[str, Any], multi_template_tokens: int = 0
                           ) -> list[int]:
    """Tokens each op of ``request`` runs after the prompt ([0] for a single classify op).

    multi_token: ``len(c) - 1`` per candidate (the op teacher-forces ``c[:-1]``); multi:
    ``len(c) + multi_template_tokens`` (the template's own tokens depend on the tokenizer).
    """
    kind = request_kind(request)
    candidates = request["candidate_token_ids"]
    if kind == "classify":
        return [0]
    if kind == "multi_token":
        return [len(c) - 1 for c in candidates]
    return [len(c) + multi_template_tokens for c in candidates]


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    m = min(len(a), len(b))
    if m == 0 or a[0] != b[0]:   # the usual case for unshared prompts: skip the arrays
        return 0
    diff = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
    return int(diff[0]) if diff.size else m


def _sorted_common_prefixes(sequences: Iterable[Sequence[int]]) -> tuple[int, list[int]]:
    """(total tokens, common-prefix length of each adjacent pair in sorted order)."""
    ordered = sorted(sequences)
    return (sum(len(s) for s in ordered),
            [_common_prefix_len(a, b) for a, b in zip(ordered, ordered[1:])])


def distinct_prefix_tokens(sequences: Iterable[Sequence[int]]) -> int:
    """Number of distinct non-empty prefixes of ``sequences`` (= nodes of their token trie).

    Sorted, each sequence adds its tokens beyond the prefix it shares with its predecessor.
    """
    total, common = _sorted_common_prefixes(sequences)
    return total - sum(common)


def _shared_prefix_count(common: Sequence[int]) -> int:
    """Branch points of the trie (distinct prefixes that 2+ sequences share, maximal ones).

    Each adjacent common-prefix length names one shared node; a stack of open depths
    tells a node already counted (same depth, same run) from a new one.
    """
    stack = [0]
    nodes = 0
    for depth in common:
        while stack[-1] > depth:
            stack.pop()
            nodes += 1
        if stack[-1] < depth:
            stack.append(depth)
    return nodes + len(stack) - 1


def ideal_prefill_tokens(requests: Sequence[Mapping[str, Any]], *,
                         multi_template_tokens: int = 0) -> int:
    """Prefill tokens with perfect reuse: each distinct prefix once plus every suffix.

    The prefixes: the distinct prefixes of all prompts (a system prompt / profile /
    document shared by many requests is counted once; a prompt shared by the K sibling
    ops of a multi or multi_token request is counted once). The suffixes: what each
    sibling op runs after the prompt (:func:`sibling_suffix_lengths`), counted in full.
    """
    prompts = [r["prompt_token_ids"] for r in requests]
    return distinct_prefix_tokens(prompts) + sum(
        sum(sibling_suffix_lengths(r, multi_template_tokens)) for r in requests)


def prefill_tokens(requests: Sequence[Mapping[str, Any]], *, multi_template_tokens: int = 0
                   ) -> int:
    """Prefill tokens with no reuse at all: every op run in full."""
    total = 0
    for r in requests:
        tails = sibling_suffix_lengths(r, multi_template_tokens)
        total += len(r["prompt_token_ids"]) * len(tails) + sum(tails)
    return total


def prefix_stats(requests: Sequence[Mapping[str, Any]]) -> dict[str, float | int]:
    """Sharing statistics of token-id requests, to check a workload's share level.

    ``distinct_prefixes``: prefixes shared by two or more prompts (branch points of the
    prompts' token trie: system prompts, documents); ``share_ratio`` = 1 - distinct prefix
    tokens / prompt tokens (cross-request sharing); ``reuse_ratio`` = 1 - ideal / no-reuse
    prefill tokens (siblings included; multi template tokens left out).
    """
    prompts = [r["prompt_token_ids"] for r in requests]
    lengths = [len(p) for p in prompts]
    total, common = _sorted_common_prefixes(prompts)
    distinct = total - sum(common)
    kinds = [request_kind(r) for r in requests]
    ideal, naive = ideal_prefill_tokens(requests), prefill_tokens(requests)
    ops = sum(len(sibling_suffix_lengths(r)) for r in requests)
    return {
        "requests": len(requests),
        "ops": ops,
        **{f"{k}_requests": kinds.count(k) for k in REQUEST_KINDS},
        "prompt_tokens": total,
        "mean_len": total / len(requests) if requests else 0.0,
        "max_len": max(lengths, default=0),
        "distinct_prefixes": _shared_prefix_count(common),
        "distinct_prefix_tokens": distinct,
        "share_ratio": 1 - distinct / total if total else 0.0,
        "ideal_prefill_tokens": ideal,
        "prefill_tokens": naive,
        "reuse_ratio": 1 - ideal / naive if naive else 0.0,
    }


# ----------------------------------------------------------------------------- self-check
FULL = dict(requests=500, aggregated=2_000, scale=1.0, vocab=151_936, max_context=131_072,
            sweep_lengths=SWEEP_LENGTHS, sweep_requests=2)
QUICK = dict(requests=100, aggregated=400, scale=0.1, vocab=1_024, max_context=4_096,
             sweep_lengths=(256, 512, 1_024, 2_048), sweep_requests=4)


def self_check(shape: Mapping[str, Any], seed: int = 0) -> dict[str, dict[str, float | int]]:
    """prefix_stats of a sample of every spec, of the aggregated mix and of the sweep."""
    sizes = dict(vocab_size=shape["vocab"], max_context=shape["max_context"], seed=seed)
    stats = {name: prefix_stats(generate(name, shape["requests"], scale=shape["scale"], **sizes))
             for name in SPECS}
    stats["aggregated"] = prefix_stats(aggregated(shape["aggregated"], scale=shape["scale"],
                                                  **sizes))
    stats["no_sharing_sweep"] = prefix_stats(no_sharing_sweep(
        shape["sweep_lengths"], shape["sweep_requests"], **sizes))
    return stats


_OTHER_LEVELS = {"aggregated": "mixed", "no_sharing_sweep": "none"}


def _print_stats(stats: Mapping[str, Mapping[str, float | int]]) -> None:
    def level(name: str) -> str:
        return SPECS[name].share_level if name in SPECS else _OTHER_LEVELS.get(name, "")

    rows = [(name, s) for name, s in stats.items()]
    print_table([("workload", -18, lambda r: r[0]), ("level", 7, lambda r: level(r[0])),
                 ("reqs", 6, lambda r: str(r[1]["requests"])), ("ops", 7, lambda r: str(r[1]["ops"])),
                 ("mean_len", 10, lambda r: f"{r[1]['mean_len']:.0f}"),
                 ("max_len", 9, lambda r: str(r[1]["max_len"])),
                 ("prefixes", 9, lambda r: str(r[1]["distinct_prefixes"])),
                 ("share", 7, lambda r: f"{r[1]['share_ratio']:.3f}"),
                 ("reuse", 7, lambda r: f"{r[1]['reuse_ratio']:.3f}")], rows, rule="")


def main(argv: list[str] | None = None) -> dict[str, float | int]:
    parser = bench_parser(__doc__, quick_help="small samples, scale 0.1")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL)
    stats = self_check(shape, seed=args.seed)
    print(f"workload self-check: vocab {shape['vocab']}, max_context {shape['max_context']}, "
          f"scale {shape['scale']}, seed {args.seed}")
    _print_stats(stats)
    flat = {f"{name}_{key}": value for name, s in stats.items() for key, value in s.items()}
    return finish_run(flat, args.json_path)


if __name__ == "__main__":
    main()

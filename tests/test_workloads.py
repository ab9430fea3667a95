"""Tests of benchmarks/workloads.py: seeded synthetic workloads shaped like the seed's Table 2."""

from __future__ import annotations

import json
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import workloads as wl  # noqa: E402
from serving.requests import normalize_requests, parse_request  # noqa: E402

VOCAB = 1_024
MAX_CONTEXT = 2_048
SIZES = dict(vocab_size=VOCAB, max_context=MAX_CONTEXT)


class WordTokenizer:
    """Whitespace tokenizer stand-in: only kind "multi" needs one (template + yes/no)."""

    FIXED = {"yes": 2, "no": 3}

    def encode(self, text: str) -> list[int]:
        return [self.FIXED.get(w, 4 + zlib.crc32(w.encode()) % (VOCAB - 4)) for w in text.split()]


def _ids_by_dataset(requests: list[dict]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in requests:
        name = r["id"].rsplit("-", 1)[0]
        counts[name] = counts.get(name, 0) + 1
    return counts


def test_specs_carry_table2():
    assert sum(s.table_requests for s in wl.SPECS.values()) == 73_800
    assert sum(s.table_tokens for s in wl.SPECS.values()) == 37_900_000
    assert min(s.context_len[0] for s in wl.SPECS.values()) == 50
    assert max(s.context_len[1] for s in wl.SPECS.values()) == 128_000
    levels = {name: s.share_level for name, s in wl.SPECS.items()}
    assert levels == {"moralstories": "high", "mmlu": "low", "boolq": "low", "imdb": "low",
                      "quality": "high", "arxiv": "medium"}


def test_deterministic_for_a_seed():
    assert wl.generate("quality", 40, seed=3, scale=0.05, **SIZES) == \
        wl.generate("quality", 40, seed=3, scale=0.05, **SIZES)
    assert wl.aggregated(200, seed=3, scale=0.05, **SIZES) == \
        wl.aggregated(200, seed=3, scale=0.05, **SIZES)
    assert wl.no_sharing_sweep([16, 32], 5, seed=3, vocab_size=VOCAB) == \
        wl.no_sharing_sweep([16, 32], 5, seed=3, vocab_size=VOCAB)


def test_different_seeds_differ():
    a = wl.generate("moralstories", 40, seed=0, **SIZES)
    b = wl.generate("moralstories", 40, seed=1, **SIZES)
    assert [r["prompt_token_ids"] for r in a] != [r["prompt_token_ids"] for r in b]
    assert wl.no_sharing_sweep([16], 4, seed=0, vocab_size=VOCAB) != \
        wl.no_sharing_sweep([16], 4, seed=1, vocab_size=VOCAB)


def test_share_levels_follow_the_table():
    share = {name: wl.prefix_stats(wl.generate(name, 120, scale=0.1, **SIZES))["share_ratio"]
             for name in wl.SPECS}
    assert share["moralstories"] > 0.5 and share["quality"] > 0.8       # high
    assert 0.2 < share["arxiv"] < 0.6                                   # medium
    assert share["mmlu"] < 0.1 and share["boolq"] == 0 and share["imdb"] == 0   # low
    assert share["moralstories"] > 10 * share["mmlu"]


def test_shared_prefixes_interleave_in_arrival_order():
    requests = wl.generate("moralstories", 64, scale=0.2, **SIZES)
    heads = [tuple(r["prompt_token_ids"][:4]) for r in requests]
    runs = sum(a != b for a, b in zip(heads, heads[1:]))
    assert len(set(heads)) == wl.MIN_PREFIX_POOL and runs > 20


def test_no_sharing_sweep_lengths_and_zero_share():
    # 3 x 10 prompts use all 30 usable ids of a 32-token vocabulary as first tokens.
    lengths = [8, 16, 32]
    requests = wl.no_sharing_sweep(lengths, 10, vocab_size=32, max_context=32)
    stats = wl.prefix_stats(requests)
    assert stats["share_ratio"] == 0 and stats["reuse_ratio"] == 0
    assert stats["distinct_prefixes"] == 0
    assert [len(r["prompt_token_ids"]) for r in requests] == [n for n in lengths for _ in range(10)]
    # More prompts than ids: two-token heads, overlaps of at most one token.
    crowded = wl.no_sharing_sweep([32], 100, vocab_size=32)
    assert len({tuple(r["prompt_token_ids"][:2]) for r in crowded}) == 100
    assert wl.prefix_stats(crowded)["share_ratio"] <= 1 / 32
    per_length = wl.no_sharing_sweep([10, 20], [3, 5], vocab_size=VOCAB)
    assert [len(r["prompt_token_ids"]) for r in per_length] == [10] * 3 + [20] * 5
    assert wl.requests_for_tokens(131_072) == 77    # 10M tokens per regime (seed §8.4)
    with pytest.raises(ValueError):
        wl.no_sharing_sweep([64], 1, vocab_size=VOCAB, max_context=32)


def _all_workloads(max_context: int) -> dict[str, list[dict]]:
    sizes = dict(vocab_size=VOCAB, max_context=max_context)
    out = {name: wl.generate(name, 40, scale=0.2, **sizes) for name in wl.SPECS}
    out["aggregated"] = wl.aggregated(300, scale=0.2, **sizes)
    out["sweep"] = wl.no_sharing_sweep([32, max_context], 3, **sizes)
    return out


@pytest.mark.parametrize("max_context", [MAX_CONTEXT, 256])
def test_requests_are_valid_for_the_scoring_api(max_context):
    for name, requests in _all_workloads(max_context).items():
        for i, r in enumerate(requests):
            parse_request(r, i)
            assert all(wl.FIRST_TOKEN_ID <= t < VOCAB for t in r["prompt_token_ids"])
            assert all(wl.FIRST_TOKEN_ID <= t < VOCAB for c in r["candidate_token_ids"] for t in c)
        ops, errors, _ = normalize_requests(requests, WordTokenizer(), vocab_size=VOCAB,
                                            max_context=max_context)
        assert errors == {}, (name, next(iter(errors.values())))
        assert max(len(op.token_ids) for op in ops) <= max_context


def test_clipping_keeps_the_designed_sharing():
    requests = wl.generate("quality", 60, vocab_size=VOCAB, max_context=300)
    assert wl.prefix_stats(requests)["share_ratio"] > 0.8
    assert max(len(r["prompt_token_ids"]) for r in requests) <= 300


def test_unscaled_prompts_stay_in_the_table_context_range():
    for name, spec in wl.SPECS.items():
        n = 8 if name == "arxiv" else 30
        requests = wl.generate(name, n, vocab_size=VOCAB, max_context=131_072)
        lo, hi = spec.context_len
        assert all(lo <= len(r["prompt_token_ids"]) <= hi for r in requests), name


def test_aggregated_mix_and_kinds():
    requests = wl.aggregated(738, **SIZES, scale=0.05)
    assert _ids_by_dataset(requests) == {"moralstories": 240, "mmlu": 240, "boolq": 120,
                                         "imdb": 120, "quality": 12, "arxiv": 6}
    stats = wl.prefix_stats(requests)
    assert all(stats[f"{k}_requests"] > 0 for k in wl.REQUEST_KINDS)
    assert len({r["id"] for r in requests}) == len(requests)
    assert wl.apportion(5, {"a": 1, "b": 1, "c": 2}) == {"a": 1, "b": 1, "c": 3}


def test_ideal_prefill_tokens_hand_made():
    requests = [
        {"id": 1, "prompt_token_ids": [5, 6, 7, 8], "candidate_token_ids": [[9], [10]]},
        {"id": 2, "prompt_token_ids": [5, 6, 7, 11, 12], "candidate_token_ids": [[9], [10]]},
        # multi-token siblings: ops [20, 21] + [3] and [20, 21] + [5, 6]
        {"id": 3, "prompt_token_ids": [20, 21], "candidate_token_ids": [[3, 4], [5, 6, 7]]},
        # multi siblings: ops [30, 31, 32] + template + [3] and ... + [4, 5]
        {"id": 4, "kind": "multi", "prompt_token_ids": [30, 31, 32],
         "candidate_token_ids": [[3], [4, 5]]},
    ]
    # distinct prompt prefixes: 4 + 5 + 2 + 3 - 3 (the shared [5, 6, 7]) = 11; suffixes 3 + 3
    assert wl.ideal_prefill_tokens(requests) == 17
    assert wl.ideal_prefill_tokens(requests, multi_template_tokens=2) == 21
    assert wl.prefill_tokens(requests) == 4 + 5 + (2 + 1 + 2 + 2) + (3 + 1 + 3 + 2)
    stats = wl.prefix_stats(requests)
    assert stats["distinct_prefixes"] == 1 and stats["ops"] == 6
    assert stats["share_ratio"] == pytest.approx(1 - 11 / 14)
    assert stats["multi_token_requests"] == 1 and stats["multi_requests"] == 1


def test_ideal_equals_a_brute_force_trie_on_a_generated_workload():
    requests = wl.aggregated(150, vocab_size=64, max_context=512, scale=0.03)
    prefixes = set()
    for r in requests:
        prompt = r["prompt_token_ids"]
        kind = wl.request_kind(r)
        tails = [[]] if kind == "classify" else [
            c[:-1] if kind == "multi_token" else c for c in r["candidate_token_ids"]]
        for tail in tails:
            seq = prompt + tail
            prefixes.update(tuple(seq[:i]) for i in range(1, len(seq) + 1))
    assert wl.ideal_prefill_tokens(requests) == len(prefixes)


def test_self_check_writes_flat_json(tmp_path, capsys):
    path = tmp_path / "stats.json"
    flat = wl.main(["--quick", "--json", str(path)])
    assert json.loads(path.read_text()) == flat
    assert flat["no_sharing_sweep_share_ratio"] == 0
    assert flat["quality_share_ratio"] > flat["mmlu_share_ratio"]
    assert "moralstories" in capsys.readouterr().out

"""The ideal-FLOPs reference of ``benchmarks/prefill_serving.py`` on a hand-made example
(arithmetic only: no model is run, nothing is timed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.prefill_serving import ideal_flops  # noqa: E402
from moejax.config import ModelConfig  # noqa: E402
from moejax.ops import OpKey, PrefillOp  # noqa: E402

# d=2, one layer, one query / one KV head of width 2, 2 experts top-1, f=1, vocab 10:
#   F_lin = 2·2·(2 + 2·2) + 2·2·2 + 2·2·2 + 1·6·2·1 = 24 + 8 + 8 + 12 = 52
#   F_att(c) = 1·4·1·2·c = 8c;  F_head = 2·2·columns (vocabulary: 40)
TINY = ModelConfig(model_type="qwen3_moe", vocab_size=10, hidden_size=2, num_layers=1,
                   num_heads=1, num_kv_heads=1, head_dim=2, num_experts=2,
                   num_experts_per_tok=1, moe_intermediate_size=1, norm_topk_prob=True,
                   qk_norm=True, rms_norm_eps=1e-6, rope_theta=1e4, max_context=64,
                   tie_word_embeddings=False)


def op(index: int, tokens: tuple[int, ...], positions: tuple[int, ...],
       ids: tuple[tuple[int, ...], ...], vocab: bool = False) -> PrefillOp:
    return PrefillOp(key=OpKey(index, -1), token_ids=tokens, prefix_len=len(tokens),
                     score_positions=positions, score_token_ids=ids, full_vocab=vocab)


OPS = [
    op(0, (1, 2, 3), (2,), ((5, 6),)),               # head 2·2·2 = 8
    op(1, (1, 2, 4, 5), (3,), ((5, 6),)),            # shares "1 2" with op 0; head 8
    op(2, (1, 2, 3), (2,), ((5, 6),)),               # same prompt as op 0: no new node; head 8
    op(3, (7, 8), (0, 1), ((8,), (9,)), vocab=True),  # two vocabulary heads: 2·40 = 80
]


def test_ideal_flops_counts_each_trie_node_once():
    assert TINY.linear_flops_per_token == 52
    assert TINY.attention_flops(1) == 8
    assert TINY.head_flops(None) == 40 and TINY.head_flops(2) == 8
    # Trie nodes: 1 | 1 2 | 1 2 3 | 1 2 4 | 1 2 4 5 | 7 | 7 8  -> depths 1,2,3,3,4,1,2
    # body = 7·52 + 8·(1+2+3+3+4+1+2) = 364 + 128 = 492; heads = 8+8+8+80 = 104
    got = ideal_flops(TINY, OPS)
    assert got == {"tokens": 7, "head_flops": 104, "flops": 596}


def test_ideal_flops_ignores_op_order():
    assert ideal_flops(TINY, OPS[::-1]) == ideal_flops(TINY, OPS)
    # A prompt that is a prefix of another adds only its own head.
    assert ideal_flops(TINY, [op(0, (1, 2), (1,), ((3,),)), op(1, (1, 2, 3), (2,), ((4,),))]) \
        == {"tokens": 3, "head_flops": 8, "flops": 3 * 52 + 8 * 6 + 8}


def test_plan_floor_is_the_engine_plan_of_the_whole_workload():
    from benchmarks.prefill_serving import plan_floor_flops, pool_blocks_needed

    # With 2-token blocks (the planner shares a block's worth or more), sorted:
    # (1 2 3)op0 computes 3 tokens; (1 2 3)op2 reads 2 (never its score position 2) and
    # computes 1; (1 2 4 5) reads "1 2", computes 2; (7 8) computes 2: 8 tokens.
    # FLOPs: 3·52 + 8·(1+2+3) + 8 = 212; 52 + 8·3 + 8 = 84; 2·52 + 8·(3+4) + 8 = 168;
    # 2·52 + 8·(1+2) + 80 = 208.
    assert plan_floor_flops(TINY, OPS, block_size=2) == {"tokens": 8,
                                                         "flops": 212 + 84 + 168 + 208}
    # Blocks: op 0 keeps "1 2" (read by the next two, and its whole block), op 1 keeps
    # "4 5", op 3 keeps "7 8"; op 2 has no whole block of its own.
    assert pool_blocks_needed(OPS, [list(range(len(OPS)))], block_size=2) == 3
    # With 16-token blocks nothing this short is worth sharing: every op runs whole.
    assert plan_floor_flops(TINY, OPS)["tokens"] == sum(len(o.token_ids) for o in OPS)

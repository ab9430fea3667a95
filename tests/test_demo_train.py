"""The demo's training script: the loss falls, the balance loss does its job, the training
forward is the inference forward, and the export is what the loader reads."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax import checkpoint as ck
from moejax import demo
from moejax import model as mdl
from moejax import moe
from moejax.config import from_hf_dict
from moejax.demo import corpus, train

TINY = dict(demo.demo_config_dict(), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32)


@pytest.fixture(scope="module")
def tokenizer():
    return ck.load_tokenizer(demo.WEIGHTS_DIR)


@pytest.fixture(scope="module")
def tiny_run(tokenizer):
    tc = train.TrainConfig(steps=40, batch_rows=4, seq_len=64, peak_lr=1e-2, log_every=10,
                           eval_batches=2)
    params, log = train.train(TINY, tc, tokenizer, corpus.sources("train"),
                              corpus.sources("eval"), progress=False)
    return tc, params, log


def test_tiny_training_loss_falls(tiny_run):
    _, _, log = tiny_run
    curve = log["curve"]
    assert curve[0]["step"] == 1 and curve[-1]["step"] == 40
    assert curve[-1]["loss"] < curve[0]["loss"] - 1.5, curve
    assert np.isfinite(log["held_out_loss"]) and log["held_out_loss"] < curve[0]["loss"] - 1.0
    # The balance loss is E·Σ f·P: 1.0 for a uniform router, up to E when collapsed.
    assert all(0.99 <= entry["aux"] < 1.5 for entry in curve), curve


def test_tiny_training_is_reproducible(tokenizer, tiny_run):
    tc, params, _ = tiny_run
    again, _ = train.train(TINY, dataclasses.replace(tc, steps=3), tokenizer,
                           corpus.sources("train"), corpus.sources("eval"), progress=False)
    once_more, _ = train.train(TINY, dataclasses.replace(tc, steps=3), tokenizer,
                               corpus.sources("train"), corpus.sources("eval"), progress=False)
    for a, b in zip(jax.tree_util.tree_leaves(again), jax.tree_util.tree_leaves(once_more)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_expert_usage_rows_are_distributions(tiny_run):
    _, _, log = tiny_run
    usage = log["expert_usage_by_domain"]
    assert sorted(usage) == sorted(corpus.DOMAINS)
    for per_layer in usage.values():
        arr = np.array(per_layer)
        assert arr.shape == (2, 8)
        np.testing.assert_allclose(arr.sum(axis=1), 1.0, atol=1e-3)


def test_balance_loss_values():
    """Uniform router -> 1.0; a router that sends every token to one expert -> about E."""
    cfg = from_hf_dict(TINY)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
    valid = jnp.ones(16, bool)

    def loss(router, x):
        routing = moe.route(x, router, cfg.num_experts_per_tok, cfg.norm_topk_prob)
        return train.balance_loss(routing, valid, cfg)

    aux, counts = loss(jnp.zeros((32, 8)), x)
    assert float(aux) == pytest.approx(1.0, abs=1e-5)
    assert float(counts.sum()) == 16 * 2
    collapsed = jnp.zeros((32, 8)).at[:, 0].set(50.0)
    aux, _ = loss(collapsed, jnp.abs(x))
    assert float(aux) > 3.9   # E·(f_0·P_0 + f_1·P_1) with f_0 = 1/2 and P_0 near 1


def test_pack_rows_segments_and_positions():
    examples = iter([[5] * 30, [6] * 40, [7] * 10, [8] * 50])
    tokens, segs, positions, weights = train.pack_rows(examples, rows=2, seq_len=64)
    # 30 + 10 fill row 0 (the 40 waits), then 40 in row 1; the 50 no longer fits anywhere.
    assert list(np.unique(segs[0][segs[0] >= 0])) == [0, 1]
    assert (tokens[0, :30] == 5).all() and (tokens[0, 30:40] == 7).all()
    assert (tokens[1, :40] == 6).all() and (segs[1, 40:] == -1).all()
    assert positions[0, 30] == 0 and positions[0, 39] == 9
    assert (weights[segs >= 0] == 1.0).all() and (weights[segs < 0] == 0.0).all()


def test_answer_tokens_get_the_answer_weight(tokenizer):
    ex = corpus.Example("arithmetic_yes_no", "math", "Is 3 + 4 = 7? Answer: yes",
                        "Is 3 + 4 = 7? Answer:", " yes", (" yes", " no"))
    ((ids, weights),) = list(train.token_stream(tokenizer, iter([ex]), answer_weight=5.0))
    assert ids[-1] == tokenizer.token_to_id("<|endoftext|>")
    assert ids[-2] == tokenizer.token_to_id("Ġyes")
    assert weights[-2] == 5.0 and weights[:-2] == [1.0] * (len(ids) - 2) and weights[-1] == 1.0


def test_training_forward_equals_inference_on_shipped_model(tokenizer):
    """The trained model's logits from the training forward equal ``full_logits`` on the
    directory the HF loader reads (same weights, same function)."""
    # Square matrices (wq, wo, every expert matrix: 128 x 128) are where an export that
    # forgets a transpose still loads, so the shipped model is the case to check.
    cfg, params, _ = ck.load_model_dir(demo.WEIGHTS_DIR, "float32")
    texts = ["Is 3 + 4 = 7? Answer: yes",
             "Text: def f(x):\n    return x + 1\nQuestion: Which domain is this? Answer: code"]
    ids = [tokenizer.encode(t).ids for t in texts]
    tokens, segs, positions, _ = train.pack_rows(iter(ids), rows=1, seq_len=64)
    logits, _, _ = train.train_forward(jax.tree_util.tree_map(jnp.asarray, params),
                                       tokens, segs, positions, cfg)
    batch = train._packed(jnp.asarray(tokens), jnp.asarray(segs), jnp.asarray(positions))
    reference = mdl.full_logits(params, batch, cfg, mdl.ForwardOptions(attn_block=64))
    real = segs.reshape(-1) >= 0
    np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(reference)[real],
                               atol=1e-4, rtol=1e-4)


def test_export_round_trips_through_the_loader(tmp_path, tokenizer, tiny_run):
    _, params, _ = tiny_run
    train.save_model_dir(str(tmp_path), params, TINY, tokenizer, "test notice")
    cfg, loaded, _ = ck.load_model_dir(tmp_path, "float32")
    assert cfg == from_hf_dict(TINY)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(loaded)):
        # bfloat16 storage: 8 bits of mantissa
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-2, atol=1e-6)


def test_stages_in_order_with_their_own_streams():
    plan = train.stages(train.TrainConfig())
    assert [stage.name for stage in plan] == [f"stage{i}" for i in range(1, 7)]
    assert len({stage.stream_offset for stage in plan}) == len(plan)
    assert 1 not in {stage.stream_offset for stage in plan}   # seed + 1: held-out loss stream
    for stage in plan:
        assert abs(sum(stage.mixture.values()) - 1.0) < 1e-9, stage.name
        assert set(stage.mixture) <= set(corpus.TASKS) | set(corpus.DOMAINS), stage.name
        assert stage.steps > 0 and stage.peak_lr > 0 and stage.warmup_steps < stage.steps


def test_run_checks_its_stage_arguments(tmp_path):
    tc = train.TrainConfig(steps=2)
    with pytest.raises(ValueError, match="unknown stage 'stage9'"):
        train.run(str(tmp_path), tc, start_stage="stage9", progress=False)
    with pytest.raises(ValueError, match="stage5 needs init_dir .*stage4"):
        train.run(str(tmp_path), tc, start_stage="stage5", progress=False)


@pytest.mark.parametrize("task", ["multiple_choice", "option_lookup"])
def test_choice_items_are_the_apis_choice_rendering(task):
    """Training text of the choice tasks is exactly what a kind "choice" request renders."""
    from serving import requests as rq

    rng = np.random.default_rng(3)
    for _ in range(5):
        ex = corpus.TASKS[task](corpus.sources("train"), rng)
        question, rest = ex.prompt.split("\n", 1)
        options = [line.split(". ", 1)[1] for line in rest.split("\n")[:-1]]
        req = rq.parse_request({"kind": "choice", "prompt": question, "candidates": options}, 0)
        assert rq._choice_prompt(req, rq.NormalizeOptions()) == ex.prompt
        assert ex.answer in ex.candidates and ex.text == ex.prompt + ex.answer


def test_lookup_drill_asks_every_option_once():
    ex = corpus.lookup_drill_task(corpus.sources("train"), np.random.default_rng(4))
    lines = ex.text.split("\n")
    assert lines[0] == "Options:" and len(lines) == 9
    options = dict(line.split(". ") for line in lines[1:5])
    asked = dict(reversed(line.split(" is ")) for line in lines[5:])
    assert asked == options and not ex.answer   # plain text: every token counts alike

"""serving.metrics on a Scorer with a prefix cache: the cache's block lookups, hits and
evictions and the pool's blocks by state, from the allocators at scrape time, in the
Prometheus text format parsed by prometheus_client."""

from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from serving import Scorer
from serving.metrics import ServingMetrics


def samples(metrics: ServingMetrics) -> dict:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def test_prefix_cache_metrics_follow_the_allocator():
    scorer = Scorer("demo", calibrate=False, max_batch_tokens=256, prefix_cache_blocks=8)
    metrics = ServingMetrics()
    metrics.watch(scorer)
    engine = (("engine", "0"),)
    request = {"prompt": "A shared system prompt about code and data. " * 4 + "Q?",
               "candidates": [" yes", " no"]}
    scorer.score([request])
    first = samples(metrics)
    scorer.score([request])                    # its prompt's blocks are cached now
    second = samples(metrics)
    lookups = second[("moejax_prefix_cache_block_lookups_total", engine)] - \
        first[("moejax_prefix_cache_block_lookups_total", engine)]
    hits = second[("moejax_prefix_cache_block_hits_total", engine)] - \
        first[("moejax_prefix_cache_block_hits_total", engine)]
    allocator = scorer.engine.kv_store.allocators[0]
    assert lookups > 0 and hits == lookups and allocator.hits == second[
        ("moejax_prefix_cache_block_hits_total", engine)]
    states = {state: second[("moejax_prefix_pool_blocks", (("engine", "0"), ("state", state)))]
              for state in ("in_use", "cached", "free")}
    assert sum(states.values()) == allocator.num_blocks and states["cached"] > 0
    for k in range(6):                         # other prompts push the first one out
        scorer.score([{**request, "prompt": f"Another prompt {k} " * 12 + "Q?"}])
    assert samples(metrics)[("moejax_prefix_cache_block_evictions_total", engine)] > 0


def expert_series(metrics: ServingMetrics, phase: str) -> dict:
    """(layer, expert) -> tokens of moejax_expert_tokens_total{phase}."""
    return {(int(dict(labels)["layer"]), int(dict(labels)["expert"])): value
            for (name, labels), value in samples(metrics).items()
            if name == "moejax_expert_tokens_total" and dict(labels)["phase"] == phase}


def test_the_prefill_expert_load_is_the_routing_of_every_token_run(demo_scorer):
    """Counted in the scoring programs (every layer, every real token), scraped per
    (layer, expert): equal to the routing the static prefill traces for the same tokens,
    on one device and summed over an AsyncEP group's ranks."""
    from moejax import checkpoint
    from moejax.expert_trace import expert_counts, trace_prefill_experts
    from serving.api import resolve_model_dir

    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    prompt = "def add(a, b):\n    return a + b  # a small sum"
    tokens = demo_scorer.tokenizer.encode_prompt(prompt)
    # prompt_logprobs: one op over every token but the last, all of its rows scored, so
    # the last layer runs on every token too.
    want = expert_counts(trace_prefill_experts(params, cfg, tokens[:-1]), cfg.num_experts)
    assert want.sum(axis=1).tolist() == [len(tokens[:-1]) * cfg.num_experts_per_tok] * \
        cfg.num_layers
    for scorer in (Scorer("demo", calibrate=False),
                   Scorer("demo", backend="async_ep", devices=2, calibrate=False)):
        metrics = ServingMetrics()
        metrics.watch(scorer)
        assert expert_series(metrics, "prefill") == {}        # nothing run yet
        (result,) = scorer.score([{"kind": "prompt_logprobs", "prompt": prompt}])
        assert result.error is None
        got = expert_series(metrics, "prefill")
        np.testing.assert_array_equal(scorer.engine.stats.expert_tokens, want)
        assert got == {(layer, expert): float(want[layer, expert])
                       for layer, expert in zip(*want.nonzero())}


def test_the_decode_expert_load_counts_one_step_in_eight(demo_generator):
    """The scheduler counts the routing of one decode step in EXPERT_SAMPLE_EVERY (the
    served metric of it: tests/test_http_openai.py)."""
    from moejax.core.continuous import EXPERT_SAMPLE_EVERY

    generator = demo_generator
    scheduler = generator.scheduler
    before = scheduler.decode_expert_tokens
    before = 0 if before is None else before.copy()
    steps = scheduler.stats["decode_steps"]
    generator.generate([{"prompt": "1 + 2 =", "max_new_tokens": 24, "temperature": 0}])
    counted = scheduler.decode_expert_tokens - before
    ran = scheduler.stats["decode_steps"] - steps
    # One token per decode row: each counted layer holds k choices per counted row.
    per_layer = counted.sum(axis=1)
    k = generator.config.num_experts_per_tok
    assert len(set(per_layer.tolist())) == 1 and per_layer[0] % k == 0
    rows = per_layer[0] // k
    assert 1 <= rows <= -(-ran // EXPERT_SAMPLE_EVERY)

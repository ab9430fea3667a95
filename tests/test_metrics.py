"""serving.metrics on a Scorer with a prefix cache: the cache's block lookups, hits and
evictions and the pool's blocks by state, from the allocators at scrape time, in the
Prometheus text format parsed by prometheus_client."""

from __future__ import annotations

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

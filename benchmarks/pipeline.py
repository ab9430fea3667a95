"""One prefill→decode pipeline (issue 44): every combination of prefill backend ×
decoder placement × decode replica router × decoder routing policy in
:data:`COMBINATIONS`, run on 8 CPU host devices through ``Generator(pipeline=...)``,
against one resident decoder on the same requests, in one run.

* ``pipeline_tokens_equal``: 1 when every combination's greedy float32 tokens equal the
  resident decoder's (0 otherwise; ``pipeline_tokens_equal_<name>`` per combination);
* ``pipeline_combinations``: how many ran; ``pipeline_decoders_<name>``: its decoders;
* ``pipeline_tokens_per_s_<name>`` and ``resident_tokens_per_s``: output tokens over the
  wall time of a second call (every program precompiled, a first call run; the timed
  call's compiles are counted and must be 0), and
  ``pipeline_over_resident_tokens_per_s_<name>``. On CPU every host device shares the
  same cores, so this is the pipeline's host overhead, not what K decoders give on K
  accelerators (``benchmarks/pipeline_sim.py`` models that at Qwen3-30B-A3B shape).

The simulated figures of the issue (``composed_over_best_single_modelled_h100``,
``mu_queue_throughput_over_sync_ep_h100_*``, ``prefetch_tpot_over_ondemand_*_modelled``)
come from ``benchmarks/pipeline_sim.py``, ``benchmarks/asyncmoe_sim.py --h100`` and
``benchmarks/prefetch_lengths.py``; ``mu_queue_real_over_decode_runtime_tokens_per_s``
from ``benchmarks/ep_decode.py``.

    python -m benchmarks.pipeline [--quick] [--json PATH] [--requests N]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from benchmarks.lib import cli, compiles
from benchmarks.lib.meta import finish_run, platform_figures

HOST_DEVICES = 8
EVERY_PLACEMENT = ({"placement": "resident"}, {"placement": "offload"},
                   {"placement": "offload", "prefetch": "router", "prefetch_mode": "exact"},
                   {"placement": "sync_ep", "devices": 2},
                   {"placement": "async_ep", "devices": 2})
REPLICA_ROUTERS = ({"placement": "sync_ep", "devices": 2, "replicas": 1.5, "router": "metro"},
                   {"placement": "sync_ep", "devices": 2, "replicas": 1.5,
                    "router": "eplb_even"},
                   {"placement": "resident"}, {"placement": "offload"})
COMBINATIONS: dict[str, dict[str, Any]] = {
    "resident_prefill_every_placement_round_robin": {
        "prefill": {"backend": "resident"}, "decoders": EVERY_PLACEMENT,
        "routing": "round_robin"},
    "async_ep_prefill_every_placement_jsq": {
        "prefill": {"backend": "async_ep", "devices": 2}, "decoders": EVERY_PLACEMENT,
        "routing": "jsq"},
    "sync_ep_eplb_prefill_metro_decoders_round_robin": {
        "prefill": {"backend": "sync_ep", "devices": 2, "replicas": 1.5,
                    "router": "eplb_even"},
        "decoders": REPLICA_ROUTERS, "routing": "round_robin"},
    "offload_prefill_mixed_p2c": {
        "prefill": {"backend": "offload"},
        "decoders": ({"placement": "async_ep", "devices": 2}, {"placement": "resident"},
                     {"placement": "sync_ep", "devices": 2, "replicas": 2,
                      "router": "metro"}),
        "routing": "p2c", "routing_seed": 3},
    "async_ep_prefill_resident_and_mu_queue_round_robin": {
        "prefill": {"backend": "async_ep", "devices": 2},
        "decoders": ({"placement": "resident"},
                     {"placement": "mu_queue", "devices": 2, "first_device": 2}),
        "routing": "round_robin"},
}
QUICK = ("resident_prefill_every_placement_round_robin", "async_ep_prefill_every_placement_jsq")
OPTIONS = {"dtype": "float32", "max_prefill_tokens": 32, "max_batch_size": 2}
# Every step and hand-off program compiled before the first call: a pipeline's routing
# shifts from call to call (jsq, p2c), and a timed call must not compile.
TIMED_OPTIONS = {**OPTIONS, "precompile": True}


def requests(count: int) -> list[dict[str, Any]]:
    """``count`` requests of the demo vocabulary: prompts of 5..40 tokens, 3..8 new."""
    import numpy as np

    rng = np.random.default_rng(11)
    return [{"id": i, "prompt_token_ids": [int(t) for t in rng.integers(3, 1000, n)],
             "max_new_tokens": int(m), "stop_token_ids": []}
            for i, (n, m) in enumerate(zip(rng.integers(5, 41, count),
                                           rng.integers(3, 9, count)))]


def timed_tokens(gen: Any, batch: list[dict[str, Any]], label: str
                 ) -> tuple[list[list[int]], float]:
    """The tokens of ``batch`` and output tokens per second of a second call (the
    Generator is built with ``precompile``, and a first call runs before the timed one,
    which is counted for compiles: ``compiles_in_timed_pass_<label>``)."""
    gen.generate(batch)
    with compiles.timed_pass(label):
        start = time.perf_counter()
        results = gen.generate(batch)
        seconds = time.perf_counter() - start
    errors = [r.error for r in results if r.error is not None]
    if errors:
        raise RuntimeError(f"generation failed: {errors[0]}")
    tokens = [r.token_ids for r in results]
    return tokens, sum(map(len, tokens)) / seconds


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = cli.bench_parser(__doc__, quick_help="two combinations, 4 requests (< 1 min "
                                                  "once compiled)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default 8; --quick 4)")
    args = cli.parse_args(parser, argv, host_devices=HOST_DEVICES)
    from serving import Generator

    count = args.requests or (4 if args.quick else 8)
    batch = requests(count)
    names = QUICK if args.quick else tuple(COMBINATIONS)
    figures: dict[str, Any] = {**platform_figures(), "requests": count}
    # --quick checks the tokens and the keys; its timed calls may compile (no precompile).
    options = OPTIONS if args.quick else TIMED_OPTIONS
    want, rate = timed_tokens(Generator("demo", **options), batch, "resident")
    figures["resident_tokens_per_s"] = rate
    equal = []
    for name in names:
        gen = Generator("demo", pipeline=COMBINATIONS[name], **options)
        tokens, rate = timed_tokens(gen, batch, name)
        equal.append(tokens == want)
        figures[f"pipeline_tokens_equal_{name}"] = int(tokens == want)
        figures[f"pipeline_decoders_{name}"] = len(gen.scheduler.decoders)
        figures[f"pipeline_tokens_per_s_{name}"] = rate
        figures[f"pipeline_over_resident_tokens_per_s_{name}"] = (
            rate / figures["resident_tokens_per_s"])
        print(f"{name}: tokens {'equal' if tokens == want else 'DIFFER'}, "
              f"{rate:.1f} tokens/s", flush=True)
    figures["pipeline_combinations"] = len(names)
    figures["pipeline_tokens_equal"] = int(all(equal))
    print(f"pipeline_tokens_equal = {figures['pipeline_tokens_equal']} over {len(names)} "
          f"combinations", flush=True)
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()

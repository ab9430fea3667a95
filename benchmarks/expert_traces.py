"""Reference expert traces of a built-in demo model and its untrained twin.

For each domain of the model's corpus (``moejax.demo.corpus``, held-out split) it builds
``--per-domain`` prompts of exactly ``--prompt-tokens`` token ids (held-out texts of the
domain joined by newlines, cut), decodes ``--new-tokens`` greedy tokens for each with
``serving.Generator(trace_experts=True)`` (EOS ignored, so every request has the same
number of decode steps to align), and writes one trace per model in the format of
``moejax.traces`` (top-k ids, gate weights, router inputs with ``--router-inputs``, the
domain label of every request):

    OUT/<model>.npz         e.g. out/traces/demo-e32.npz
    OUT/<model>-init.npz    its untrained twin (``demo-e32-init``; for a model directory
                            the training script's seeded init): the same prompts

The ELDR, prefetch and expert-parallel decode benchmarks, and
``benchmarks/expert_specialization.py --traces OUT``, read these. The same seed gives the
same prompts and (greedy, float32) the same traces. The full set (64 requests x 8 domains,
64-token prompts, 32 new tokens, router inputs) is about 160 MB per model uncompressed, so
it is not committed: it takes about 3 minutes to rebuild on the 2-core CPU.

    python -m benchmarks.expert_traces [--quick] [--json PATH] [--model demo-e32]
        [--out out/traces] [--per-domain N] [--prompt-tokens N] [--new-tokens N]
        [--router-inputs | --no-router-inputs] [--seed N]

JSON keys: requests, prompt_tokens_total, decode_tokens_total, trace_seconds_{model},
trace_mib_{model}, and the run's settings.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

from benchmarks.lib.cli import bench_parser, parse_args, run_shape
from benchmarks.lib.meta import finish_run
from benchmarks.lib.reference_traces import write_reference_traces

FULL = dict(per_domain=64, prompt_tokens=64, new_tokens=32)
QUICK = dict(per_domain=8, prompt_tokens=32, new_tokens=8)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = bench_parser(__doc__, quick_help="8 requests per domain, 32-token prompts, 8 new "
                          "tokens", model="demo-e32", model_help="built-in model or directory")
    parser.add_argument("--out", default=os.path.join("out", "traces"),
                        help="directory of the traces (default out/traces)")
    parser.add_argument("--per-domain", type=int, help="requests per domain (default 64)")
    parser.add_argument("--prompt-tokens", type=int, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, help="greedy tokens decoded (default 32)")
    parser.add_argument("--router-inputs", action=argparse.BooleanOptionalAction, default=True,
                        help="record every token's router input at every layer (default on)")
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, argv)
    shape = run_shape(args, QUICK, FULL, FULL)
    if shape["new_tokens"] < 2 or shape["prompt_tokens"] < 1 or shape["per_domain"] < 1:
        parser.error("--new-tokens must be >= 2, --prompt-tokens and --per-domain >= 1")
    logging.getLogger("moejax.scorer").setLevel(logging.ERROR)
    start = time.perf_counter()
    figures = {"model": args.model, **shape, "router_inputs": args.router_inputs,
               "seed": args.seed}
    figures.update(write_reference_traces(args.model, args.out, router_inputs=args.router_inputs,
                                          seed=args.seed, **shape))
    figures["total_seconds"] = time.perf_counter() - start
    for key, value in figures.items():
        if key.startswith("trace_path_"):
            name = key[len("trace_path_"):]
            print(f"{value}: {figures['requests']} requests, "
                  f"{figures[f'trace_mib_{name}']:.1f} MiB, "
                  f"{figures[f'trace_seconds_{name}']:.1f} s")
    print(f"total {figures['total_seconds']:.0f} s")
    finish_run({k: v for k, v in figures.items() if k != "domains"}, args.json_path)
    return figures


if __name__ == "__main__":
    main()

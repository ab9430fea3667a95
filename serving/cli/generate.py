"""``moejax generate IN.jsonl [-o OUT.jsonl]``: JSONL generation requests in, results out.

One JSON request per line (fields of :mod:`serving.generate`: id, prompt |
prompt_token_ids, max_new_tokens, temperature, top_p, seed, stop_token_ids); one JSON
result per non-blank input line, in input order (fields of ``GenerationResult.to_dict``).
A line that is not valid JSON (or too long, not UTF-8, ...), or an invalid request, gets a
result with ``error`` set; the other lines still run. An id-less request is named by its
line number (``"line 3: prompt: is empty"``); the input rules and the file checks made
before the model loads are those of ``moejax score`` (``serving.jsonl``, ``serving.cli``).

Exit status: 0 done (some results may be errors); 2 a usage or file error (one line
``moejax: error: ...``); 3 every result is an error (the results are written all the
same: a script must not take a run that generated nothing for a success); 141 stdout
closed early. ``examples/generate.jsonl`` holds requests the demo model answers.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from serving.cli.options import add_model_options, command_compilation_cache, positive_int
from serving.exit_status import ERRORS_STATUS
from serving.jsonl import JsonlLine, add_line_limit_option, open_jsonl, run_chunk

# Options of the shared model-option block that only the scoring engines implement.
SCORING_ONLY = ("max_batch_tokens", "window", "deployment", "theta",
                 "engines", "routing", "prefix_cache_blocks", "kv_cache_free",
                 "share_prompts", "max_text_bytes", "max_token_ids", "max_candidates")
EXIT_CODES = f"""exit codes:
  0    done (every line answered; some results may be errors)
  2    refused: usage, an unreadable input, an unwritable -o, a model that cannot be
       loaded (one line 'moejax: error: ...')
  {ERRORS_STATUS}    every result is an error; the results are written all the same
  141  standard output closed early (e.g. | head -1)"""


def add_generate_command(sub: Any) -> argparse.ArgumentParser:
    """Register ``generate`` on the ``moejax`` subparsers ``sub``, with the shared
    --model / --dtype / --expert-impl ... block (:func:`serving.cli.options.add_model_options`)."""
    p = sub.add_parser("generate", help="generate text for a JSONL file of requests",
                       description=__doc__.split("\n\n")[1],
                       epilog="Of the model options, generate uses --model, --dtype, --backend\n"
                              "(resident, offload, sync_ep), --devices, --expert-impl and\n"
                              "--weights-dtype; the scoring-engine ones (not listed) are\n"
                              "refused.\n\n" + EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="JSONL requests ('-' for stdin)")
    p.add_argument("-o", "--output", default=None, help="JSONL results (default: stdout)")
    p.add_argument("--trace-experts", action="store_true", default=None,
                   help="add each request's top-k expert ids per layer (prefill and decode)")
    p.add_argument("--max-batch-size", type=positive_int, default=None,
                   help="requests decoded together (default 8)")
    add_decode_runtime_options(p)
    p.add_argument("--chunk-size", type=positive_int, default=256,
                   help="requests read per chunk; results are written after each chunk")
    add_line_limit_option(p)
    add_model_options(p, hidden=SCORING_ONLY)   # refused below, so not offered in --help either
    p.set_defaults(func=cmd_generate)
    return p


def add_decode_runtime_options(p: argparse.ArgumentParser) -> None:
    """The decode runtime's flags (``serving.generate.GeneratorOptions``); the shared
    --backend and --devices choose the decode backend."""
    p.add_argument("--batching", choices=["continuous", "static"], default=None,
                   help="continuous (default: sequences join and leave at every step) or "
                        "static (batches run to their longest sequence)")
    p.add_argument("--step", choices=["auto", "fused", "layerwise"], default=None,
                   help="decode step: all layers in one program, or driven layer by layer "
                        "(auto: layerwise on offload, fused otherwise)")
    p.add_argument("--max-prefill-tokens", type=positive_int, default=None,
                   help="prompt tokens prefilled per step (default 512)")
    p.add_argument("--prefill-row-tokens", type=positive_int, default=None,
                   help="width of a packed prefill row (default 64)")
    p.add_argument("--no-pipeline", dest="pipelined", action="store_false", default=None,
                   help="continuous batching: read each step's tokens before planning the "
                        "next (default: the next step is dispatched first, the tokens fed "
                        "on the device; the same tokens either way)")
    p.add_argument("--precompile", action="store_true", default=None,
                   help="compile every step program at start-up (continuous batching)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--kv-cache-blocks", type=positive_int, default=None,
                      help="paged KV pool size in 16-token blocks (per rank)")
    size.add_argument("--kv-cache-mib", type=float, default=None,
                      help="paged KV pool size in MiB (per rank; default: enough for "
                           "--max-batch-size sequences at full context, at most 1024)")
    p.add_argument("--replicas", type=float, default=None,
                   help="sync_ep: expert replication factor (e.g. 1.5)")
    p.add_argument("--replica-router", choices=["metro", "eplb_even"], default=None,
                   help="sync_ep: how tokens pick among an expert's replicas (decode "
                        "steps, and prefill steps unless --prefill-replica-router is given)")
    p.add_argument("--prefill-replica-router", choices=["metro", "eplb_even"], default=None,
                   help="sync_ep: the replica router of the prefill steps (default: "
                        "--replica-router; METRO's pairing: --replica-router metro "
                        "--prefill-replica-router eplb_even)")
    p.add_argument("--pipeline", default=None, metavar="FILE",
                   help="a prefill->decode pipeline in a TOML or JSON file (serving."
                        "pipeline_config): the prefill stage's backend and devices (async_ep "
                        "on a group, for one), K decoders of any placement with their own "
                        "options, and the routing between them; replaces --decoders, "
                        "--decode-routing, --eldr-*, --backend, --devices, --prefetch*")
    p.add_argument("--decoders", type=positive_int, default=None,
                   help="decode on K decoders, one device each, fed by a prefill engine "
                        "(default 1: prefill and decode together); on CPU it sets K host "
                        "devices, as --devices does")
    p.add_argument("--decode-routing", default=None,
                   help="with --decoders K >= 2: which decoder takes each request: jsq "
                        "(default), round_robin, p2c, random, domain (reads each request's "
                        "'domain'), eldr (needs --eldr-fit)")
    p.add_argument("--eldr-fit", default=None,
                   help="--decode-routing eldr: the fit file of `moejax eldr-fit ... --decoders K`")
    p.add_argument("--eldr-tau", type=float, default=None,
                   help="--decode-routing eldr: the locality band in [0, 1] (default 0.1)")
    p.add_argument("--prefetch", choices=["none", "router", "quasi", "estimator", "hybrid",
                                          "oracle", "layer"], default=None,
                   help="--backend offload: predict and copy the next layer's experts while "
                        "a layer computes (quasi/estimator/hybrid need --prefetch-file)")
    p.add_argument("--prefetch-mode", choices=["exact", "speculative"], default=None,
                   help="exact (default): true experts, misses copied on demand (tokens equal "
                        "resident); speculative: compute with the predicted experts")
    p.add_argument("--prefetch-file", action="append", default=None, dest="prefetch_files",
                   help="a default-vector file (moejax prefetch-calibrate) or an estimator "
                        "file (python -m moejax.prefetch.train); repeat for both")
    p.add_argument("--runtime", choices=["continuous", "mu_queue"], default=None,
                   help="continuous (default): the paged decode runtime; mu_queue: AsyncMoE's "
                        "asynchronous expert-parallel runtime over --devices (moejax.asyncmoe)")
    p.add_argument("--scheduler", choices=["defrag", "most_tokens", "first_layer"],
                   default=None, help="--runtime mu_queue: which μ-queue runs next on an idle "
                                      "device (default defrag)")


def decode_runtime_options(args: argparse.Namespace) -> dict[str, Any]:
    """Generator keywords of the flags given (absent ones keep the defaults)."""
    options = {name: getattr(args, name) for name in
               ("batching", "step", "max_prefill_tokens", "prefill_row_tokens", "precompile",
                "pipelined",
                "kv_cache_blocks", "kv_cache_mib", "backend", "devices", "decoders", "pipeline",
                "eldr_fit", "eldr_tau", "prefetch", "prefetch_mode", "prefetch_files",
                "runtime", "scheduler") if getattr(args, name, None) is not None}
    if getattr(args, "decode_routing", None) is not None:
        options["routing"] = args.decode_routing
    backend_options = {key: getattr(args, flag) for key, flag in
                       (("replicas", "replicas"), ("router", "replica_router"),
                        ("prefill_router", "prefill_replica_router"))
                       if getattr(args, flag, None) is not None}
    if backend_options:
        options["backend_options"] = backend_options
    return options


def scoring_only_given(args: argparse.Namespace) -> list[str]:
    return ["--" + name.replace("_", "-") for name in SCORING_ONLY
            if getattr(args, name, None) is not None]


def generate_chunk(generator: Any, chunk: list[JsonlLine]) -> list[Any]:
    """Results of one chunk in order: a bad line's error as an error result, the rest
    generated together; an id-less request's error names its line."""
    from serving.generate import GenerationResult

    return run_chunk(chunk, generator.generate, lambda error: GenerationResult(error=error))


def all_failed_status(results: int, errors: int) -> int:
    """The exit status of a finished run: :data:`ERRORS_STATUS` when there were
    results and every one is an error, else 0 (an empty input is a success)."""
    return ERRORS_STATUS if results and errors == results else 0


def cmd_generate(args: argparse.Namespace) -> int:
    """Run the ``generate`` subcommand; returns the exit status (see :data:`EXIT_CODES`)."""
    from serving.generate import Generator

    refused = scoring_only_given(args)
    if refused:
        raise ValueError(f"generate does not take {', '.join(refused)} (scoring-engine "
                         f"options)")
    with open_jsonl(args.input, args.output, args.max_line_mib) as files:  # before the model
        generator = Generator(args.model, dtype=args.dtype, expert_impl=args.expert_impl,
                              weights_dtype=args.weights_dtype,
                              trace_experts=args.trace_experts,
                              max_batch_size=args.max_batch_size,
                              compilation_cache=command_compilation_cache(None),
                              **decode_runtime_options(args))
        files.start_output()
        count = errors = tokens = 0
        start = time.perf_counter()
        for chunk in files.chunks(args.chunk_size):
            for result in generate_chunk(generator, chunk):
                files.write(result.to_dict())
                errors += result.error is not None
                tokens += len(result.token_ids)
            count += len(chunk)
            files.flush()
    elapsed = time.perf_counter() - start
    rate = tokens / elapsed if elapsed > 0 else 0.0
    print(f"generated {tokens} tokens for {count - errors} of {count} requests ({errors} with "
          f"errors) in {elapsed:.2f}s ({rate:.1f} tokens/s)"
          + (f", results in {args.output}" if args.output not in (None, "-") else ""),
          file=sys.stderr)
    return all_failed_status(count, errors)

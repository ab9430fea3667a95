"""Command-line options shared by the ``moejax`` subcommands.

The dispatcher (:mod:`serving.cli`) and the modules that define subcommands
(``serving.cli.generate``, ``serving.cli.trace``, ``serving.cli.eldr``,
``serving.remote_score``, ``serving.grpc.cli``, ...) all take these: argparse types, the
model option block of ``score`` / ``info`` / ``serve`` (and, in part, ``generate`` and
``trace``), and the Scorer keywords those options mean. They live here, apart from the
dispatcher, so that a subcommand module never imports :mod:`serving.cli`, which imports
the subcommand modules to register them: the CLI modules then form no import cycle.

Importing this module loads neither JAX nor the model code (``moejax`` commands that only
talk to a server start without them).
"""

from __future__ import annotations

import argparse
from typing import Any, Collection

from serving.cli.distributed import add_distributed_options

# The commands keep a restarted job's compiled shapes (a library Scorer leaves the
# process-wide cache alone unless asked).
COMMAND_COMPILATION_CACHE = "auto"


def positive_int(text: str) -> int:
    """argparse type: an integer > 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _cache_blocks(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of blocks or 'auto', got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def add_model_options(p: argparse.ArgumentParser, *, hidden: Collection[str] = ()) -> None:
    """The model options shared by score, info, serve (and, in part, generate and trace).

    ``hidden``: destinations (``"max_batch_tokens"``, ...) of options a command parses but
    refuses: they are left out of its ``--help``, while still parsed so that the command
    can refuse them by name."""

    def option(flag: str, **kwargs: Any) -> None:
        if flag[2:].replace("-", "_") in hidden:
            kwargs["help"] = argparse.SUPPRESS
        p.add_argument(flag, **kwargs)

    option("--model", default="demo",
           help="local Hugging Face model directory, converted moejax directory, or a "
                "built-in toy model trained here: 'demo' (default), 'demo-e32' "
                "(32 experts, eight domains) or its untrained twin 'demo-e32-init'")
    option("--dtype", choices=["float32", "bfloat16", "auto"], default=None,
           help="compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    option("--max-batch-tokens", type=positive_int, default=None,
           help="tokens per packed batch (default: serving/configs/scoring.yaml)")
    option("--backend", default=None,
           help="execution backend: resident (default), offload, async_ep, hybrid, "
                "sync_ep or tp")
    option("--devices", type=positive_int, default=None,
           help="devices for the backend (default 1; on CPU, host devices are created)")
    option("--window", type=positive_int, default=None,
           help="layers of experts kept on the device (offload, hybrid)")
    option("--deployment", default=None,
           help="deployment: a shipped name (async_ep, hybrid, offload, sync_ep, tp) or a YAML file")
    option("--theta", type=float, default=None,
           help="pin the saturation threshold Θ (FLOPs) instead of calibrating")
    option("--engines", type=positive_int, default=None,
           help="data-parallel engines behind the router, each the backend on its own "
                "--devices devices (e.g. --engines 2 --backend async_ep --devices 4)")
    option("--routing", default=None,
           help="request routing over engines (and an engine's ranks): prefix (default), "
                "round_robin, least_tokens, random or prefill_only (PrefillOnly's "
                "shortest-prefill-first scheduler, also over one engine)")
    option("--max-num-seqs", type=positive_int, default=None,
           help="an engine runs at most this many sequences at a time, in the router's "
                "order (PrefillOnly's max-num-seqs; default: all of a call's ops packed)")
    option("--prefix-cache-blocks", default=None, type=_cache_blocks,
           help="prefix KV cache size in 16-token blocks (0 = off, 'auto')")
    option("--kv-cache-free", action="store_true", default=None,
           help="share prefixes within a chunk only; keep no KV cache after it")
    option("--expert-impl", default=None,
           help="expert computation path: auto (default: chosen per platform and "
                "shape), fused_tiles, pallas, gmm, ragged_dot or dense")
    option("--weights-dtype", choices=["auto", "fp8"], default=None,
           help="how an FP8 checkpoint's routed experts are held: auto (default: "
                "dequantized on load into --dtype) or fp8 (kept in FP8 with their block "
                "scales on the device, dequantized inside the expert kernels; backend "
                "resident)")
    option("--share-prompts", choices=["auto", "true", "false"], default=None,
           help="compute a request's prompt once for all its candidates (default "
                "auto: where the backend holds a prefix pool)")
    option("--max-text-bytes", type=positive_int, default=None,
           help="a request's prompt + candidates text, UTF-8 bytes (default: 64 per "
                "context token); larger requests get an error result")
    option("--max-token-ids", type=positive_int, default=None,
           help="a request's prompt + candidate token ids (default: 16 x the context)")
    option("--max-candidates", type=positive_int, default=None,
           help="candidates of one request (default 4096)")
    add_distributed_options(p)


def add_traces_argument(p: argparse.ArgumentParser) -> None:
    """The calibration commands' positional TRACES (``eldr-fit``, ``prefetch-calibrate``)."""
    p.add_argument("traces", nargs="+", metavar="TRACES",
                   help="expert traces (.npz) of calibration requests, from `moejax trace "
                        "REQUESTS.jsonl -o TRACE.npz --model M`: REQUESTS.jsonl holds "
                        "generation requests, one a line, each with an optional \"domain\" "
                        "label (examples/calibration.jsonl, for demo-e32)")


def command_compilation_cache(deployment: str | None) -> str:
    """The commands' ``compilation_cache``: serving/configs/scoring.yaml's or the deployment's
    setting when they name one, else :data:`COMMAND_COMPILATION_CACHE`."""
    from serving.options import load_options   # on use: it imports JAX

    configured = load_options(deployment=deployment).compilation_cache
    return COMMAND_COMPILATION_CACHE if configured is None else configured


def scorer_options(args: argparse.Namespace) -> dict[str, Any]:
    """Scorer keyword arguments from the model options of ``args`` (score, info, serve)."""
    options = {"dtype": args.dtype, "max_batch_tokens": args.max_batch_tokens,
               "expert_impl": args.expert_impl, "backend": args.backend,
               "weights_dtype": args.weights_dtype,
               "devices": args.devices, "theta": args.theta, "deployment": args.deployment,
               "compilation_cache": command_compilation_cache(args.deployment)}
    if args.window is not None:
        options["backend_options"] = {"window": args.window}
    options.update(engines=args.engines, routing=args.routing, max_num_seqs=args.max_num_seqs,
                   kv_cache_free=args.kv_cache_free,
                   prefix_cache_blocks=args.prefix_cache_blocks,
                   share_prompts={"true": True, "false": False}.get(args.share_prompts,
                                                                    args.share_prompts),
                   max_text_bytes=args.max_text_bytes, max_token_ids=args.max_token_ids,
                   max_candidates=args.max_candidates)
    return options

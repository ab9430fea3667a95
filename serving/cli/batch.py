"""``moejax batch INPUT... -o OUTPUT --ray [ADDRESS] --actors N``: an offline job on Ray Data.

Scores (or, with --generate, generates for) the requests of JSONL or Parquet files, a
directory of them or URIs that pyarrow.fs opens (s3://, gs://, hdfs://), on N Ray actors
that each hold the model (on --gpus-per-actor GPUs), and writes one JSONL or Parquet file
(by its extension) in input order, each result with its input row ("row", counted from 0).
--ray alone starts a Ray cluster on this machine (every core); --ray auto joins the
cluster this machine belongs to; --ray ADDRESS joins that one (ray://HOST:10001,
HOST:6379). The nodes need moejax installed (pip install 'moejax[ray]'); local input
files are read on this machine and the output is written here. One model too big for one
host is a job for moejax launch instead. Rows, errors and order: serving/ray_data.py.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from serving import ray_data      # (imports Ray only when a job runs)
from serving.cli.generate import SCORING_ONLY, scoring_only_given
from serving.cli.options import (add_model_options, command_compilation_cache, positive_int,
                                 scorer_options)
from serving.exit_status import ERRORS_STATUS, FAILED_STATUS
from serving.jsonl import CommandError, add_line_limit_option

# The multi-process flags of the shared model options: one model over several processes
# is moejax launch's; a batch job holds one model per actor.
MULTI_PROCESS_FLAGS = ("--coordinator", "--num-processes", "--process-id", "--distributed",
                       "--heartbeat-seconds", "--coordinator-timeout")
EXIT_CODES = f"""exit codes:
  0    done (every row answered; some results may be errors)
  {FAILED_STATUS}    the Ray job failed (an actor or task past its retries); no output is left
  2    refused: usage, an unreadable input, an unwritable -o, Ray not installed, bad model
       options (one line 'moejax: error: ...')
  {ERRORS_STATUS}    every result is an error (with --fail-on-errors: any result is an error); the
       results are written all the same"""


def non_negative_float(text: str) -> float:
    """argparse type: a number >= 0."""
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _refused_flag(flag: str) -> Any:
    def refuse(_text: str) -> Any:
        raise argparse.ArgumentTypeError(f"batch runs one model per Ray actor; one model over "
                                         f"several processes or hosts is `moejax launch`'s "
                                         f"({flag} is not taken here)")
    return refuse


def add_batch_command(sub: Any) -> argparse.ArgumentParser:
    """Register ``batch`` on the ``moejax`` subparsers ``sub``."""
    p = sub.add_parser("batch", help="score or generate for JSONL/Parquet files on a Ray cluster",
                       description=__doc__.split("\n\n")[1], epilog=EXIT_CODES,
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       conflict_handler="resolve")    # (the multi-process flags, below)
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="JSONL or Parquet requests: files, directories or URIs")
    p.add_argument("-o", "--output", required=True,
                   help="the results, JSONL or Parquet by its extension (a path or a URI)")
    p.add_argument("--ray", nargs="?", const=ray_data.LOCAL, default=None, metavar="ADDRESS",
                   help="run on Ray: alone, a cluster on this machine; 'auto', the cluster "
                        "this machine belongs to; or a cluster's address")
    p.add_argument("--actors", type=positive_int, default=1,
                   help="actors, each holding the model (default 1)")
    p.add_argument("--gpus-per-actor", type=non_negative_float, default=0.0,
                   help="GPUs each actor holds (default 0: CPU)")
    p.add_argument("--cpus-per-actor", type=non_negative_float, default=1.0,
                   help="CPUs each actor holds (default 1)")
    p.add_argument("--batch-size", type=positive_int, default=ray_data.DEFAULT_BATCH_SIZE,
                   help=f"rows per actor call (default {ray_data.DEFAULT_BATCH_SIZE})")
    p.add_argument("--generate", action="store_true",
                   help="generation requests (a Generator per actor) instead of scoring")
    p.add_argument("--unordered", action="store_true",
                   help="write results as they finish, not in input order (sort or join them "
                        "by 'row')")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a progress bar of rows, rows/s and time left (default: on a terminal)")
    p.add_argument("--fail-on-errors", action="store_true",
                   help=f"exit {ERRORS_STATUS} when any result is an error")
    add_line_limit_option(p)
    add_model_options(p)
    for flag in MULTI_PROCESS_FLAGS:
        dest = flag[2:].replace("-", "_")
        p.add_argument(flag, dest=dest, type=_refused_flag(flag), default=p.get_default(dest),
                       help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_batch)
    return p


def _job_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Scorer's (or the Generator's) keywords of the model options given."""
    if not args.generate:
        return scorer_options(args)
    refused = scoring_only_given(args)
    if refused:
        raise CommandError(f"batch --generate does not take {', '.join(refused)} "
                           f"(scoring-engine options: {', '.join(SCORING_ONLY)})")
    options = {"dtype": args.dtype, "expert_impl": args.expert_impl, "backend": args.backend,
               "devices": args.devices, "weights_dtype": getattr(args, "weights_dtype", None),
               "compilation_cache": command_compilation_cache(None)}
    return {key: value for key, value in options.items() if value is not None}


def _status(rows: int, errors: int, fail_on_errors: bool) -> int:
    if errors and (fail_on_errors or errors == rows):
        return ERRORS_STATUS
    return 0


def cmd_batch(args: argparse.Namespace) -> int:
    """Run ``batch``; returns the exit status (:data:`EXIT_CODES`)."""
    if args.ray is None:
        raise CommandError("batch runs on Ray Data: give --ray (a cluster on this machine), "
                           "--ray auto or --ray ADDRESS")
    options = _job_options(args)
    try:
        ray = ray_data.require_ray()
    except ImportError as exc:
        raise CommandError(str(exc)) from None
    run = ray_data.generate if args.generate else ray_data.score
    session_before = ray.is_initialized()     # (a caller's own, e.g. a test's: kept)
    try:
        summary = run(args.inputs, args.output, model=args.model, actors=args.actors,
                      gpus_per_actor=args.gpus_per_actor, cpus_per_actor=args.cpus_per_actor,
                      batch_size=args.batch_size, ordered=not args.unordered,
                      progress=args.progress, max_line_mib=args.max_line_mib,
                      ray_address=args.ray, **options)
    except ray.exceptions.RayError as exc:
        print(f"moejax: error: the Ray job failed: {_cause(exc)}", file=sys.stderr)
        return FAILED_STATUS
    finally:
        if not session_before and ray.is_initialized():
            ray.shutdown()
    rate = summary.rows / summary.seconds if summary.seconds > 0 else 0.0
    verb = "generated for" if args.generate else "scored"
    print(f"{verb} {summary.rows - summary.errors} of {summary.rows} rows ({summary.errors} "
          f"with errors) in {summary.seconds:.1f}s on {args.actors} actor(s), "
          f"{rate:.1f} rows/s; results in {summary.output}", file=sys.stderr)
    return _status(summary.rows, summary.errors, args.fail_on_errors)


def _cause(exc: BaseException) -> str:
    """The line of a Ray failure that says what went wrong: its traceback's last."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1].strip()[:500] if lines else type(exc).__name__

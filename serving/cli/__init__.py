"""The ``moejax`` command line (console script ``moejax = serving.cli:main``).

    moejax score IN.jsonl [-o OUT.jsonl] [--model DIR|demo] [--dtype float32|bfloat16]
                 [--chunk-size N] [--max-line-mib MIB]
    moejax convert MODEL OUT_DIR [--dtype bfloat16]   (MODEL: an HF directory or a built-in name)
    moejax info [--model DIR|demo]
    moejax generate IN.jsonl [-o OUT.jsonl] [--model DIR|demo] [--trace-experts]
                 [--batching continuous|static] [--step auto|fused|layerwise]
                 [--backend resident|offload|sync_ep] [--devices G] [--max-batch-size N]
                 [--max-prefill-tokens N] [--kv-cache-blocks N | --kv-cache-mib MIB]
    moejax trace IN.jsonl -o OUT.npz [--model DIR|demo] [--max-new-tokens N] [--router-inputs]
    moejax eldr-fit TRACES... -o FIT.npz --decoders K [--model DIR|demo-e32] [--layers 0,2,5]
    moejax prefetch-calibrate TRACES... -o DEFAULTS.npz [--model DIR|demo-e32]
    moejax serve [--model DIR|demo] [--host 127.0.0.1] [--port 50051] [--token T] [--tls-cert F]
    moejax client score IN.jsonl --target HOST:PORT [-o OUT.jsonl]   (also: client info, health)

``score`` reads one JSON request per line (fields of ``serving.ScoreRequest``:
id, prompt | prompt_token_ids, candidates | candidate_token_ids, kind, normalize)
and writes one JSON result per non-blank input line, in input order (fields of
``serving.ScoreResult``). A line that is not valid JSON (or too long, not UTF-8, ...), or
a request that is invalid, gets a result with ``error`` set; the other lines are still
scored. An id-less request is named by its line number (``"line 3: prompt: is empty"``).
The input rules, shared with ``generate`` and ``client score``, are in ``serving.jsonl``.

Exit status of ``score`` (also :data:`SCORE_EXIT_CODES`, shown by ``moejax score
--help``): 0 done; 1 the run stopped on a failure (a server failure with ``--target``, a
lost process of a multi-process run, a run that ended before every line was answered);
2 a usage or file error, as one line ``moejax: error: ...`` on stderr (a missing or
unreadable input, an unwritable ``-o``, ``-o`` naming the input: all checked before the
model loads; a model directory that cannot be loaded, the file named; a malformed progress
file); 3 every result is an error (or, with ``--fail-on-errors``, any result is one): the
results are written all the same; 130 Ctrl-C (the results so far are written); 141 (as for
a command killed by SIGPIPE) when stdout is closed early, e.g. ``| head -1``: the command
stops quietly.

As an entry point, :func:`main` sets what a library leaves to its user: the XLA flags
(``moejax.configure_xla``, before JAX starts) and JAX's persistent compilation cache
(``"auto"`` unless serving/configs/scoring.yaml or the deployment names one). This module is the
dispatcher (and ``score``): it registers the subcommands of the package's other modules
(``generate``, ``trace``, ``eldr``, ``prefetch``) and of ``serving.grpc.cli``, which take
their shared options from :mod:`serving.cli.options` (never from here: no import cycle).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Sequence

from moejax import configure_xla
from moejax.distributed import JoinError
from serving.cli.distributed import (exit_now, host_devices_per_process,
                                     join as join_processes, quiet_unless_output_process)
from serving.cli.options import add_model_options, positive_int, scorer_options
from serving.exit_status import BROKEN_PIPE_STATUS, ERRORS_STATUS, FAILED_STATUS
from serving.jsonl import CommandError, JsonlLine, add_line_limit_option, run_chunk
from serving.multi_process import CollectiveFailure, collective_failure, is_collective_failure
from serving.score_progress import IncompleteRun
from serving.logs import LOG_FORMATS, configure_logging

DESCRIPTION = ("moejax: score and generate with Mixture-of-Experts models in JAX, from JSONL "
               "files, over gRPC, or over several processes. Run 'moejax COMMAND --help' "
               "for a command's options.")

SCORE_EXIT_CODES = """exit codes:
  0    done (every line answered; some results may be errors)
  1    the run stopped on a failure: a server failure (--target, progress kept), a lost
       process of a multi-process run, or a run that ended before every line was answered
  2    refused: usage, an unreadable input, an unwritable -o, a model that cannot be
       loaded, a malformed progress file (one line 'moejax: error: ...')
  3    every result is an error (with --fail-on-errors: any result is an error); the
       results are written all the same
  130  Ctrl-C (143 SIGTERM with --target); the results so far are written
  141  standard output closed early (e.g. | head -1)"""


# ----------------------------------------------------------------------------- commands
def score_chunk(scorer: Any, chunk: list[JsonlLine]) -> list[Any]:
    """Results for one chunk, in order: a bad line's error as an error result, the rest
    scored together; an id-less request's error names its line."""
    from serving.requests import ScoreResult

    return run_chunk(chunk, lambda requests: scorer.score(requests, progress=False),
                     lambda error: ScoreResult(error=error))


def errors_status(results: int, errors: int, fail_on_errors: bool) -> int:
    """The exit status of a run that answered every line: :data:`ERRORS_STATUS` when every
    result is an error (a run that scored nothing is no success), or when any is and
    ``--fail-on-errors`` was given; else 0. An empty input (no results) is a success."""
    if errors and (fail_on_errors or errors == results):
        return ERRORS_STATUS
    return 0


def _remote_errors_status(args: argparse.Namespace) -> int:
    """:func:`errors_status` of a finished ``--target`` run, from its progress record (the
    whole output's counts, resumed runs included)."""
    from serving.score_progress import load_progress, progress_path

    record = load_progress(progress_path(args.output), check_files=False)   # just written
    if record is None:
        return 0
    return errors_status(record["lines_done"], record.get("errors", 0), args.fail_on_errors)


def cmd_score(args: argparse.Namespace) -> int:
    """Run ``score``; returns the exit status (see :data:`SCORE_EXIT_CODES`)."""
    if getattr(args, "target", None) is not None:   # through a server: serving.remote_score
        from serving.remote_score import run_remote

        status = run_remote(args)
        return _remote_errors_status(args) if status == 0 else status
    from serving import Scorer
    from serving.shards import (CountedRows, already_complete, new_record, shard_chunks,
                                write_record)
    from serving.tables import open_score_files

    shard = args.shard
    if shard is not None:
        if args.output in (None, "-"):
            raise CommandError("--shard needs -o OUTPUT: its record is written beside it")
        if already_complete(args.input, args.output, shard):
            print(f"shard {shard} of {args.input} is already complete in {args.output}: "
                  f"nothing to do", file=sys.stderr)
            return 0
    with open_score_files(args.input, args.output, args.max_line_mib,   # before the model
                          with_row=shard is not None) as files:
        scorer = Scorer(args.model, **scorer_options(args))
        files.start_output()
        record = None
        if shard is not None:
            record = new_record(args.input, shard)
            write_record(args.output, record)
        total = files.count()
        rows_seen = None
        if shard is None:
            parts = _whole_chunks(files, args.chunk_size)
        else:
            total = None          # (a shard holds a part of the rows)
            rows_seen = CountedRows(files.lines())
            parts = shard_chunks(rows_seen, shard, args.chunk_size)
        show_bar = args.progress if args.progress is not None else (
            sys.stderr.isatty() and (total or 0) >= scorer.options.progress_min_requests)
        bar = None
        if show_bar:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="req", desc="scoring", file=sys.stderr)
        count = errors = 0
        interrupted = False
        start = time.perf_counter()
        try:
            # Chunks bound memory on files of millions of requests; results are written as
            # each chunk finishes, in input order (a shard's carry their input row).
            for rows, chunk in parts:
                for row, result in zip(rows, score_chunk(scorer, chunk)):
                    out = result.to_dict()
                    files.write(out if row is None else {"row": row, **out})
                    errors += result.error is not None
                count += len(chunk)
                files.flush()
                if bar is not None:
                    bar.update(len(chunk))
            if record is not None:
                files.flush()
                record.update(rows=count, errors=errors, rows_total=rows_seen.count)
        except KeyboardInterrupt:
            # Ctrl-C: the chunks already scored are written and flushed; stop cleanly.
            interrupted = True
        finally:
            if bar is not None:
                bar.close()
    if record is not None and not interrupted:
        record["complete"] = True        # (after the output is closed: its footer is written)
        write_record(args.output, record)
    elapsed = time.perf_counter() - start
    stats = scorer.engine.stats
    rate = stats.real_tokens / elapsed if elapsed > 0 else 0.0
    if interrupted:
        print(f"interrupted: the first {count} requests' results are written; the rest were "
              f"not scored", file=sys.stderr)
    print(f"scored {count - errors} of {count} requests ({errors} with errors) in "
          f"{elapsed:.2f}s: {stats.real_tokens} tokens, {rate:.0f} tokens/s, "
          f"{stats.batches} batches, {stats.compiles} compiled shapes"
          + (f", results in {args.output}" if args.output not in (None, "-") else ""),
          file=sys.stderr)
    if interrupted:
        return 130
    return errors_status(count, errors, args.fail_on_errors)


def _whole_chunks(files: Any, size: int) -> Any:
    """(Nones, lines) chunk by chunk over the whole input (no rows to carry)."""
    for chunk in files.chunks(size):
        yield [None] * len(chunk), chunk


def cmd_convert(args: argparse.Namespace) -> int:
    """Run ``convert``: a HF checkpoint (a directory, or a built-in model's name) to orbax
    params."""
    from moejax import checkpoint
    from moejax.model_dirs import resolve_model_dir

    model_dir, _ = resolve_model_dir(args.model_dir)
    out = checkpoint.convert_checkpoint(model_dir, args.out_dir, dtype=args.dtype,
                                        overwrite=args.overwrite)
    print(f"converted {args.model_dir} -> {out} ({args.dtype})", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    """Run ``info``: print what is served, as JSON."""
    from moejax.param_layout import num_params
    from serving import Scorer

    scorer = Scorer(args.model, **scorer_options(args))
    info = dict(scorer.info)
    cfg = scorer.config
    heads, key_dim, value_dim = cfg.kv_store_dims
    info.update(params=num_params(cfg), linear_flops_per_token=cfg.linear_flops_per_token,
                token_buckets=scorer.engine.policy.token_buckets(cfg.max_context),
                model_type=cfg.model_type,
                kv_cache={"per_token_per_layer": {"heads": heads, "key_dim": key_dim,
                                                  "value_dim": value_dim},
                          "stores": "latent + rope key" if cfg.mla is not None
                          else "per-head keys and values",
                          "bytes_per_token": cfg.kv_bytes_per_token(
                              scorer.engine.dtype.itemsize)},
                dense_layers=list(cfg.dense_layers),
                shared_expert_size=cfg.shared_intermediate_size,
                weights=_weights_info(scorer))
    print(json.dumps(info, indent=2), flush=True)   # a closed stdout fails here, not at exit
    return 0


def _weights_info(scorer: Any) -> dict[str, Any]:
    """Stored dtype and bytes (safetensors headers: an FP8 checkpoint reads "float8_e4m3fn,
    128x128 block scales") next to the serving dtype and bytes: what dequantizing on load
    costs in memory (params x the dtype's size), or with ``weights_dtype="fp8"`` what the
    backend holds (its memory report: FP8 experts and their scales)."""
    from moejax.checkpoint import stored_weights
    from moejax.param_layout import num_params

    stored = stored_weights(scorer.model_dir)
    dtype = scorer.engine.dtype
    serving_dtype, serving_bytes = dtype.name, num_params(scorer.config) * dtype.itemsize
    if scorer.options.weights_dtype == "fp8":
        report = scorer.engine.backend.memory_report()
        serving_dtype = f"{dtype.name}, routed experts float8_e4m3fn with block scales"
        serving_bytes = report.dense_weight_bytes + report.expert_bytes_all_layers
    return {"stored_dtype": stored["dtype"], "stored_bytes": stored["bytes"],
            "stored_bytes_by_dtype": stored["bytes_by_dtype"], "serving_dtype": serving_dtype,
            "serving_bytes": serving_bytes}


class CommandParser(argparse.ArgumentParser):
    """The parser of ``moejax`` and of each of its (sub)commands: an ArgumentParser that
    keeps what its ``add_subparsers`` returned, so that :func:`build_parser` can reach the
    commands nested under a command (``client score``) through public argparse API.
    (``add_parser`` makes each subcommand's parser of its parent's class.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.subcommand_groups: list[Any] = []

    def add_subparsers(self, **kwargs: Any) -> Any:
        group = super().add_subparsers(**kwargs)
        self.subcommand_groups.append(group)
        return group


def build_parser() -> argparse.ArgumentParser:
    """The ``moejax`` argument parser with every subcommand."""
    from serving.cli.generate import add_generate_command
    from serving.cli.trace import add_trace_command
    from serving.cli.eldr import add_parser as add_eldr_fit_command
    from serving.cli.prefetch import add_parser as add_prefetch_calibrate_command
    from serving.grpc.cli import add_commands as add_grpc_commands
    from serving.launch import add_launch_command
    from serving.remote_score import add_remote_options

    parser = CommandParser(prog="moejax", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="log compiles and batches")
    parser.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                        help="log lines on stderr: text (default; timestamped) or json (one "
                             "object a line: time, level, logger, message, request_id)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    score = sub.add_parser("score", help="score a JSONL or Parquet file of requests",
                           description="Score a JSONL file of requests (one JSON request a "
                                       "line; one JSON result a line, in input order), or a "
                                       "Parquet file (a request a row; by the extension "
                                       ".parquet, for the input and the output apart).",
                           epilog=SCORE_EXIT_CODES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    score.add_argument("input", help="JSONL or Parquet requests ('-' for stdin: JSONL)")
    score.add_argument("-o", "--output", default=None,
                       help="JSONL or Parquet results (default: JSONL on stdout)")
    score.add_argument("--shard", type=_shard_type, default=None, metavar="I/N",
                       help="score shard I of N only (slices of 1,024 rows, every N-th one, "
                            "each result with its input row; a record beside -o); join the "
                            "shards with moejax merge")
    score.add_argument("--chunk-size", type=positive_int, default=4096,
                       help="requests scored per chunk; results are written after each chunk")
    score.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                       help="progress bar (default: on for large inputs on a terminal)")
    score.add_argument("--fail-on-errors", action="store_true",
                       help=f"exit {ERRORS_STATUS} when any result is an error (without it: "
                            f"only when every result is one)")
    add_line_limit_option(score)
    add_model_options(score)
    add_remote_options(score)   # --target HOST:PORT: through a server, resumable
    score.set_defaults(func=cmd_score)

    convert = sub.add_parser("convert", help="convert a HF checkpoint to moejax params (orbax)")
    convert.add_argument("model_dir", metavar="MODEL",
                         help="HF model directory or a built-in model: demo, demo-e32, "
                              "demo-e32-init")
    convert.add_argument("out_dir", help="where the moejax params (orbax) are written")
    convert.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    convert.add_argument("--overwrite", action="store_true")
    convert.set_defaults(func=cmd_convert)

    info = sub.add_parser("info", help="print what a model directory holds and how it is served")
    add_model_options(info)
    info.set_defaults(func=cmd_info)
    add_merge_command(sub)
    add_generate_command(sub)
    add_trace_command(sub)
    add_eldr_fit_command(sub)
    add_prefetch_calibrate_command(sub)
    add_grpc_commands(sub)
    add_launch_command(sub)
    from serving.cli.batch import add_batch_command   # Ray Data jobs (serving.ray_data)
    add_batch_command(sub)
    _accept_verbose_after_the_command(sub)
    return parser


def _shard_type(text: str) -> Any:
    from serving.shards import Shard

    try:
        return Shard.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def cmd_merge(args: argparse.Namespace) -> int:
    """Join the outputs of ``moejax score --shard`` in input order (``serving.shards``)."""
    from serving.shards import write_merged

    count = write_merged(args.outputs, args.output)
    print(f"merged {count} results from {len(args.outputs)} shards into {args.output}",
          file=sys.stderr)
    return 0


def add_merge_command(sub: Any) -> None:
    merge = sub.add_parser("merge", help="join the outputs of moejax score --shard",
                           description="Join the shards' outputs of moejax score --shard I/N "
                                       "in input order, checking that every input row is "
                                       "there exactly once (JSONL or Parquet, by extension).")
    merge.add_argument("outputs", nargs="+", metavar="SHARD_OUTPUT",
                       help="every shard's -o (its .shard record beside it)")
    merge.add_argument("-o", "--output", required=True, help="the merged results")
    merge.set_defaults(func=cmd_merge)


def _accept_verbose_after_the_command(sub: Any) -> None:
    """``moejax score -v ...`` as well as ``moejax -v score ...``: every (sub)command takes
    ``-v`` and ``--log-format``. Their default is SUPPRESS, so a command without them keeps
    the top-level value."""
    for command in sub.choices.values():
        nested = getattr(command, "subcommand_groups", ())
        if nested:
            for group in nested:
                _accept_verbose_after_the_command(group)
            continue
        try:
            command.add_argument("-v", "--verbose", action="store_true",
                                 default=argparse.SUPPRESS, help="log compiles and batches")
        except argparse.ArgumentError:   # a command with a -v of its own keeps it
            pass
        try:
            command.add_argument("--log-format", choices=LOG_FORMATS, default=argparse.SUPPRESS,
                                 help="log lines: text (timestamped) or json")
        except argparse.ArgumentError:
            pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``moejax`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose, args.log_format)
    multi_process = False
    try:
        # Before anything starts JAX's backends, which read XLA_FLAGS once; then join the
        # other processes of a multi-process run (serving.cli.distributed).
        configure_xla(host_devices=host_devices_per_process(args))
        multi_process = join_processes(args)
        if multi_process:
            quiet_unless_output_process(args)
        return args.func(args)
    except BrokenPipeError:
        _silence_stdout()
        return BROKEN_PIPE_STATUS
    except (IncompleteRun, JoinError) as exc:   # failures, with a message that says it all
        print(f"moejax: error: {exc}", file=sys.stderr)
        if multi_process:
            exit_now(FAILED_STATUS)
        return FAILED_STATUS
    except (OSError, ValueError, RuntimeError) as exc:
        if is_collective_failure(exc):
            _report_lost_process(exc)
            if multi_process:
                exit_now(FAILED_STATUS)
            return FAILED_STATUS
        if not multi_process and isinstance(exc, RuntimeError):
            raise
        print(f"moejax: error: {exc}", file=sys.stderr)
        if multi_process:
            exit_now(2)
        return 2
    except BaseException:
        if multi_process:   # a traceback, then end now rather than at JAX's shutdown barrier
            import traceback

            traceback.print_exc()
            exit_now(1)
        raise


def _report_lost_process(error: BaseException) -> None:
    """One message for a failed collective between processes (fatal: see
    :mod:`serving.multi_process`), in place of a traceback or per-request errors."""
    failure = error if isinstance(error, CollectiveFailure) else collective_failure(error)
    print(f"moejax: error: {failure}; stopping now: the results written are of requests "
          f"scored before it, the others have no result line", file=sys.stderr)


def _silence_stdout() -> None:
    """After a broken pipe, point stdout at /dev/null (the recipe of Python's ``signal``
    docs): the interpreter flushes stdout again at exit and would print "Exception
    ignored ... BrokenPipeError" about the closed pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
    except (AttributeError, OSError, ValueError):   # a stdout without a descriptor (tests)
        pass


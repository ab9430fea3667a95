"""The multi-process options of every model command (``score``, ``generate``, ``serve``,
``info``, ``trace``) and what ``moejax`` does with them before JAX starts.

    moejax score IN.jsonl -o OUT.jsonl --backend async_ep --devices 8 \\
        --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 0     # on host 0
    ... --process-id 1                                                   # on host 1
    moejax score ... --distributed auto       # SLURM / Open MPI / Kubernetes: JAX detects

``--devices`` stays the total over all processes; on CPU each process gets
``devices / num_processes`` host devices. Every process reads the same input and runs the
same batches; process 0 writes the output (the others write nothing).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from moejax.distributed import DEFAULT_HEARTBEAT_SECONDS, DEFAULT_JOIN_SECONDS, DistributedOptions


def coordinator_address(text: str) -> str:
    """argparse type of ``--coordinator``: HOST:PORT with a port in 1..65535 and a host
    that parses (refused at once, exit 2, rather than left to JAX, which waits)."""
    from moejax.distributed import coordinator_problem

    problem = coordinator_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
    return text


coordinator_address.__name__ = "coordinator address"   # argparse names the type with it


def add_distributed_options(p: argparse.ArgumentParser) -> None:
    """``--coordinator``, ``--num-processes``, ``--process-id``, ``--distributed auto``."""
    group = p.add_argument_group("multi-process (one model over several processes/hosts)")
    group.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                       type=coordinator_address,
                       help="process 0's coordination address (with --num-processes and "
                            "--process-id)")
    group.add_argument("--num-processes", type=int, default=None,
                       help="processes in the run (every one runs this same command)")
    group.add_argument("--process-id", type=int, default=None,
                       help="this process's index, 0 .. num-processes-1 (0 writes the output)")
    group.add_argument("--distributed", choices=["auto"], default=None,
                       help="'auto': let JAX detect the processes (SLURM, Open MPI, "
                            "Kubernetes) instead of the three flags above")
    group.add_argument("--heartbeat-seconds", type=int, default=DEFAULT_HEARTBEAT_SECONDS,
                       help="stop within this long when another process hangs or died without "
                            "the others noticing in a collective; keep it above 30 s (the "
                            "collectives' own timeout), a batch's and a compile's time "
                            f"(default {DEFAULT_HEARTBEAT_SECONDS})")
    group.add_argument("--coordinator-timeout", type=int, default=DEFAULT_JOIN_SECONDS,
                       metavar="SECONDS",
                       help="give up (exit 1) when the coordinator does not answer, or not "
                            "every process joins, within this long (default "
                            f"{DEFAULT_JOIN_SECONDS})")


def distributed_options(args: argparse.Namespace) -> DistributedOptions:
    """The DistributedOptions of the parsed flags (disabled when none is given)."""
    return DistributedOptions(coordinator=getattr(args, "coordinator", None),
                              num_processes=getattr(args, "num_processes", None),
                              process_id=getattr(args, "process_id", None),
                              auto=getattr(args, "distributed", None) == "auto",
                              heartbeat_timeout_seconds=getattr(args, "heartbeat_seconds",
                                                                DEFAULT_HEARTBEAT_SECONDS),
                              initialization_timeout_seconds=getattr(
                                  args, "coordinator_timeout", DEFAULT_JOIN_SECONDS))


def pipeline_devices(args: argparse.Namespace) -> int:
    """Devices the ``--pipeline`` file's stages span (1 without one; a bad file is
    reported when the Generator reads it)."""
    path = getattr(args, "pipeline", None)
    if path is None:
        return 1
    from serving import pipeline_config     # imported when used

    try:
        return pipeline_config.load(path).devices_needed()
    except pipeline_config.PipelineError:
        return 1


def host_devices_per_process(args: argparse.Namespace) -> int:
    """CPU host devices this process should expose: the command's total (``--devices``,
    ``--engines``, ``--decoders``: one device each; the devices a ``--pipeline`` spans)
    split evenly over ``--num-processes``."""
    total = max(getattr(args, "devices", None) or 1, getattr(args, "engines", None) or 1,
                getattr(args, "decoders", None) or 1, pipeline_devices(args))
    processes = getattr(args, "num_processes", None) or 1
    if total % processes:
        raise ValueError(f"--devices {total} must be a multiple of --num-processes "
                         f"{processes} (each process holds the same number of devices)")
    return total // processes


def join(args: argparse.Namespace) -> bool:
    """Join the other processes when the flags ask for it; returns whether the run is
    multi-process. Must run after the XLA flags are set and before any JAX computation.
    A multi-process run first moves native code's stdout to stderr
    (:func:`native_stdout_to_stderr`)."""
    from moejax import distributed

    options = distributed_options(args)
    if options.enabled:
        native_stdout_to_stderr()
    return distributed.initialize(options)


def native_stdout_to_stderr() -> None:
    """Point file descriptor 1 at stderr, and Python's ``sys.stdout`` at a copy of the
    real stdout. The collectives' native code prints on its own stdout (gloo's
    ``[Gloo] Rank 0 is connected to 1 peer ranks``), which would otherwise land between
    the result lines of a command writing to stdout (``moejax score IN.jsonl > OUT``)."""
    try:
        out_fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        return   # a stream without a descriptor (a test's): native code cannot reach it
    old = sys.stdout
    old.flush()
    real = os.dup(out_fd)
    os.dup2(err_fd, out_fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(real, "w"), encoding=old.encoding,
                                  errors=old.errors, line_buffering=old.line_buffering)


def quiet_unless_output_process(args: argparse.Namespace) -> None:
    """On every process but 0: write the command's output nowhere (``os.devnull``) and
    show no progress bar, so one output is written however many processes run."""
    from moejax.distributed import is_output_process

    if is_output_process():
        return
    if hasattr(args, "output"):
        args.output = os.devnull
    if hasattr(args, "progress"):
        args.progress = False


def exit_now(status: int) -> None:
    """End a failed multi-process run's process at once: skipping JAX's shutdown barrier
    lets the other processes see this one gone (their collectives fail, the coordination
    heartbeat notices) instead of waiting for it at the barrier."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)

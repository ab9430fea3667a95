"""``moejax launch``: N local processes of one multi-process command, for trying a
multi-host run on one machine and for the tests. A thin wrapper, not a scheduler.

    moejax launch --processes 2 -- moejax score IN.jsonl -o OUT.jsonl --backend async_ep \\
        --devices 8

starts ``moejax score ... --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I``
for I = 0, 1 (a free PORT), waits for all of them, and returns the first non-zero exit
status. When one process fails, the others get ``--grace-seconds`` to stop on their own
(JAX's coordination service notices a dead peer) before they are terminated, so a failed
run never hangs. Ctrl-C and SIGTERM are passed on to every process.

What is shown: process 0's output and messages (its summary is the run's), without the
collectives' connection chatter (gloo's ``[Gloo] Rank 0 is connected to 1 peer ranks``).
The other processes write theirs to ``--log-dir`` (default: a new temporary directory),
one ``process-I.log`` each, named at the start; when one of them fails, the end of its
log is shown.

On a cluster the scheduler starts the processes instead; see the README (SLURM:
``srun ... moejax score ... --distributed auto``; Kubernetes: an indexed Job whose pods
pass ``--coordinator <pod-0>:PORT --num-processes N --process-id $JOB_COMPLETION_INDEX``).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any, Sequence

POLL_SECONDS = 0.1
LOG_TAIL_LINES = 20   # lines of a failed process's log shown
# Lines the collectives print as they connect: noise in a run's messages.
CHATTER = re.compile(rb"^\[Gloo\] Rank \d+ is connected to \d+ peer ranks")
_CHATTER_PREFIX = b"[Gloo] "


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (for the coordinator)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def process_commands(command: Sequence[str], processes: int, coordinator: str
                     ) -> list[list[str]]:
    """The command of each process: ``command`` plus the three multi-process flags. A
    leading ``moejax`` runs this Python's moejax (``python -m serving.cli``)."""
    if not command:
        raise ValueError("launch: no command given (put it after '--')")
    if processes < 1:
        raise ValueError(f"launch: --processes must be >= 1, got {processes}")
    taken = {"--coordinator", "--num-processes", "--process-id", "--distributed"} \
        & {arg.split("=", 1)[0] for arg in command}
    if taken:
        raise ValueError(f"launch: the command must not set {', '.join(sorted(taken))}; "
                         "launch adds them for each process")
    base = list(command)
    if base[0] == "moejax":
        base = [sys.executable, "-m", "serving.cli", *base[1:]]
    return [base + ["--coordinator", coordinator, "--num-processes", str(processes),
                    "--process-id", str(index)] for index in range(processes)]


def without_chatter(data: bytes, mid_line: bool) -> tuple[bytes, bytes, bool]:
    """Filter one piece of a process's output: (what to show, what to hold back until more
    comes, whether what is shown ends inside a line). Whole lines matching
    :data:`CHATTER` are dropped; an unfinished line is held back only while it could
    still become one (so a progress bar's ``\\r`` updates pass at once)."""
    *lines, rest = data.split(b"\n")
    shown = []
    for line in lines:
        if mid_line or not CHATTER.match(line):
            shown.append(line + b"\n")
        mid_line = False
    could_be_chatter = not mid_line and (rest.startswith(_CHATTER_PREFIX)
                                         or _CHATTER_PREFIX.startswith(rest))
    if rest and not could_be_chatter:
        shown.append(rest)
        return b"".join(shown), b"", True
    return b"".join(shown), rest, mid_line


def _copy_without_chatter(source: IO[bytes], sink: IO[bytes]) -> None:
    """Copy ``source`` to ``sink`` as it comes, without :data:`CHATTER` lines (a thread)."""
    held, mid_line = b"", False
    while True:
        data = os.read(source.fileno(), 1 << 16)
        if not data:
            break
        shown, held, mid_line = without_chatter(held + data, mid_line)
        if shown:
            sink.write(shown)
            sink.flush()
    if held and not CHATTER.match(held):
        sink.write(held)
        sink.flush()
    source.close()


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of a process's log (without chatter), for a failure."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - (1 << 16)))
            text = fh.read()
    except OSError as exc:
        return f"(its log {path} cannot be read: {exc.strerror or exc})"
    kept = [line for line in text.splitlines() if not CHATTER.match(line)]
    return b"\n".join(kept[-lines:]).decode("utf-8", "replace")


def supervise(children: Sequence[subprocess.Popen], grace_seconds: float,
              logs: Sequence[str | None] = ()) -> int:
    """Wait for every child; after the first failure give the rest ``grace_seconds`` to
    stop, then terminate (and, 5 s later, kill) them. Returns the first non-zero status
    (0 when all succeeded). ``logs[i]``: where child i's output goes (None: shown), whose
    end is shown when it fails first."""
    status = 0
    failed_at: float | None = None
    while True:
        codes = [child.poll() for child in children]
        for index, code in enumerate(codes):
            if code not in (None, 0) and status == 0:
                status = code
                failed_at = time.monotonic()
                print(f"moejax launch: process {index} exited with status {code}; the "
                      f"others have {grace_seconds:g}s to stop", file=sys.stderr)
                log = logs[index] if index < len(logs) else None
                if log is not None:
                    print(f"moejax launch: the end of {log}:\n{log_tail(log)}",
                          file=sys.stderr)
        if all(code is not None for code in codes):
            return status
        if failed_at is not None and time.monotonic() - failed_at > grace_seconds:
            _stop(children)
            return status
        time.sleep(POLL_SECONDS)


def _stop(children: Sequence[subprocess.Popen]) -> None:
    for index, child in enumerate(children):
        if child.poll() is None:
            print(f"moejax launch: terminating process {index}", file=sys.stderr)
            child.terminate()
    deadline = time.monotonic() + 5.0
    for child in children:
        try:
            child.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def cmd_launch(args: argparse.Namespace) -> int:
    """Run ``launch``; returns the first failing process's status (0 if none)."""
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    port = args.coordinator_port or free_port()
    commands = process_commands(command, args.processes, f"127.0.0.1:{port}")
    logs = process_logs(args.log_dir, args.processes)
    children, copier = start_processes(commands, logs)

    def forward(signum: int, frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervise(children, args.grace_seconds, logs)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(children)
        copier.join(timeout=5)   # the rest of process 0's messages


def process_logs(log_dir: str | None, processes: int) -> list[str | None]:
    """Where each process's output goes: None (shown) for process 0, ``process-I.log`` in
    ``log_dir`` (created; default a new temporary directory) for the others."""
    if processes < 2:
        return [None] * processes
    if log_dir is None:
        log_dir = tempfile.mkdtemp(prefix="moejax-launch-")
    os.makedirs(log_dir, exist_ok=True)
    logs: list[str | None] = [None] + [os.path.join(log_dir, f"process-{index}.log")
                                       for index in range(1, processes)]
    print(f"moejax launch: the output of processes 1-{processes - 1} goes to "
          f"{os.path.join(log_dir, 'process-I.log')}", file=sys.stderr)
    return logs


def start_processes(commands: Sequence[Sequence[str]], logs: Sequence[str | None]
                    ) -> tuple[list[subprocess.Popen], threading.Thread]:
    """Start the processes: process 0's stdout as is (results may go there), its stderr
    copied here without the collectives' chatter; the others' output to their logs."""
    children = []
    for command, log in zip(commands, logs):
        if log is None:
            children.append(subprocess.Popen(command, stderr=subprocess.PIPE))
            continue
        with open(log, "wb") as sink:   # the child keeps its own descriptor
            children.append(subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT))
    copier = threading.Thread(target=_copy_without_chatter, daemon=True,
                              args=(children[0].stderr, sys.stderr.buffer),
                              name="moejax-launch-stderr")
    copier.start()
    return children, copier


def add_launch_command(sub: Any) -> None:
    """Register ``launch`` on the ``moejax`` subparsers."""
    launch = sub.add_parser(
        "launch", help="start N local processes of one multi-process moejax command",
        description="Start N local processes of COMMAND, each with --coordinator, "
                    "--num-processes and --process-id added.")
    launch.add_argument("--processes", type=int, required=True, help="processes to start")
    launch.add_argument("--coordinator-port", type=int, default=None,
                        help="port of process 0's coordinator on 127.0.0.1 (default: free)")
    launch.add_argument("--grace-seconds", type=float, default=60.0,
                        help="after one process fails, time for the others to stop on their "
                             "own before they are terminated (default 60)")
    launch.add_argument("--log-dir", default=None,
                        help="directory of the output of processes 1..N-1, one "
                             "process-I.log each (default: a new temporary directory)")
    launch.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the command, e.g. -- moejax score IN.jsonl -o OUT.jsonl "
                             "--backend async_ep --devices 8")
    launch.set_defaults(func=cmd_launch)

"""``moejax launch``: N local processes of one multi-process command, for trying a
multi-host run on one machine and for the tests. A thin wrapper, not a scheduler.

    moejax launch --processes 2 -- moejax score IN.jsonl -o OUT.jsonl --backend async_ep \\
        --devices 8

starts ``moejax score ... --coordinator 127.0.0.1:PORT --num-processes 2 --process-id I``
for I = 0, 1 (a free PORT), waits for all of them, and returns the first non-zero exit
status. When one process fails, the others get ``--grace-seconds`` to stop on their own
(JAX's coordination service notices a dead peer) before they are terminated, so a failed
run never hangs. Ctrl-C and SIGTERM are passed on to every process.

On a cluster the scheduler starts the processes instead; see the README (SLURM:
``srun ... moejax score ... --distributed auto``; Kubernetes: an indexed Job whose pods
pass ``--coordinator <pod-0>:PORT --num-processes N --process-id $JOB_COMPLETION_INDEX``).
"""

from __future__ import annotations

import argparse
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Sequence

POLL_SECONDS = 0.1


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


def supervise(children: Sequence[subprocess.Popen], grace_seconds: float) -> int:
    """Wait for every child; after the first failure give the rest ``grace_seconds`` to
    stop, then terminate (and, 5 s later, kill) them. Returns the first non-zero status
    (0 when all succeeded)."""
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
    children = [subprocess.Popen(c) for c in commands]

    def forward(signum: int, frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {signum: signal.signal(signum, forward)
                for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return supervise(children, args.grace_seconds)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(children)


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
    launch.add_argument("command", nargs=argparse.REMAINDER,
                        help="-- then the command, e.g. -- moejax score IN.jsonl -o OUT.jsonl "
                             "--backend async_ep --devices 8")
    launch.set_defaults(func=cmd_launch)
